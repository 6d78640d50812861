"""Required hook servers: the guard in virtual time, and ``needed``'s shortcut when no flag and no
annotation of ours is there (the flag, the annotations and the decision: test_hooks_required.py)."""

from __future__ import annotations

import logging
from typing import Any

import attrs
import pytest
import trio
import trio.lowlevel
import trio.testing

from krproxy.hooks.guard import DEADLINE_MARGIN, PROBE_INTERVAL, Guard, RequiredMissing, counted_guard
from krproxy.hooks.outcomes import Outcome
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import PluginRegistration, Registry
from krproxy.hooks.required import (
    NOTHING_NEEDED,
    REQUIRED_PLUGINS_ANNOTATION,
    AnnotationError,
    RequiredServer,
    Requirements,
    State,
    hooked_names,
    needed,
    parse_required_server,
    required_names,
)
from krproxy.metrics import Metrics
from tests.unit.test_hooks_required import CREATE, RUN

# -- the guard, in virtual time ---------------------------------------------------------------------


@attrs.define
class FakeDispatcher:
    """What the guard uses of a Dispatcher: the registry, and a probe each plugin answers as scripted."""

    registry: Registry = attrs.field(factory=Registry)
    answers: dict[str, BaseException | None] = attrs.field(factory=dict)  # by endpoint; None: answers
    probes: int = 0

    def register(self, name: str, answer: BaseException | None = None) -> None:
        plugin = PluginRegistration(name, f"{name}.json", f"/run/{name}.sock", hooks=(RUN,))
        self.registry = Registry(self.registry.plugins.merged({plugin.file: plugin}))
        self.answers[plugin.endpoint] = answer

    def unregister(self, name: str) -> None:
        self.registry = self.registry.apply(f"{name}.json", None)

    async def probe(self, plugin: PluginRegistration, within: float) -> None:
        self.probes += 1
        await trio.lowlevel.checkpoint()
        answer = self.answers.get(plugin.endpoint)
        if answer is not None:
            raise answer


def guard(dispatcher: FakeDispatcher, grace: float = 0.0, **kwargs: Any) -> Guard:
    requirements = Requirements((parse_required_server("koordlet"),), startup_grace=grace)
    return Guard(requirements, dispatcher, "/etc/runtime/hookserver.d", **kwargs)  # type: ignore[arg-type]


def missing_events(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "required_server" in r.getMessage()]


class TestGuard:
    async def test_counted_guard_reports_to_the_metrics(self) -> None:
        """The daemons' guard: a held call is counted, and each flagged server's state is a gauge."""
        metrics = Metrics()
        requirements = Requirements((parse_required_server("koordlet"),), startup_grace=0.0)
        g = counted_guard(requirements, FakeDispatcher(), "/etc/runtime/hookserver.d", metrics)  # type: ignore[arg-type]

        with pytest.raises(RequiredMissing):
            await g.admit(RUN, ["koordlet"])

        sample = metrics.registry.get_sample_value
        held = sample("krproxy_required_calls_held_total", {"server": "koordlet", "hook": RUN.value})
        assert (1.0, 0.0) == (held, sample("krproxy_required_server_up", {"server": "koordlet"}))

    async def test_refuses_with_what_is_missing_and_counts(self) -> None:
        held: list[tuple[str, HookPoint]] = []
        g = guard(FakeDispatcher(), held=lambda name, point: held.append((name, point)))

        with pytest.raises(RequiredMissing) as info:
            await g.admit(RUN, ["koordlet"])

        assert "koordlet is not registered (no /etc/runtime/hookserver.d/koordlet.json)" in info.value.message
        assert [("koordlet", RUN)] == held

    @pytest.mark.parametrize(
        ("answer", "state"),
        [
            (FileNotFoundError(2, "No such file or directory"), State.UNREACHABLE),
            (ConnectionRefusedError(111, "Connection refused"), State.UNREACHABLE),
            (TimeoutError(), State.NOT_ANSWERING),
            (None, State.UP),
        ],
    )
    async def test_probe_states(self, answer: BaseException | None, state: State) -> None:
        dispatcher = FakeDispatcher()
        dispatcher.register("koordlet", answer)
        g = guard(dispatcher)

        if state is State.UP:
            await g.admit(RUN, ["koordlet"])
        else:
            with pytest.raises(RequiredMissing):
                await g.admit(RUN, ["koordlet"])

        assert state is g.availability("koordlet").state

    async def test_back_is_seen_by_the_next_call(self) -> None:
        dispatcher = FakeDispatcher()
        g = guard(dispatcher)
        with pytest.raises(RequiredMissing):
            await g.admit(RUN, ["koordlet"])

        dispatcher.register("koordlet")
        await g.admit(RUN, ["koordlet"])  # no wait for the prober's next round

    async def test_waits_during_the_grace_then_refuses(self, autojump_clock: trio.testing.MockClock) -> None:
        g = guard(FakeDispatcher(), grace=5.0)
        start = trio.current_time()

        with pytest.raises(RequiredMissing):
            await g.admit(RUN, ["koordlet"])

        assert 5.0 == pytest.approx(trio.current_time() - start, abs=PROBE_INTERVAL)
        with pytest.raises(RequiredMissing):  # after the grace: at once
            with trio.fail_after(0.5):
                await g.admit(RUN, ["koordlet"])

    async def test_grace_wait_ends_when_the_server_appears(
        self, autojump_clock: trio.testing.MockClock
    ) -> None:
        dispatcher = FakeDispatcher()
        g = guard(dispatcher, grace=60.0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(g.run)

            async def appear() -> None:
                await trio.sleep(3)
                dispatcher.register("koordlet")

            nursery.start_soon(appear)
            await g.admit(RUN, ["koordlet"])
            assert trio.current_time() < 10
            nursery.cancel_scope.cancel()

    async def test_logs_once_per_outage(
        self, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.INFO, logger="krproxy.hooks.required")
        dispatcher = FakeDispatcher()
        dispatcher.register("koordlet")
        g = guard(dispatcher)
        async with trio.open_nursery() as nursery:
            await nursery.start(g.run)
            dispatcher.answers["/run/koordlet.sock"] = ConnectionRefusedError(111, "Connection refused")
            await trio.sleep(30)  # many probe rounds, one outage
            for _ in range(3):
                with pytest.raises(RequiredMissing):
                    await g.admit(RUN, ["koordlet"])
            dispatcher.unregister("koordlet")  # another reason, the same outage
            g.publish(dispatcher.registry)
            await trio.sleep(30)
            dispatcher.register("koordlet")
            g.publish(dispatcher.registry)
            await trio.sleep(30)
            nursery.cancel_scope.cancel()

        events = missing_events(caplog)
        assert ["required_server_up", "required_server_missing", "required_server_back"] == [
            e.split()[0].removeprefix("event=") for e in events
        ], events

    async def test_missing_lists_flag_servers_only(self) -> None:
        g = guard(FakeDispatcher())
        with pytest.raises(RequiredMissing):
            await g.admit(RUN, ["net"])  # an annotated name
        assert ["koordlet"] == [name for name, _ in g.missing()]
        assert State.MISSING is g.availability("net").state

    async def test_a_failed_hook_call_prompts_a_probe(self, autojump_clock: trio.testing.MockClock) -> None:
        dispatcher = FakeDispatcher()
        dispatcher.register("koordlet")
        g = guard(dispatcher)
        async with trio.open_nursery() as nursery:
            await nursery.start(g.run)
            dispatcher.answers["/run/koordlet.sock"] = TimeoutError()
            g.observe(Outcome("koordlet", RUN, "rejected", 2.0, "no answer within 2s"))
            await trio.sleep(0.1)  # well before the prober's next round (UP_INTERVAL)
            assert State.NOT_ANSWERING is g.availability("koordlet").state
            nursery.cancel_scope.cancel()

    async def test_the_callers_deadline_bounds_the_grace(
        self, autojump_clock: trio.testing.MockClock
    ) -> None:
        """NRI drops a plugin that misses its request timeout: the wait ends before the deadline given."""
        g = guard(FakeDispatcher(), grace=60.0)
        deadline = trio.current_time() + 2.0

        with pytest.raises(RequiredMissing):
            await g.admit(RUN, ["koordlet"], deadline=deadline)

        assert deadline - DEADLINE_MARGIN == pytest.approx(trio.current_time())

    async def test_annotated_names_tracked_are_bounded(self, caplog: pytest.LogCaptureFixture) -> None:
        """Many pods naming distinct servers: the guard keeps at most the bound of annotated names (the
        least recently needed go, their metric series with them) besides the flags' servers; the log says
        when the bound is hit; a forgotten name needed again is refused as before."""
        caplog.set_level(logging.INFO, logger="krproxy.hooks.required")
        forgotten: list[str] = []
        g = guard(FakeDispatcher(), forget=forgotten.append, max_annotated=10)

        for i in range(25):
            with pytest.raises(RequiredMissing):
                await g.admit(RUN, [f"net-{i}"])

        assert ["koordlet", *[f"net-{i}" for i in range(15, 25)]] == list(g.states())
        assert [f"net-{i}" for i in range(15)] == forgotten
        bound = [r for r in caplog.records if r.getMessage().startswith("required_names_bound")]
        assert [1, 10] == [r.krproxy_fields["forgotten"] for r in bound]  # type: ignore[attr-defined]
        assert logging.WARNING == bound[0].levelno
        with pytest.raises(RequiredMissing, match="net-0 is not registered"):
            await g.admit(RUN, ["net-0"])
        assert "net-0" in g.states()

    async def test_a_name_needed_again_is_kept_over_older_ones(self) -> None:
        g = guard(FakeDispatcher(), max_annotated=2)
        for name in ["a", "b", "a", "c"]:
            with pytest.raises(RequiredMissing):
                await g.admit(RUN, [name])

        assert ["koordlet", "a", "c"] == list(g.states())

    async def test_a_name_needed_while_up_is_kept_over_older_ones(self) -> None:
        """A call that finds an annotated server up (no probe) counts as needing it: the bound forgets
        the name needed least recently, not the one probed longest ago."""
        dispatcher = FakeDispatcher()
        for name in "abc":
            dispatcher.register(name)
        g = guard(dispatcher, max_annotated=2)
        for name in ["a", "b", "a", "c"]:
            await g.admit(RUN, [name])

        assert 3 == dispatcher.probes  # "a" was up the second time: not probed again
        assert ["koordlet", "a", "c"] == list(g.states())

    async def test_an_annotated_server_failing_a_call_is_probed(
        self, autojump_clock: trio.testing.MockClock
    ) -> None:
        """Names pods annotate are not probed in rounds, except right after they failed a hook call."""
        dispatcher = FakeDispatcher()
        dispatcher.register("net")
        g = guard(dispatcher)
        async with trio.open_nursery() as nursery:
            await nursery.start(g.run)
            await g.admit(RUN, ["net"])
            dispatcher.answers["/run/net.sock"] = ConnectionRefusedError(111, "Connection refused")
            g.observe(Outcome("net", RUN, "rejected", 0.1, "unreachable"))
            await trio.sleep(0.1)
            assert State.UNREACHABLE is g.availability("net").state
            nursery.cancel_scope.cancel()


class TestNeededShortcut:
    """``needed`` answers NOTHING_NEEDED without parsing when no flag and no annotation of ours is there:
    it must give what the full reading gives, and still refuse a malformed annotation."""

    KEYS = (
        REQUIRED_PLUGINS_ANNOTATION,
        f"{REQUIRED_PLUGINS_ANNOTATION}/pod",
        f"{REQUIRED_PLUGINS_ANNOTATION}/container.app",
        f"{REQUIRED_PLUGINS_ANNOTATION}x",
        "tolerate",
        "tolerate/container.app",
        "toleratex",
        "other",
    )
    VALUES = ('["koordlet"]', "true", "false", "not json", "")

    @staticmethod
    def full(requirements: Requirements, annotations: dict[str, str]) -> Any:
        try:
            return (
                required_names(requirements, CREATE, annotations, "app"),
                hooked_names(requirements, CREATE, annotations, "app"),
            )
        except AnnotationError as err:
            return str(err)

    @pytest.mark.parametrize("tolerate", ["", "tolerate"])
    def test_same_as_the_full_reading(self, tolerate: str) -> None:
        requirements = Requirements(tolerate_annotation=tolerate)
        for i in range(len(self.KEYS) * len(self.VALUES)):
            for j in range(len(self.KEYS)):
                annotations = {self.KEYS[j]: self.VALUES[i % len(self.VALUES)], "other": "1"}
                if i % 3 == 0:
                    annotations[self.KEYS[i % len(self.KEYS)]] = self.VALUES[(i + 1) % len(self.VALUES)]
                try:
                    got: Any = needed(requirements, CREATE, annotations, "app")
                    got = (got.names, got.hooked)
                except AnnotationError as err:
                    got = str(err)
                assert self.full(requirements, annotations) == got, annotations

    def test_unrelated_annotations_need_nothing(self) -> None:
        assert NOTHING_NEEDED is needed(Requirements(tolerate_annotation="t"), CREATE, {"a": "1"}, "app")
        assert NOTHING_NEEDED is not needed(
            Requirements((RequiredServer("k", frozenset({CREATE})),)), CREATE, {"a": "1"}, "app"
        )
