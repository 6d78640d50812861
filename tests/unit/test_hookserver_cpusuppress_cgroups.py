"""CPU suppress against the node's cgroups: the order of cgroup v1 quota writes, the CFS period,
and the online CPUs (the control loop's hysteresis and cpusets: test_hookserver_cpusuppress.py)."""

from __future__ import annotations

import json
import logging
import pathlib

import pytest

from krproxy.hookserver import (
    CgroupFile,
    ContainerContext,
    HookServer,
    Level,
    NodePolicy,
    QoSClass,
    Stage,
)
from krproxy.hookserver._cgroups import DEFAULT_CFS_PERIOD, scale_quota
from krproxy.hookserver._executor import online_cpus
from krproxy.hookserver.policies import cpusuppress
from krproxy.hookserver.policies.cpusuppress import (
    RAISE_INTERVAL,
)
from krproxy.hookserver.testing import FakeNode, container_request, logged_events, pod_request
from krproxy.proto.runtime import v1alpha1 as pb
from tests.unit.test_hookserver_cpusuppress import BE_POD, LS_POD, Load, _policy, _setup, _start


def _be_quotas(node: FakeNode) -> tuple[str | None, str | None]:
    """The CFS quotas of the BE pod and of its container, as the files hold them."""
    return node.read(BE_POD, CgroupFile.CFS_QUOTA), node.read(f"{BE_POD}/c-be", CgroupFile.CFS_QUOTA)


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
