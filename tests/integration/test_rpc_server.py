"""krproxy.rpc's server, driven by independent peers: grpcio's sync client in a worker thread,
and a raw HTTP/2 client (:mod:`tests.integration.h2_client`) where the frames are the point
(trailers-only answers, resets, deadlines under a MockClock)."""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
import trio.testing

from krproxy.grpcstatus import GRPCError, Status
from krproxy.rpc import Server, Stream, unary
from krproxy.unixsock import SocketInUseError
from tests.integration.h2_client import framed, grpc_request, request

ECHO = "/test.Echo/Echo"
LIVENESS_LIMIT = 30.0  # seconds: a bound on what must happen, not a speed claim


async def _reverse(message: bytes) -> bytes:
    return message[::-1]


async def start(nursery: trio.Nursery, path: str, server: Server) -> str:
    await nursery.start(server.serve, path)
    return path


@pytest.fixture
def sock(short_tmp: Path) -> str:
    return str(short_tmp / "rpc.sock")


@pytest.fixture
def grpcio() -> Iterator[Callable[[str], grpc.Channel]]:
    channels: list[grpc.Channel] = []

    def open_channel(path: str) -> grpc.Channel:
        channel = grpc.insecure_channel(
            "unix://" + path, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        )
        channels.append(channel)
        return channel

    yield open_channel
    for channel in channels:
        channel.close()


async def call_unary(channel: grpc.Channel, path: str, message: bytes, **kwargs: Any) -> Any:
    """A unary call of raw bytes from grpcio, in a worker thread (with_call: reply and call)."""
    method = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    kwargs.setdefault("timeout", LIVENESS_LIMIT)
    return await trio.to_thread.run_sync(functools.partial(method.with_call, message, **kwargs))


async def grpcio_error(
    channel: grpc.Channel, path: str, message: bytes = b"x", **kwargs: Any
) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        await call_unary(channel, path, message, **kwargs)
    return caught.value


async def test_a_unary_handler_answers_grpcio_and_sees_its_metadata(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], grpc.Channel]
) -> None:
    seen: list[Stream] = []

    async def handler(stream: Stream) -> None:
        seen.append(stream)
        message = await stream.recv_message()
        assert message is not None
        await stream.send_initial_metadata([(b"x-answer", b"yes")])
        await stream.send_message(message[::-1])
        await stream.send_trailing_metadata(metadata=[(b"x-trailer", b"done")])

    await start(nursery, sock, Server({ECHO: handler, "/test.Echo/Plain": unary(_reverse)}))
    channel = grpcio(sock)
    reply, call = await call_unary(channel, ECHO, b"hello", metadata=[("x-asked", "please")])
    assert b"olleh" == reply
    assert ("x-answer", "yes") in call.initial_metadata()
    assert ("x-trailer", "done") in call.trailing_metadata()
    assert (b"x-asked", b"please") in seen[0].metadata
    assert all(not name.startswith(b":") for name, _ in seen[0].metadata)
    assert (b":path", ECHO.encode()) in seen[0].headers
    assert ECHO == seen[0].path
    assert seen[0].deadline is not None  # grpcio sends its timeout
    reply, _ = await call_unary(channel, "/test.Echo/Plain", b"abc")
    assert b"cba" == reply
    big = os.urandom(5 * 1024 * 1024)  # beyond one stream window both ways
    reply, _ = await call_unary(channel, "/test.Echo/Plain", big)
    assert big[::-1] == reply


async def test_grpc_error_is_the_status_and_other_exceptions_are_unknown(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], grpc.Channel], caplog: pytest.LogCaptureFixture
) -> None:
    async def refuse(message: bytes) -> bytes:
        raise GRPCError(Status.NOT_FOUND, "no such pod: é", b"\x08\x05")

    async def crash(message: bytes) -> bytes:
        raise ValueError("a bug")

    server = Server({"/t.S/Refuse": unary(refuse), "/t.S/Crash": unary(crash), ECHO: unary(_reverse)})
    await start(nursery, sock, server)
    channel = grpcio(sock)
    err = await grpcio_error(channel, "/t.S/Refuse")
    assert grpc.StatusCode.NOT_FOUND == err.code()
    assert "no such pod: é" == err.details()
    assert ("grpc-status-details-bin", b"\x08\x05") in err.trailing_metadata()
    with caplog.at_level(logging.ERROR, logger="krproxy.rpc"):
        err = await grpcio_error(channel, "/t.S/Crash")
    assert grpc.StatusCode.UNKNOWN == err.code()
    assert "ValueError: a bug" == err.details()
    assert any(r.exc_info and "/t.S/Crash" in r.getMessage() for r in caplog.records)
    reply, _ = await call_unary(channel, ECHO, b"still here")  # the server lives on
    assert b"ereh llits" == reply


async def test_an_error_before_any_message_is_a_trailers_only_answer(
    nursery: trio.Nursery, sock: str
) -> None:
    async def refuse(message: bytes) -> bytes:
        raise GRPCError(Status.PERMISSION_DENIED, "not you")

    await start(nursery, sock, Server({"/t.S/Refuse": unary(refuse)}))
    answer = await request(sock, grpc_request("/t.S/Refuse"), framed(b"x"))
    assert [] == answer.trailers and b"" == answer.data
    assert ("grpc-status", "7") in answer.headers and ("grpc-message", "not you") in answer.headers
    assert (":status", "200") in answer.headers
    assert answer.reset is None


async def test_unknown_paths_are_unimplemented_unless_the_fallback_answers(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], grpc.Channel]
) -> None:
    asked: list[str] = []

    def fallback(path: str) -> Any:
        asked.append(path)
        return unary(_reverse) if path.startswith("/known.") else None

    await start(nursery, sock, Server({}, fallback=fallback))
    channel = grpcio(sock)
    reply, _ = await call_unary(channel, "/known.S/Any", b"ab")
    assert b"ba" == reply
    err = await grpcio_error(channel, "/unknown.S/Any")
    assert grpc.StatusCode.UNIMPLEMENTED == err.code()
    assert "/unknown.S/Any" in (err.details() or "")
    assert ["/known.S/Any", "/unknown.S/Any"] == asked
    no_fallback = os.path.join(os.path.dirname(sock), "plain.sock")
    await start(nursery, no_fallback, Server({ECHO: unary(_reverse)}))
    err = await grpcio_error(grpcio(no_fallback), "/known.S/Any")
    assert grpc.StatusCode.UNIMPLEMENTED == err.code()


async def test_a_handler_returning_without_trailers_ends_ok(nursery: trio.Nursery, sock: str) -> None:
    async def quiet(stream: Stream) -> None:
        await stream.send_message(b"one")

    async def silent(stream: Stream) -> None:
        pass

    await start(nursery, sock, Server({"/t.S/Quiet": quiet, "/t.S/Silent": silent}))
    answer = await request(sock, grpc_request("/t.S/Quiet"), framed(b""))
    assert framed(b"one") == answer.data and ("grpc-status", "0") in answer.trailers
    answer = await request(sock, grpc_request("/t.S/Silent"), framed(b""))
    assert ("grpc-status", "0") in answer.headers and [] == answer.trailers  # trailers-only OK


async def test_serve_replaces_a_stale_socket_refuses_a_live_one_and_removes_its_own(sock: str) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(sock)
    stale.close()  # a file nobody listens on, as a crash leaves
    async with trio.open_nursery() as nursery:
        await start(nursery, sock, Server({ECHO: unary(_reverse)}))
        answer = await request(sock, grpc_request(ECHO), framed(b"ab"))
        assert b"ba" == answer.message
        with pytest.raises(SocketInUseError):
            await Server({}).serve(sock)
        nursery.cancel_scope.cancel()
    assert not Path(sock).exists()  # noqa: ASYNC240 - one stat, after the server stopped


async def test_the_callers_deadline_cancels_the_handler(
    nursery: trio.Nursery, sock: str, autojump_clock: trio.testing.MockClock
) -> None:
    ended: list[str] = []
    deadlines: list[float | None] = []

    async def hang(stream: Stream) -> None:
        deadlines.append(stream.deadline)
        try:
            await trio.sleep_forever()
        finally:
            ended.append("cancelled")

    await start(nursery, sock, Server({"/t.S/Hang": hang}))
    started = trio.current_time()
    answer = await request(sock, grpc_request("/t.S/Hang", timeout=5.0), framed(b""))
    assert 4 == answer.grpc_status  # DEADLINE_EXCEEDED, from the server
    assert ["cancelled"] == ended
    assert deadlines[0] is not None and deadlines[0] == pytest.approx(started + 5.0, abs=0.1)


async def test_without_enforce_deadlines_the_handler_runs_past_the_deadline(
    nursery: trio.Nursery, sock: str, autojump_clock: trio.testing.MockClock
) -> None:
    ran: list[float] = []

    async def slow(stream: Stream) -> None:
        await trio.sleep(60)
        ran.append(trio.current_time())
        await stream.send_message(b"late")

    await start(nursery, sock, Server({"/t.S/Slow": slow}, enforce_deadlines=False))
    started = trio.current_time()
    answer = await request(sock, grpc_request("/t.S/Slow", timeout=5.0), framed(b""))
    assert b"late" == answer.message and ("grpc-status", "0") in answer.trailers
    assert ran and ran[0] >= started + 60
