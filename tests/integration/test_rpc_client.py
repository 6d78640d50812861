"""krproxy.rpc's client (Channel) against grpcio's server (an independent peer, in its own
threads) and against krproxy.rpc's own Server."""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio

from krproxy.grpcstatus import GRPCError, Status
from krproxy.rpc import Channel, Server, Stream, unary, unary_stream

LIVENESS_LIMIT = 30.0  # seconds: a bound on what must happen, not a speed claim


@pytest.fixture
def sock(short_tmp: Path) -> str:
    return str(short_tmp / "rpc.sock")


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

    async def hang(stream: Stream) -> None:
        deadlines.append(stream.deadline)
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

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
