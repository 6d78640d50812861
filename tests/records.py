"""Hook records and runtime-side values that tests of several tiers build alike (this module holds no tests).

A test that needs "a pod" or "resources with every field set" starts from these and states what it
changes with :func:`attrs.evolve`, so that what matters to the test is what it writes.
"""

from __future__ import annotations

from krproxy.calls import CallRecord
from krproxy.grpcstatus import Status
from krproxy.hooks.model import PodInfo, Resources

#: Container resources with every field set, as kubelet sends for a Guaranteed container with a cpuset,
#: hugepages and a cgroup v2 setting.
FULL_RESOURCES = Resources(
    cpu_period=100_000,
    cpu_quota=-1,
    cpu_shares=1024,
    memory_limit_in_bytes=1 << 30,
    oom_score_adj=-997,
    cpuset_cpus="0-3",
    cpuset_mems="0",
    hugepage_limits=(("2MB", 1 << 21),),
    unified={"memory.high": "max"},
    memory_swap_limit_in_bytes=2 << 30,
)

#: A pod as the store keeps it after RunPodSandbox (no resources: kubelet sends them only on a resize).
WEB_POD = PodInfo(
    name="web",
    uid="u1",
    namespace="default",
    attempt=1,
    runtime_handler="runc",
    labels={"app": "web"},
    annotations={"a": "1"},
    cgroup_parent="/kubepods/podu1",
)

#: What kubelet asks for a pod resized to 1.5 CPUs (CRI's LinuxContainerResources field names); the memory
#: limit is each test's own.
RESIZED_CPU = {"cpu_period": 100_000, "cpu_quota": 150_000, "cpu_shares": 1536}

#: The resource fields of a Docker HostConfig as dockershim writes them for a container.
DOCKER_HOST_RESOURCES = {
    "CpuPeriod": 100_000,
    "CpuQuota": 200_000,
    "CpuShares": 2048,
    "Memory": 1 << 30,
    "OomScoreAdj": 900,
    "CpusetCpus": "0-3",
    "CpusetMems": "0",
}


def call_record(
    path: str, status: Status = Status.OK, seconds: float = 0.001, backend: float = 0.0005
) -> CallRecord:
    """A finished call's record of ``path`` with no hooks and no bytes: what metrics observe."""
    return CallRecord(
        path=path,
        started=0.0,
        seconds=seconds,
        backend_seconds=backend,
        request=b"",
        forwarded=None,
        reply=None,
        replies=0,
        status=status,
        message=None,
        hooks=(),
    )
