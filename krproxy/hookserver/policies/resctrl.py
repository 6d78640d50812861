"""LLC and memory-bandwidth isolation: one resctrl group per QoS class.

Groups ``LSR``, ``LS`` and ``BE`` (koordlet's names) are created under the resctrl root with
schemata from the policy's ``resctrlQOS``: ``L3:<id>=<mask>`` where the mask covers the
ways between ``catRangeStartPercent`` and ``catRangeEndPercent`` of the cache (from
``info/L3/cbm_mask``), and ``MB:<id>=<mbaPercent>`` where the CPU offers MBA (``info/MB``).
Cache ids come from the root ``schemata`` (default ``0``). A container's processes
(``cgroup.procs``) are moved into its class's group after start (PostStartContainer) and on
every reconcile. LSE pods use the LSR group; SYSTEM pods are left alone. When a policy change
drops a class's setting, its group gets the whole cache and bandwidth (its running containers are
still in it). Does nothing on
machines without resctrl (no ``info/L3``).
"""

from __future__ import annotations

import functools
import math

import attrs

from .._app import HookServer
from .._context import ContainerContext, QoSClass, ResctrlGroup
from .._executor import Executor
from .._features import FeatureStatus
from .._policy import NodePolicy, ResctrlQoS
from .._registry import Level, Stage

NAME = "resctrl"
GROUPS = {QoSClass.LSE: "LSR", QoSClass.LSR: "LSR", QoSClass.LS: "LS", QoSClass.BE: "BE"}


def cat_mask(cbm_mask: str, start_percent: int, end_percent: int) -> str:
    """The contiguous L3 way mask for [start%, end%) of the cache, as resctrl hex.

    >>> cat_mask("fff", 0, 100), cat_mask("fff", 0, 30), cat_mask("fff", 50, 100)
    ('fff', 'f', 'fc0')
    """
    ways = int(cbm_mask, 16).bit_count()
    # At least one way, and none beyond the cache (the kernel refuses a bit outside cbm_mask):
    # 95-100 % of 12 ways is the top way, not way 12.
    start = min(math.ceil(ways * start_percent / 100), ways - 1)
    end = min(max(math.ceil(ways * end_percent / 100), start + 1), ways)
    return format(((1 << end) - 1) ^ ((1 << start) - 1), "x")


def schemata_lines(qos: ResctrlQoS, cbm_mask: str, cache_ids: tuple[str, ...], mba: bool) -> tuple[str, ...]:
    mask = cat_mask(cbm_mask, qos.cat_range_start_percent, qos.cat_range_end_percent)
    lines = ["L3:" + ";".join(f"{i}={mask}" for i in cache_ids)]
    if mba:
        lines.append("MB:" + ";".join(f"{i}={qos.mba_percent}" for i in cache_ids))
    return tuple(lines)


def _cache_ids(executor: Executor) -> tuple[str, ...]:
    path = executor.resctrl_path("schemata")
    text = path.read_text() if path.is_file() else ""
    for line in text.splitlines():
        kind, _, domains = line.strip().partition(":")
        if kind == "L3" and domains:
            return tuple(d.split("=")[0] for d in domains.split(";"))
    return ("0",)


@attrs.define
class Resctrl:
    executor: Executor
    groups: dict[QoSClass, ResctrlGroup] = attrs.Factory(dict)
    #: Classes the last policy change took the setting from: their group (where their running
    #: containers are) gets the whole cache and bandwidth at the re-apply.
    released: dict[QoSClass, ResctrlGroup] = attrs.Factory(dict)

    def supported(self) -> bool:
        return self.executor.resctrl_path("info/L3/cbm_mask").is_file()

    def parse(self, policy: NodePolicy) -> bool:
        cbm = self.executor.resctrl_path("info/L3/cbm_mask").read_text().strip()
        mba = self.executor.resctrl_path("info/MB").is_dir()
        ids = _cache_ids(self.executor)
        groups = {}
        for qos, name in GROUPS.items():
            strategy = policy.strategy(qos)
            if strategy is not None and strategy.resctrl_qos is not None:
                groups[qos] = ResctrlGroup(name, schemata_lines(strategy.resctrl_qos, cbm, ids, mba))
        changed = groups != self.groups
        if changed:
            full = schemata_lines(ResctrlQoS(), cbm, ids, mba)
            self.released = {
                qos: ResctrlGroup(group.name, full) for qos, group in self.groups.items() if qos not in groups
            }
        self.groups = groups
        return changed

    def set_container(self, ctx: ContainerContext) -> None:
        group = self.groups.get(ctx.request.pod.qos_class)
        if group is not None:
            ctx.response.resources.resctrl = group

    def reconcile_container(self, ctx: ContainerContext) -> None:
        """As :meth:`set_container`; a class whose setting the policy dropped gets its group back
        with the whole cache and bandwidth."""
        group = self.groups.get(ctx.request.pod.qos_class, self.released.get(ctx.request.pod.qos_class))
        if group is not None:
            ctx.response.resources.resctrl = group


def status(executor: Executor, policy: NodePolicy | None) -> FeatureStatus:
    """Active when the policy has a resctrlQOS and the node has resctrl with L3 CAT."""
    if policy is None or all(s.resctrl_qos is None for s in policy.strategies()):
        return FeatureStatus.not_in_policy(NAME, "resourceQOSStrategy.<class>.resctrlQOS")
    root = executor.resctrl_root
    if not executor.resctrl_path("info").is_dir():
        return FeatureStatus(
            NAME, False, f"no resctrl mount at {root} (mount -t resctrl resctrl {root}; needs a CPU with RDT)"
        )
    if not executor.resctrl_path("info/L3/cbm_mask").is_file():
        return FeatureStatus(
            NAME, False, f"no {root}/info/L3/cbm_mask: the CPU has no L3 cache allocation (CAT)"
        )
    if not executor.resctrl_path("info/MB").is_dir():
        return FeatureStatus(
            NAME,
            True,
            f"no {root}/info/MB: the CPU has no memory bandwidth allocation, mbaPercent is ignored",
            mode="L3",
        )
    return FeatureStatus(NAME, True, "resctrl with L3 CAT and MBA", mode="L3+MB")


def install(app: HookServer) -> Resctrl:
    plugin = Resctrl(app.executor)
    description = "LLC/memory bandwidth: resctrl group per QoS class"
    app.rules.register(NAME, description, plugin.parse, system_supported=plugin.supported)
    app.registry.register(Stage.POST_START_CONTAINER, NAME, description, plugin.set_container, blocking=False)
    app.registry.register_reconciler(Level.CONTAINER, NAME, description, plugin.reconcile_container)
    app.feature(NAME, functools.partial(status, app.executor))
    return plugin
