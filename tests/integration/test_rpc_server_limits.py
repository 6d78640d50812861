"""krproxy.rpc's server at its limits and a call's endings: max_request, max_streams, a dropped
transport or caller, compressed and bad messages, and flow control against a handler or a caller
that does not read (grpcio's sync client, and raw HTTP/2 where the frames are the point)."""

from __future__ import annotations

import gzip
import logging
import os
from collections.abc import Callable
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

from krproxy.grpcstatus import Status
from krproxy.h2 import frames as f
from krproxy.relay.rpc import CloseConnection
from krproxy.rpc import Server, Stream, unary
from tests.integration.h2_client import framed, grpc_request, request
from tests.integration.support import hanging
from tests.integration.test_rpc_server import (
    ECHO,
    LIVENESS_LIMIT,
    _reverse,
    call_unary,
    grpcio_error,
    start,
)
from tests.integration.test_rpc_server import grpcio as grpcio  # the fixture, taken by its name

# -- limits and endings -----------------------------------------------------------------------


async def test_a_request_over_max_request_is_resource_exhausted(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], grpc.Channel]
) -> None:
    """A request message over max request is resource exhausted."""
    await start(nursery, sock, Server({ECHO: unary(_reverse)}, max_request=1024 * 1024))
    channel = grpcio(sock)
    err = await grpcio_error(channel, ECHO, b"x" * (1024 * 1024 + 1))
    assert grpc.StatusCode.RESOURCE_EXHAUSTED == err.code()
    assert "grpc: received message larger than max (1048577 vs. 1048576)" == err.details()
    reply, _ = await call_unary(channel, ECHO, b"x" * (1024 * 1024))
    assert 1024 * 1024 == len(reply)


async def test_max_streams_is_advertised_and_kept(nursery: trio.Nursery, sock: str) -> None:
    release = trio.Event()

    async def wait(stream: Stream) -> None:
        await release.wait()
        await stream.send_message(b"done")

    await start(nursery, sock, Server({ECHO: wait}, max_streams=1))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    async with await trio.open_unix_socket(sock) as stream:
        conn.initiate_connection()
        for stream_id in (1, 3):
            conn.send_headers(stream_id, grpc_request(ECHO))
            conn.send_data(stream_id, framed(b""), end_stream=True)
        await stream.send_all(conn.data_to_send())
        events: list[Any] = []
        with trio.fail_after(LIVENESS_LIMIT):
            while not any(isinstance(e, h2.events.StreamReset) for e in events):
                events += conn.receive_data(await stream.receive_some(65536))
                await stream.send_all(conn.data_to_send())
        settings = next(e for e in events if isinstance(e, h2.events.RemoteSettingsChanged))
        assert 1 == settings.changed_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS].new_value
        reset = next(e for e in events if isinstance(e, h2.events.StreamReset))
        assert (3, h2.errors.ErrorCodes.REFUSED_STREAM) == (reset.stream_id, reset.error_code)
        release.set()
    unlimited = os.path.join(os.path.dirname(sock), "unlimited.sock")
    await start(nursery, unlimited, Server({ECHO: unary(_reverse)}))
    answer = await request(unlimited, grpc_request(ECHO), framed(b""))
    assert h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS not in answer.settings  # as grpc-go


async def test_close_connection_drops_transport_server_goes_on(nursery: trio.Nursery, sock: str) -> None:
    """Close connection drops the transport and the server goes on."""

    async def crash(stream: Stream) -> None:
        stream.close_connection()

    async def crash_by_raising(stream: Stream) -> None:
        raise CloseConnection()

    await start(
        nursery, sock, Server({"/t.S/Crash": crash, "/t.S/Raise": crash_by_raising, ECHO: unary(_reverse)})
    )
    for path in ("/t.S/Crash", "/t.S/Raise"):
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.send_headers(1, grpc_request(path))
        conn.send_data(1, framed(b""), end_stream=True)
        received = bytearray()
        async with await trio.open_unix_socket(sock) as stream:
            await stream.send_all(conn.data_to_send())
            with trio.fail_after(LIVENESS_LIMIT):
                while data := await stream.receive_some(65536):  # until the server closes it
                    received += data
        events = conn.receive_data(bytes(received))
        assert not [e for e in events if getattr(e, "stream_id", 0) == 1]  # no answer at all
    assert b"ba" == (await request(sock, grpc_request(ECHO), framed(b"ab"))).message


async def test_the_caller_going_away_cancels_the_handler(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], grpc.Channel]
) -> None:
    running, cancelled = trio.Event(), trio.Event()
    token = trio.lowlevel.current_trio_token()

    hang = hanging(lambda _stream: token.run_sync_soon(running.set), cancelled.set)

    await start(nursery, sock, Server({"/t.S/Hang": hang}, enforce_deadlines=False))
    method = grpcio(sock).unary_unary("/t.S/Hang", request_serializer=None, response_deserializer=None)
    future = method.future(b"", timeout=LIVENESS_LIMIT)
    with trio.fail_after(LIVENESS_LIMIT):
        await running.wait()
        future.cancel()  # grpcio resets the stream (RST_STREAM CANCEL)
        await cancelled.wait()


async def test_a_gzip_request_message_is_decompressed(nursery: trio.Nursery, sock: str) -> None:
    await start(nursery, sock, Server({ECHO: unary(_reverse)}))
    packed = gzip.compress(b"hello")
    body = b"\x01" + len(packed).to_bytes(4, "big") + packed
    answer = await request(sock, grpc_request(ECHO, **{"grpc-encoding": "gzip"}), body)
    assert b"olleh" == answer.message
    answer = await request(sock, grpc_request(ECHO, **{"grpc-encoding": "br"}), body)
    assert 12 == answer.grpc_status and "br" in answer.grpc_message
    answer = await request(sock, grpc_request(ECHO), body)  # the flag without grpc-encoding
    assert 13 == answer.grpc_status and "compressed flag set" in answer.grpc_message
    bomb = gzip.compress(b"\x00" * (16 * 1024 * 1024 + 1))  # over max_request once inflated
    answer = await request(
        sock, grpc_request(ECHO, **{"grpc-encoding": "gzip"}), b"\x01" + len(bomb).to_bytes(4, "big") + bomb
    )
    assert 8 == answer.grpc_status and "after decompression larger than max" in answer.grpc_message


async def test_a_message_flag_byte_other_than_0_or_1_is_internal(nursery: trio.Nursery, sock: str) -> None:
    """The byte before a message's length is 0 (plain) or 1 (compressed); grpc-go answers any
    other INTERNAL "grpc: received unexpected payload format N" (it was taken as plain, answered OK)."""
    await start(nursery, sock, Server({ECHO: unary(_reverse)}))
    for flag in (2, 0x81, 0xFF):
        answer = await request(sock, grpc_request(ECHO), bytes([flag]) + b"\x00\x00\x00\x02ab")
        assert 13 == answer.grpc_status and b"" == answer.data
        assert f"grpc: received unexpected payload format {flag}" == answer.grpc_message
    answer = await request(sock, grpc_request(ECHO), b"\x00\x00\x00\x00\x02ab")
    assert b"ba" == answer.message


async def test_a_handler_that_does_not_read_holds_its_caller_back(nursery: trio.Nursery, sock: str) -> None:
    """Stream credit comes back as the handler takes messages: a caller sending faster than the
    handler reads stops after one stream window (4 MiB), not at the server's memory."""
    reading = trio.Event()

    async def total(stream: Stream) -> None:
        await reading.wait()
        size = 0
        while (message := await stream.recv_message()) is not None:
            size += len(message)
        await stream.send_message(b"%d" % size)

    await start(nursery, sock, Server({"/t.S/Total": total}))
    message = framed(b"m" * (16 * 1024 - 5))  # one frame each
    wanted = 16 * 1024 * 1024
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, grpc_request("/t.S/Total"))
    sent = 0
    answer = b""
    async with await trio.open_unix_socket(sock) as stream:

        async def pump(until: float) -> bool:
            """Send what the windows allow and read the server's frames; True once the stream ended."""
            nonlocal sent, answer
            with trio.move_on_after(until):
                while True:
                    while sent < wanted and conn.local_flow_control_window(1) >= len(message):
                        conn.send_data(1, message, end_stream=sent + len(message) == wanted)
                        sent += len(message)
                    await stream.send_all(conn.data_to_send())
                    for event in conn.receive_data(await stream.receive_some(65536)):
                        if isinstance(event, h2.events.DataReceived):
                            answer += event.data
                        if isinstance(event, h2.events.StreamEnded):
                            return True
            return False

        assert not await pump(0.5)
        held = sent
        reading.set()
        with trio.fail_after(LIVENESS_LIMIT):
            assert await pump(LIVENESS_LIMIT)
    assert held <= 5 * 1024 * 1024  # the stream window and the messages in flight, no more
    assert sent == wanted and framed(b"%d" % (1024 * (16 * 1024 - 5))) == answer


async def test_a_handler_sending_after_its_caller_left_is_cancelled(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], grpc.Channel]
) -> None:
    """Sends to a call that is over return at once (nothing is written): without a checkpoint
    they would let a handler whose own loop never waits spin forever."""
    running = trio.Event()
    outcome: list[str] = []
    token = trio.lowlevel.current_trio_token()

    async def stubborn(stream: Stream) -> None:
        token.run_sync_soon(running.set)
        with trio.CancelScope(shield=True):  # deaf to the cancellation for a moment
            await trio.sleep(0.5)
        try:
            for _ in range(100_000):
                await stream.send_message(b"x")
            outcome.append("spun")
        except trio.Cancelled:
            outcome.append("cancelled")
            raise

    await start(nursery, sock, Server({"/t.S/Stubborn": stubborn}, enforce_deadlines=False))
    method = grpcio(sock).unary_unary("/t.S/Stubborn", request_serializer=None, response_deserializer=None)
    future = method.future(b"", timeout=LIVENESS_LIMIT)
    with trio.fail_after(LIVENESS_LIMIT):
        await running.wait()
        future.cancel()
        while not outcome:  # noqa: ASYNC110 - the handler's own end, no event to wait on
            await trio.sleep(0.05)
    assert ["cancelled"] == outcome


async def test_sending_after_the_call_ended_is_the_handlers_error(
    nursery: trio.Nursery, sock: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Sending after the handler ended the call is an error of the handler."""

    async def twice(stream: Stream) -> None:
        await stream.send_trailing_metadata(Status.OK)
        await stream.send_message(b"late")

    await start(nursery, sock, Server({"/t.S/Twice": twice}))
    with caplog.at_level(logging.ERROR, logger="krproxy.rpc"):
        answer = await request(sock, grpc_request("/t.S/Twice"), framed(b""))
        with trio.fail_after(LIVENESS_LIMIT):
            while not caplog.records:  # noqa: ASYNC110 - logged by the handler's task
                await trio.sleep(0.01)
    assert 0 == answer.grpc_status and b"" == answer.data
    record = caplog.records[0]
    assert "/t.S/Twice" in record.getMessage() and record.exc_info is not None
    assert "ended this call already" in str(record.exc_info[1])


async def test_a_check_headers_that_raises_resets_its_stream_only(
    nursery: trio.Nursery, sock: str, caplog: pytest.LogCaptureFixture
) -> None:
    def check(stream: Stream) -> bool:
        if (b"x-bug", b"1") in stream.headers:
            raise KeyError("a bug in the check")
        return True

    await start(nursery, sock, Server({ECHO: unary(_reverse)}, check_headers=check))
    with caplog.at_level(logging.ERROR, logger="krproxy.rpc"):
        answer = await request(sock, grpc_request(ECHO, **{"x-bug": "1"}), framed(b"ab"))
    assert f.INTERNAL_ERROR == answer.reset and not answer.connection_closed
    assert any(r.exc_info and ECHO in r.getMessage() for r in caplog.records)
    assert b"ba" == (await request(sock, grpc_request(ECHO), framed(b"ab"))).message
