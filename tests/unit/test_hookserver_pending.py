"""Pod settings whose cgroup does not exist yet are kept and retried, never dropped silently."""

from __future__ import annotations

import errno
import logging
import pathlib

import pytest

from krproxy.hookserver import (
    CgroupFile,
    ContainerContext,
    HookServer,
    NodePolicy,
    PodContext,
    QoSClass,
    Stage,
)
from krproxy.hookserver._app import PENDING_TIMEOUT
from krproxy.hookserver._executor import CgroupWriteError
from krproxy.hookserver.policies import cpusuppress
from krproxy.hookserver.policies.cpusuppress import Measurement
from krproxy.hookserver.testing import FakeNode, container_request, logged_events, pod_request

POD = "/kubepods/besteffort/poduid-be"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _app(tmp_path: pathlib.Path, version: int = 2) -> tuple[HookServer, FakeNode, Clock]:
    node = FakeNode(tmp_path, cgroup_version=version).create()
    clock = Clock()
    app = HookServer(executor=node.executor(), clock=clock)

    @app.hook(Stage.PRE_RUN_POD_SANDBOX, name="be-idle")
    def be_idle(ctx: PodContext) -> None:
        if ctx.request.qos_class is QoSClass.BE:
            ctx.response.resources.cpu_idle = 1

    return app, node, clock


class TestPending:
    @pytest.mark.parametrize("version", [1, 2])
    def test_setting_waits_for_the_pod_cgroup(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, version: int
    ) -> None:
        """At PreRunPodSandbox the pod cgroup does not exist yet: the setting is logged as deferred
        and written by the next retry after the cgroup appears."""
        app, node, _ = _app(tmp_path, version)
        with caplog.at_level(logging.INFO):
            app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("be", qos="BE", cgroup_parent=POD))
            [deferred] = logged_events(caplog.records, "cgroup_write_deferred")
            assert "default/be" == deferred["pod"] and POD.strip("/") in deferred["reason"]
            assert [] == app.retry_pending()  # still missing: kept
            assert 1 == len(app.pending)
            node.add_cgroup(POD)
            changes = app.retry_pending()
        assert "1" == node.read(POD, CgroupFile.CPU_IDLE)
        assert 1 == len(changes) and {} == app.pending
        assert [{"pod": "default/be", "changes": 1}] == logged_events(caplog.records, "cgroup_write_retried")

    def test_a_container_hook_retries(self, tmp_path: pathlib.Path) -> None:
        """The pod's containers are created after its cgroup exists: their hook calls retry too."""
        app, node, _ = _app(tmp_path)
        pod = pod_request("be", qos="BE", cgroup_parent=POD)
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod)
        node.add_cgroup(POD)
        app.handle_container(Stage.PRE_CREATE_CONTAINER, container_request(pod, "app"))
        assert "1" == node.read(POD, CgroupFile.CPU_IDLE)

    def test_given_up_after_the_timeout(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A pod whose cgroup never appears is given up after PENDING_TIMEOUT, as an error."""
        app, _, clock = _app(tmp_path)
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("be", qos="BE", cgroup_parent=POD))
        clock.now = PENDING_TIMEOUT - 1
        app.retry_pending()
        assert app.pending
        clock.now = PENDING_TIMEOUT
        with caplog.at_level(logging.ERROR):
            app.retry_pending()
        assert {} == app.pending
        [abandoned] = logged_events(caplog.records, "cgroup_write_abandoned")
        assert "default/be" == abandoned["pod"]

    def test_stopped_pod_is_not_retried(self, tmp_path: pathlib.Path) -> None:
        """PostStopPodSandbox drops what was waiting for that pod."""
        app, _, _ = _app(tmp_path)
        pod = pod_request("be", qos="BE", cgroup_parent=POD)
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod)
        app.handle_pod(Stage.POST_STOP_POD_SANDBOX, pod)
        assert {} == app.pending

    def test_pod_without_settings_is_not_pending(self, tmp_path: pathlib.Path) -> None:
        """Nothing to write, nothing to wait for (an LS pod here)."""
        app, _, _ = _app(tmp_path)
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("ls", cgroup_parent=POD))
        assert {} == app.pending


class TestDecisionLog:
    def test_debug_logs_each_hook_decision(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """At debug level each hook call logs the pod, the functions that ran and what they set."""
        app, node, _ = _app(tmp_path)
        node.add_cgroup(POD)
        with caplog.at_level(logging.DEBUG):
            app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("be", qos="BE", cgroup_parent=POD))
        [decision] = logged_events(caplog.records, "hook_decision")
        assert {
            "stage": "PreRunPodSandbox",
            "pod": "default/be",
            "ran": "be-idle",
            "failed": "",
            "changes": {"resources.cpu_idle": 1},
        } == decision

    def test_nothing_at_info(self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
        """At info level no per-call line is logged."""
        app, node, _ = _app(tmp_path)
        node.add_cgroup(POD)
        with caplog.at_level(logging.INFO):
            app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("be", qos="BE", cgroup_parent=POD))
        assert [] == logged_events(caplog.records, "hook_decision")


class TestRefusedWriteKeepsThePod:
    """A write the kernel refuses fails the hook call (naming pod, file and value), but the pod and
    its containers are still remembered, so re-applies (policy change, CPU suppress) reach them."""

    @staticmethod
    def _refuse(app: HookServer, monkeypatch: pytest.MonkeyPatch) -> None:
        def refuse(self: object, cgroup_dir: str, file: CgroupFile, value: int | str) -> None:
            raise CgroupWriteError(
                f"{cgroup_dir}/{file.name}", str(value), OSError(errno.EINVAL, "Invalid argument")
            )

        monkeypatch.setattr(type(app.executor), "set", refuse)

    def test_pod(self, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
        app, node, _ = _app(tmp_path)
        node.add_cgroup(POD)
        self._refuse(app, monkeypatch)
        with pytest.raises(CgroupWriteError, match="pod default/be: cannot write '1'"):
            app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("be", qos="BE", cgroup_parent=POD))
        assert ["be"] == [t.pod.meta.name for t in app.pods.targets()]

    def test_container(self, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
        app, node, _ = _app(tmp_path)

        @app.hook(Stage.PRE_START_CONTAINER, name="idle")
        def idle(ctx: ContainerContext) -> None:
            ctx.response.resources.cpu_idle = 1

        node.add_cgroup(POD)
        node.add_cgroup(f"{POD}/c1")
        be = pod_request("be", qos="BE", cgroup_parent=POD)
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, be)
        self._refuse(app, monkeypatch)
        with pytest.raises(CgroupWriteError, match="pod default/be/app: cannot write '1'"):
            app.handle_container(Stage.PRE_START_CONTAINER, container_request(be, "app", id="c1"))
        [target] = app.pods.targets()
        assert ["c1"] == [c.id for c in target.containers]


def test_a_retry_is_not_older_than_a_re_apply_missed_meanwhile(tmp_path: pathlib.Path) -> None:
    """The budget is cut while the BE pod's cgroup does not exist yet (that re-apply cannot reach
    it): when the cgroup appears, the pod ends with the budget in force, not the one its
    PreRunPodSandbox was answered with."""
    node = FakeNode(tmp_path, cgroup_version=1).create()
    app = HookServer(executor=node.executor())
    load = {"ls": 2.0}  # 8 × 50 % − 2 = 2 CPUs
    plugin = cpusuppress.install(app, lambda targets: Measurement(8, load["ls"], load["ls"]))
    plugin.clock = lambda: 0.0
    app.set_policy(
        NodePolicy.from_text(
            "resourceUsedThresholdWithBE: {cpuSuppressThresholdPercent: 50, cpuSuppressPolicy: cfsQuota}"
        )
    )
    app.tick(app.tickers[0])
    app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("be", qos="BE", cgroup_parent=POD))
    assert 1 == len(app.pending)
    load["ls"] = 3.0  # 1 CPU: a cut, taken at once; the pod's cgroup is still missing
    app.tick(app.tickers[0])
    node.add_cgroup(POD)
    app.retry_pending()
    assert "100000" == node.read(POD, CgroupFile.CFS_QUOTA)
