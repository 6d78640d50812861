"""Group identity: CPU priority of a pod's cgroup by QoS class.

On kernels with Alibaba Cloud Linux / Anolis group identity, ``cpu.bvt_warp_ns`` of the pod
cgroup is set from the policy's ``cpuQOS.groupIdentity`` for the pod's class (Koordinator's
usual values: LSR/LS 2, BE -1). Where the kernel lacks ``cpu.bvt_warp_ns`` the executor
falls back (see ``_done.plan_writes``): a negative value (BE) becomes ``cpu.idle = 1``
(SCHED_IDLE cgroup, Linux ≥ 5.15), or ``cpu.shares = 2`` where ``cpu.idle`` is missing too;
a non-negative value becomes ``cpu.idle = 0``. Classes without a ``cpuQOS`` section, and
SYSTEM pods, are left alone; when a policy change drops a class's setting, that class's running
pods are set back to 0 (``cpu.idle = 0``), as koordlet resets them.

Runs at PreRunPodSandbox (kubelet has created the pod cgroup by then) and as a pod
reconciler, so a policy change reaches running pods.
"""

from __future__ import annotations

import functools

import attrs

from .._app import HookServer
from .._cgroups import CgroupFile
from .._context import PodContext, QoSClass
from .._features import FeatureStatus, NodeProbe
from .._policy import NodePolicy
from .._registry import Level, Stage

NAME = "groupidentity"


@attrs.define
class GroupIdentity:
    bvt: dict[QoSClass, int] = attrs.Factory(dict)
    #: Classes the last policy change took the setting from: their running pods go back to 0.
    released: dict[QoSClass, int] = attrs.Factory(dict)

    def parse(self, policy: NodePolicy) -> bool:
        bvt = {}
        for qos in (QoSClass.LSE, QoSClass.LSR, QoSClass.LS, QoSClass.BE):
            strategy = policy.strategy(qos)
            if strategy is not None and strategy.cpu_qos is not None:
                bvt[qos] = strategy.cpu_qos.group_identity
        changed = bvt != self.bvt
        if changed:
            self.released = {qos: 0 for qos in self.bvt if qos not in bvt}
        self.bvt = bvt
        return changed

    def set_pod(self, ctx: PodContext) -> None:
        value = self.bvt.get(ctx.request.qos_class)
        if value is not None:
            ctx.response.resources.cpu_bvt = value

    def reconcile_pod(self, ctx: PodContext) -> None:
        """As :meth:`set_pod`; a class whose setting the policy dropped gets 0 (koordlet's reset)."""
        value = self.bvt.get(ctx.request.qos_class, self.released.get(ctx.request.qos_class))
        if value is not None:
            ctx.response.resources.cpu_bvt = value


def status(probe: NodeProbe, policy: NodePolicy | None) -> FeatureStatus:
    """Active when the policy sets a groupIdentity; the mode says which kernel file carries it."""
    if policy is None or all(s.cpu_qos is None for s in policy.strategies()):
        return FeatureStatus.not_in_policy(NAME, "resourceQOSStrategy.<class>.cpuQOS.groupIdentity")
    if probe.has(CgroupFile.CPU_BVT):
        return FeatureStatus(NAME, True, "the kernel has group identity", mode="cpu.bvt_warp_ns")
    no_bvt = probe.missing(CgroupFile.CPU_BVT) + ": kernel without group identity"
    if probe.has(CgroupFile.CPU_IDLE):
        return FeatureStatus(
            NAME, True, f"fallback: {no_bvt}; BE pods get cpu.idle=1, the others cpu.idle=0", mode="cpu.idle"
        )
    return FeatureStatus(
        NAME,
        True,
        f"fallback: {no_bvt}, {probe.missing(CgroupFile.CPU_IDLE)} (Linux < 5.15); BE pods get cpu.shares=2,"
        " the others nothing",
        mode="cpu.shares",
    )


def install(app: HookServer) -> GroupIdentity:
    plugin = GroupIdentity()
    description = "cpu.bvt_warp_ns (or cpu.idle/cpu.shares) of the pod cgroup by QoS class"
    app.rules.register(NAME, description, plugin.parse)
    app.registry.register(Stage.PRE_RUN_POD_SANDBOX, NAME, description, plugin.set_pod, blocking=False)
    app.registry.register_reconciler(Level.POD, NAME, description, plugin.reconcile_pod)
    app.feature(NAME, functools.partial(status, app.probe))
    return plugin
