"""CPU suppress as a control loop: hysteresis, rate limits, LS-pinned CPUs, cgroup v1 quota order."""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Sequence

import pytest

from krproxy.hookserver import (
    CgroupFile,
    HookServer,
    NodePolicy,
    PodTarget,
    Stage,
)
from krproxy.hookserver._cgroups import DEFAULT_CFS_PERIOD
from krproxy.hookserver.policies import cpusuppress
from krproxy.hookserver.policies.cpusuppress import (
    RAISE_INTERVAL,
    Measurement,
    be_cpuset,
    format_cpus,
    parse_cpus,
)
from krproxy.hookserver.testing import FakeNode, container_request, logged_events, pod_request
from krproxy.proto.runtime import v1alpha1 as pb

BE_POD = "/kubepods/besteffort/poduid-be"
LS_POD = "/kubepods/burstable/poduid-ls"


def _policy(mode: str = "cfsQuota", threshold: int = 50) -> NodePolicy:
    return NodePolicy.from_text(
        f"resourceUsedThresholdWithBE: {{cpuSuppressThresholdPercent: {threshold}, cpuSuppressPolicy: {mode},"
        " cpuSuppressMinQuota: 2000}"
    )


class Load:
    """A meter whose LS usage the test sets, and a clock the test moves."""

    def __init__(self, ls_used: float, total: int = 8) -> None:
        self.ls_used, self.total, self.now = ls_used, total, 0.0

    def __call__(self, targets: Sequence[PodTarget]) -> Measurement:
        return Measurement(self.total, self.ls_used, self.ls_used)

    def clock(self) -> float:
        return self.now


def _setup(
    tmp_path: pathlib.Path,
    load: Load,
    *,
    version: int = 2,
    mode: str = "cfsQuota",
    strict: bool = False,
    be_period: int = DEFAULT_CFS_PERIOD,
    cpus: str | None = None,
) -> tuple[HookServer, FakeNode, cpusuppress.CpuSuppressPlugin]:
    """A node (online CPUs ``cpus``, default ``0..load.total-1``) with a BE and an LS pod."""
    cpus = f"0-{load.total - 1}" if cpus is None else cpus
    node = FakeNode(tmp_path, cgroup_version=version, strict_quota=strict, cpus=cpus).create()
    node.add_cgroup(BE_POD, cfs_period=be_period)
    node.add_cgroup(LS_POD)
    node.add_cgroup(f"{BE_POD}/c-be")
    node.add_cgroup(f"{LS_POD}/c-ls")
    app = HookServer(executor=node.executor())
    plugin = cpusuppress.install(app, load)
    plugin.clock = load.clock
    app.set_policy(_policy(mode))
    return app, node, plugin


def _start(
    app: HookServer, *, be_quota: int = 0, ls_annotations: dict[str, str] | None = None
) -> pb.PodSandboxHookRequest:
    be = pod_request("be", qos="BE", cgroup_parent=BE_POD)
    ls = pod_request("ls", cgroup_parent=LS_POD, annotations=ls_annotations)
    for pod, cid, quota in ((be, "c-be", be_quota), (ls, "c-ls", 0)):
        res = pb.LinuxContainerResources(cpu_period=100000, cpu_quota=quota)
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod)
        app.handle_container(Stage.PRE_START_CONTAINER, container_request(pod, "app", id=cid, resources=res))
    return be


def _quota_writes(changes: Sequence[object], cgroup: str) -> int:
    return sum(1 for c in changes if cgroup in c.path and ("cfs_quota" in c.path or "cpu.max" in c.path))  # type: ignore[attr-defined]


class TestHysteresis:
    @pytest.mark.parametrize("version", [1, 2])
    def test_load_around_the_budget_writes_at_most_once_a_minute(
        self, tmp_path: pathlib.Path, version: int
    ) -> None:
        """LS usage moving ±1 % around its level every second for 10 minutes changes the BE quota
        at most once a minute (here: never after the first)."""
        load = Load(ls_used=2.0)
        app, node, _ = _setup(tmp_path, load, version=version)
        _start(app)
        budget = 8 * 0.5 - 2.0
        writes = 0
        for second in range(600):
            load.now = float(second)
            load.ls_used = 2.0 + (budget * 0.01 if second % 2 else -budget * 0.01)
            writes += _quota_writes(app.tick(app.tickers[0]), "poduid-be")
        assert writes <= 10
        assert writes == 1  # only the first tick: the rest is within the hysteresis
        assert node.read(BE_POD, CgroupFile.CFS_QUOTA) in (
            "198000",
            "198000 100000",
            "202000",
            "202000 100000",
        )

    @pytest.mark.parametrize("version", [1, 2])
    def test_cut_at_once_raise_after_the_interval(self, tmp_path: pathlib.Path, version: int) -> None:
        """More LS load cuts BE at once; less load raises BE only RAISE_INTERVAL after the last change."""
        load = Load(ls_used=2.0)
        app, node, _ = _setup(tmp_path, load, version=version)
        q = {1: "{}", 2: "{} 100000"}[version].format
        _start(app)
        app.tick(app.tickers[0])
        assert q(200000) == node.read(BE_POD, CgroupFile.CFS_QUOTA)
        load.now, load.ls_used = 10.0, 3.0
        app.tick(app.tickers[0])
        assert q(100000) == node.read(BE_POD, CgroupFile.CFS_QUOTA)  # cut: at once
        load.now, load.ls_used = 20.0, 1.0
        app.tick(app.tickers[0])
        assert q(100000) == node.read(BE_POD, CgroupFile.CFS_QUOTA)  # raise: deferred
        load.now = 10.0 + RAISE_INTERVAL
        app.tick(app.tickers[0])
        assert q(300000) == node.read(BE_POD, CgroupFile.CFS_QUOTA)

    @pytest.mark.parametrize("version", [1, 2])
    @pytest.mark.parametrize("mode", ["cfsQuota", "cpuset"])
    def test_switched_off_releases_be(self, tmp_path: pathlib.Path, version: int, mode: str) -> None:
        """Suppress switched off (section removed, or enable: false) gives BE its CPU back: the pod
        quota unlimited, a v1 container its own quota, the cpuset every CPU; as koordlet recovers
        BE when the strategy is disabled. Nothing is written for BE afterwards."""
        load = Load(ls_used=3.0)  # 1 CPU
        app, node, _ = _setup(tmp_path, load, version=version, mode=mode, strict=True)
        node.write(f"{BE_POD}/c-be", CgroupFile.CFS_QUOTA, "400000" if version == 1 else "400000 100000")
        _start(app, be_quota=400000)
        app.tick(app.tickers[0])
        container = f"{BE_POD}/c-be"
        if mode == "cfsQuota":
            assert "100000" == node.read(BE_POD, CgroupFile.CFS_QUOTA).split()[0]
        else:
            assert "7" == node.read(container, CgroupFile.CPUSET_CPUS)
        app.set_policy(NodePolicy.from_text("resourceUsedThresholdWithBE: {enable: false}"))
        unlimited = "-1" if version == 1 else "max 100000"
        assert unlimited == node.read(BE_POD, CgroupFile.CFS_QUOTA)
        assert 400000 == int(node.read(container, CgroupFile.CFS_QUOTA).split()[0])
        if mode == "cpuset":
            assert "0-7" == node.read(container, CgroupFile.CPUSET_CPUS)
        node.write(BE_POD, CgroupFile.CFS_QUOTA, "123456" if version == 1 else "123456 100000")
        load.now = 5.0
        app.tick(app.tickers[0])
        app.reconcile()
        assert "123456" == node.read(BE_POD, CgroupFile.CFS_QUOTA).split()[0]  # left alone now

    def test_release_is_logged_only_when_something_is_given_back(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A new threshold releases nothing (no line); switching off logs what is given back."""
        load = Load(ls_used=3.0)
        app, _, _ = _setup(tmp_path, load)
        _start(app)
        app.tick(app.tickers[0])
        caplog.clear()
        with caplog.at_level(logging.INFO):
            app.set_policy(_policy(threshold=75))
            assert [] == logged_events(caplog.records, "cpusuppress_released")
            app.set_policy(NodePolicy.from_text("{}"))
        assert [{"quota": True, "cpuset": "", "now": "off"}] == logged_events(
            caplog.records, "cpusuppress_released"
        )

    def test_cpuset_to_cfs_quota_gives_the_cpus_back(self, tmp_path: pathlib.Path) -> None:
        """From cpuset mode to cfsQuota: the BE container leaves its one CPU for every CPU no LS pod
        is pinned to, and the pod gets the quota instead."""
        load = Load(ls_used=3.0)  # 1 CPU
        app, node, _ = _setup(tmp_path, load, mode="cpuset")
        status = {"scheduling.koordinator.sh/resource-status": json.dumps({"cpuset": "0-1"})}
        _start(app, ls_annotations=status)
        app.tick(app.tickers[0])
        assert "7" == node.read(f"{BE_POD}/c-be", CgroupFile.CPUSET_CPUS)
        app.set_policy(_policy("cfsQuota"))
        assert "2-7" == node.read(f"{BE_POD}/c-be", CgroupFile.CPUSET_CPUS)
        assert "100000 100000" == node.read(BE_POD, CgroupFile.CFS_QUOTA)

    def test_policy_change_is_taken_at_once(self, tmp_path: pathlib.Path) -> None:
        """A new threshold bypasses the rate limit: the operator asked for it."""
        load = Load(ls_used=2.0)
        app, node, _ = _setup(tmp_path, load)
        _start(app)
        app.tick(app.tickers[0])
        load.now = 1.0
        app.set_policy(_policy(threshold=75))
        assert "400000 100000" == node.read(BE_POD, CgroupFile.CFS_QUOTA)


class TestCpuset:
    def test_cpus_lists(self) -> None:
        """cpuset lists parse and fold back."""
        assert frozenset({0, 1, 2, 5}) == parse_cpus("0-2,5")
        assert "0-2,5" == format_cpus({5, 0, 2, 1})
        assert ("5,7", None) == (
            be_cpuset(range(8), 200000, pinned=frozenset({6})),
            be_cpuset(range(2), 100000, pinned=frozenset({0, 1})),
        )
        assert "4-5" == be_cpuset(range(8), 200000, pinned=frozenset({6, 7}))

    @pytest.mark.parametrize("version", [1, 2])
    def test_be_never_gets_cpus_ls_pods_are_pinned_to(self, tmp_path: pathlib.Path, version: int) -> None:
        """An LS pod pinned to CPUs 6-7 (resource-status) keeps them: BE gets the next highest ones."""
        load = Load(ls_used=2.0)
        app, node, _ = _setup(tmp_path, load, mode="cpuset", version=version)
        status = {"scheduling.koordinator.sh/resource-status": json.dumps({"cpuset": "6-7"})}
        _start(app, ls_annotations=status)
        app.tick(app.tickers[0])
        assert "4-5" == node.read(f"{BE_POD}/c-be", CgroupFile.CPUSET_CPUS)  # 2 cores, not 6-7
        assert "" == node.read(f"{LS_POD}/c-ls", CgroupFile.CPUSET_CPUS)

    def test_no_flipping_around_a_cpu_boundary(self, tmp_path: pathlib.Path) -> None:
        """A budget wandering around 1 CPU (0.99 / 1.01 cores) does not flip BE between 1 and 2 CPUs."""
        load = Load(ls_used=3.0)  # budget 1 core
        app, _, _ = _setup(tmp_path, load, mode="cpuset")
        _start(app)
        writes = 0
        for second in range(120):
            load.now = float(second)
            load.ls_used = 3.0 + (0.01 if second % 2 else -0.01)
            writes += sum(1 for c in app.tick(app.tickers[0]) if "cpuset" in c.path)
        assert writes <= 1

    def test_every_cpu_pinned_keeps_the_cpuset(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """When LS pods hold every CPU, BE keeps what it has, and the log says why."""
        load = Load(ls_used=2.0, total=2)
        app, _, plugin = _setup(tmp_path, load, mode="cpuset")
        _start(app)
        app.tick(app.tickers[0])
        before = plugin.cpuset
        status = {"scheduling.koordinator.sh/resource-status": json.dumps({"cpuset": "0-1"})}
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("ls", cgroup_parent=LS_POD, annotations=status))
        with caplog.at_level(logging.WARNING):
            app.tick(app.tickers[0])
        assert before == plugin.cpuset
        assert [{"online": "0-1", "pinned": "0-1", "kept": before}] == logged_events(
            caplog.records, "cpusuppress_no_free_cpu"
        )

    def test_every_cpu_pinned_is_logged_once_not_every_second(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The warning is for the change of state: a minute of ticks with every CPU pinned logs it
        once; once a CPU is free and then pinned again, it is logged again."""
        load = Load(ls_used=2.0, total=2)
        app, _, _ = _setup(tmp_path, load, mode="cpuset")
        _start(app)
        app.tick(app.tickers[0])
        status = {"scheduling.koordinator.sh/resource-status": json.dumps({"cpuset": "0-1"})}
        pinned = pod_request("ls", cgroup_parent=LS_POD, annotations=status)
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pinned)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            for second in range(1, 61):
                load.now = float(second)
                app.tick(app.tickers[0])
            assert 1 == len(logged_events(caplog.records, "cpusuppress_no_free_cpu"))
            app.handle_pod(Stage.POST_STOP_POD_SANDBOX, pinned)
            app.tick(app.tickers[0])
            app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pinned)
            app.tick(app.tickers[0])
        assert 2 == len(logged_events(caplog.records, "cpusuppress_no_free_cpu"))

    def test_cfs_quota_mode_does_not_care_about_pinned_cpus(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """With cpuSuppressPolicy cfsQuota, BE's cpuset is not touched: LS pods pinning CPUs (all of
        them, even) neither warn about cpusets nor re-apply every pod."""
        load = Load(ls_used=2.0, total=2)
        app, _, plugin = _setup(tmp_path, load, mode="cfsQuota")
        _start(app)
        app.tick(app.tickers[0])
        status = {"scheduling.koordinator.sh/resource-status": json.dumps({"cpuset": "0-1"})}
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("ls", cgroup_parent=LS_POD, annotations=status))
        caplog.clear()  # only what the ticks below log (another test may have left INFO on)
        with caplog.at_level(logging.INFO):
            for second in range(1, 11):
                load.now = float(second)
                app.tick(app.tickers[0])
        assert [] == logged_events(caplog.records, "cpusuppress_no_free_cpu")
        reapplied = [
            e for e in logged_events(caplog.records, "reapplied") if e["cause"] == "ticker:cpusuppress"
        ]
        assert [] == reapplied
        assert plugin.cpuset is None
