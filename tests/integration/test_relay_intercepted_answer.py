"""An interceptor's answer that cannot be written (a bug of ours: a header field that is not bytes)
still answers the caller at once, UNKNOWN, and the relay serves the next call."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio

from krproxy.forward import Forward, Reply
from krproxy.relay import Relay
from tests.integration.support import LIVENESS_LIMIT, in_thread, raw_unary, serve_relay

PATH = "/test.Echo/Intercepted"

#: Header blocks an interceptor might get wrong: each cannot be encoded.
BAD: dict[str, Any] = {
    "headers": {"headers": [(":status", "200")]},
    "trailers": {"trailers": [(b"grpc-status", 0)]},
}


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
async def test_unwritable_answer_is_unknown(
    relay: Relay,
    nursery: trio.Nursery,
    short_tmp: Path,
    channel_to: Callable[[str], grpc.Channel],
    bad: str,
) -> None:
    """The caller gets UNKNOWN naming the fault well before its deadline, and the next call its echo."""

    async def intercept(path: str, request: bytes, forward: Forward) -> Reply:
        if request == b"bad":
            return Reply(request, **BAD[bad])
        return Reply(request)

    relay.configure(None, None, {PATH: intercept}, unary_paths=[PATH])
    listen = await serve_relay(nursery, relay, str(short_tmp / "relay.sock"))
    method = raw_unary(channel_to(listen), PATH)

    with trio.fail_after(LIVENESS_LIMIT):
        with pytest.raises(grpc.RpcError) as caught:
            await in_thread(method, b"bad", timeout=LIVENESS_LIMIT * 2)
        assert grpc.StatusCode.UNKNOWN == caught.value.code()
        assert "TypeError" in (caught.value.details() or "")
        assert b"ok" == await in_thread(method, b"ok", timeout=LIVENESS_LIMIT)
