"""Tests of 0d51c9f (the header fields of the relay's own calls: ``_grpc.own_call_headers`` and
``LocalCall._metadata``): what a caller sent that an intercepted forward or a hand-over must not pass on.

The relay forwards the interceptor's request, not the caller's: a ``content-length`` the caller sent
counts the caller's bytes, and an upstream that checks it (RFC 9113 §8.1.1: krproxy's own core, so a
krproxy behind krproxy; any HTTP/2 proxy between) refuses the changed request as malformed."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from krproxy.forward import Forward, Reply, Watcher
from krproxy.grpcstatus import Status
from krproxy.relay import Relay, Route, connect_unix
from tests.integration.h2_client import framed, grpc_request, request
from tests.integration.support import LIVENESS_LIMIT, serve_relay, start_scripted_backend

PATH = "/test.Review7/Call"


@pytest.mark.parametrize("hand_over", [False, True], ids=["forward", "handed over"])
async def test_a_callers_content_length_is_dropped_on_a_new_request(
    relay: Relay, nursery: trio.Nursery, short_tmp: Path, hand_over: bool
) -> None:
    """A callers content length is not passed on with a changed request."""
    told: list[Status] = []

    async def intercept(path: str, request_: bytes, forward: Forward) -> Reply:
        changed = b"changed " + request_
        if not hand_over:
            return await forward(changed)
        watcher: Watcher = lambda status, reply: told.append(status)  # noqa: E731
        reply: Reply = forward.hand_over(changed, watcher)  # type: ignore[attr-defined]
        return reply

    backend_path = str(short_tmp / "backend.sock")
    backend, _ = await start_scripted_backend(nursery, backend_path)
    relay.configure(
        Route(relay.transport, "runtime", connect_unix(backend_path)), None, {PATH: intercept}, [PATH]
    )
    listen = await serve_relay(nursery, relay, str(short_tmp / "relay.sock"))
    body = framed(b"ping")
    fields = grpc_request(PATH, LIVENESS_LIMIT, **{"content-length": str(len(body)), "x-asked": "yes"})
    with trio.fail_after(LIVENESS_LIMIT):
        answer = await request(listen, fields, body)
    assert 0 == answer.grpc_status, answer
    assert b"changed ping" == answer.message
    (received,) = backend.received
    assert [b"changed ping"] == received.messages
    assert "content-length" not in received.metadata
    assert "yes" == received.metadata.get("x-asked")
