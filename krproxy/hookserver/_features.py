"""Which policy features are active on this node, and if not, why.

Each built-in policy registers a status function (``app.feature(name, fn)``) that looks at the
policy in force and at the node (the kernel files the executor would write, the resctrl mount,
the cgroup version) and says whether the feature does anything here. The hook server reports
them all at start and on every policy change: one ``event=feature_status`` log line per
feature and the gauge ``krproxy_hookserver_feature_active{feature}`` (1 active, 0 not).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs
from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

from krproxy import log

from ._cgroups import CgroupFile
from ._executor import Executor
from ._policy import NodePolicy

LOGGER = logging.getLogger("krproxy.hookserver.features")

#: Cgroups the node probe looks at, first found wins: kubelet's pod parent (cgroupfs, systemd),
#: then the hierarchy's root (cgroup v2's root has no ``cpu.*`` files, so a v2 node needs one).
PROBE_DIRS = ("kubepods", "kubepods.slice", "")


@attrs.frozen
class FeatureStatus:
    """What a feature does on this node.

    Attributes:
        feature: the feature's (policy's) name.
        active: whether it changes anything here with the policy in force.
        mode: how, when there is a choice (``cpu.idle`` for group identity without bvt...).
        reason: why it is (in)active, in words an operator can act on.
        wanted: whether the policy asks for it (inactive but wanted is logged as a warning).
    """

    feature: str
    active: bool
    reason: str
    mode: str = ""
    wanted: bool = True

    @classmethod
    def not_in_policy(cls, feature: str, key: str) -> FeatureStatus:
        """Off because the node policy does not set *key* (not wanted, so no warning)."""
        return cls(feature, False, f"no {key} in the policy", wanted=False)


StatusFn = Callable[[NodePolicy | None], FeatureStatus]


@attrs.frozen
class NodeProbe:
    """Looks for kernel files on this node through the executor (never writes)."""

    executor: Executor

    def probe_dir(self) -> str:
        for candidate in PROBE_DIRS:
            if not candidate or self.executor.cgroup_exists(candidate):
                return candidate
        return ""

    def has(self, file: CgroupFile) -> bool:
        return self.executor.has(self.probe_dir(), file)

    def missing(self, file: CgroupFile) -> str:
        """Why ``file`` cannot be written: its path, and the cgroup version's naming."""
        version = self.executor.cgroup_version
        path = self.executor.cgroup_path(self.probe_dir(), file)
        hint = ""
        if version == 2 and file in (CgroupFile.CFS_QUOTA, CgroupFile.CPU_SHARES, CgroupFile.CPU_IDLE):
            hint = " (cgroup v2: is the cpu controller enabled in the parent's cgroup.subtree_control?)"
        elif version == 2 and file is CgroupFile.CPUSET_CPUS:
            hint = " (cgroup v2: is the cpuset controller enabled in the parent's cgroup.subtree_control?)"
        return f"no {path} on this node (cgroup v{version}){hint}"


@attrs.define
class Features:
    """The registered status functions and the gauge they feed."""

    registry: CollectorRegistry = attrs.Factory(CollectorRegistry)
    #: Where to write the gauge after each report (node_exporter's textfile collector), if anywhere.
    textfile: str | None = None
    _fns: dict[str, StatusFn] = attrs.Factory(dict)
    _gauge: Gauge = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._gauge = Gauge(
            "krproxy_hookserver_feature_active",
            "1 when a policy feature is active on this node, 0 when not (the log says why).",
            ["feature"],
            registry=self.registry,
        )

    def register(self, name: str, fn: StatusFn) -> None:
        if name in self._fns:
            raise ValueError(f"feature {name!r} is already registered")
        self._fns[name] = fn

    def report(self, policy: NodePolicy | None) -> list[FeatureStatus]:
        """Compute, log and export every feature's status for ``policy``."""
        statuses = []
        for name in sorted(self._fns):
            try:
                status = self._fns[name](policy)
            except Exception as exc:  # a broken status function must not stop the others
                status = FeatureStatus(name, False, f"status check failed: {exc!r}")
            statuses.append(status)
            self._gauge.labels(name).set(1 if status.active else 0)
            fields = {"feature": name, "active": status.active, "reason": status.reason}
            if status.mode:
                fields["mode"] = status.mode
            level = logging.WARNING if status.wanted and not status.active else logging.INFO
            log.event(LOGGER, "feature_status", level=level, **fields)
        if self.textfile:
            try:
                write_to_textfile(self.textfile, self.registry)
            except OSError as exc:
                log.error(LOGGER, "metrics_write_failed", path=self.textfile, error=str(exc))
        return statuses
