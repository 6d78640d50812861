"""krproxy.rpc's server, driven by independent peers: grpcio's sync client in a worker thread,
and a raw HTTP/2 client (:mod:`tests.integration.h2_client`) where the frames are the point
(trailers-only answers, resets, deadlines under a MockClock)."""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
import trio
import trio.testing

from krproxy.grpcstatus import GRPCError, Status
from krproxy.h2 import frames as f
from krproxy.rpc import Channel, Server, Stream, unary, unary_stream
from krproxy.unixsock import SocketInUseError
from tests.integration.h2_client import framed, grpc_request, request
from tests.integration.support import grpcio_channels, hanging

ECHO = "/test.Echo/Echo"
LIVENESS_LIMIT = 30.0  # seconds: a bound on what must happen, not a speed claim


async def _reverse(message: bytes) -> bytes:
    return message[::-1]


async def start(nursery: trio.Nursery, path: str, server: Server) -> str:
    await nursery.start(server.serve, path)
    return path


@pytest.fixture
def grpcio() -> Iterator[Callable[[str], grpc.Channel]]:
    with grpcio_channels(("grpc.max_receive_message_length", 64 * 1024 * 1024)) as open_channel:
        yield open_channel


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


async def test_grpc_error_is_its_status_other_exceptions_unknown(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], grpc.Channel], caplog: pytest.LogCaptureFixture
) -> None:
    """Grpc error is the status and other exceptions are unknown."""

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


async def test_unknown_paths_unimplemented_unless_fallback_answers(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], grpc.Channel]
) -> None:
    """Unknown paths are unimplemented unless the fallback answers."""
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


async def test_serve_replaces_stale_socket_refuses_live_one(sock: str) -> None:
    """Serve replaces a stale socket refuses a live one and removes its own."""
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

    hang = hanging(lambda stream: deadlines.append(stream.deadline), lambda: ended.append("cancelled"))

    await start(nursery, sock, Server({"/t.S/Hang": hang}))
    started = trio.current_time()
    answer = await request(sock, grpc_request("/t.S/Hang", timeout=5.0), framed(b""))
    assert 4 == answer.grpc_status  # DEADLINE_EXCEEDED, from the server
    assert ["cancelled"] == ended
    assert deadlines[0] is not None and deadlines[0] == pytest.approx(started + 5.0, abs=0.1)


async def test_without_enforce_deadlines_handler_runs_past_it(
    nursery: trio.Nursery, sock: str, autojump_clock: trio.testing.MockClock
) -> None:
    """Without enforce deadlines the handler runs past the deadline."""
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


# -- streaming ------------------------------------------------------------------------------


async def test_server_streaming_to_grpcio(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], grpc.Channel]
) -> None:
    async def count(message: bytes) -> AsyncIterator[bytes]:
        for i in range(int(message)):
            yield b"%d" % i

    await start(nursery, sock, Server({"/t.S/Count": unary_stream(count)}))
    method = grpcio(sock).unary_stream("/t.S/Count", request_serializer=None, response_deserializer=None)
    replies = await trio.to_thread.run_sync(lambda: list(method(b"1000", timeout=LIVENESS_LIMIT)))
    assert [b"%d" % i for i in range(1000)] == replies


async def test_client_and_bidi_streaming_from_grpcio(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], grpc.Channel]
) -> None:
    async def total(stream: Stream) -> None:
        size = 0
        while (message := await stream.recv_message()) is not None:
            size += len(message)
        await stream.send_message(b"%d" % size)

    async def echo_each(stream: Stream) -> None:
        while (message := await stream.recv_message()) is not None:
            await stream.send_message(message.upper())

    await start(nursery, sock, Server({"/t.S/Total": total, "/t.S/Each": echo_each}))
    channel = grpcio(sock)
    chunks = [os.urandom(1024 * 1024) for _ in range(12)]  # 12 MiB: beyond the stream window
    total_method = channel.stream_unary("/t.S/Total", request_serializer=None, response_deserializer=None)
    reply = await trio.to_thread.run_sync(lambda: total_method(iter(chunks), timeout=LIVENESS_LIMIT))
    assert b"%d" % (12 * 1024 * 1024) == reply
    each = channel.stream_stream("/t.S/Each", request_serializer=None, response_deserializer=None)
    words = [b"a", b"bc", b"def"]
    replies = await trio.to_thread.run_sync(lambda: list(each(iter(words), timeout=LIVENESS_LIMIT)))
    assert [b"A", b"BC", b"DEF"] == replies


async def test_send_message_waits_for_a_caller_that_does_not_read(nursery: trio.Nursery, sock: str) -> None:
    sent: list[int] = []
    chunk = b"x" * (256 * 1024)

    async def flood(stream: Stream) -> None:
        for i in range(256):  # 64 MiB if nothing held it back
            await stream.send_message(chunk)
            sent.append(i)

    await start(nursery, sock, Server({"/t.S/Flood": flood}))
    async with Channel(sock) as channel:
        async with channel.server_stream("/t.S/Flood", b"") as replies:
            await trio.sleep(0.3)  # the handler runs until the windows (4 MiB) and the slack are used
            held_at = len(sent)
            assert held_at < 32  # 8 MiB: the stream window (4 MiB) plus a little
            received = 0
            async for reply in replies:
                received += len(reply)
        assert 256 * len(chunk) == received and 256 == len(sent)


# -- the strict fakes' header checks ----------------------------------------------------------


_ANSWER_EVENTS = frozenset(
    ("ResponseReceived", "DataReceived", "TrailersReceived", "StreamEnded", "StreamReset")
)


def _strict(stream: Stream) -> bool:
    """A grpc-go-like check: x-refuse: reset -> PROTOCOL_ERROR; abort -> trailers-only 400; else None."""
    verdict = dict(stream.headers).get(b"x-refuse")
    if verdict == b"reset":
        stream.reset(f.PROTOCOL_ERROR)
        return False
    if verdict == b"abort":
        stream.refuse([(b":status", b"400"), (b"content-type", b"application/grpc"), (b"grpc-status", b"13")])
        return False
    return verdict is None


async def test_check_headers_resets_or_refuses_as_grpc_go_does(nursery: trio.Nursery, sock: str) -> None:
    handled: list[str] = []

    async def handler(stream: Stream) -> None:
        handled.append(stream.path)
        await stream.send_message(b"ok")

    await start(nursery, sock, Server({ECHO: handler}, check_headers=_strict))
    answer = await request(sock, grpc_request(ECHO, **{"x-refuse": "reset"}), framed(b""))
    assert f.PROTOCOL_ERROR == answer.reset and [] == answer.headers
    # An early abort: the answer, then RST_STREAM NO_ERROR since the HEADERS did not end the
    # request (its DATA arrives in the same read, after the check ran) ...
    seen = await frames_until_ping(sock, grpc_request(ECHO, **{"x-refuse": "abort"}), framed(b""))
    assert [(f.HEADERS, True), (f.RST_STREAM, False)] == [(k, bool(fl & f.END_STREAM)) for k, fl, _ in seen]
    assert f.NO_ERROR == f.parse_u32(seen[1][2])
    answer = await request(sock, grpc_request(ECHO, **{"x-refuse": "abort"}), framed(b""))
    assert (":status", "400") in answer.headers and 13 == answer.grpc_status
    # ... and no reset for a request that ended with its HEADERS.
    seen = await frames_until_ping(sock, grpc_request(ECHO, **{"x-refuse": "abort"}), None)
    assert [f.HEADERS] == [kind for kind, _, _ in seen]
    # False without an answer of its own: PROTOCOL_ERROR.
    answer = await request(sock, grpc_request(ECHO, **{"x-refuse": "other"}), framed(b""))
    assert f.PROTOCOL_ERROR == answer.reset
    assert [] == handled
    answer = await request(sock, grpc_request(ECHO), framed(b""))
    assert b"ok" == answer.message and [ECHO] == handled


async def test_an_async_check_headers_runs_before_the_handler(nursery: trio.Nursery, sock: str) -> None:
    async def check(stream: Stream) -> bool:
        await trio.lowlevel.checkpoint()
        return _strict(stream)

    await start(nursery, sock, Server({ECHO: unary(_reverse)}, check_headers=check))
    answer = await request(sock, grpc_request(ECHO, **{"x-refuse": "reset"}), framed(b""))
    assert f.PROTOCOL_ERROR == answer.reset
    answer = await request(sock, grpc_request(ECHO), framed(b"ab"))
    assert b"ba" == answer.message


async def test_check_headers_replaces_the_relays_header_rules(nursery: trio.Nursery, sock: str) -> None:
    # A value starting with a space: RFC 9113 §8.2.1 refuses it (the relay resets the stream),
    # grpc-go lets it pass, and so does a server with a check of its own.
    fields = grpc_request(ECHO, **{"x-padded": " value"})
    await start(nursery, sock, Server({ECHO: unary(_reverse)}))
    assert f.PROTOCOL_ERROR == (await request(sock, fields, framed(b"ab"))).reset
    lenient = os.path.join(os.path.dirname(sock), "lenient.sock")
    await start(nursery, lenient, Server({ECHO: unary(_reverse)}, check_headers=_strict))
    assert b"ba" == (await request(lenient, fields, framed(b"ab"))).message


async def frames_until_ping(
    socket_path: str, fields: list[tuple[str, str]], body: bytes | None
) -> list[tuple[int, int, bytes]]:
    """The frames of stream 1 the server sent for one request on a new connection, as (type,
    flags, payload), up to its answer to a PING sent once it answered: what it wrote right
    after its answer (a reset) is in. Read raw: h2 hides a reset of a stream it saw end."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, fields, end_stream=body is None)
    if body is not None:
        conn.send_data(1, body, end_stream=True)
    seen: list[tuple[int, int, bytes]] = []
    buf = bytearray()
    async with await trio.open_unix_socket(socket_path) as stream:
        await stream.send_all(conn.data_to_send())
        pinged = False
        with trio.fail_after(LIVENESS_LIMIT):
            while True:
                data = await stream.receive_some(65536)
                assert data, seen
                buf += data
                while len(buf) >= f.HEAD_SIZE:
                    high, low, kind, flags, stream_id = f.HEAD.unpack_from(buf)
                    end = f.HEAD_SIZE + (high << 16 | low)
                    if len(buf) < end:
                        break
                    payload = bytes(buf[f.HEAD_SIZE : end])
                    del buf[:end]
                    if kind == f.PING and flags & f.ACK:
                        return seen
                    if kind == f.SETTINGS and not flags & f.ACK:
                        await stream.send_all(f.frame(f.SETTINGS, f.ACK, 0))
                    if stream_id == 1:
                        seen.append((kind, flags, payload))
                if not pinged and any(k == f.RST_STREAM or fl & f.END_STREAM for k, fl, _ in seen):
                    await stream.send_all(f.frame(f.PING, 0, 0, b"12345678"))
                    pinged = True
