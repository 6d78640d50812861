"""krproxy.hookserver._registry: where a stage runs (``blocking``, :meth:`Registry.placement`) and the
timing of non-blocking functions on the loop (:class:`InlineWatch`, on a fake clock)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import pytest
import trio
import trio.lowlevel

from krproxy.hookserver import (
    ContainerContext,
    ContainerInfo,
    DuplicateHookError,
    FailurePolicy,
    HookFailedError,
    HookServer,
    PodInfo,
    Stage,
    run_hooks,
)
from krproxy.hookserver._registry import InlineWatch, Placement, run_hooks_on_loop
from krproxy.hookserver.policies import envinject, install_all
from krproxy.hookserver.testing import container_request, logged_events, pod_request

STAGE = Stage.PRE_CREATE_CONTAINER


def plain(ctx: ContainerContext) -> None:
    ctx.response.add_envs["PLAIN"] = "1"


async def awaiting(ctx: ContainerContext) -> None:
    await trio.lowlevel.checkpoint()
    ctx.response.add_envs["ASYNC"] = "1"


def _ctx() -> ContainerContext:
    return ContainerContext(ContainerInfo(PodInfo()))


class FakeClock:
    """Seconds that move only when a test says so (``advance``)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class TestPlacement:
    @pytest.mark.parametrize(
        ("declared", "expected"),
        [
            ([], Placement.LOOP),
            ([(plain, None)], Placement.WORKER),
            ([(plain, True)], Placement.WORKER),
            ([(plain, False)], Placement.LOOP),
            ([(awaiting, None)], Placement.TASK),
            ([(awaiting, None), (plain, False)], Placement.TASK),
            ([(awaiting, None), (plain, None)], Placement.WORKER),
            ([(plain, False), (plain, None)], Placement.WORKER),
        ],
        ids=[
            "none",
            "plain",
            "blocking",
            "non-blocking",
            "async",
            "async+non-blocking",
            "async+plain",
            "mixed",
        ],
    )
    def test_a_stage_runs_where_its_functions_allow(
        self, declared: list[tuple[Callable[[ContainerContext], object], bool | None]], expected: Placement
    ) -> None:
        """A plain function is blocking unless declared otherwise; one blocking function puts the whole
        stage in the worker, an async one (without blocking ones) in a task on the loop, and a stage of
        non-blocking plain functions (or none) runs on the loop itself."""
        app = HookServer()
        for i, (fn, blocking) in enumerate(declared):
            app.hook(STAGE, name=f"f{i}", blocking=blocking)(fn)
        assert expected == app.registry.placement(STAGE)
        assert Placement.LOOP == app.registry.placement(Stage.PRE_START_CONTAINER)  # another stage: none

    def test_builtin_policies_that_only_compute_run_on_loop(self) -> None:
        """The built-in policies' hook functions that read no file (cpuset, envinject, groupidentity,
        resctrl, cpusuppress's forget_pod) are declared non-blocking; cpusuppress's set_pod and
        set_container read the pod cgroup's CFS period, so the stages they are in stay in the worker."""
        app = HookServer()
        install_all(app)
        blocking = {(stage, h.name) for stage in Stage for h in app.registry.hooks(stage) if h.blocking}
        assert {
            (Stage.PRE_RUN_POD_SANDBOX, "cpusuppress"),
            (Stage.PRE_CREATE_CONTAINER, "cpusuppress"),
            (Stage.PRE_UPDATE_CONTAINER_RESOURCES, "cpusuppress"),
        } == blocking
        assert Placement.LOOP == app.registry.placement(Stage.POST_START_CONTAINER)  # resctrl alone
        assert Placement.LOOP == app.registry.placement(Stage.POST_STOP_POD_SANDBOX)  # forget_pod alone
        assert Placement.WORKER == app.registry.placement(Stage.PRE_CREATE_CONTAINER)

    def test_an_async_function_declared_blocking_is_refused(self) -> None:
        """``blocking=True`` on an ``async def`` function is a TypeError naming it: it runs on the event
        loop whatever it declares."""
        app = HookServer()
        with pytest.raises(TypeError, match="'waits' is an async def function"):
            app.hook(STAGE, name="waits", blocking=True)(awaiting)
        assert () == app.registry.hooks(STAGE)

    def test_declared_non_blocking_runs_as_before_in_process(self) -> None:
        """In-process (``handle_container``), a non-blocking function runs as any plain one does."""
        app = HookServer()
        app.hook(STAGE, name="quick", blocking=False)(plain)
        answer = app.handle_container(STAGE, container_request(pod_request("p"), "c"))
        assert {"PLAIN": "1"} == answer.container_envs


class TestPlanAfterRegister:
    """A stage's functions and placement are worked out when it changes, not per call: whatever is
    registered after a call has read them counts from the next call on."""

    def test_a_function_added_after_a_call_runs_next(self) -> None:
        """A blocking function registered after a call of a loop stage is in the next call, ordered by
        name, and moves the stage to the worker."""
        app = HookServer()
        app.hook(STAGE, name="b", blocking=False)(plain)
        request = container_request(pod_request("p"), "c")
        assert {"PLAIN": "1"} == app.handle_container(STAGE, request).container_envs
        assert Placement.LOOP == app.registry.placement(STAGE)

        @app.hook(STAGE, name="a")
        def first(ctx: ContainerContext) -> None:
            ctx.response.add_envs["FIRST"] = "a"

        assert ["a", "b"] == [h.name for h in app.registry.hooks(STAGE)]
        assert Placement.WORKER == app.registry.placement(STAGE)
        assert {"FIRST": "a", "PLAIN": "1"} == app.handle_container(STAGE, request).container_envs

    def test_an_async_function_added_moves_a_loop_stage(self) -> None:
        """An ``async def`` function registered after the stage's plan was read moves a loop stage to a
        task; a blocking one after that to the worker."""
        app = HookServer()
        app.hook(STAGE, name="a", blocking=False)(plain)
        assert Placement.LOOP == app.registry.placement(STAGE)
        app.hook(STAGE, name="b")(awaiting)
        assert Placement.TASK == app.registry.placement(STAGE)
        app.hook(STAGE, name="c")(plain)
        assert Placement.WORKER == app.registry.placement(STAGE)

    def test_a_policy_installed_after_a_call_runs_next(self) -> None:
        """A built-in policy installed after a call (here envinject) runs from the next call on."""
        app = HookServer()
        app.hook(STAGE, name="quick", blocking=False)(plain)
        env = json.dumps({"FROM_POD": "yes"})
        request = container_request(pod_request("p", annotations={envinject.ANNOTATION: env}), "c")
        assert {"PLAIN": "1"} == app.handle_container(STAGE, request).container_envs
        envinject.install(app)
        assert ["envinject", "quick"] == [h.name for h in app.registry.hooks(STAGE)]
        assert {"FROM_POD": "yes", "PLAIN": "1"} == app.handle_container(STAGE, request).container_envs

    def test_a_refused_duplicate_leaves_the_plan(self) -> None:
        """A second function of a name already registered is refused and the stage's functions and
        placement stay as they were."""
        app = HookServer()
        app.hook(STAGE, name="a", blocking=False)(plain)
        before = (app.registry.hooks(STAGE), app.registry.placement(STAGE))
        with pytest.raises(DuplicateHookError, match="'a' is already registered"):
            app.hook(STAGE, name="a")(plain)
        assert before == (app.registry.hooks(STAGE), app.registry.placement(STAGE))

    def test_another_stage_s_function_leaves_this_plan(self) -> None:
        """A function registered at one stage changes that stage's plan only."""
        app = HookServer()
        app.hook(STAGE, name="a", blocking=False)(plain)
        app.hook(Stage.PRE_START_CONTAINER, name="b")(plain)
        assert (["a"], Placement.LOOP) == (
            [h.name for h in app.registry.hooks(STAGE)],
            app.registry.placement(STAGE),
        )
        assert Placement.WORKER == app.registry.placement(Stage.PRE_START_CONTAINER)


class TestInlineWatch:
    def test_a_slow_inline_function_is_logged_once(self, caplog: pytest.LogCaptureFixture) -> None:
        """A non-blocking function that took longer than the limit (on the watch's clock) is logged at
        warning level, naming it, with how long it took and the fix; once per function; a quick one is
        not logged."""
        clock = FakeClock()
        watch = InlineWatch(clock=clock, limit=0.01)
        app = HookServer()

        def slow(ctx: ContainerContext) -> None:
            clock.advance(0.025)

        def quick(ctx: ContainerContext) -> None:
            clock.advance(0.009)

        app.hook(STAGE, name="slow", blocking=False)(slow)
        app.hook(STAGE, name="quick", blocking=False)(quick)
        with caplog.at_level(logging.WARNING, logger="krproxy.hookserver"):
            for _ in range(3):
                app.run_stage(STAGE, _ctx(), watch.call)
        [slow_line] = logged_events(caplog.records, "inline_hook_slow")
        assert "slow" == slow_line["plugin"]
        assert 25.0 == slow_line["took_ms"]
        assert 10.0 == slow_line["limit_ms"]
        assert "blocking=False" in slow_line["fix"]

    def test_a_raising_inline_function_is_timed_too(self, caplog: pytest.LogCaptureFixture) -> None:
        """A function that took too long and then raised is logged as slow, and its error still goes to
        the failure policy."""
        clock = FakeClock()
        watch = InlineWatch(clock=clock, limit=0.01)
        app = HookServer()

        def broken(ctx: ContainerContext) -> None:
            clock.advance(1.0)
            raise RuntimeError("kaput")

        app.hook(STAGE, name="broken", blocking=False)(broken)
        with caplog.at_level(logging.WARNING, logger="krproxy.hookserver"):
            result = app.run_stage(STAGE, _ctx(), watch.call)
        assert ("broken",) == result.failed
        [slow_line] = logged_events(caplog.records, "inline_hook_slow")
        assert 1000.0 == slow_line["took_ms"]

    @pytest.mark.parametrize(
        "raised", [SystemExit(3), KeyboardInterrupt()], ids=["sys.exit", "KeyboardInterrupt"]
    )
    def test_an_exit_in_an_inline_function_is_its_failure(self, raised: BaseException) -> None:
        """Called on the served loop (through a watch), SystemExit and KeyboardInterrupt from a function
        are its failure, as in the worker thread: under FAIL the stage fails naming it."""
        app = HookServer(plugin_failure_policy=FailurePolicy.FAIL)

        def exits(ctx: ContainerContext) -> None:
            raise raised

        app.hook(STAGE, name="exits", blocking=False)(exits)
        with pytest.raises(HookFailedError, match="hook plugin 'exits' failed"):
            run_hooks(
                app.registry.hooks(STAGE),
                _ctx(),
                FailurePolicy.FAIL,
                where="x",
                call=InlineWatch().call,
            )


class TestRunHooksOnLoop:
    async def test_async_and_inline_functions_share_the_context_in_order(self) -> None:
        """On the loop, a stage's async functions are awaited and its non-blocking plain ones called, by
        name, on one context; an async one raising under IGNORE is logged and the rest run."""
        app = HookServer()

        async def b_async(ctx: ContainerContext) -> None:
            await trio.lowlevel.checkpoint()
            ctx.response.add_envs["B"] = ctx.response.add_envs["A"] + "b"

        async def c_broken(ctx: ContainerContext) -> None:
            raise RuntimeError("kaput")

        def d_plain(ctx: ContainerContext) -> None:
            ctx.response.add_envs["D"] = ctx.response.add_envs["B"] + "d"

        app.hook(STAGE, name="a", blocking=False)(lambda ctx: ctx.response.add_envs.update(A="a"))
        app.hook(STAGE, name="b")(b_async)
        app.hook(STAGE, name="c")(c_broken)
        app.hook(STAGE, name="d", blocking=False)(d_plain)
        ctx = _ctx()
        result = await run_hooks_on_loop(
            app.registry.hooks(STAGE), ctx, FailurePolicy.IGNORE, where="x", watch=InlineWatch()
        )
        assert ("a", "b", "c", "d") == result.ran
        assert ("c",) == result.failed
        assert {"A": "a", "B": "ab", "D": "abd"} == ctx.response.add_envs
