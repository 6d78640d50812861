"""Built-in policies write the expected files for a BE pod and an LS pod (temp root, no sockets)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

import pytest

from krproxy.hookserver import CgroupFile, HookServer, NodePolicy, PodInfo, PodTarget, Stage
from krproxy.hookserver.policies import cpuset, cpusuppress, envinject, groupidentity, install_all, resctrl
from krproxy.hookserver.policies.cpusuppress import Measurement, ProcfsMeter, be_budget, be_cpuset, be_quota
from krproxy.hookserver.testing import FakeNode, container_request, pod_request
from krproxy.proto.runtime import v1alpha1 as pb

POLICY = """
resourceQOSStrategy:
  lsClass:
    cpuQOS: {groupIdentity: 2}
    resctrlQOS: {catRangeStartPercent: 0, catRangeEndPercent: 100, mbaPercent: 100}
  beClass:
    cpuQOS: {groupIdentity: -1}
    resctrlQOS: {catRangeStartPercent: 0, catRangeEndPercent: 25, mbaPercent: 30}
resourceUsedThresholdWithBE:
  cpuSuppressThresholdPercent: 50
  cpuSuppressPolicy: cfsQuota
  cpuSuppressMinQuota: 10000
"""
BE_POD = "/kubepods/besteffort/poduid-be"
LS_POD = "/kubepods/burstable/poduid-ls"


class FixedMeter:
    """Feeds the suppress plugin numbers instead of /proc."""

    def __init__(self, m: Measurement | None) -> None:
        self.m = m

    def __call__(self, targets: Sequence[PodTarget]) -> Measurement | None:
        return self.m


def _quota(version: int, quota: int) -> str:
    """A CFS quota as the kernel shows it: v1 ``cpu.cfs_quota_us``, v2 ``cpu.max``."""
    if version == 1:
        return str(quota)
    return f"{'max' if quota < 0 else quota} 100000"


def _node(tmp_path: pathlib.Path, **kw: object) -> FakeNode:
    node = FakeNode(tmp_path, **kw).create()  # type: ignore[arg-type]
    node.add_cgroup(BE_POD)
    node.add_cgroup(LS_POD)
    node.add_cgroup(f"{BE_POD}/c-be", pids=[101, 102])
    node.add_cgroup(f"{LS_POD}/c-ls", pids=[201])
    return node


def _app(node: FakeNode, meter: FixedMeter) -> HookServer:
    app = HookServer(executor=node.executor())
    install_all(app, meter=meter)
    return app


def _run_pods(app: HookServer) -> tuple[pb.PodSandboxHookRequest, pb.PodSandboxHookRequest]:
    be = pod_request("be", qos="BE", cgroup_parent=BE_POD)
    ls = pod_request("ls", cgroup_parent=LS_POD)  # no label: LS
    for pod, cid in ((be, "c-be"), (ls, "c-ls")):
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod)
        app.handle_container(Stage.PRE_CREATE_CONTAINER, container_request(pod, "app"))
        app.handle_container(Stage.PRE_START_CONTAINER, container_request(pod, "app", id=cid))
        app.handle_container(Stage.POST_START_CONTAINER, container_request(pod, "app", id=cid))
    return be, ls


class TestBEvsLS:
    @pytest.mark.parametrize("version", [1, 2])
    def test_hooks_write_class_specific_files(self, tmp_path: pathlib.Path, version: int) -> None:
        """BE gets bvt −1, the suppress quota and the BE resctrl group; LS gets bvt 2 and the LS group."""
        node = _node(tmp_path, cgroup_version=version)
        app = _app(node, FixedMeter(Measurement(total_cores=8, node_used=3.0, ls_used=2.5)))
        app.set_policy(NodePolicy.from_text(POLICY))
        app.tick(app.tickers[0])
        _run_pods(app)
        # group identity
        assert "-1" == node.read(BE_POD, CgroupFile.CPU_BVT)
        assert "2" == node.read(LS_POD, CgroupFile.CPU_BVT)
        # suppress: 8 × 50% − 2.5 LS − 0.5 system = 1 core = 100000 µs
        expected_quota = "100000" if version == 1 else "100000 100000"
        assert expected_quota == node.read(BE_POD, CgroupFile.CFS_QUOTA)
        assert node.read(LS_POD, CgroupFile.CFS_QUOTA) in ("-1", "max 100000")
        # resctrl: BE = first 25% of 12 ways, MB 30; tasks moved
        assert "L3:0=7\nMB:0=30" == node.read_resctrl("BE/schemata")
        assert "L3:0=fff\nMB:0=100" == node.read_resctrl("LS/schemata")
        assert "101\n102" == node.read_resctrl("BE/tasks")
        assert "201" == node.read_resctrl("LS/tasks")

    @pytest.mark.parametrize("version", [1, 2])
    def test_group_identity_fallback_cpu_idle(self, tmp_path: pathlib.Path, version: int) -> None:
        """Without cpu.bvt_warp_ns: BE → cpu.idle 1, LS → cpu.idle 0."""
        node = _node(tmp_path, bvt=False, cgroup_version=version)
        app = _app(node, FixedMeter(None))
        app.set_policy(NodePolicy.from_text(POLICY))
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("be", qos="BE", cgroup_parent=BE_POD))
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("ls", cgroup_parent=LS_POD))
        assert ("1", "0") == (node.read(BE_POD, CgroupFile.CPU_IDLE), node.read(LS_POD, CgroupFile.CPU_IDLE))
        assert node.read(BE_POD, CgroupFile.CPU_BVT) is None

    @pytest.mark.parametrize("version", [1, 2])
    @pytest.mark.parametrize("bvt", [True, False])
    def test_group_identity_switched_off_resets_to_0(
        self, tmp_path: pathlib.Path, version: int, bvt: bool
    ) -> None:
        """A class's cpuQOS removed from the policy (or enable: false): its running pods go back to
        group identity 0 (cpu.idle 0 in the fallback), as koordlet resets them when cpuQOS is
        disabled, instead of staying at -1 / SCHED_IDLE for good. New pods are left alone."""
        node = _node(tmp_path, bvt=bvt, cgroup_version=version)
        app = _app(node, FixedMeter(None))
        app.set_policy(NodePolicy.from_text(POLICY))
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("be", qos="BE", cgroup_parent=BE_POD))
        file = CgroupFile.CPU_BVT if bvt else CgroupFile.CPU_IDLE
        assert ("-1" if bvt else "1") == node.read(BE_POD, file)
        app.set_policy(
            NodePolicy.from_text(POLICY.replace("cpuQOS: {groupIdentity: -1}", "cpuQOS: {enable: false}"))
        )
        assert "0" == node.read(BE_POD, file)
        other = "/kubepods/besteffort/poduid-be2"
        node.add_cgroup(other)
        node.write(other, file, "-1" if bvt else "1")
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("be2", qos="BE", cgroup_parent=other))
        assert ("-1" if bvt else "1") == node.read(other, file)

    @pytest.mark.parametrize("version", [1, 2])
    def test_group_identity_fallback_shares(self, tmp_path: pathlib.Path, version: int) -> None:
        """Without cpu.bvt_warp_ns and cpu.idle: BE → minimal cpu.shares (v2: cpu.weight 1); LS untouched."""
        node = _node(tmp_path, cgroup_version=version, bvt=False, idle=False)
        app = _app(node, FixedMeter(None))
        app.set_policy(NodePolicy.from_text(POLICY))
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("be", qos="BE", cgroup_parent=BE_POD))
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("ls", cgroup_parent=LS_POD))
        assert (("2", "1024") if version == 1 else ("1", "100")) == (
            node.read(BE_POD, CgroupFile.CPU_SHARES),
            node.read(LS_POD, CgroupFile.CPU_SHARES),
        )

    @pytest.mark.parametrize("version", [1, 2])
    def test_policy_change_reapplies_to_existing_pods(self, tmp_path: pathlib.Path, version: int) -> None:
        """A new policy re-applies group identity, resctrl and quota to the pods already running."""
        node = _node(tmp_path, cgroup_version=version)
        app = _app(node, FixedMeter(Measurement(8, 3.0, 2.5)))
        app.set_policy(NodePolicy.from_text(POLICY))
        app.tick(app.tickers[0])
        _run_pods(app)
        changed = app.set_policy(
            NodePolicy.from_text(
                POLICY.replace("groupIdentity: 2", "groupIdentity: 1")
                .replace("catRangeEndPercent: 25", "catRangeEndPercent: 50")
                .replace("cpuSuppressThresholdPercent: 50", "cpuSuppressThresholdPercent: 75")
            )
        )
        assert ("cpusuppress", "groupidentity", "resctrl") == changed
        assert "1" == node.read(LS_POD, CgroupFile.CPU_BVT)
        assert "L3:0=3f" in (node.read_resctrl("BE/schemata") or "")
        # 8 × 75% − 2.5 − 0.5 = 3 cores
        assert _quota(version, 300000) == node.read(BE_POD, CgroupFile.CFS_QUOTA)

    @pytest.mark.parametrize("version", [1, 2])
    def test_measured_usage_change_reapplies(self, tmp_path: pathlib.Path, version: int) -> None:
        """When LS usage rises, the BE quota shrinks at the next tick, down to the floor."""
        node = _node(tmp_path, cgroup_version=version)
        meter = FixedMeter(Measurement(8, 1.0, 1.0))
        app = _app(node, meter)
        app.set_policy(NodePolicy.from_text(POLICY))
        _run_pods(app)
        app.tick(app.tickers[0])
        assert _quota(version, 300000) == node.read(BE_POD, CgroupFile.CFS_QUOTA)
        meter.m = Measurement(8, 7.5, 7.0)
        app.tick(app.tickers[0])
        assert _quota(version, 10000) == node.read(BE_POD, CgroupFile.CFS_QUOTA)

    def test_stopped_pods_are_forgotten(self, tmp_path: pathlib.Path) -> None:
        """PostStop hooks remove pods and containers from the re-apply targets."""
        node = _node(tmp_path)
        app = _app(node, FixedMeter(None))
        be, ls = _run_pods(app)
        app.handle_container(Stage.POST_STOP_CONTAINER, container_request(be, "app", id="c-be"))
        app.handle_pod(Stage.POST_STOP_POD_SANDBOX, ls)
        targets = app.pods.targets()
        assert [("be", ())] == [(t.pod.meta.name, t.containers) for t in targets]


class TestSuppressMath:
    def test_budget_counts_system_usage(self) -> None:
        """budget = total × threshold − LS − max(node − LS − BE, 0)."""
        assert 8 * 0.65 - 2 - 1 == pytest.approx(be_budget(Measurement(8, 4.0, 2.0, 1.0), 65))
        assert 8 * 0.65 - 2 == pytest.approx(be_budget(Measurement(8, 1.0, 2.0, 1.0), 65))

    def test_quota_floor_and_cpuset(self) -> None:
        """The quota never goes below the floor; the cpuset takes ceil(quota) top CPUs."""
        assert 2000 == be_quota(-3.0, 2000)
        assert 150000 == be_quota(1.5, 2000)
        assert ("6-7", "7", "0-7") == (
            be_cpuset(range(8), 150000),
            be_cpuset(range(8), 2000),
            be_cpuset(range(8), 10**7),
        )

    @pytest.mark.parametrize("version", [1, 2])
    def test_cpuset_policy(self, tmp_path: pathlib.Path, version: int) -> None:
        """With cpuSuppressPolicy cpuset, BE containers get the top CPUs and the pod quota is unset."""
        node = _node(tmp_path, cgroup_version=version)
        app = _app(node, FixedMeter(Measurement(8, 2.0, 2.0)))
        app.set_policy(NodePolicy.from_text(POLICY.replace("cfsQuota", "cpuset")))
        app.tick(app.tickers[0])
        be, _ = _run_pods(app)
        resp = app.handle_container(Stage.PRE_CREATE_CONTAINER, container_request(be, "app"))
        assert "6-7" == resp.container_resources.cpuset_cpus  # type: ignore[union-attr]
        app.reconcile()
        assert "6-7" == node.read(f"{BE_POD}/c-be", CgroupFile.CPUSET_CPUS)
        assert "" == node.read(f"{LS_POD}/c-ls", CgroupFile.CPUSET_CPUS)
        assert _quota(version, -1) == node.read(BE_POD, CgroupFile.CFS_QUOTA)

    @pytest.mark.parametrize("version", [1, 2])
    def test_procfs_meter(self, tmp_path: pathlib.Path, version: int) -> None:
        """The meter turns /proc/stat and cgroup usage deltas into cores; the first call primes."""
        node = _node(tmp_path, cgroup_version=version)
        stat = tmp_path / "stat"
        now = [0.0]
        meter = ProcfsMeter(node.executor(), str(stat), clock=lambda: now[0])
        be = pod_request("be", qos="BE", cgroup_parent=BE_POD)
        ls = pod_request("ls", cgroup_parent=LS_POD)
        targets = [PodTarget(PodInfo.from_proto(be)), PodTarget(PodInfo.from_proto(ls))]

        def feed(total: int, idle: int, be_s: float, ls_s: float) -> None:
            cpus = "".join(f"cpu{i} 0 0 0 0 0 0 0 0 0 0\n" for i in range(4))
            stat.write_text(f"cpu  {total - idle} 0 0 {idle} 0 0 0 0 0 0\n{cpus}")
            for pod, secs in ((BE_POD, be_s), (LS_POD, ls_s)):
                ns = int(secs * 1e9)
                node.write(pod, CgroupFile.CPU_USAGE, str(ns) if version == 1 else f"usage_usec {ns // 1000}")

        feed(1000, 1000, 0, 0)
        assert meter(targets) is None
        now[0] = 2.0
        feed(1800, 1400, 1.0, 3.0)  # 2 s: node 50% of 4 cores, BE 0.5 cores, LS 1.5 cores
        m = meter(targets)
        assert m is not None
        assert (4, 2.0, 1.5, 0.5) == (m.total_cores, pytest.approx(m.node_used), m.ls_used, m.be_used)


class TestSmallPolicies:
    @pytest.mark.parametrize("version", [1, 2])
    def test_cpuset_from_annotation(self, tmp_path: pathlib.Path, version: int) -> None:
        """resource-status {"cpuset"} → container cpuset and unlimited quota, in the answer and (reconcile)
        in the container's files; bad JSON is ignored."""
        node = _node(tmp_path, cgroup_version=version)
        node.write(f"{LS_POD}/c-ls", CgroupFile.CFS_QUOTA, _quota(version, 50000))
        app = HookServer(executor=node.executor())
        cpuset.install(app)
        pod = pod_request("p", annotations={cpuset.ANNOTATION: json.dumps({"cpuset": "0-3"})})
        for stage in (Stage.PRE_CREATE_CONTAINER, Stage.PRE_UPDATE_CONTAINER_RESOURCES):
            resp = app.handle_container(stage, container_request(pod, "c"))
            assert ("0-3", -1) == (resp.container_resources.cpuset_cpus, resp.container_resources.cpu_quota)  # type: ignore[union-attr]
        bad = pod_request("p", annotations={cpuset.ANNOTATION: "{nope"})
        resp = app.handle_container(Stage.PRE_CREATE_CONTAINER, container_request(bad, "c"))
        assert "" == resp.container_resources.cpuset_cpus  # type: ignore[union-attr]
        pinned = pod_request(
            "ls", cgroup_parent=LS_POD, annotations={cpuset.ANNOTATION: json.dumps({"cpuset": "2-3"})}
        )
        app.handle_container(Stage.POST_START_CONTAINER, container_request(pinned, "app", id="c-ls"))
        app.reconcile()
        assert ("2-3", _quota(version, -1)) == (
            node.read(f"{LS_POD}/c-ls", CgroupFile.CPUSET_CPUS),
            node.read(f"{LS_POD}/c-ls", CgroupFile.CFS_QUOTA),
        )

    def test_env_from_annotation(self, tmp_path: pathlib.Path) -> None:
        """The env annotation's variables are added to the container's own."""
        app = HookServer(executor=_node(tmp_path).executor())
        envinject.install(app)
        pod = pod_request("p", annotations={envinject.ANNOTATION: '{"OMP_NUM_THREADS": "4"}'})
        resp = app.handle_container(Stage.PRE_CREATE_CONTAINER, container_request(pod, "c", envs={"A": "1"}))
        assert {"A": "1", "OMP_NUM_THREADS": "4"} == resp.container_envs
        bad = pod_request("p", annotations={envinject.ANNOTATION: '{"N": 4}'})
        resp = app.handle_container(Stage.PRE_CREATE_CONTAINER, container_request(bad, "c", envs={"A": "1"}))
        assert {"A": "1"} == resp.container_envs

    def test_cat_mask(self) -> None:
        """Contiguous masks over the way range; at least one way."""
        assert ("fff", "7", "ff8", "1") == (
            resctrl.cat_mask("fff", 0, 100),
            resctrl.cat_mask("fff", 0, 25),
            resctrl.cat_mask("fff", 25, 100),
            resctrl.cat_mask("fff", 0, 1),
        )

    def test_resctrl_switched_off_gives_the_cache_back(self, tmp_path: pathlib.Path) -> None:
        """A class's resctrlQOS dropped by a policy change: its group (where its running containers
        still are) gets the whole cache and bandwidth at the re-apply, instead of keeping BE on a
        quarter of the LLC for good."""
        node = _node(tmp_path)
        app = _app(node, FixedMeter(None))
        app.set_policy(NodePolicy.from_text(POLICY))
        _run_pods(app)
        assert "L3:0=7\nMB:0=30" == node.read_resctrl("BE/schemata")
        be_line = "\n    resctrlQOS: {catRangeStartPercent: 0, catRangeEndPercent: 25, mbaPercent: 30}"
        assert be_line in POLICY
        app.set_policy(NodePolicy.from_text(POLICY.replace(be_line, "")))
        assert "L3:0=fff\nMB:0=100" == node.read_resctrl("BE/schemata")
        assert "101\n102" == node.read_resctrl("BE/tasks")

    @pytest.mark.parametrize(("start", "end"), [(95, 100), (99, 100), (92, 93), (0, 100), (50, 51)])
    def test_cat_mask_stays_inside_the_cache(self, start: int, end: int) -> None:
        """A range at the top of the cache (catRangeStartPercent 95 of 12 ways) still gives a mask
        within cbm_mask — the kernel refuses a bit beyond it — with at least one way."""
        mask = int(resctrl.cat_mask("fff", start, end), 16)
        assert mask and mask & 0xFFF == mask

    @pytest.mark.parametrize("version", [1, 2])
    def test_resctrl_absent_does_nothing(self, tmp_path: pathlib.Path, version: int) -> None:
        """Without resctrl the rule is not supported and no group is made."""
        node = _node(tmp_path, resctrl=False, cgroup_version=version)
        app = HookServer(executor=node.executor())
        plugin = resctrl.install(app)
        app.set_policy(NodePolicy.from_text(POLICY))
        assert {} == plugin.groups
        assert not (node.resctrl_root / "BE").exists()

    @pytest.mark.parametrize("version", [1, 2])
    def test_groupidentity_skips_system_pods(self, tmp_path: pathlib.Path, version: int) -> None:
        """SYSTEM pods are not touched."""
        node = _node(tmp_path, cgroup_version=version)
        app = HookServer(executor=node.executor())
        groupidentity.install(app)
        app.set_policy(NodePolicy.from_text(POLICY))
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("s", qos="SYSTEM", cgroup_parent=BE_POD))
        assert "0" == node.read(BE_POD, CgroupFile.CPU_BVT)

    @pytest.mark.parametrize("version", [1, 2])
    def test_suppress_disabled_by_default(self, tmp_path: pathlib.Path, version: int) -> None:
        """Without a resourceUsedThresholdWithBE section nothing is suppressed."""
        node = _node(tmp_path, cgroup_version=version)
        app = HookServer(executor=node.executor())
        cpusuppress.install(app, FixedMeter(Measurement(8, 8.0, 8.0)))
        app.set_policy(NodePolicy())
        app.tick(app.tickers[0])
        _run_pods(app)
        assert _quota(version, -1) == node.read(BE_POD, CgroupFile.CFS_QUOTA)
