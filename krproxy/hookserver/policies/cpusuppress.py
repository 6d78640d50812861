"""BE CPU suppress, measured: BE pods get what LS pods and the system leave of a budget.

Every ``interval`` seconds a meter samples node CPU usage (``/proc/stat``) and each pod's
usage (``cpuacct.usage`` on cgroup v1, ``usage_usec`` of ``cpu.stat`` on v2) and turns the
deltas into cores. Like koordlet::

    system = max(node_used − ls_used − be_used, 0)
    budget = total_cores × cpuSuppressThresholdPercent / 100 − ls_used − system

(LS here means every non-BE pod.) With ``cpuSuppressPolicy: cfsQuota`` each BE pod's cgroup
gets ``cfs quota = budget × period``, never below ``cpuSuppressMinQuota`` (µs per 100 ms), where
the period is the pod cgroup's own (``cpu.cfs_period_us``, or the second field of v2 ``cpu.max``;
100 ms only when it shows none): the budget held is in µs per 100 ms, scaled to each cgroup's
period when written. (koordlet writes the
budget once to the ``besteffort`` QoS cgroup; we write it per BE pod because a Koordinator
BE pod need not live there — each BE pod is capped at the budget, not their sum.) With
``cpuset`` BE containers get the ``ceil(budget)`` highest-numbered online CPUs (the cgroup root's
effective cpuset, else ``/sys/devices/system/cpu/online``: an offline CPU is never named) and
the pod quota is unset (−1). The meter is injectable, so tests feed numbers instead of /proc.

A control loop, not a follower: a new budget is taken only when it differs from the one in
force by more than :data:`HYSTERESIS` (and at least :data:`MIN_STEP`), so a load that wanders
around the budget causes no writes; a cut (less CPU for BE: LS needs it) is taken at once, a raise
at most once per :data:`RAISE_INTERVAL`. In cpuset mode BE containers never get a CPU that an
LS pod is pinned to (the cpuset of a non-BE pod's ``scheduling.koordinator.sh/resource-status``);
when every CPU is pinned, BE keeps the cpuset it has (logged when that starts). In cfsQuota mode
BE's cpuset is not touched. A policy change is taken at once. Switched off (or from one mode to the
other), suppress gives back what it held BE to, once: the pod quota unlimited, a v1 container its
own quota, the cpuset every CPU no LS pod is pinned to.
The clock is injectable, like the meter.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence

import attrs

from krproxy import log

from .._app import HookServer, PodTarget
from .._cgroups import (
    DEFAULT_CFS_PERIOD,
    CgroupFile,
    format_cpus,
    parse_cpus,
    pod_cgroup_dir,
    scale_quota,
)
from .._context import ContainerContext, PodContext, PodInfo, QoSClass
from .._executor import SYSFS_CPU_ONLINE, Executor, online_cpus
from .._features import FeatureStatus, NodeProbe
from .._policy import CPUSuppress, NodePolicy
from .._registry import Level, Stage
from .cpuset import cpuset_from_annotations

NAME = "cpusuppress"
LOGGER = logging.getLogger("krproxy.hookserver.cpusuppress")
#: How often usage is sampled and the budget recomputed (koordlet's default is 1 s too).
INTERVAL = 1.0
#: A new quota is taken only when it differs from the one in force by more than this share of it:
#: usage measured over one second wanders by a few percent without any real change.
HYSTERESIS = 0.05
#: ... and by more than this (µs per 100 ms period, 0.05 CPU), so small quotas do not chatter.
MIN_STEP = 5000
#: Seconds between raises (more CPU for BE); cuts are taken at once, since LS pods need the CPU.
RAISE_INTERVAL = 60.0


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


def be_cpuset(
    cpus: Iterable[int], quota: int, period: int = DEFAULT_CFS_PERIOD, pinned: frozenset[int] = frozenset()
) -> str | None:
    """The ``ceil(quota/period)`` highest-numbered of the node's online ``cpus`` not in ``pinned``,
    as a cpuset list (fewer when not enough are free; ``None`` when none is)."""
    free = sorted(set(cpus) - pinned, reverse=True)
    n = min(max(math.ceil(quota / period), 1), len(free))
    return format_cpus(free[:n]) if n else None


def ls_pinned_cpus(targets: Sequence[PodTarget]) -> frozenset[int]:
    """CPUs that non-BE pods are pinned to by the scheduler (their resource-status cpuset)."""
    pinned: set[int] = set()
    for t in targets:
        if not _is_be(t.pod.qos_class):
            cpus = cpuset_from_annotations(t.pod.annotations)
            if cpus:
                pinned |= parse_cpus(cpus)
    return frozenset(pinned)


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


def _default_period(cgroup_dir: str) -> int:
    return DEFAULT_CFS_PERIOD


def _no_cpus() -> frozenset[int]:
    return frozenset()


@attrs.define
class CpuSuppressPlugin:
    """The BE budget in force (``quota``, ``cpuset``) and how it follows measurements.

    Attributes:
        quota: the budget as a CFS quota in µs per :data:`DEFAULT_CFS_PERIOD` (100 ms); written
            scaled to each cgroup's own period.
        clock: seconds, monotonic; injectable so tests drive time.
        cfs_period: the CFS period of a cgroup directory (the executor's :meth:`Executor.cfs_period`).
        node_cpus: the node's online CPUs by number (:func:`online_cpus`), read when cpuset mode
            places BE (so a CPU taken offline is left out from the next tick on).
    """

    meter: Meter = attrs.field(hash=False)
    config: CPUSuppress | None = None
    quota: int | None = None
    cpuset: str | None = None
    clock: Callable[[], float] = attrs.field(default=time.monotonic, hash=False)
    cgroup_version: int = 2
    cfs_period: Callable[[str], int] = attrs.field(default=_default_period, hash=False)
    node_cpus: Callable[[], frozenset[int]] = attrs.field(default=_no_cpus, hash=False)
    _last: Measurement | None = None
    _pinned: frozenset[int] = frozenset()
    #: Each BE container's own CFS quota and period as kubelet set them, by (pod uid, container name).
    _own: dict[tuple[str, str], tuple[int, int]] = attrs.Factory(dict)
    _changed_at: float | None = None
    #: Every CPU is pinned by LS pods (cpuset mode): logged once when it starts.
    _no_free_cpu: bool = False
    #: Set by :meth:`_release` for the re-apply that follows a switch-off or a mode change.
    _release_quota: bool = False
    _release_cpuset: str | None = None

    def parse(self, policy: NodePolicy) -> bool:
        changed = policy.cpu_suppress != self.config
        old, self.config = self.config, policy.cpu_suppress
        if changed and old is not None:
            self._release(old)
        if changed and self._last is not None:
            self._recompute(self._last, force=True)
        return changed

    def _release(self, old: CPUSuppress) -> None:
        """Suppress switched off, or its mode changed: what the old mode held BE to is given back
        at the re-apply that follows (as koordlet recovers BE when the strategy is disabled)."""
        new_mode = self.config.policy if self.config is not None else None
        if old.policy == "cfsQuota" and new_mode != "cfsQuota" and self.quota is not None:
            self._release_quota = True
        if old.policy == "cpuset" and new_mode != "cpuset" and self.cpuset is not None:
            cpus = self.node_cpus()
            self._release_cpuset = format_cpus(cpus - self._pinned or cpus) or None
        if self.config is None:
            self.quota = self.cpuset = None
        elif new_mode != "cpuset":
            self.cpuset = None
        if not (self._release_quota or self._release_cpuset):
            return
        log.event(
            LOGGER,
            "cpusuppress_released",
            quota=self._release_quota,
            cpuset=self._release_cpuset or "",
            now=new_mode or "off",
        )

    def _take_quota(self, target: int, *, force: bool) -> bool:
        """Whether ``target`` replaces the quota in force (hysteresis and rate limit)."""
        held, now = self.quota, self.clock()
        if held is None or force:
            return True
        if abs(target - held) <= max(held * HYSTERESIS, MIN_STEP):
            return False
        if target > held and self._changed_at is not None and now - self._changed_at < RAISE_INTERVAL:
            log.debug(LOGGER, "cpusuppress_raise_deferred", quota=held, wanted=target)
            return False
        return True

    def _recompute(self, m: Measurement, *, force: bool = False) -> bool:
        if self.config is None:
            return False
        target = be_quota(be_budget(m, self.config.threshold_percent), self.config.min_quota)
        quota = target if self._take_quota(target, force=force) else self.quota
        assert quota is not None
        cpuset = None  # cfsQuota mode leaves BE's cpuset alone, whatever LS pods pin
        if self.config.policy == "cpuset":
            cpus = self.node_cpus()
            cpuset = be_cpuset(cpus, quota, pinned=self._pinned)
            if cpuset is None and not self._no_free_cpu:  # logged when it starts, not every tick
                log.warning(
                    LOGGER,
                    "cpusuppress_no_free_cpu",
                    online=format_cpus(cpus),
                    pinned=format_cpus(self._pinned),
                    kept=self.cpuset or "",
                )
            self._no_free_cpu = cpuset is None
            if cpuset is None:
                cpuset = self.cpuset
        changed = (quota, cpuset) != (self.quota, self.cpuset)
        if changed:
            if quota != self.quota:
                self._changed_at = self.clock()
            log.event(LOGGER, "cpusuppress_budget", quota=quota, cpuset=cpuset or "", target=target)
        self.quota, self.cpuset = quota, cpuset
        return changed

    def tick(self, targets: Sequence[PodTarget]) -> bool:
        """Sample; True when the BE budget in force changed (so BE pods must be re-applied)."""
        # A release is for the re-apply that followed the policy change (already done).
        self._release_quota, self._release_cpuset = False, None
        m = self.meter(targets)
        if m is None:
            return False
        self._last = m
        self._pinned = ls_pinned_cpus(targets)
        return self._recompute(m)

    def set_pod(self, ctx: PodContext) -> None:
        if not _is_be(ctx.request.qos_class):
            return
        if self._release_quota and (self.config is None or self.config.policy != "cfsQuota"):
            ctx.response.resources.cfs_quota = -1
        if self.config is None or self.quota is None:
            return
        if self.config.policy != "cfsQuota":
            ctx.response.resources.cfs_quota = -1
            return
        ctx.response.resources.cfs_quota = self._pod_quota(ctx.request, self.quota)[0]

    def _pod_quota(self, pod: PodInfo, quota: int) -> tuple[int, int]:
        """The budget ``quota`` (µs per 100 ms) for ``pod``'s cgroup, and that cgroup's period."""
        parent = pod.cgroup_parent
        period = self.cfs_period(pod_cgroup_dir(parent)) if parent else DEFAULT_CFS_PERIOD
        return scale_quota(quota, period), period

    def set_container(self, ctx: ContainerContext) -> None:
        """Hook (PreCreateContainer, PreUpdateContainerResources): the request carries kubelet's
        limits, remembered as the container's own quota; then as :meth:`reconcile_container`."""
        self._own[_container_key(ctx)] = _limit(ctx)
        self.reconcile_container(ctx)

    def reconcile_container(self, ctx: ContainerContext) -> None:
        if not _is_be(ctx.request.pod.qos_class):
            return
        if self._release_cpuset is not None:
            ctx.response.resources.cpuset = self._release_cpuset
        if self._release_quota and self.cgroup_version == 1 and ctx.request.id:
            own, _ = self._own.get(_container_key(ctx), _limit(ctx))
            if own > 0:
                ctx.response.resources.cfs_quota = own
        if self.config is None:
            return
        if self.config.policy == "cpuset":
            if self.cpuset is not None:
                ctx.response.resources.cpuset = self.cpuset
            return
        # cgroup v1 refuses a container quota above the pod's (as a share of a CPU, quota / period):
        # the container gets at most the budget, and its own (kubelet's) quota back when the budget
        # allows. (The request may carry the capped value: the runtime was told it.)
        own, period = self._own.get(_container_key(ctx), _limit(ctx))
        if self.cgroup_version != 1 or own <= 0:
            return
        if self.quota is None:
            pod_quota, pod_period = -1, DEFAULT_CFS_PERIOD
        else:
            pod_quota, pod_period = self._pod_quota(ctx.request.pod, self.quota)
        if pod_quota >= 0 and own * pod_period > pod_quota * period:
            ctx.response.resources.cfs_quota = scale_quota(pod_quota, period, pod_period)
        elif ctx.request.id:  # a running container: back to its own
            ctx.response.resources.cfs_quota = own

    def forget_pod(self, ctx: PodContext) -> None:
        """PostStopPodSandbox: the pod's containers' remembered quotas go."""
        uid = ctx.request.meta.uid
        for key in [k for k in self._own if k[0] == uid]:
            del self._own[key]


def _container_key(ctx: ContainerContext) -> tuple[str, str]:
    return (ctx.request.pod.meta.uid, ctx.request.name)


def _limit(ctx: ContainerContext) -> tuple[int, int]:
    """The container's CFS quota and period as the request carries them (kubelet sends both; a
    period of 0 is the runtime's default, 100 ms)."""
    res = ctx.request.resources
    return res.cpu_quota, res.cpu_period if res.cpu_period > 0 else DEFAULT_CFS_PERIOD


def status(
    probe: NodeProbe,
    proc_stat: str,
    node_cpus: Callable[[], frozenset[int]],
    cpu_online: str,
    policy: NodePolicy | None,
) -> FeatureStatus:
    """Active when the policy has resourceUsedThresholdWithBE and the node has the files it needs."""
    config = policy.cpu_suppress if policy is not None else None
    if config is None:
        return FeatureStatus.not_in_policy(NAME, "resourceUsedThresholdWithBE")
    needed = [CgroupFile.CPU_USAGE, CgroupFile.CFS_QUOTA]
    if config.policy == "cpuset":
        needed.append(CgroupFile.CPUSET_CPUS)
    for file in needed:
        if not probe.has(file):
            return FeatureStatus(NAME, False, probe.missing(file), mode=config.policy)
    if config.policy == "cpuset" and not node_cpus():
        return FeatureStatus(
            NAME,
            False,
            f"cannot tell which CPUs are online: the cgroup root shows no effective cpuset and"
            f" {cpu_online} cannot be read",
            mode=config.policy,
        )
    if not os.access(proc_stat, os.R_OK):
        return FeatureStatus(NAME, False, f"cannot read {proc_stat} (node CPU usage)", mode=config.policy)
    return FeatureStatus(
        NAME,
        True,
        f"BE held to {config.threshold_percent}% of the node minus LS and system use",
        mode=config.policy,
    )


def install(
    app: HookServer,
    meter: Meter | None = None,
    *,
    interval: float = INTERVAL,
    proc_stat: str = "/proc/stat",
    cpu_online: str = SYSFS_CPU_ONLINE,
) -> CpuSuppressPlugin:
    """Install with ``meter`` (default: :class:`ProcfsMeter` on the app's executor and ``proc_stat``);
    the node's CPUs are the cgroup root's, else those ``cpu_online`` lists (:func:`online_cpus`)."""
    node_cpus = functools.partial(online_cpus, app.executor, cpu_online)
    plugin = CpuSuppressPlugin(
        meter if meter is not None else ProcfsMeter(app.executor, proc_stat),
        cgroup_version=app.executor.cgroup_version,
        cfs_period=app.executor.cfs_period,
        node_cpus=node_cpus,
    )
    description = "BE CPU suppress: cfs quota or cpuset from measured LS usage"
    app.rules.register(NAME, description, plugin.parse)
    app.registry.register(Stage.PRE_RUN_POD_SANDBOX, NAME, description, plugin.set_pod)
    app.registry.register(Stage.PRE_CREATE_CONTAINER, NAME, description, plugin.set_container)
    app.registry.register(Stage.PRE_UPDATE_CONTAINER_RESOURCES, NAME, description, plugin.set_container)
    app.registry.register(Stage.POST_STOP_POD_SANDBOX, NAME, description, plugin.forget_pod, blocking=False)
    app.registry.register_reconciler(Level.POD, NAME, description, plugin.set_pod)
    app.registry.register_reconciler(Level.CONTAINER, NAME, description, plugin.reconcile_container)
    app.every(interval, name=NAME)(plugin.tick)
    app.feature(NAME, functools.partial(status, app.probe, proc_stat, node_cpus, cpu_online))
    return plugin
