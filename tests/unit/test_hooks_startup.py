"""The hook store's start-up (krproxy.hooks.startup): calls at hook points wait for store recovery no longer
than the grace (in virtual time), the log says why once, and a call on a record recovery left out or has not
recovered is refused only where a required server or a Fail plugin needs that record."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from krproxy.grpcstatus import Status
from krproxy.hooks.listing import Unusable
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import FailurePolicy, PluginRegistration
from krproxy.hooks.required import RequiredServer, Requirements
from krproxy.hooks.startup import StoreGate, refusal
from krproxy.hookserver.testing import logged_events

START = HookPoint.PRE_START_CONTAINER
STOP = HookPoint.POST_STOP_CONTAINER


async def _waiters(gate: StoreGate, count: int) -> list[float]:
    """When each of *count* concurrent waiters got through the gate (trio time)."""
    through: list[float] = []

    async def wait() -> None:
        await gate.wait()
        through.append(trio.current_time())

    with trio.fail_after(3600):  # virtual time: fails, rather than hangs, where the wait is unbounded
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(wait)
    return through


class TestGrace:
    async def test_calls_wait_no_longer_than_the_grace(
        self, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
    ) -> None:
        """With recovery failing throughout, every waiting call gets through when the grace is over, not
        before; why they wait is logged once with recovery's last error, and the grace's end once."""
        caplog.set_level(logging.INFO, logger="krproxy.hooks.startup")
        gate = StoreGate()
        started = trio.current_time()
        gate.start(7.5)
        gate.failed("DecodeError: string field contains invalid UTF-8")
        through = await _waiters(gate, 5)
        assert [started + 7.5] * 5 == through
        [waiting] = logged_events(caplog.records, "hook_calls_wait_for_store")
        assert "DecodeError: string field contains invalid UTF-8" == waiting["last_error"]
        assert 7.5 == waiting["grace_left"]
        [over] = logged_events(caplog.records, "recovery_grace_over")
        assert 7.5 == over["grace"]
        await gate.wait()  # after the grace: at once, and nothing logged again
        assert 1 == len(logged_events(caplog.records, "recovery_grace_over"))
        assert not gate.is_set()

    async def test_recovery_lets_calls_through_at_once(self, autojump_clock: trio.testing.MockClock) -> None:
        """Recovery finishing within the grace lets the waiting calls through then."""
        gate = StoreGate()
        started = trio.current_time()
        gate.start(10.0)

        async def recover() -> None:
            await trio.sleep(2.0)
            gate.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(recover)
            through = await _waiters(gate, 3)
        assert [started + 2.0] * 3 == through
        assert gate.is_set()

    async def test_without_a_start_the_wait_is_unbounded(
        self, autojump_clock: trio.testing.MockClock
    ) -> None:
        """A gate nobody started (a bare HookRuntime) holds calls until it is set, as a trio.Event does."""
        gate = StoreGate()
        with trio.move_on_after(3600) as scope:
            await gate.wait()
        assert scope.cancelled_caught

    async def test_why_a_record_is_missing(self, autojump_clock: trio.testing.MockClock) -> None:
        """Before recovery every id's record is missing for it (UNAVAILABLE: a retry may find it); after it,
        only the ids it left out (FAILED_PRECONDITION, with the reason), and nothing else."""
        gate = StoreGate()
        gate.failed("OSError: connection refused")
        missing = gate.missing("c1")
        assert missing is not None
        assert Status.UNAVAILABLE == missing[0]
        assert "not recovered from the runtime yet (last attempt: OSError: connection refused)" in missing[1]
        gate.leave_out({"c2": Unusable("container", "c2", "its pod p2 was left out")})
        gate.set()
        assert None is gate.missing("c1")
        assert (
            Status.FAILED_PRECONDITION,
            "store recovery left its record out: its pod p2 was left out",
        ) == (gate.missing("c2"))


def _plugin(name: str, policy: FailurePolicy, *points: HookPoint) -> PluginRegistration:
    return PluginRegistration(name, f"{name}.json", f"/run/{name}.sock", failure_policy=policy, hooks=points)


MISSING = (Status.FAILED_PRECONDITION, "store recovery left its record out: annotations['x']: too long")


class TestRefusal:
    def test_required_server_at_the_point_refuses(self) -> None:
        """A --required-hook-server at one of the call's points refuses it, naming the server, the record
        and why its record is missing; one required only elsewhere does not."""
        requirements = Requirements(servers=(RequiredServer("koordlet", frozenset({START})),))
        err = refusal(
            MISSING, "container", "c1", (START,), requirements=requirements, plugins_for=lambda p: []
        )
        assert err is not None
        assert Status.FAILED_PRECONDITION == err.status
        assert "container c1 has no record (store recovery left its record out" in str(err.message)
        assert "required hook server koordlet (PreStartContainer) needs it" in str(err.message)
        assert None is refusal(
            MISSING, "container", "c1", (STOP,), requirements=requirements, plugins_for=lambda p: []
        )

    def test_fail_plugin_at_a_pre_point_refuses(self) -> None:
        """A Fail plugin at a Pre point refuses (its hook cannot run: that is it failing); an Ignore plugin
        there, or a Fail one at a Post point (Post hooks never hold a call), lets the call be forwarded."""
        fail = _plugin("policy", FailurePolicy.FAIL, START, STOP)
        ignore = _plugin("observer", FailurePolicy.IGNORE, START)
        pending = (Status.UNAVAILABLE, "the hook store is not recovered from the runtime yet")
        err = refusal(
            pending, "container", "c1", (START,), requirements=None, plugins_for=lambda p: [fail, ignore]
        )
        assert err is not None
        assert Status.UNAVAILABLE == err.status
        assert "hook server policy (failure-policy Fail, PreStartContainer)" in str(err.message)
        assert "observer" not in str(err.message)
        assert None is refusal(
            pending, "container", "c1", (START,), requirements=None, plugins_for=lambda p: [ignore]
        )
        assert None is refusal(
            pending, "container", "c1", (STOP,), requirements=None, plugins_for=lambda p: [fail]
        )

    def test_nothing_needed_forwards(self) -> None:
        """No plugin and no required server at the points: forwarded (None), whatever the reason."""
        assert None is refusal(
            MISSING, "pod", "p1", tuple(HookPoint), requirements=Requirements(), plugins_for=lambda p: []
        )
