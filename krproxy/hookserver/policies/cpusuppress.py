"""BE CPU suppress, measured: BE pods get what LS pods and the system leave of a budget.

Every ``interval`` seconds a meter samples node CPU usage (``/proc/stat``) and each pod's
usage (``cpuacct.usage`` on cgroup v1, ``usage_usec`` of ``cpu.stat`` on v2) and turns the
deltas into cores. Like koordlet::

    system = max(node_used − ls_used − be_used, 0)
    budget = total_cores × cpuSuppressThresholdPercent / 100 − ls_used − system

(LS here means every non-BE pod.) With ``cpuSuppressPolicy: cfsQuota`` each BE pod's cgroup
gets ``cfs quota = budget × period``, never below ``cpuSuppressMinQuota``. (koordlet writes the
budget once to the ``besteffort`` QoS cgroup; we write it per BE pod because a Koordinator
BE pod need not live there — each BE pod is capped at the budget, not their sum.) With
``cpuset`` BE containers get the ``ceil(budget)`` highest-numbered CPUs and the pod quota
is unset (−1). The meter is injectable, so tests feed numbers instead of /proc.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Sequence

import attrs

from .._app import HookServer, PodTarget
from .._cgroups import DEFAULT_CFS_PERIOD, CgroupFile, pod_cgroup_dir
from .._context import ContainerContext, PodContext, QoSClass
from .._executor import Executor
from .._features import FeatureStatus, NodeProbe
from .._policy import CPUSuppress, NodePolicy
from .._registry import Level, Stage

NAME = "cpusuppress"
#: How often usage is sampled and the budget recomputed (koordlet's default is 1 s too).
INTERVAL = 1.0


@attrs.frozen
class Measurement:
    """CPU usage over the last sampling interval, in cores."""

    total_cores: int
    node_used: float
    ls_used: float
    be_used: float = 0.0


Meter = Callable[[Sequence[PodTarget]], "Measurement | None"]


def be_budget(m: Measurement, threshold_percent: int) -> float:
    """Cores BE pods may use now."""
    system = max(m.node_used - m.ls_used - m.be_used, 0.0)
    return m.total_cores * threshold_percent / 100 - m.ls_used - system


def be_quota(budget_cores: float, min_quota: int, period: int = DEFAULT_CFS_PERIOD) -> int:
    """The CFS quota (µs per ``period``) for ``budget_cores``, clamped to ``min_quota``."""
    return max(int(budget_cores * period), min_quota)


def be_cpuset(total_cores: int, quota: int, period: int = DEFAULT_CFS_PERIOD) -> str:
    """The ``ceil(quota/period)`` highest-numbered CPUs, as a cpuset list."""
    n = min(max(math.ceil(quota / period), 1), total_cores)
    first, last = total_cores - n, total_cores - 1
    return str(last) if first == last else f"{first}-{last}"


def _is_be(qos: QoSClass) -> bool:
    return qos is QoSClass.BE


@attrs.define
class ProcfsMeter:
    """Samples ``/proc/stat`` and pods' cgroup CPU usage; the first call only primes it."""

    executor: Executor
    proc_stat: str = "/proc/stat"
    clock: Callable[[], float] = time.monotonic
    _node: tuple[int, int] | None = None
    _pods: dict[str, int] = attrs.Factory(dict)
    _at: float | None = None

    def _read_node(self) -> tuple[int, int, int]:
        total = idle = cores = 0
        with open(self.proc_stat) as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] == "cpu":
                    values = [int(v) for v in fields[1:]]
                    total, idle = sum(values[:8]), values[3] + (values[4] if len(values) > 4 else 0)
                elif fields and fields[0].startswith("cpu"):
                    cores += 1
        return total, idle, cores

    def _pod_usage_ns(self, cgroup_dir: str) -> int | None:
        try:
            text = self.executor.read(cgroup_dir, CgroupFile.CPU_USAGE)
        except OSError:
            return None
        if text is None:
            return None
        if self.executor.cgroup_version == 1:
            return int(text)
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) * 1000
        return None

    def __call__(self, targets: Sequence[PodTarget]) -> Measurement | None:
        now = self.clock()
        total, idle, cores = self._read_node()
        pods = {}
        for t in targets:
            usage = self._pod_usage_ns(pod_cgroup_dir(t.pod.cgroup_parent)) if t.pod.cgroup_parent else None
            if usage is not None:
                pods[t.pod.cgroup_parent] = usage
        prev_node, prev_pods, prev_at = self._node, self._pods, self._at
        self._node, self._pods, self._at = (total, idle), pods, now
        if prev_node is None or prev_at is None or now <= prev_at or total <= prev_node[0]:
            return None
        node_used = cores * (1 - (idle - prev_node[1]) / (total - prev_node[0]))
        elapsed_ns = (now - prev_at) * 1e9
        ls = be = 0.0
        for t in targets:
            key = t.pod.cgroup_parent
            if key in pods and key in prev_pods:
                cores_used = max(pods[key] - prev_pods[key], 0) / elapsed_ns
                if _is_be(t.pod.qos_class):
                    be += cores_used
                else:
                    ls += cores_used
        return Measurement(cores, node_used, ls, be)


@attrs.define
class CpuSuppressPlugin:
    meter: Meter = attrs.field(hash=False)
    config: CPUSuppress | None = None
    quota: int | None = None
    cpuset: str | None = None
    _last: Measurement | None = None

    def parse(self, policy: NodePolicy) -> bool:
        changed = policy.cpu_suppress != self.config
        self.config = policy.cpu_suppress
        if changed and self._last is not None:
            self._recompute(self._last)
        return changed

    def _recompute(self, m: Measurement) -> bool:
        if self.config is None:
            return False
        quota = be_quota(be_budget(m, self.config.threshold_percent), self.config.min_quota)
        cpuset = be_cpuset(m.total_cores, quota)
        changed = (quota, cpuset) != (self.quota, self.cpuset)
        self.quota, self.cpuset = quota, cpuset
        return changed

    def tick(self, targets: Sequence[PodTarget]) -> bool:
        """Sample; True when the BE budget changed (so BE pods must be re-applied)."""
        m = self.meter(targets)
        if m is None:
            return False
        self._last = m
        return self._recompute(m)

    def set_pod(self, ctx: PodContext) -> None:
        if self.config is None or self.quota is None or not _is_be(ctx.request.qos_class):
            return
        ctx.response.resources.cfs_quota = self.quota if self.config.policy == "cfsQuota" else -1

    def set_container(self, ctx: ContainerContext) -> None:
        if self.config is None or self.cpuset is None or self.config.policy != "cpuset":
            return
        if _is_be(ctx.request.pod.qos_class):
            ctx.response.resources.cpuset = self.cpuset


def status(probe: NodeProbe, proc_stat: str, policy: NodePolicy | None) -> FeatureStatus:
    """Active when the policy has resourceUsedThresholdWithBE and the node has the files it needs."""
    config = policy.cpu_suppress if policy is not None else None
    if config is None:
        return FeatureStatus(NAME, False, "no resourceUsedThresholdWithBE in the policy", wanted=False)
    needed = [CgroupFile.CPU_USAGE, CgroupFile.CFS_QUOTA]
    if config.policy == "cpuset":
        needed.append(CgroupFile.CPUSET_CPUS)
    for file in needed:
        if not probe.has(file):
            return FeatureStatus(NAME, False, probe.missing(file), mode=config.policy)
    if not os.access(proc_stat, os.R_OK):
        return FeatureStatus(NAME, False, f"cannot read {proc_stat} (node CPU usage)", mode=config.policy)
    return FeatureStatus(
        NAME,
        True,
        f"BE held to {config.threshold_percent}% of the node minus LS and system use",
        mode=config.policy,
    )


def install(
    app: HookServer, meter: Meter | None = None, *, interval: float = INTERVAL, proc_stat: str = "/proc/stat"
) -> CpuSuppressPlugin:
    """Install with ``meter`` (default: :class:`ProcfsMeter` on the app's executor and ``proc_stat``)."""
    plugin = CpuSuppressPlugin(meter if meter is not None else ProcfsMeter(app.executor, proc_stat))
    description = "BE CPU suppress: cfs quota or cpuset from measured LS usage"
    app.rules.register(NAME, description, plugin.parse)
    app.registry.register(Stage.PRE_RUN_POD_SANDBOX, NAME, description, plugin.set_pod)
    app.registry.register(Stage.PRE_CREATE_CONTAINER, NAME, description, plugin.set_container)
    app.registry.register_reconciler(Level.POD, NAME, description, plugin.set_pod)
    app.registry.register_reconciler(Level.CONTAINER, NAME, description, plugin.set_container)
    app.every(interval, name=NAME)(plugin.tick)
    app.feature(NAME, functools.partial(status, app.probe, proc_stat))
    return plugin
