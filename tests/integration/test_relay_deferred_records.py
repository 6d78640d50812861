"""Tests of the relay's deferred records (6ee74d8: a call that ends while a reader hands out a
frame's events is reported after the flush that writes its answer): every call is reported once,
without waiting for later traffic, when the reader that ended it meets a connection error or
the connection's end in the same read, on the runtime's side and on the caller's."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import trio

from krproxy.calls import CallRecord
from krproxy.h2 import frames as f
from krproxy.relay import Relay
from krproxy.relay.rpc import grpc_message, request_headers
from tests.integration.support import LIVENESS_LIMIT, in_thread, raw_unary, serve_relay_to, wait_until
from tests.integration.test_relay_attacks import PATH, ScriptedUpstream, _answer

CONNECTION_ERROR = f.frame(f.DATA, 0, 0, b"x")  # DATA on stream 0: PROTOCOL_ERROR (RFC 9113 §6.1)


def _records(relay: Relay) -> list[CallRecord]:
    records: list[CallRecord] = []
    relay.transport.observers.append(records.append)
    return records


@pytest.mark.parametrize(
    "after",
    [b"", CONNECTION_ERROR, f.goaway(0, f.PROTOCOL_ERROR) + CONNECTION_ERROR],
    ids=["nothing", "connection-error", "goaway-and-error"],
)
async def test_a_call_ended_by_the_runtimes_last_read_is_reported_once(
    relay: Relay,
    nursery: trio.Nursery,
    short_tmp: Path,
    channel_to: Callable[[str], grpc.Channel],
    after: bytes,
) -> None:
    """The runtime writes a call's whole answer and, in the same write, breaks its connection:
    the caller gets the answer, and the call's record comes once, with no traffic after it."""
    upstream = ScriptedUpstream(str(short_tmp / "up.sock"), lambda stream: _answer(stream) + after)
    try:
        records = _records(relay)
        listen = await serve_relay_to(nursery, relay, str(short_tmp / "up.sock"), str(short_tmp), [PATH])
        method = raw_unary(channel_to(listen), PATH)
        with trio.fail_after(LIVENESS_LIMIT):
            for count in range(1, 4):
                assert b"pong" == await in_thread(method, b"ping", timeout=LIVENESS_LIMIT)
                await wait_until(lambda: len(records) >= count)  # noqa: B023 - awaited here
            await relay.transport.wait_idle()
        await trio.sleep(0.2)  # (a record reported twice would show by now)
        assert [(PATH, "OK")] * 3 == [(r.path, r.status.name) for r in records]
    finally:
        upstream.close()


@pytest.mark.parametrize("then", ["connection-error", "eof"])
async def test_a_call_reset_in_its_last_read_is_reported_once(
    relay: Relay, nursery: trio.Nursery, short_tmp: Path, then: str
) -> None:
    """A caller sends a request, resets it and breaks (or closes) its connection in one write,
    the runtime never answering: the call's record comes once, CANCELLED, without more traffic."""
    upstream = ScriptedUpstream(str(short_tmp / "up.sock"), lambda stream: b"")  # never answers
    try:
        records = _records(relay)
        listen = await serve_relay_to(nursery, relay, str(short_tmp / "up.sock"), str(short_tmp), [PATH])
        block = f.encode_headers(request_headers(PATH))
        data = b"".join(
            (
                f.PREFACE,
                f.settings([]),
                f.frame(f.HEADERS, f.END_HEADERS, 1, block),
                f.frame(f.DATA, f.END_STREAM, 1, grpc_message(b"ping")),
                f.rst_stream(1, f.CANCEL),
                CONNECTION_ERROR if then == "connection-error" else b"",
            )
        )
        with trio.fail_after(LIVENESS_LIMIT):
            sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with sock:
                await sock.connect(listen)
                await sock.send(data)
                if then == "eof":
                    sock.shutdown(socket.SHUT_WR)
                await wait_until(lambda: len(records) >= 1)
                await relay.transport.wait_idle()
        await trio.sleep(0.2)
        assert [(PATH, "CANCELLED")] == [(r.path, r.status.name) for r in records], records
    finally:
        upstream.close()
