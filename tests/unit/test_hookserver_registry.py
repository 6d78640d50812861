"""Plugin registration, ordering and failure policies (pure; no sockets)."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest
import trio

from krproxy.hookserver import (
    CgroupFile,
    ContainerContext,
    DuplicateHookError,
    FailurePolicy,
    HookFailedError,
    HookServer,
    PodContext,
    PodInfo,
    Registry,
    Stage,
    run_hooks,
)
from krproxy.hookserver.testing import FakeNode, container_request, pod_request


def _recorder(log: list[str], name: str, *, fail: bool = False) -> Callable[[PodContext], None]:
    def fn(ctx: PodContext) -> None:
        log.append(name)
        ctx.response.labels[name] = "seen"
        if fail:
            raise RuntimeError(f"{name} broke")

    return fn


class TestRegistry:
    def test_stage_runs_by_name_not_registration_order(self) -> None:
        """Within a stage, functions run sorted by name, whatever the registration order."""
        registry = Registry()
        log: list[str] = []
        for name in ("zeta", "alpha", "mid"):
            registry.register(Stage.PRE_RUN_POD_SANDBOX, name, "", _recorder(log, name))
        run_hooks(
            registry.hooks(Stage.PRE_RUN_POD_SANDBOX), PodContext(PodInfo()), FailurePolicy.FAIL, where="x"
        )
        assert ["alpha", "mid", "zeta"] == log

    def test_shared_context(self) -> None:
        """Later functions see what earlier ones changed."""
        registry = Registry()
        seen: list[dict[str, str]] = []
        registry.register(Stage.PRE_RUN_POD_SANDBOX, "a", "", lambda c: c.response.labels.update(x="1"))
        registry.register(Stage.PRE_RUN_POD_SANDBOX, "b", "", lambda c: seen.append(dict(c.response.labels)))
        run_hooks(
            registry.hooks(Stage.PRE_RUN_POD_SANDBOX), PodContext(PodInfo()), FailurePolicy.FAIL, where="x"
        )
        assert [{"x": "1"}] == seen

    def test_duplicate_name_in_stage_is_refused(self) -> None:
        """A name is unique per stage (koordlet treats a duplicate as fatal)."""
        registry = Registry()
        registry.register(Stage.PRE_CREATE_CONTAINER, "a", "", lambda c: None)
        registry.register(Stage.PRE_START_CONTAINER, "a", "", lambda c: None)
        with pytest.raises(DuplicateHookError):
            registry.register(Stage.PRE_CREATE_CONTAINER, "a", "", lambda c: None)

    def test_stages_lists_only_used_stages_minus_disabled(self) -> None:
        """Registration advertises the stages with at least one function, in declaration order."""
        registry = Registry()
        registry.register(Stage.PRE_UPDATE_CONTAINER_RESOURCES, "a", "", lambda c: None)
        registry.register(Stage.PRE_RUN_POD_SANDBOX, "a", "", lambda c: None)
        registry.register(Stage.POST_STOP_CONTAINER, "a", "", lambda c: None)
        assert (Stage.PRE_RUN_POD_SANDBOX, Stage.PRE_UPDATE_CONTAINER_RESOURCES) == registry.stages(
            [Stage.POST_STOP_CONTAINER]
        )


class TestFailurePolicy:
    def test_fail_stops_at_first_failure(self) -> None:
        """FAIL: the first raising function stops the stage; the error names it and the stage."""
        log: list[str] = []
        registry = Registry()
        for name, fail in (("a", False), ("b", True), ("c", False)):
            registry.register(Stage.PRE_RUN_POD_SANDBOX, name, "", _recorder(log, name, fail=fail))
        with pytest.raises(HookFailedError) as info:
            run_hooks(
                registry.hooks(Stage.PRE_RUN_POD_SANDBOX),
                PodContext(PodInfo()),
                FailurePolicy.FAIL,
                where="PreRunPodSandbox",
            )
        assert ["a", "b"] == log
        assert "'b'" in str(info.value) and "PreRunPodSandbox" in str(info.value)

    def test_ignore_logs_and_goes_on(self, caplog: pytest.LogCaptureFixture) -> None:
        """IGNORE: a failing function is logged, the others still run and keep their changes."""
        log: list[str] = []
        registry = Registry()
        for name, fail in (("a", False), ("b", True), ("c", False)):
            registry.register(Stage.PRE_RUN_POD_SANDBOX, name, "", _recorder(log, name, fail=fail))
        ctx = PodContext(PodInfo())
        result = run_hooks(registry.hooks(Stage.PRE_RUN_POD_SANDBOX), ctx, FailurePolicy.IGNORE, where="x")
        assert ["a", "b", "c"] == log
        assert ("b",) == result.failed
        assert {"a": "seen", "b": "seen", "c": "seen"} == ctx.response.labels
        assert "hook_failed" in caplog.text

    def test_fail_answers_with_error_and_writes_nothing(self, tmp_path: pathlib.Path) -> None:
        """Through the app: under FAIL a failing plugin means an error and no cgroup writes."""
        node = FakeNode(tmp_path).create()
        node.add_cgroup("/kubepods/besteffort/poduid-p")
        app = HookServer(executor=node.executor(), plugin_failure_policy=FailurePolicy.FAIL)

        @app.hook(Stage.PRE_RUN_POD_SANDBOX, name="a-sets-idle")
        def sets_idle(ctx: PodContext) -> None:
            ctx.response.resources.cpu_idle = 1

        @app.hook(Stage.PRE_RUN_POD_SANDBOX, name="b-breaks")
        def breaks(ctx: PodContext) -> None:
            raise ValueError("nope")

        with pytest.raises(HookFailedError):
            app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("p"))
        assert "0" == node.read("/kubepods/besteffort/poduid-p", CgroupFile.CPU_IDLE)

        app.plugin_failure_policy = FailurePolicy.IGNORE
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("p"))
        assert "1" == node.read("/kubepods/besteffort/poduid-p", CgroupFile.CPU_IDLE)

    def test_container_hook_decorator_uses_function_name_and_doc(self, tmp_path: pathlib.Path) -> None:
        """The decorator defaults name and description to the function's name and docstring."""
        app = HookServer(executor=FakeNode(tmp_path).create().executor())

        @app.hook(Stage.PRE_CREATE_CONTAINER)
        def add_env(ctx: ContainerContext) -> None:
            """Adds FOO."""
            ctx.response.add_envs["FOO"] = "bar"

        (hook,) = app.registry.hooks(Stage.PRE_CREATE_CONTAINER)
        assert ("add_env", "Adds FOO.") == (hook.name, hook.description)
        resp = app.handle_container(Stage.PRE_CREATE_CONTAINER, container_request(pod_request("p"), "c"))
        assert {"FOO": "bar"} == resp.container_envs


class TestAsyncPluginFunctions:
    def test_async_function_outside_an_app_runs_in_its_own_trio(self) -> None:
        """Called without the SDK's server (a unit test calling handle_pod), an ``async def``
        function still runs, and may await trio."""
        app = HookServer(executor=FakeNode(pathlib.Path("/nonexistent")).executor())

        @app.hook(Stage.PRE_RUN_POD_SANDBOX, name="later")
        async def later(ctx: PodContext) -> None:
            await trio.sleep(0.001)
            ctx.response.labels["later"] = "yes"

        assert "yes" == app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("p")).labels["later"]

    async def test_async_function_on_the_loop_thread_fails_saying_why(self) -> None:
        """From the event loop's own thread an ``async def`` function cannot be awaited by the
        synchronous app: under FAIL the call fails naming the function and what to do."""
        app = HookServer(
            executor=FakeNode(pathlib.Path("/nonexistent")).executor(),
            plugin_failure_policy=FailurePolicy.FAIL,
        )

        @app.hook(Stage.PRE_RUN_POD_SANDBOX, name="later")
        async def later(ctx: PodContext) -> None:
            raise AssertionError("never run")

        with pytest.raises(HookFailedError, match=r"'later'.*event loop's thread.*worker thread"):
            app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("p"))
