"""The hook server's policies on this machine's real cgroup v1 hierarchy (the kernel's own rules).

Needs root and a cgroup v1 ``cpu`` hierarchy at /sys/fs/cgroup/cpu (skipped otherwise). Each test
makes its own scratch cgroups under ``/sys/fs/cgroup/cpu/krproxy-test-<random>`` and removes them.
"""

from __future__ import annotations

import logging
import os
import pathlib
import uuid
from collections.abc import Iterator, Sequence

import pytest

from krproxy.hookserver import (
    ContainerContext,
    Executor,
    HookServer,
    Level,
    NodePolicy,
    PodInfo,
    PodTarget,
    Stage,
)
from krproxy.hookserver.policies import cpusuppress, groupidentity
from krproxy.hookserver.policies.cpusuppress import RAISE_INTERVAL, Measurement
from krproxy.hookserver.testing import container_request, logged_events, pod_request
from krproxy.proto.runtime import v1alpha1 as pb

CPU = pathlib.Path("/sys/fs/cgroup/cpu")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0
    or not (CPU / "cpu.cfs_quota_us").exists()
    or (CPU.parent / "cgroup.controllers").exists(),
    reason="needs root and a cgroup v1 cpu hierarchy at /sys/fs/cgroup/cpu",
)

POLICY = NodePolicy.from_text(
    "resourceQOSStrategy: {beClass: {cpuQOS: {groupIdentity: -1}}}\n"
    "resourceUsedThresholdWithBE: {cpuSuppressThresholdPercent: 50, cpuSuppressPolicy: cfsQuota}\n"
)


class Load:
    def __init__(self) -> None:
        self.ls_used, self.now = 2.0, 0.0

    def __call__(self, targets: Sequence[PodTarget]) -> Measurement:
        return Measurement(8, self.ls_used, self.ls_used)


@pytest.fixture
def scratch() -> Iterator[str]:
    """A scratch cgroup parent in the real cpu hierarchy, removed (children first) afterwards."""
    name = f"krproxy-test-{uuid.uuid4().hex[:8]}"
    (CPU / name).mkdir()
    try:
        yield name
    finally:
        for directory in sorted((CPU / name).rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if directory.is_dir():
                directory.rmdir()
        (CPU / name).rmdir()


def _app(load: Load) -> tuple[HookServer, cpusuppress.CpuSuppressPlugin]:
    app = HookServer(executor=Executor.for_roots("/sys/fs/cgroup", "/nonexistent-resctrl"))
    assert 1 == app.executor.cgroup_version
    groupidentity.install(app)
    plugin = cpusuppress.install(app, load)
    plugin.clock = lambda: load.now
    app.set_policy(POLICY)
    return app, plugin


def _quota(path: pathlib.Path) -> str:
    return (path / "cpu.cfs_quota_us").read_text().strip()


def test_v1_kernel_accepts_the_write_order(scratch: str, caplog: pytest.LogCaptureFixture) -> None:
    """A BE pod whose container kubelet gave 4 CPUs, under a 2-CPU budget: the kernel takes every
    write — the capped create answer, the pod raised before the container, the container lowered
    before the pod — and BE gets cpu.idle (no bvt on this kernel) when the kernel has it."""
    load = Load()
    app, _ = _app(load)
    app.tick(app.tickers[0])  # 8 × 50 % − 2 = 2 CPUs
    pod_dir = CPU / scratch / "podbe"
    pod_dir.mkdir()
    be = pod_request("be", qos="BE", cgroup_parent=f"/{scratch}/podbe")
    with caplog.at_level(logging.INFO):
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, be)
        assert "200000" == _quota(pod_dir)
        if (pod_dir / "cpu.idle").exists():
            assert "1" == (pod_dir / "cpu.idle").read_text().strip()
        kubelet = pb.LinuxContainerResources(cpu_period=100000, cpu_quota=400000)
        answer = app.handle_container(
            Stage.PRE_CREATE_CONTAINER, container_request(be, "app", resources=kubelet)
        )
        capped = answer.container_resources
        assert capped is not None and 200000 == capped.cpu_quota
        (pod_dir / "c1").mkdir()  # the runtime creates the container with the answer
        (pod_dir / "c1" / "cpu.cfs_quota_us").write_text(str(capped.cpu_quota))
        app.handle_container(
            Stage.PRE_START_CONTAINER, container_request(be, "app", id="c1", resources=capped)
        )
        load.now, load.ls_used = RAISE_INTERVAL, 0.0  # 4 CPUs: pod first, then the container
        app.tick(app.tickers[0])
        assert ("400000", "400000") == (_quota(pod_dir), _quota(pod_dir / "c1"))
        load.now, load.ls_used = 2 * RAISE_INTERVAL, 3.0  # 1 CPU: container first, then the pod
        app.tick(app.tickers[0])
        assert ("100000", "100000") == (_quota(pod_dir), _quota(pod_dir / "c1"))
    assert [] == logged_events(caplog.records, "reconcile_failed")


def test_refused_write_names_pod_file_and_value(scratch: str, caplog: pytest.LogCaptureFixture) -> None:
    """A child cgroup the hook server does not know holds 4 CPUs: the kernel refuses the pod's 2,
    and the log says which pod, which file, which value and why."""
    load = Load()
    app, _ = _app(load)
    pod_dir = CPU / scratch / "podbe"
    (pod_dir / "other").mkdir(parents=True)
    (pod_dir / "other" / "cpu.cfs_quota_us").write_text("400000")
    app.pods.add_pod(PodInfo.from_proto(pod_request("be", qos="BE", cgroup_parent=f"/{scratch}/podbe")))
    with caplog.at_level(logging.ERROR):
        app.tick(app.tickers[0])
    [failed] = logged_events(caplog.records, "reconcile_failed")
    assert "default/be" == failed["pod"]
    assert f"{pod_dir}/cpu.cfs_quota_us" in failed["error"] and "'200000'" in failed["error"]
    assert "Invalid argument" in failed["error"]
    assert "-1" == _quota(pod_dir)


def test_v1_kernel_accepts_unlimited_container_as_pod_rises(
    scratch: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A container without a quota (-1) that a plugin limits to 1.5 CPUs while the pod rises from
    1 CPU to 4: the kernel refuses the 1.5 under the pod's old 1, so it is written after the pod."""
    load = Load()
    load.ls_used = 3.0  # 8 × 50 % − 3 = 1 CPU
    app, _ = _app(load)

    @app.reconciler(Level.CONTAINER)
    def cap(ctx: ContainerContext) -> None:
        if ctx.request.id:
            ctx.response.resources.cfs_quota = 150000

    pod_dir = CPU / scratch / "podbe"
    (pod_dir / "c1").mkdir(parents=True)
    be = pod_request("be", qos="BE", cgroup_parent=f"/{scratch}/podbe")
    app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, be)
    app.handle_container(Stage.PRE_START_CONTAINER, container_request(be, "app", id="c1"))
    app.tick(app.tickers[0])
    assert ("100000", "100000") == (_quota(pod_dir), _quota(pod_dir / "c1"))
    (pod_dir / "c1" / "cpu.cfs_quota_us").write_text("-1")
    load.now, load.ls_used = RAISE_INTERVAL, 0.0  # 4 CPUs
    with caplog.at_level(logging.ERROR):
        app.tick(app.tickers[0])
    assert [] == logged_events(caplog.records, "reconcile_failed")
    assert ("400000", "150000") == (_quota(pod_dir), _quota(pod_dir / "c1"))
