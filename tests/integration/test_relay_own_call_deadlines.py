"""The deadline of a unary call of the relay's own (a plugin call, store recovery's): the transport's timer
ends it, as it ends a caller's call at its deadline, without a cancel scope in the calling task (entering
and leaving one cost every plugin call ~50 Python calls)."""

from __future__ import annotations

import functools

import pytest
import trio

from krproxy import rpc
from krproxy.relay import Relay
from krproxy.rpc import Server
from tests.integration.support import LIVENESS_LIMIT, hanging, wait_until


async def test_an_own_calls_deadline_is_the_transports_timer(
    relay: Relay, nursery: trio.Nursery, sock: str
) -> None:
    """A call hanging past its time ends in TimeoutError at its deadline, the server's handler is
    cancelled (its stream reset), and the timer's entry is dropped once the call is over."""
    started: list[float | None] = []
    cancelled = trio.Event()
    await nursery.start(
        Server(
            {"/t.S/Hang": hanging(lambda stream: started.append(stream.deadline), cancelled.set)},
            enforce_deadlines=False,
        ).serve,
        sock,
    )
    transport = relay.transport
    route = relay.route_to(sock, "a hanging server")
    timers: list[list[object]] = []

    async def watch_timers() -> None:
        while not started:  # noqa: ASYNC110 - a look at the heap while the call waits
            await trio.sleep(0.01)
        timers.extend(entry for entry in transport._deadlines if entry[2] is not None)

    with trio.fail_after(LIVENESS_LIMIT):
        nursery.start_soon(watch_timers)
        began = trio.current_time()
        with pytest.raises(TimeoutError):
            await transport.call(route, "/t.S/Hang", b"", within=0.3)
        ended = trio.current_time()
        await cancelled.wait()

    assert 0.3 <= ended - began < 0.3 + LIVENESS_LIMIT
    assert 1 == len(timers) and abs(timers[0][0] - (began + 0.3)) < 0.05  # type: ignore[operator]
    assert [] == [entry for entry in transport._deadlines if entry[2] is not None]


async def test_an_earlier_deadline_wakes_the_timer_sooner(
    relay: Relay, nursery: trio.Nursery, sock: str
) -> None:
    """A call with a short deadline, made while the timer waits for a longer one, ends at its own deadline
    (the timer's wait is shortened), and the longer one is still waiting then."""
    await nursery.start(
        Server({"/t.S/Hang": hanging(lambda stream: None, lambda: None)}, enforce_deadlines=False).serve, sock
    )
    transport = relay.transport
    route = relay.route_to(sock, "a hanging server")
    took: dict[str, float] = {}

    async def call(name: str, within: float) -> None:
        began = trio.current_time()
        with pytest.raises(TimeoutError):
            await transport.call(route, "/t.S/Hang", b"", within=within)
        took[name] = trio.current_time() - began

    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as calls:
            calls.start_soon(call, "long", LIVENESS_LIMIT)
            await wait_until(lambda: len(transport._deadlines) == 1)
            calls.start_soon(call, "short", 0.2)
            await wait_until(lambda: "short" in took)
            calls.cancel_scope.cancel()

    assert 0.2 <= took["short"] < 0.2 + 0.2
    assert "long" not in took


async def test_a_cancelled_own_call_resets_its_stream(relay: Relay, nursery: trio.Nursery, sock: str) -> None:
    """A call whose caller is cancelled before its deadline resets its stream (the server's handler is
    cancelled) and leaves no live entry in the timer's heap."""
    started = trio.Event()
    cancelled = trio.Event()
    await nursery.start(
        Server(
            {"/t.S/Hang": hanging(lambda stream: started.set(), cancelled.set)}, enforce_deadlines=False
        ).serve,
        sock,
    )
    transport = relay.transport
    route = relay.route_to(sock, "a hanging server")

    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as caller:
            caller.start_soon(
                functools.partial(transport.call, route, "/t.S/Hang", b"", within=LIVENESS_LIMIT * 2)
            )
            await started.wait()
            caller.cancel_scope.cancel()
        await cancelled.wait()

    assert [] == [entry for entry in transport._deadlines if entry[2] is not None]


#: Own calls in a row, each with a deadline it never reaches (a plugin's few seconds).
SHORT_CALLS = 1000


async def test_short_calls_keep_the_timer_heap_small(relay: Relay, nursery: trio.Nursery, sock: str) -> None:
    """Many answered calls with long deadlines leave at most about a hundred dropped entries in the heap, not
    one per call until each deadline comes."""

    async def answer(request: bytes) -> bytes:
        return b"ok"

    await nursery.start(Server({"/t.S/Ok": rpc.unary(answer)}).serve, sock)
    transport = relay.transport
    route = relay.route_to(sock, "a server")

    with trio.fail_after(LIVENESS_LIMIT * 4):
        for _ in range(SHORT_CALLS):
            assert b"ok" == await transport.call(route, "/t.S/Ok", b"", within=60)

    assert len(transport._deadlines) <= 101
    assert [] == [entry for entry in transport._deadlines if entry[2] is not None]


async def test_expired_calls_leave_no_dropped_count(relay: Relay, nursery: trio.Nursery, sock: str) -> None:
    """A call whose deadline the timer expired (its entry popped) counts no dropped entry when it ends: the
    count of dropped entries is that of the heap, which its rebuild is measured by."""
    await nursery.start(
        Server({"/t.S/Hang": hanging(lambda stream: None, lambda: None)}, enforce_deadlines=False).serve, sock
    )
    transport = relay.transport
    route = relay.route_to(sock, "a hanging server")

    with trio.fail_after(LIVENESS_LIMIT):
        for _ in range(3):
            with pytest.raises(TimeoutError):
                await transport.call(route, "/t.S/Hang", b"", within=0.05)

    assert [] == transport._deadlines
    assert 0 == transport._dead_timers
