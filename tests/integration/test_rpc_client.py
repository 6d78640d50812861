"""krproxy.rpc's client (Channel) against grpcio's server (an independent peer, in its own
threads) and against krproxy.rpc's own Server."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
import trio
import trio.lowlevel

from krproxy.grpcstatus import GRPCError, Status
from krproxy.h2 import frames as f
from krproxy.rpc import Channel, Server, Stream, unary, unary_stream
from tests.integration.support import hanging

LIVENESS_LIMIT = 30.0  # seconds: a bound on what must happen, not a speed claim


class _Generic(grpc.GenericRpcHandler):
    """grpcio handlers of raw bytes: /g.S/Echo (reversed, with the metadata seen), /g.S/Fail,
    /g.S/Count (server streaming: as many messages as the request says)."""

    def __init__(self) -> None:
        self.metadata: list[tuple[str, Any]] = []

    def service(self, details: Any) -> Any:
        if details.method == "/g.S/Echo":
            return grpc.unary_unary_rpc_method_handler(self._echo)
        if details.method == "/g.S/Fail":
            return grpc.unary_unary_rpc_method_handler(self._fail)
        if details.method == "/g.S/Count":
            return grpc.unary_stream_rpc_method_handler(self._count)
        return None

    def _echo(self, request: bytes, context: Any) -> bytes:
        self.metadata = list(context.invocation_metadata())
        return request[::-1]

    def _fail(self, request: bytes, context: Any) -> bytes:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not now")

    def _count(self, request: bytes, context: Any) -> Iterator[bytes]:
        for i in range(int(request)):
            yield b"%d" % i
        if int(request) == 3:
            context.abort(grpc.StatusCode.ABORTED, "after three")


@pytest.fixture
def grpcio_server(sock: str) -> Iterator[_Generic]:
    handlers = _Generic()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4), handlers=[handlers])
    server.add_insecure_port("unix://" + sock)
    server.start()
    yield handlers
    server.stop(None)


async def test_unary_calls_to_grpcio(grpcio_server: _Generic, sock: str) -> None:
    async with Channel("unix://" + sock) as channel:
        reply = await channel.unary("/g.S/Echo", b"hello", timeout=LIVENESS_LIMIT, metadata=[(b"x-a", b"b")])
        assert b"olleh" == reply
        assert ("x-a", "b") in grpcio_server.metadata
        with pytest.raises(GRPCError) as caught:
            await channel.unary("/g.S/Fail", b"", timeout=LIVENESS_LIMIT)
        assert (Status.FAILED_PRECONDITION, "not now") == (caught.value.status, caught.value.message)
        with pytest.raises(GRPCError) as caught:
            await channel.unary("/g.S/Nope", b"", timeout=LIVENESS_LIMIT)
        assert Status.UNIMPLEMENTED == caught.value.status


async def test_server_streams_from_grpcio(grpcio_server: _Generic, sock: str) -> None:
    async with Channel(sock) as channel:
        async with channel.server_stream("/g.S/Count", b"5", timeout=LIVENESS_LIMIT) as replies:
            assert [b"0", b"1", b"2", b"3", b"4"] == [reply async for reply in replies]
        got = []
        async with channel.server_stream("/g.S/Count", b"3", timeout=LIVENESS_LIMIT) as replies:
            with pytest.raises(GRPCError) as caught:
                async for reply in replies:
                    got.append(reply)
        assert [b"0", b"1", b"2"] == got  # the messages before the error, then the error
        assert (Status.ABORTED, "after three") == (caught.value.status, caught.value.message)


async def test_a_socket_nobody_serves_is_unavailable_naming_it(sock: str) -> None:
    channel = Channel(sock)  # without `async with`: it works, aclose ends it
    with pytest.raises(GRPCError) as caught:
        await channel.unary("/g.S/Echo", b"")
    assert Status.UNAVAILABLE == caught.value.status
    assert sock in (caught.value.message or "") and "No such file" in (caught.value.message or "")
    with pytest.raises(GRPCError) as caught:
        async with channel.server_stream("/g.S/Count", b"1"):
            pass
    assert Status.UNAVAILABLE == caught.value.status
    await channel.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await channel.unary("/g.S/Echo", b"")


async def test_the_timeout_is_deadline_exceeded_and_reaches_the_server(
    nursery: trio.Nursery, sock: str
) -> None:
    deadlines: list[float | None] = []
    cancelled = trio.Event()

    # ``cancelled`` is a new event for the second call: the handler sets whichever is current.
    hang = hanging(lambda stream: deadlines.append(stream.deadline), lambda: cancelled.set())

    # The server does not enforce it: the client's own deadline ends the call, and its reset
    # (the caller going away) cancels the handler.
    await nursery.start(Server({"/t.S/Hang": hang}, enforce_deadlines=False).serve, sock)
    async with Channel(sock) as channel:
        with pytest.raises(GRPCError) as caught:
            await channel.unary("/t.S/Hang", b"", timeout=0.2)
        assert Status.DEADLINE_EXCEEDED == caught.value.status
        with trio.fail_after(LIVENESS_LIMIT):
            await cancelled.wait()
        assert deadlines[0] is not None
        cancelled = trio.Event()
        with pytest.raises(GRPCError) as caught:
            async with channel.server_stream("/t.S/Hang", b"", timeout=0.2) as replies:
                async for _ in replies:
                    pass
        assert Status.DEADLINE_EXCEEDED == caught.value.status
        with trio.fail_after(LIVENESS_LIMIT):
            await cancelled.wait()
        assert deadlines[1] is not None  # the stream's grpc-timeout reached the server too


async def test_calls_to_krproxys_own_server(nursery: trio.Nursery, sock: str) -> None:
    async def reverse(message: bytes) -> bytes:
        return message[::-1]

    async def refuse(message: bytes) -> bytes:
        raise GRPCError(Status.NOT_FOUND, "gone", b"\x01\x02")

    async def count(message: bytes) -> AsyncIterator[bytes]:
        for i in range(int(message)):
            yield b"%d" % i

    left = trio.Event()

    async def endless(message: bytes) -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"more"
        finally:
            left.set()

    handlers = {
        "/t.S/Reverse": unary(reverse),
        "/t.S/Refuse": unary(refuse),
        "/t.S/Count": unary_stream(count),
        "/t.S/Endless": unary_stream(endless),
    }
    await nursery.start(Server(handlers).serve, sock)
    async with Channel(sock) as channel:
        assert b"cba" == await channel.unary("/t.S/Reverse", b"abc")
        with pytest.raises(GRPCError) as caught:
            await channel.unary("/t.S/Refuse", b"")
        assert (Status.NOT_FOUND, "gone", b"\x01\x02") == (
            caught.value.status,
            caught.value.message,
            caught.value.details,
        )
        many = 2000  # more than a stream window's worth of small messages, read as they come
        async with channel.server_stream("/t.S/Count", b"%d" % many) as replies:
            got = [reply async for reply in replies]
        assert [b"%d" % i for i in range(many)] == got
        async with channel.server_stream("/t.S/Endless", b"") as replies:
            async for _ in replies:
                break  # leaving early cancels the call: the handler's generator is closed
        with trio.fail_after(LIVENESS_LIMIT):
            await left.wait()
        assert b"ok" == await channel.unary("/t.S/Reverse", b"ko")


async def test_first_calls_made_at_once_share_the_channel(nursery: trio.Nursery, sock: str) -> None:
    async def reverse(message: bytes) -> bytes:
        return message[::-1]

    await nursery.start(Server({"/t.S/Reverse": unary(reverse)}).serve, sock)
    replies: dict[int, bytes] = {}
    async with Channel(sock) as channel:

        async def one(i: int) -> None:
            replies[i] = await channel.unary("/t.S/Reverse", b"%d-" % i)

        async with trio.open_nursery() as calls:
            for i in range(20):
                calls.start_soon(one, i)
    assert {i: (b"%d-" % i)[::-1] for i in range(20)} == replies


async def test_drain_lets_running_calls_finish_then_closes(nursery: trio.Nursery, sock: str) -> None:
    release, running = trio.Event(), trio.Event()

    async def slow(message: bytes) -> bytes:
        running.set()
        await release.wait()
        return b"finished"

    server = Server({"/t.S/Slow": unary(slow)})
    await nursery.start(server.serve, sock)
    replies: list[bytes] = []
    drained: list[bool] = []
    async with Channel(sock) as channel, trio.open_nursery() as tasks:

        async def call() -> None:
            replies.append(await channel.unary("/t.S/Slow", b"", timeout=LIVENESS_LIMIT))

        async def drain() -> None:
            drained.append(await server.drain(LIVENESS_LIMIT))

        tasks.start_soon(call)
        with trio.fail_after(LIVENESS_LIMIT):
            await running.wait()
        tasks.start_soon(drain)
        await trio.sleep(0.2)
        assert [] == drained  # the call is still running: the drain waits for it
        release.set()
    assert [b"finished"] == replies and [True] == drained
    # A call that never ends: the drain gives up after its grace.
    second = Server({"/t.S/Slow": unary(slow)})
    await nursery.start(second.serve, sock + "2")
    running, release = trio.Event(), trio.Event()  # never released
    async with Channel(sock + "2") as channel, trio.open_nursery() as tasks:
        tasks.start_soon(functools.partial(channel.unary, "/t.S/Slow", b"", timeout=LIVENESS_LIMIT))
        with trio.fail_after(LIVENESS_LIMIT):
            await running.wait()
        assert not await second.drain(0.3)
        tasks.cancel_scope.cancel()


async def test_a_server_stream_the_server_refused_is_opened_again(nursery: trio.Nursery, sock: str) -> None:
    """Two streams opened on a new connection before the server's SETTINGS arrive: the second
    is beyond its MAX_CONCURRENT_STREAMS of 1 and refused (REFUSED_STREAM, not processed), so it
    is sent again, and waits for the first to end."""

    async def count(message: bytes) -> AsyncIterator[bytes]:
        for i in range(3):
            await trio.sleep(0.01)
            yield b"%d" % i

    await nursery.start(Server({"/t.S/Count": unary_stream(count)}, max_streams=1).serve, sock)
    got: list[list[bytes]] = []
    async with Channel(sock) as channel:

        async def one() -> None:
            async with channel.server_stream("/t.S/Count", b"", timeout=LIVENESS_LIMIT) as replies:
                got.append([reply async for reply in replies])

        async with trio.open_nursery() as calls:
            calls.start_soon(one)
            calls.start_soon(one)
    assert [[b"0", b"1", b"2"]] * 2 == got


async def test_an_answer_over_max_answer_is_resource_exhausted(grpcio_server: _Generic, sock: str) -> None:
    """As the Channel's docstring says (and grpc-go's client answers), for unary calls as for
    server streams; it was UNAVAILABLE for a unary call (the relay's own error), which tells a
    caller to try again. The channel goes on serving calls."""
    async with Channel(sock, max_answer=1000) as channel:
        with pytest.raises(GRPCError) as caught:
            await channel.unary("/g.S/Echo", b"y" * 2000)
        assert Status.RESOURCE_EXHAUSTED == caught.value.status, caught.value
        assert "larger than 1000 bytes" in (caught.value.message or "")
        assert b"cba" == await channel.unary("/g.S/Echo", b"abc")


async def test_a_server_reset_has_the_status_grpc_go_gives(nursery: trio.Nursery, sock: str) -> None:
    """RST_STREAM's code is the status as grpc-go's client maps it (http2ErrConvTab): CANCEL is
    CANCELLED, INTERNAL_ERROR (or any code not listed) INTERNAL, ENHANCE_YOUR_CALM
    RESOURCE_EXHAUSTED; only REFUSED_STREAM is UNAVAILABLE (it was UNAVAILABLE for every code)."""

    async def reset(stream: Stream) -> None:
        code = int(await stream.recv_message() or b"0")
        stream.reset(code)

    await nursery.start(Server({"/t.S/Reset": reset}).serve, sock)
    wanted = {
        f.CANCEL: Status.CANCELLED,
        f.INTERNAL_ERROR: Status.INTERNAL,
        f.PROTOCOL_ERROR: Status.INTERNAL,
        f.ENHANCE_YOUR_CALM: Status.RESOURCE_EXHAUSTED,
    }
    async with Channel(sock) as channel:
        for code, status in wanted.items():
            with pytest.raises(GRPCError) as caught:
                await channel.unary("/t.S/Reset", b"%d" % code)
            assert status == caught.value.status, caught.value
            assert f.ERROR_NAMES[code] in (caught.value.message or "")
            with pytest.raises(GRPCError) as caught:
                async with channel.server_stream("/t.S/Reset", b"%d" % code) as replies:
                    async for _ in replies:
                        pass
            assert status == caught.value.status, caught.value


async def test_an_ok_answer_without_exactly_one_message_is_internal(nursery: trio.Nursery, sock: str) -> None:
    """A unary call answered OK with no message, or with two, got UNAVAILABLE, which tells the
    caller to send again a call the server did carry out; grpc-go's client answers INTERNAL
    (a cardinality violation)."""

    async def none(stream: Stream) -> None:
        await stream.recv_message()

    async def two(stream: Stream) -> None:
        await stream.recv_message()
        await stream.send_message(b"one")
        await stream.send_message(b"two")

    await nursery.start(Server({"/t.S/None": none, "/t.S/Two": two}).serve, sock)
    async with Channel(sock) as channel:
        for method in ("/t.S/None", "/t.S/Two"):
            with pytest.raises(GRPCError) as caught:
                await channel.unary(method, b"")
            assert Status.INTERNAL == caught.value.status, caught.value
            assert "not one uncompressed gRPC message" in (caught.value.message or "")


async def test_an_answer_ending_without_trailers_is_internal(sock: str) -> None:
    """A server that ends the stream with its DATA, no trailers: grpc-go's client answers
    INTERNAL ("server closed the stream without sending trailers"), as the Channel's server
    streams did; a unary call got UNAVAILABLE (send it again) for a call the server answered."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock)
    listener.listen(1)
    listener.settimeout(LIVENESS_LIMIT)

    def answer_without_trailers() -> None:
        conn_sock, _ = listener.accept()
        conn_sock.settimeout(LIVENESS_LIMIT)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        conn_sock.sendall(conn.data_to_send())
        answered = 0
        with contextlib.suppress(OSError):
            while answered < 2:
                data = conn_sock.recv(65536)
                if not data:
                    break
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.StreamEnded):
                        conn.send_headers(
                            event.stream_id, [(":status", "200"), ("content-type", "application/grpc")]
                        )
                        conn.send_data(event.stream_id, b"\x00\x00\x00\x00\x02ok", end_stream=True)
                        answered += 1
                conn_sock.sendall(conn.data_to_send())
        conn_sock.close()

    thread = threading.Thread(target=answer_without_trailers, daemon=True)
    thread.start()
    try:
        async with Channel(sock) as channel:
            with pytest.raises(GRPCError) as caught:
                await channel.unary("/t.S/M", b"")
            assert Status.INTERNAL == caught.value.status, caught.value
            with pytest.raises(GRPCError) as caught:
                async with channel.server_stream("/t.S/M", b"") as replies:
                    assert [b"ok"] == [reply async for reply in replies]
            assert Status.INTERNAL == caught.value.status, caught.value
    finally:
        await trio.to_thread.run_sync(thread.join, LIVENESS_LIMIT)
        listener.close()


async def test_no_fd_or_call_is_left_after_many_calls_and_failures(nursery: trio.Nursery, sock: str) -> None:
    """Calls that succeed, fail, are reset, time out or find no server, on channels opened and
    closed, leave the process's fds and the server's calls and connections as they were."""

    async def reverse(message: bytes) -> bytes:
        return message[::-1]

    async def hang(stream: Stream) -> None:
        await trio.sleep_forever()

    async def reset(stream: Stream) -> None:
        await stream.recv_message()
        stream.reset(f.CANCEL)

    async def count(message: bytes) -> AsyncIterator[bytes]:
        for i in range(int(message)):
            yield b"%d" % i

    server = Server(
        {"/t.S/R": unary(reverse), "/t.S/Hang": hang, "/t.S/Reset": reset, "/t.S/Count": unary_stream(count)}
    )
    fds = len(os.listdir("/proc/self/fd"))
    scope = trio.CancelScope()

    async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await server.serve(sock, task_status=task_status)

    await nursery.start(serve)
    for _ in range(10):
        async with Channel(sock) as channel:
            assert b"ba" == await channel.unary("/t.S/R", b"ab")
            with pytest.raises(GRPCError) as caught:
                await channel.unary("/t.S/Hang", b"", timeout=0.05)
            assert Status.DEADLINE_EXCEEDED == caught.value.status
            with pytest.raises(GRPCError) as caught:
                await channel.unary("/t.S/Reset", b"")  # no deadline: a loaded machine is slow
            assert Status.CANCELLED == caught.value.status
            async with channel.server_stream("/t.S/Count", b"5") as replies:
                async for _ in replies:
                    break
            with pytest.raises(GRPCError):
                await channel.unary("/t.S/Missing", b"")
    with trio.fail_after(LIVENESS_LIMIT):
        await server.transport.wait_idle()  # every call ended on the server too
        while server.transport._clients:  # noqa: ASYNC110 - no event for it: the server sees each EOF
            await trio.sleep(0.01)
    assert fds + 1 == len(os.listdir("/proc/self/fd"))  # the server's listening socket
    scope.cancel()
    for _ in range(10):
        async with Channel(sock) as channel:
            with pytest.raises(GRPCError) as caught:
                await channel.unary("/t.S/R", b"")
            assert Status.UNAVAILABLE == caught.value.status
    await trio.lowlevel.checkpoint()
    assert fds == len(os.listdir("/proc/self/fd"))
