"""An interceptor hands its last step to the relay (``forward.hand_over``): its request goes upstream from
the call's own stream, the runtime's answer is relayed as a watched call's, and the watcher is told its end.

Its hooks have run, so a runtime refusing the call unprocessed (REFUSED_STREAM) is not passed to the caller,
whose retry would run them again: the relay sends the same bytes again, a bounded number of times. A watched
call (no hook ran) is refused to the caller as a passthrough call is.
"""

from __future__ import annotations

import grpc
import pytest

import krproxy.relay.intercepted as local_module
from krproxy.forward import Forward, Reply, Watcher
from krproxy.grpcstatus import Status
from krproxy.relay.rpc import grpc_message
from tests.integration.handover_support import ECHO, HEADERS_REFUSE, REFUSE, Harness
from tests.integration.support import wait_until


async def test_a_refused_hand_over_is_resent_without_its_hooks(
    harness: Harness,
) -> None:
    """A handed over call the runtime refuses is sent again without running its hooks again."""
    runtime, method = await harness.start(lambda n: REFUSE if n <= 2 else ECHO)
    answer = await harness.call(method)
    hooked = harness.hooked

    assert b"changed ping" == answer
    await wait_until(lambda: bool(harness.records))
    assert 1 == hooked.runs
    assert [grpc_message(b"changed ping")] * 3 == runtime.bodies  # refused twice, the same bytes each time
    assert [(Status.OK, b"changed ping")] == hooked.told
    record = harness.records[0]
    assert (b"ping", b"changed ping", b"changed ping", 1, Status.OK) == (
        record.request,
        record.forwarded,
        record.reply,
        record.replies,
        record.status,
    )


async def test_a_hand_over_always_refused_ends_unavailable(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not forever, even without a deadline; the watcher is told the failure (and keeps nothing)."""
    monkeypatch.setattr(local_module, "REFUSED_ATTEMPTS", 3)
    runtime, method = await harness.start(lambda n: REFUSE)
    err = await harness.call(method)
    hooked = harness.hooked

    assert isinstance(err, grpc.RpcError)
    assert grpc.StatusCode.UNAVAILABLE == err.code()
    assert "runtime refused the call 3 times" in (err.details() or "")
    assert (1, 3) == (hooked.runs, len(runtime.bodies))
    await wait_until(lambda: bool(hooked.told))
    assert [(Status.UNAVAILABLE, None)] == hooked.told


async def test_a_hand_over_refused_mid_answer_is_not_resent(harness: Harness) -> None:
    """The caller already has the answer's header block: a second attempt would send it another. The call
    fails as a relayed one does (grpc-go's status for the reset), and the runtime sees it once."""
    runtime, method = await harness.start(lambda n: HEADERS_REFUSE if n == 1 else ECHO)
    err = await harness.call(method)
    hooked = harness.hooked

    assert isinstance(err, grpc.RpcError)
    assert grpc.StatusCode.UNAVAILABLE == err.code()
    assert (1, 1) == (hooked.runs, len(runtime.bodies))


async def test_a_refused_watched_call_is_refused_to_the_caller(harness: Harness) -> None:
    """No hook ran: the caller gets the refusal (grpc-go sends the call again; this client, retries off,
    reports UNAVAILABLE), and the relay does not send it again itself."""
    told: list[tuple[Status, bytes | None]] = []

    async def intercept(path: str, request: bytes, forward: Forward) -> Reply:
        raise AssertionError("a watched call reaches no interceptor")

    def watch(request: bytes) -> Watcher:
        return lambda status, reply: told.append((status, reply))

    runtime, method = await harness.start(lambda n: REFUSE if n == 1 else ECHO, intercept, watch)
    err = await harness.call(method)

    assert isinstance(err, grpc.RpcError)
    assert grpc.StatusCode.UNAVAILABLE == err.code()
    assert [grpc_message(b"ping")] == runtime.bodies
    await wait_until(lambda: bool(told))
    assert [(Status.UNAVAILABLE, None)] == told
