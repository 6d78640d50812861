"""A call the relay answers itself (an interceptor's) is reported after its answer is written, as a call
a reader ends is: the record and the observers (metrics, the recorder) are off the answer's path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import trio

from krproxy.forward import Forward, Reply
from krproxy.relay import Relay
from tests.integration.support import LIVENESS_LIMIT, in_thread, raw_unary, serve_relay, wait_until

PATH = "/test.Echo/Intercepted"


async def test_an_intercepted_calls_record_follows_its_answer(
    relay: Relay, nursery: trio.Nursery, short_tmp: Path, channel_to: Callable[[str], grpc.Channel]
) -> None:
    """An intercepted calls record comes after its answer is written."""

    async def intercept(path: str, request: bytes, forward: Forward) -> Reply:
        return Reply(b"pong")

    relay.configure(None, None, {PATH: intercept}, unary_paths=[PATH])
    queued: list[int] = []  # connections with bytes still to write, as each record is observed
    relay.transport.observers.append(lambda record: queued.append(len(relay.transport.dirty)))
    listen = await serve_relay(nursery, relay, str(short_tmp / "relay.sock"))
    method = raw_unary(channel_to(listen), PATH)

    with trio.fail_after(LIVENESS_LIMIT):
        for count in range(1, 4):
            assert b"pong" == await in_thread(method, b"ping", timeout=LIVENESS_LIMIT)
            await wait_until(lambda: len(queued) >= count)  # noqa: B023 - awaited here

    assert [0, 0, 0] == queued
