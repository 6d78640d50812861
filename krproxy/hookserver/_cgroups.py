"""Names of the cgroup files the policies touch, for cgroup v1 and v2, and where pods live.

Pure: nothing here reads or writes a file. The executor uses these tables to turn
"set cpu shares of this pod to 2" into a path and a value for the node's cgroup version.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable

import attrs

from krproxy.hooks.slices import is_slice_name, slice_path

#: The CFS period kubelet and runc use when none is given (µs), and the kernel's for a new cgroup;
#: the SDK assumes it only where a cgroup shows no period (no ``cpu.cfs_period_us``/``cpu.max``).
DEFAULT_CFS_PERIOD = 100_000
#: The least CFS quota (and period) the kernel accepts (µs): 1 ms.
MIN_CFS_QUOTA = 1000


@attrs.frozen
class _Names:
    v1_controller: str
    v1_file: str
    v2_file: str


class CgroupFile(enum.Enum):
    """A cgroup setting by meaning; :meth:`path` gives the file for a cgroup version."""

    CPU_SHARES = _Names("cpu", "cpu.shares", "cpu.weight")
    CFS_QUOTA = _Names("cpu", "cpu.cfs_quota_us", "cpu.max")
    # v2 has quota and period in one file, "QUOTA PERIOD" ("max PERIOD" when unlimited).
    CFS_PERIOD = _Names("cpu", "cpu.cfs_period_us", "cpu.max")
    CPUSET_CPUS = _Names("cpuset", "cpuset.cpus", "cpuset.cpus")
    # The CPUs a cgroup can use in fact (at the root: every online CPU).
    CPUSET_EFFECTIVE = _Names("cpuset", "cpuset.effective_cpus", "cpuset.cpus.effective")
    MEMORY_LIMIT = _Names("memory", "memory.limit_in_bytes", "memory.max")
    # Anolis/Alibaba Cloud Linux "group identity"; absent on mainline kernels.
    CPU_BVT = _Names("cpu", "cpu.bvt_warp_ns", "cpu.bvt_warp_ns")
    # Linux ≥ 5.15 SCHED_IDLE for a whole cgroup.
    CPU_IDLE = _Names("cpu", "cpu.idle", "cpu.idle")
    CPU_USAGE = _Names("cpuacct", "cpuacct.usage", "cpu.stat")
    PROCS = _Names("cpu", "cgroup.procs", "cgroup.procs")

    def path(self, cgroup_dir: str, version: int) -> str:
        """The file of this setting for ``cgroup_dir``, relative to the cgroup root."""
        names: _Names = self.value
        rel = cgroup_dir.strip("/")
        if version == 1:
            return "/".join(p for p in (names.v1_controller, rel, names.v1_file) if p)
        return "/".join(p for p in (rel, names.v2_file) if p)


#: cgroup v1 ``cpu.shares`` range (the kernel's MIN_SHARES, MAX_SHARES) and v2 ``cpu.weight`` range.
MIN_SHARES, MAX_SHARES = 2, 262144
MIN_WEIGHT, MAX_WEIGHT = 1, 10000


def shares_to_weight(shares: int) -> int:
    """cgroup v1 ``cpu.shares`` → v2 ``cpu.weight``, as runc converts the OCI ``cpu.shares``.

    0 means "unset" and gives 0: nothing is to be written (runc writes no ``cpu.weight`` then).
    Otherwise runc's current formula (opencontainers/cgroups ``ConvertCPUSharesToCgroupV2Value``,
    runc ≥ 1.3.2 and crun ≥ 1.23; kubelet's tests expect it): ``ceil(10^((l² + 125·l)/612 − 7/34))``
    with ``l = log2(shares)``, a curve through the ends of both ranges and the defaults
    (2 → 1, 1024 → 100, 262144 → 10000); at most 2 gives 1, at least 262144 gives 10000.
    Older runc (≤ 1.3.1) used the straight line ``1 + (shares − 2)·9999 // 262142`` (1024 → 39).

    Raises:
        ValueError: ``shares`` is negative (no cgroup value; runc's is unsigned).
    """
    if shares < 0:
        raise ValueError(f"cpu shares {shares} is negative: give 0 (unset) or {MIN_SHARES}..{MAX_SHARES}")
    if shares == 0:
        return 0
    if shares <= MIN_SHARES:
        return MIN_WEIGHT
    if shares >= MAX_SHARES:
        return MAX_WEIGHT
    exp = math.log2(shares)
    return math.ceil(10 ** ((exp * exp + 125 * exp) / 612 - 7 / 34))


def format_value(file: CgroupFile, value: int | str, version: int, current: str | None) -> str | None:
    """The text to write into ``file`` for ``value``; ``current`` is the file's content (for cpu.max).

    None when there is nothing to write: ``cpu.shares`` 0 is "unset" (as for runc, on v1 and v2 alike:
    the kernel would take a 0 as its minimum, 2).

    Raises:
        ValueError: a value no cgroup file can hold (negative cpu shares).
    """
    if file is CgroupFile.CPU_SHARES and isinstance(value, int):
        weight = shares_to_weight(value)  # the checks, on v1 too
        if weight == 0:
            return None
        return str(value if version == 1 else weight)
    if version == 1 or isinstance(value, str):
        return str(value)
    if file is CgroupFile.CFS_QUOTA:
        parts = (current or "").split()
        period = parts[1] if len(parts) == 2 else str(DEFAULT_CFS_PERIOD)
        return f"{'max' if value < 0 else value} {period}"
    if file is CgroupFile.MEMORY_LIMIT:
        return "max" if value <= 0 else str(value)
    return str(value)


def parse_cpus(text: str) -> frozenset[int]:
    """A cpuset list (``0-3,8``) as CPU numbers; a malformed part is ignored."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            cpus.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            continue
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """CPU numbers as a cpuset list, ranges folded: ``{0, 1, 2, 5}`` → ``0-2,5``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_cfs_period(text: str | None, version: int) -> int | None:
    """The CFS period (µs) in a ``cpu.cfs_period_us`` (v1) or ``cpu.max`` (v2) text; None if absent
    or unreadable."""
    fields = (text or "").split()
    field = fields[0] if version == 1 and len(fields) == 1 else fields[1] if len(fields) == 2 else ""
    try:
        period = int(field)
    except ValueError:
        return None
    return period if period > 0 else None


def scale_quota(quota: int, period: int, from_period: int = DEFAULT_CFS_PERIOD) -> int:
    """``quota`` µs per ``from_period`` as µs per ``period``: the same share of a CPU, rounded down
    (as kubelet's ``MilliCPUToQuota``: never above the share, so a child scaled from its parent's
    quota is accepted under it); unlimited (negative) stays -1, and a limit never goes below the
    kernel's minimum, :data:`MIN_CFS_QUOTA`."""
    if quota < 0:
        return -1
    if period == from_period:
        return quota
    return max(quota * period // from_period, MIN_CFS_QUOTA)


def pod_cgroup_dir(cgroup_parent: str) -> str:
    """The pod's cgroup directory (relative to a hierarchy root) from its cgroup parent."""
    if is_slice_name(cgroup_parent):
        return slice_path(cgroup_parent).lstrip("/")
    return cgroup_parent.strip("/")


#: How runtimes name a container's cgroup under its pod's with the systemd cgroup driver (a scope
#: ``<prefix>-<id>.scope`` in the pod's slice): containerd's CRI, CRI-O, Docker (and cri-dockerd).
SCOPE_PREFIXES = ("cri-containerd", "crio", "docker")
#: ... and with the cgroupfs driver (a directory ``<prefix><id>`` in the pod's): containerd and
#: Docker use the bare id, CRI-O ``crio-<id>``.
CGROUPFS_PREFIXES = ("", "crio-")


def container_cgroup_candidates(cgroup_parent: str, container_id: str) -> tuple[str, ...]:
    """Where runtimes put a container's cgroup (relative to a hierarchy root), the likeliest first:
    for a systemd pod slice the scopes (``cri-containerd-<id>.scope``, ``crio-<id>.scope``,
    ``docker-<id>.scope``) before the cgroupfs forms (``<id>``, ``crio-<id>``); for a cgroupfs pod
    directory the other way round."""
    scopes = tuple(f"{prefix}-{container_id}.scope" for prefix in SCOPE_PREFIXES)
    dirs = tuple(f"{prefix}{container_id}" for prefix in CGROUPFS_PREFIXES)
    systemd = is_slice_name(cgroup_parent) or cgroup_parent.rstrip("/").endswith(".slice")
    pod = pod_cgroup_dir(cgroup_parent)
    return tuple(
        "/".join(part for part in (pod, leaf) if part)
        for leaf in (scopes + dirs if systemd else dirs + scopes)
    )


def container_cgroup_dir(cgroup_parent: str, container_id: str) -> str:
    """The likeliest of :func:`container_cgroup_candidates` (containerd's naming), without looking at
    the node; the SDK itself looks for the one that exists (``find_container_cgroup``)."""
    return container_cgroup_candidates(cgroup_parent, container_id)[0]


def cgroups_path_dir(cgroups_path: str) -> str:
    """An OCI ``linux.cgroupsPath`` as the runtime gave it to runc, as a cgroup directory (relative
    to a hierarchy root): systemd's ``<slice>:<prefix>:<name>`` is the scope ``<prefix>-<name>.scope``
    in the slice (``<name>`` itself when it is a slice), a path is taken as it is. "" for ""."""
    parts = cgroups_path.split(":")
    if len(parts) != 3:
        return cgroups_path.strip("/")
    slice_name, prefix, name = parts
    unit = name if name.endswith(".slice") else f"{prefix}-{name}.scope" if prefix else f"{name}.scope"
    return "/".join(part for part in (pod_cgroup_dir(slice_name or "system.slice"), unit) if part)


def kubelet_pod_cgroup_candidates(uid: str) -> tuple[str, ...]:
    """Where kubelet puts a pod's cgroup, per QoS and driver (cgroupfs first, then systemd)."""
    under = uid.replace("-", "_")
    return (
        f"/kubepods/pod{uid}",
        f"/kubepods/burstable/pod{uid}",
        f"/kubepods/besteffort/pod{uid}",
        f"kubepods-pod{under}.slice",
        f"kubepods-burstable-pod{under}.slice",
        f"kubepods-besteffort-pod{under}.slice",
    )
