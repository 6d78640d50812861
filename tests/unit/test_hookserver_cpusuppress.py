"""CPU suppress as a control loop: hysteresis, rate limits, LS-pinned CPUs, cgroup v1 quota order."""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Sequence

import pytest

from krproxy.hookserver import (
    CgroupFile,
    ContainerContext,
    HookServer,
    Level,
    NodePolicy,
    PodTarget,
    QoSClass,
    Stage,
)
from krproxy.hookserver._cgroups import DEFAULT_CFS_PERIOD, scale_quota
from krproxy.hookserver._executor import online_cpus
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


def _be_quotas(node: FakeNode) -> tuple[str | None, str | None]:
    """The CFS quotas of the BE pod and of its container, as the files hold them."""
    return node.read(BE_POD, CgroupFile.CFS_QUOTA), node.read(f"{BE_POD}/c-be", CgroupFile.CFS_QUOTA)


def _quota_writes(changes: Sequence[object], cgroup: str) -> int:
    return sum(1 for c in changes if cgroup in c.path and ("cfs_quota" in c.path or "cpu.max" in c.path))  # type: ignore[attr-defined]


class TestHysteresis:
    @pytest.mark.parametrize("version", [1, 2])
    def test_load_wandering_around_the_budget_writes_at_most_once_a_minute(
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


class TestV1QuotaOrder:
    @pytest.mark.parametrize("pod_period", [100000, 50000])
    def test_container_quota_above_the_budget(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, pod_period: int
    ) -> None:
        """cgroup v1: a BE container whose own quota (4 CPUs) is above the budget (2) is lowered
        before the pod, and gets its own quota back (pod raised first) when the budget allows.
        The kernel compares quota / period, so a pod with a 50 ms period holds 2 CPUs at 100000
        and its container (100 ms) is capped at 200000, not at the pod's raw 100000."""
        load = Load(ls_used=2.0)
        app, node, _ = _setup(tmp_path, load, version=1, strict=True, be_period=pod_period)
        node.write(f"{BE_POD}/c-be", CgroupFile.CFS_QUOTA, "400000")
        _start(app, be_quota=400000)
        with caplog.at_level(logging.ERROR):
            app.tick(app.tickers[0])
        assert [] == logged_events(caplog.records, "reconcile_failed")
        assert (str(2 * pod_period), "200000") == _be_quotas(node)
        load.now, load.ls_used = RAISE_INTERVAL, 0.0  # budget 4 CPUs
        app.tick(app.tickers[0])
        assert (str(4 * pod_period), "400000") == _be_quotas(node)
        load.now, load.total = 2 * RAISE_INTERVAL, 12  # budget 6 CPUs: the container keeps its 4
        app.tick(app.tickers[0])
        assert (str(6 * pod_period), "400000") == _be_quotas(node)

    def test_unlimited_container_limited_while_the_pod_is_raised(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """cgroup v1: a container with no quota (-1) that a plugin limits to 1.5 CPUs while the pod
        goes from 1 CPU to 4 is written after the pod: before it, 1.5 CPUs under the pod's 1 is
        refused. (Unlimited is not "above" in the order: the child may stay unlimited meanwhile.)"""
        load = Load(ls_used=3.0)  # 8 × 50 % − 3 = 1 CPU
        app, node, _ = _setup(tmp_path, load, version=1, strict=True)

        @app.reconciler(Level.CONTAINER)
        def cap(ctx: ContainerContext) -> None:
            if ctx.request.pod.qos_class is QoSClass.BE and ctx.request.id:
                ctx.response.resources.cfs_quota = 150000

        node.write(f"{BE_POD}/c-be", CgroupFile.CFS_QUOTA, "-1")
        _start(app)
        app.tick(app.tickers[0])
        assert "100000" == node.read(BE_POD, CgroupFile.CFS_QUOTA)
        node.write(f"{BE_POD}/c-be", CgroupFile.CFS_QUOTA, "-1")  # e.g. reset by the runtime
        load.now, load.ls_used = RAISE_INTERVAL, 0.0  # budget 4 CPUs
        with caplog.at_level(logging.ERROR):
            app.tick(app.tickers[0])
        assert [] == logged_events(caplog.records, "reconcile_failed")
        assert ("400000", "150000") == (
            node.read(BE_POD, CgroupFile.CFS_QUOTA),
            node.read(f"{BE_POD}/c-be", CgroupFile.CFS_QUOTA),
        )

    def test_failure_names_pod_file_and_value(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A write the kernel refuses is logged with the pod, the file and the value."""
        load = Load(ls_used=2.0)
        app, node, _ = _setup(tmp_path, load, version=1, strict=True)
        _start(app)
        # A child cgroup nobody told us about holds 4 CPUs: the pod's 2 are refused.
        node.add_cgroup(f"{BE_POD}/unknown")
        node.write(f"{BE_POD}/unknown", CgroupFile.CFS_QUOTA, "400000")
        with caplog.at_level(logging.ERROR):
            app.tick(app.tickers[0])
        [failed] = logged_events(caplog.records, "reconcile_failed")
        assert "default/be" == failed["pod"]
        assert "'200000'" in failed["error"] and f"{BE_POD}/cpu.cfs_quota_us" in failed["error"]
        assert "Invalid argument" in failed["error"]

    def test_own_quota_remembered_from_create(self, tmp_path: pathlib.Path) -> None:
        """As through the proxy: kubelet's quota (4 CPUs) is capped in the PreCreateContainer answer
        (v1 would refuse it under a 2-CPU pod), later calls carry the capped value, and the container
        still gets its own 4 CPUs back when the budget allows; a resize is remembered too."""
        load = Load(ls_used=2.0)
        app, node, plugin = _setup(tmp_path, load, version=1, strict=True)
        app.tick(app.tickers[0])  # budget 2 CPUs
        be = pod_request("be", qos="BE", cgroup_parent=BE_POD)
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, be)
        kubelet = pb.LinuxContainerResources(cpu_period=100000, cpu_quota=400000)
        answer = app.handle_container(
            Stage.PRE_CREATE_CONTAINER, container_request(be, "app", resources=kubelet)
        )
        assert 200000 == answer.container_resources.cpu_quota  # type: ignore[union-attr]
        node.write(f"{BE_POD}/c-be", CgroupFile.CFS_QUOTA, "200000")  # what the runtime applied
        capped = pb.LinuxContainerResources(cpu_period=100000, cpu_quota=200000)
        app.handle_container(
            Stage.PRE_START_CONTAINER, container_request(be, "app", id="c-be", resources=capped)
        )
        load.now, load.ls_used = RAISE_INTERVAL, 0.0  # budget 4 CPUs
        app.tick(app.tickers[0])
        assert "400000" == node.read(f"{BE_POD}/c-be", CgroupFile.CFS_QUOTA)
        resized = pb.LinuxContainerResources(cpu_period=100000, cpu_quota=300000)
        app.handle_container(
            Stage.PRE_UPDATE_CONTAINER_RESOURCES, container_request(be, "app", id="c-be", resources=resized)
        )
        node.write(f"{BE_POD}/c-be", CgroupFile.CFS_QUOTA, "300000")
        app.reconcile()
        assert ("400000", "300000") == (
            node.read(BE_POD, CgroupFile.CFS_QUOTA),
            node.read(f"{BE_POD}/c-be", CgroupFile.CFS_QUOTA),
        )
        assert {("uid-be", "app"): (300000, 100000)} == plugin._own
        app.handle_pod(Stage.POST_STOP_POD_SANDBOX, be)
        assert {} == plugin._own  # forgotten with the pod


class TestCfsPeriod:
    """The budget is a share of the CPUs: a cgroup whose CFS period is not 100 ms gets the quota
    for its own period (v1 ``cpu.cfs_period_us``, v2 the second field of ``cpu.max``)."""

    @pytest.mark.parametrize("version", [1, 2])
    def test_pod_quota_for_its_period(self, tmp_path: pathlib.Path, version: int) -> None:
        """A 2-CPU budget is 100000 µs per 50 ms period (not 200000: that is 4 CPUs); v2 keeps
        "QUOTA PERIOD" together."""
        load = Load(ls_used=2.0)  # 8 × 50 % − 2 = 2 CPUs
        app, node, _ = _setup(tmp_path, load, version=version, be_period=50000)
        _start(app)
        app.tick(app.tickers[0])
        expected = "100000" if version == 1 else "100000 50000"
        assert expected == node.read(BE_POD, CgroupFile.CFS_QUOTA)
        if version == 1:
            assert "50000" == node.read(BE_POD, CgroupFile.CFS_PERIOD)

    @pytest.mark.parametrize("version", [1, 2])
    def test_default_period_only_without_a_period_file(self, tmp_path: pathlib.Path, version: int) -> None:
        """The executor reads the period a cgroup shows; 100 ms only when it shows none."""
        node = FakeNode(tmp_path, cgroup_version=version).create()
        node.add_cgroup(BE_POD, cfs_period=250000)
        executor = node.executor()
        assert (250000, DEFAULT_CFS_PERIOD) == (executor.cfs_period(BE_POD), executor.cfs_period(LS_POD))

    def test_scale_quota(self) -> None:
        """Same share of a CPU, rounded down, never below the kernel's 1 ms; unlimited stays -1."""
        assert (100000, 9999, 1000, -1, 200000) == (
            scale_quota(200000, 50000),
            scale_quota(33333, 30000),
            scale_quota(2000, 10000),
            scale_quota(-5, 50000),
            scale_quota(200000, 100000),
        )


class TestOnlineCpus:
    """cpuset mode places BE on the CPUs that are online, not on ``0..N-1`` from a count."""

    @pytest.mark.parametrize("version", [1, 2])
    def test_offline_cpus_never_named(self, tmp_path: pathlib.Path, version: int) -> None:
        """With CPUs 3 and 7 offline (the root cgroup shows 0-2,4-6: 6 online), a 2-CPU budget
        is the two highest online CPUs, 5-6; LS pinning 6 moves BE to 4-5."""
        load = Load(ls_used=1.0, total=6)  # 6 × 50 % − 1 = 2 CPUs
        app, node, plugin = _setup(tmp_path, load, version=version, mode="cpuset", cpus="0-2,4-6")
        _start(app)
        app.tick(app.tickers[0])
        assert "5-6" == plugin.cpuset
        assert "5-6" == node.read(f"{BE_POD}/c-be", CgroupFile.CPUSET_CPUS)
        status = {"scheduling.koordinator.sh/resource-status": json.dumps({"cpuset": "6"})}
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("ls", cgroup_parent=LS_POD, annotations=status))
        load.now = 1.0
        app.tick(app.tickers[0])
        assert "4-5" == node.read(f"{BE_POD}/c-be", CgroupFile.CPUSET_CPUS)

    @pytest.mark.parametrize("version", [1, 2])
    def test_switched_off_gives_back_the_online_cpus(self, tmp_path: pathlib.Path, version: int) -> None:
        """Released from cpuset mode, BE gets every online CPU back: 0-2,4-6, not 0-5."""
        load = Load(ls_used=1.0, total=6)
        app, node, _ = _setup(tmp_path, load, version=version, mode="cpuset", cpus="0-2,4-6")
        _start(app)
        app.tick(app.tickers[0])
        app.set_policy(NodePolicy.from_text("{}"))
        assert "0-2,4-6" == node.read(f"{BE_POD}/c-be", CgroupFile.CPUSET_CPUS)

    @pytest.mark.parametrize("version", [1, 2])
    def test_sources(self, tmp_path: pathlib.Path, version: int) -> None:
        """The root cgroup's effective cpuset first, the kernel's online list when the root shows
        none, nothing when neither can be read (then cpuset mode reports itself inactive)."""
        online = tmp_path / "online"
        online.write_text("0-1,3\n")
        with_root = FakeNode(tmp_path / "a", cgroup_version=version, cpus="2-5").create().executor()
        without = FakeNode(tmp_path / "b", cgroup_version=version, cpus=None).create().executor()
        assert (frozenset({2, 3, 4, 5}), frozenset({0, 1, 3}), frozenset()) == (
            online_cpus(with_root, str(online)),
            online_cpus(without, str(online)),
            online_cpus(without, str(tmp_path / "absent")),
        )

    def test_unknown_cpus_make_cpuset_mode_inactive(self, tmp_path: pathlib.Path) -> None:
        node = FakeNode(tmp_path, cpus=None).create()
        node.add_cgroup("kubepods")
        app = HookServer(executor=node.executor())
        cpusuppress.install(app, Load(1.0), cpu_online=str(tmp_path / "absent"))
        app.policy = _policy("cpuset")
        [status] = [s for s in app.report_features() if s.feature == "cpusuppress"]
        assert not status.active and "which CPUs are online" in status.reason
