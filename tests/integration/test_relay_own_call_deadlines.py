"""The deadline of a unary call of the relay's own (a plugin call, store recovery's): the transport's timer
ends it, as it ends a caller's call at its deadline, without a cancel scope in the calling task (entering
and leaving one cost every plugin call ~50 Python calls)."""

from __future__ import annotations

import pytest
import trio

from krproxy.relay import Relay
from krproxy.rpc import Server
from tests.integration.support import LIVENESS_LIMIT, hanging


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
