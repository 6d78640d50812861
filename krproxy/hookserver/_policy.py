"""The node policy file (shaped after Koordinator's NodeSLO spec) and its live watcher.

Example (YAML; JSON works too)::

    resourceQOSStrategy:
      lsrClass: {cpuQOS: {groupIdentity: 2}, resctrlQOS: {catRangeEndPercent: 100, mbaPercent: 100}}
      lsClass:  {cpuQOS: {groupIdentity: 2}, resctrlQOS: {catRangeEndPercent: 100, mbaPercent: 100}}
      beClass:  {cpuQOS: {groupIdentity: -1}, resctrlQOS: {catRangeEndPercent: 30, mbaPercent: 50}}
    resourceUsedThresholdWithBE:
      cpuSuppressThresholdPercent: 65
      cpuSuppressPolicy: cfsQuota        # or cpuset
      cpuSuppressMinQuota: 2000          # µs per 100 ms period: BE never gets less

A section is in force when present, unless it says ``enable: false``. LSE pods use the
``lsrClass`` strategy (as in Koordinator); SYSTEM pods are left alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import trio
import yaml

from ._context import QoSClass

LOGGER = logging.getLogger("krproxy.hookserver.policy")

#: How often the watcher looks at the policy file (s). Cheap: one stat() per poll.
POLL_INTERVAL = 1.0


class PolicyError(ValueError):
    """The policy file is not a valid node policy."""


@attrs.frozen
class CPUQoS:
    group_identity: int


@attrs.frozen
class ResctrlQoS:
    cat_range_start_percent: int = 0
    cat_range_end_percent: int = 100
    mba_percent: int = 100


@attrs.frozen
class ClassStrategy:
    cpu_qos: CPUQoS | None = None
    resctrl_qos: ResctrlQoS | None = None


@attrs.frozen
class CPUSuppress:
    threshold_percent: int = 65
    policy: str = "cfsQuota"
    min_quota: int = 2000


_CLASS_KEYS = {"lsrClass": QoSClass.LSR, "lsClass": QoSClass.LS, "beClass": QoSClass.BE}


def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise PolicyError(f"{key} must be a mapping, not {type(value).__name__}")
    return None if value.get("enable") is False else value


def _int(data: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise PolicyError(f"{key} must be an integer in [{lo}, {hi}], not {value!r}")
    return value


def _class_strategy(data: Mapping[str, Any]) -> ClassStrategy:
    cpu = _section(data, "cpuQOS")
    rdt = _section(data, "resctrlQOS")
    cpu_qos = None
    if cpu is not None and "groupIdentity" in cpu:
        cpu_qos = CPUQoS(_int(cpu, "groupIdentity", 0, -1, 2))
    resctrl_qos = None
    if rdt is not None:
        resctrl_qos = ResctrlQoS(
            _int(rdt, "catRangeStartPercent", 0, 0, 100),
            _int(rdt, "catRangeEndPercent", 100, 0, 100),
            _int(rdt, "mbaPercent", 100, 1, 100),
        )
        if resctrl_qos.cat_range_start_percent >= resctrl_qos.cat_range_end_percent:
            raise PolicyError("catRangeStartPercent must be below catRangeEndPercent")
    return ClassStrategy(cpu_qos, resctrl_qos)


@attrs.frozen
class NodePolicy:
    """The parsed policy. Build it with :meth:`from_mapping` / :meth:`from_text` / :meth:`load`."""

    classes: Mapping[QoSClass, ClassStrategy] = attrs.field(factory=dict)
    cpu_suppress: CPUSuppress | None = None

    @classmethod
    def from_mapping(cls, data: Any) -> NodePolicy:
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise PolicyError("the policy must be a mapping")
        classes = {}
        strategy = _section(data, "resourceQOSStrategy") or {}
        for key, qos in _CLASS_KEYS.items():
            section = _section(strategy, key)
            if section is not None:
                classes[qos] = _class_strategy(section)
        suppress = None
        threshold = _section(data, "resourceUsedThresholdWithBE")
        if threshold is not None:
            policy = threshold.get("cpuSuppressPolicy", "cfsQuota")
            if policy not in ("cfsQuota", "cpuset"):
                raise PolicyError(f"cpuSuppressPolicy must be cpuset or cfsQuota, not {policy!r}")
            suppress = CPUSuppress(
                _int(threshold, "cpuSuppressThresholdPercent", 65, 0, 100),
                policy,
                _int(threshold, "cpuSuppressMinQuota", 2000, 1000, 2**40),
            )
        return cls(classes, suppress)

    @classmethod
    def from_text(cls, text: str) -> NodePolicy:
        """Parse YAML (which includes JSON)."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PolicyError(f"not YAML/JSON: {exc}") from exc
        return cls.from_mapping(data)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> NodePolicy:
        with open(path) as f:
            return cls.from_text(f.read())

    def strategy(self, qos: QoSClass) -> ClassStrategy | None:
        """The strategy for a pod of class ``qos`` (LSE → LSR; SYSTEM → none)."""
        return self.classes.get(QoSClass.LSR if qos is QoSClass.LSE else qos)


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


@attrs.define
class PolicyWatcher:
    """Polls the policy file's inode/mtime/size; on a change, parses and calls ``on_change``.

    A bad or missing file keeps the last good policy (and is logged).
    """

    path: str
    on_change: Callable[[NodePolicy], object] = attrs.field(hash=False)
    interval: float = POLL_INTERVAL
    current: NodePolicy | None = None
    _stamp: tuple[int, int, int] | None = None

    def poll(self) -> bool:
        """Look once; return whether a new policy was taken (and ``on_change`` called)."""
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        if stamp is None:
            LOGGER.warning(
                "event=policy_missing path=%s kept_last_good=%s", self.path, self.current is not None
            )
            return False
        try:
            policy = NodePolicy.load(self.path)
        except (OSError, PolicyError) as exc:
            LOGGER.error("event=policy_invalid path=%s error=%s kept_last_good=true", self.path, exc)
            return False
        if policy == self.current:
            return False
        self.current = policy
        LOGGER.info("event=policy_loaded path=%s", self.path)
        self.on_change(policy)
        return True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Poll forever; ready once the first look is done."""
        self.poll()
        task_status.started()
        while True:
            await trio.sleep(self.interval)
            self.poll()
