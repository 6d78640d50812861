"""NRI sessions on trio (krproxy.nri._session): two ttrpc connections both ways over one unix socket pair."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator, Mapping

import pytest
import trio
import trio.testing

from krproxy.grpcstatus import Status
from krproxy.nri import _mux, _ttrpc
from krproxy.nri._session import ConnectionLost, Handler, Session, TtrpcError
from tests.integration.support import LIVENESS_LIMIT

PLUGIN, RUNTIME = "test.Plugin", "test.Runtime"


async def _echo(payload: bytes) -> bytes:
    return b"echo:" + payload


def _echo_now(payload: bytes) -> bytes:
    return b"now:" + payload


def _crash_now(payload: bytes) -> bytes:
    raise KeyError("at once")


def _fail_now(payload: bytes) -> bytes:
    raise TtrpcError(Status.FAILED_PRECONDITION, "no, at once")


async def _fail(payload: bytes) -> bytes:
    raise TtrpcError(Status.FAILED_PRECONDITION, "plugin says no")


async def _crash(payload: bytes) -> bytes:
    raise KeyError("boom")


class _Pair:
    def __init__(self, plugin: Session, runtime: Session, slow_cancelled: trio.Event) -> None:
        self.plugin, self.runtime, self.slow_cancelled = plugin, runtime, slow_cancelled


@pytest.fixture
async def pair(nursery: trio.Nursery) -> AsyncIterator[_Pair]:
    """A plugin session (serving PLUGIN on conn 1) and a runtime session (serving RUNTIME on conn 2)."""
    a, b = trio.socket.socketpair()
    slow_cancelled = trio.Event()

    async def _slow(payload: bytes) -> bytes:
        try:
            await trio.sleep(10)
        except trio.Cancelled:
            slow_cancelled.set()
            raise
        return b"late"

    plugin_handlers: Mapping[tuple[str, str], Handler] = {
        (PLUGIN, "Echo"): _echo,
        (PLUGIN, "Fail"): _fail,
        (PLUGIN, "Crash"): _crash,
        (PLUGIN, "Slow"): _slow,
        (PLUGIN, "Now"): _echo_now,
        (PLUGIN, "CrashNow"): _crash_now,
        (PLUGIN, "FailNow"): _fail_now,
    }
    plugin = Session(
        trio.SocketStream(a), _mux.PLUGIN_SERVICE_CONN, _mux.RUNTIME_SERVICE_CONN, plugin_handlers
    )
    runtime = Session(
        trio.SocketStream(b), _mux.RUNTIME_SERVICE_CONN, _mux.PLUGIN_SERVICE_CONN, {(RUNTIME, "Echo"): _echo}
    )
    await nursery.start(plugin.run)
    await nursery.start(runtime.run)
    yield _Pair(plugin, runtime, slow_cancelled)
    await plugin.aclose()
    await runtime.aclose()


class TestCalls:
    @pytest.mark.parametrize("size", [0, 10, 5000, 3 << 20])
    async def test_both_directions(self, pair: _Pair, size: int) -> None:
        """Each side calls the other's service on its own connection, small and multi-frame payloads alike."""
        with trio.fail_after(LIVENESS_LIMIT):
            payload = b"p" * size
            assert b"echo:" + payload == await pair.runtime.call(PLUGIN, "Echo", payload)
            assert b"echo:" + payload == await pair.plugin.call(RUNTIME, "Echo", payload)

    async def test_concurrent_calls(self, pair: _Pair) -> None:
        """Many calls in flight at once each get their own answer."""
        results: dict[int, bytes] = {}

        async def one(i: int) -> None:
            results[i] = await pair.runtime.call(PLUGIN, "Echo", str(i).encode())

        with trio.fail_after(LIVENESS_LIMIT):
            async with trio.open_nursery() as n:
                for i in range(50):
                    n.start_soon(one, i)
        assert {i: f"echo:{i}".encode() for i in range(50)} == results

    async def test_handler_status(self, pair: _Pair) -> None:
        """A handler's TtrpcError reaches the caller with its code and message."""
        with trio.fail_after(LIVENESS_LIMIT), pytest.raises(TtrpcError) as info:
            await pair.runtime.call(PLUGIN, "Fail", b"")
        assert (Status.FAILED_PRECONDITION, "plugin says no") == (info.value.code, info.value.message)

    async def test_handler_crash_is_unknown(self, pair: _Pair) -> None:
        """Any other exception is answered UNKNOWN with its text; the session goes on."""
        with trio.fail_after(LIVENESS_LIMIT):
            with pytest.raises(TtrpcError) as info:
                await pair.runtime.call(PLUGIN, "Crash", b"")
            assert (Status.UNKNOWN, "'boom'") == (info.value.code, info.value.message)
            assert b"echo:x" == await pair.runtime.call(PLUGIN, "Echo", b"x")

    @pytest.mark.parametrize(
        ("service", "method", "message"),
        [(PLUGIN, "Nope", "method Nope"), ("other.Service", "Echo", "service other.Service")],
    )
    async def test_unimplemented(self, pair: _Pair, service: str, method: str, message: str) -> None:
        """Unknown services and methods are answered UNIMPLEMENTED, worded as Go's ttrpc words it."""
        with trio.fail_after(LIVENESS_LIMIT), pytest.raises(TtrpcError) as info:
            await pair.runtime.call(service, method, b"")
        assert (Status.UNIMPLEMENTED, message) == (info.value.code, info.value.message)

    async def test_deadline(self, pair: _Pair) -> None:
        """The caller's deadline travels with the call: the handler is cancelled there and its stream answered."""
        # Real time: sockets and the autojump clock do not mix.
        with pytest.raises(trio.TooSlowError), trio.fail_after(0.2):
            await pair.runtime.call(PLUGIN, "Slow", b"")
        with trio.fail_after(LIVENESS_LIMIT):
            assert b"echo:after" == await pair.runtime.call(PLUGIN, "Echo", b"after")
            await pair.slow_cancelled.wait()  # by the deadline the call carried (the session is still open)
        assert not pair.plugin.closed
        assert frozenset() == pair.runtime._client.pending  # the caller forgot the stream it gave up on


class _Spawns(trio.abc.Instrument):
    def __init__(self) -> None:
        self.spawned = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned += 1


class _CountingStream(trio.abc.HalfCloseableStream):
    """A socket stream that counts its writes."""

    def __init__(self, inner: trio.SocketStream) -> None:
        self.inner, self.writes = inner, 0

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes += 1
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.inner.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


class TestAnsweredAtOnce:
    async def test_plain_handler_answers_without_a_task(self, pair: _Pair) -> None:
        """A handler that returns the bytes is answered on the reader's task: no task is spawned for
        the call (an async one gets its own, as before)."""
        spawns = _Spawns()
        with trio.fail_after(LIVENESS_LIMIT):
            assert b"now:x" == await pair.runtime.call(PLUGIN, "Now", b"x")  # both sessions settled
            trio.lowlevel.add_instrument(spawns)
            try:
                assert b"now:y" == await pair.runtime.call(PLUGIN, "Now", b"y")
                assert 0 == spawns.spawned
                assert b"echo:z" == await pair.runtime.call(PLUGIN, "Echo", b"z")
                assert 1 == spawns.spawned
            finally:
                trio.lowlevel.remove_instrument(spawns)

    async def test_plain_handler_errors(self, pair: _Pair) -> None:
        """Raised at once, a TtrpcError is the answer's status and anything else UNKNOWN with its text;
        the session goes on."""
        with trio.fail_after(LIVENESS_LIMIT):
            with pytest.raises(TtrpcError) as info:
                await pair.runtime.call(PLUGIN, "FailNow", b"")
            assert (Status.FAILED_PRECONDITION, "no, at once") == (info.value.code, info.value.message)
            with pytest.raises(TtrpcError) as info:
                await pair.runtime.call(PLUGIN, "CrashNow", b"")
            assert (Status.UNKNOWN, "'at once'") == (info.value.code, info.value.message)
            assert b"now:on" == await pair.runtime.call(PLUGIN, "Now", b"on")

    async def test_one_write_per_read(self, nursery: trio.Nursery) -> None:
        """Requests that arrive in one read and are answered at once go back in one write, each on its
        own stream id, in order."""
        a, b = trio.socket.socketpair()
        stream = _CountingStream(trio.SocketStream(a))
        session = Session(stream, 1, 2, {(PLUGIN, "Now"): _echo_now})
        nursery.start_soon(session.run)
        peer = trio.SocketStream(b)
        client = _ttrpc.Connection(_ttrpc.Role.CLIENT)
        for i in range(3):
            client.send_request(_ttrpc.Request(PLUGIN, "Now", str(i).encode()))
        await peer.send_all(b"".join(_mux.frames(1, m) for m in client.messages_to_send()))
        demux, answers = _mux.Demultiplexer(), []
        with trio.fail_after(LIVENESS_LIMIT):
            while len(answers) < 3:
                demux.receive_data(await peer.receive_some())
                while (frame := demux.next_frame()) is not None:
                    client.receive_data(frame[1])
                while (event := client.next_event()) is not None:
                    assert isinstance(event, _ttrpc.ResponseReceived)
                    answers.append((event.stream_id, event.response.payload))
        assert [(1, b"now:0"), (3, b"now:1"), (5, b"now:2")] == answers
        assert 1 == stream.writes
        await peer.aclose()
        await session.aclose()


class TestConnectionEnds:
    async def test_peer_close_fails_waiting_calls(self, pair: _Pair) -> None:
        """Calls waiting when the peer goes away fail with ConnectionLost, and so do later ones."""
        with trio.fail_after(LIVENESS_LIMIT):
            async with trio.open_nursery() as n:

                async def close_soon() -> None:
                    await trio.sleep(0.05)
                    await pair.plugin.aclose()

                n.start_soon(close_soon)
                with pytest.raises(ConnectionLost):
                    await pair.runtime.call(PLUGIN, "Slow", b"")
            with pytest.raises(ConnectionLost):
                await pair.runtime.call(PLUGIN, "Echo", b"")

    async def test_closing_our_side_keeps_our_reason(self) -> None:
        """A session krproxy closes while it reads (a re-subscription, a stop) ends with aclose's
        reason; trio's "another task closed this fd", which the cut-short read raised, never
        becomes the reason (it reached the log as ``nri_disconnected``)."""
        a, b = trio.socket.socketpair()
        session = Session(trio.SocketStream(a), 1, 2, {})
        with trio.fail_after(LIVENESS_LIMIT):
            async with trio.open_nursery() as n:
                await n.start(session.run)
                await trio.testing.wait_all_tasks_blocked()  # the read is waiting on the socket
                await session.aclose()
        assert "another task closed this fd" not in session.reason
        assert "NRI connection closed by krproxy" == session.reason
        b.close()

    async def test_garbage_ends_the_session(self, nursery: trio.Nursery) -> None:
        """Bytes that break NRI's framing end the session with the reason; nothing hangs."""
        a, b = trio.socket.socketpair()
        session = Session(trio.SocketStream(a), 1, 2, {})
        peer = trio.SocketStream(b)
        with trio.fail_after(LIVENESS_LIMIT):
            async with trio.open_nursery() as n:
                n.start_soon(session.run)
                await peer.send_all(struct.pack(">II", 1, 0xFFFFFFFF))
            assert "does not speak NRI's framing" in session.reason
        await peer.aclose()

    async def test_raw_ttrpc_peer(self, nursery: trio.Nursery) -> None:
        """A hand-framed request (Go's layout) on connection 1 is answered on connection 1, same stream id."""
        a, b = trio.socket.socketpair()
        session = Session(trio.SocketStream(a), 1, 2, {(PLUGIN, "Echo"): _echo})
        nursery.start_soon(session.run)
        peer = trio.SocketStream(b)
        request = _ttrpc.Request(PLUGIN, "Echo", b"hi", timeout_nano=2_000_000_000).encode()
        await peer.send_all(
            struct.pack(">II", 1, 10 + len(request)) + struct.pack(">IIBB", len(request), 7, 1, 0) + request
        )
        with trio.fail_after(LIVENESS_LIMIT):
            data = b""
            while len(data) < 18 or len(data) < 8 + struct.unpack(">II", data[:8])[1]:
                data += await peer.receive_some()
        conn_id, _ = struct.unpack(">II", data[:8])
        size, stream_id, kind, flags = struct.unpack(">IIBB", data[8:18])
        assert (1, 7, 2, 0) == (conn_id, stream_id, kind, flags)
        assert _ttrpc.Response(payload=b"echo:hi") == _ttrpc.Response.decode(data[18 : 18 + size])
        await peer.aclose()
        await session.aclose()

    async def test_call_queued_behind_a_failing_send_fails_too(self, autojump_clock: object) -> None:
        """A call that waited for the send lock while the connection was lost fails with ConnectionLost
        instead of waiting for an answer that can never come (it used to hang)."""
        left, right = trio.testing.lockstep_stream_pair()  # a peer that never reads: send_all blocks
        session = Session(left, 1, 2, {})
        outcomes: list[str] = []

        async def call() -> None:
            try:
                await session.call(RUNTIME, "Echo", b"x")
            except ConnectionLost:
                outcomes.append("lost")

        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(call)
                await trio.testing.wait_all_tasks_blocked()
                n.start_soon(call)
                await trio.testing.wait_all_tasks_blocked()  # one in send_all, one waiting for the lock
                await session.aclose()
        assert ["lost", "lost"] == outcomes
        await right.aclose()
