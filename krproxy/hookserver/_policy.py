"""The node policy file (shaped after Koordinator's NodeSLO spec): its schema and loader.

The file's keys, their meaning, unit, range and default are defined once, in :data:`SCHEMA`:
the loader validates against it (an unknown key is refused, with a "did you mean" for a near
miss, exactly like a bad value), and ``docs/plugin-authoring.md``'s policy reference is
generated from it (:func:`schema_markdown`; ``scripts/gen_policy_doc.py`` rewrites the doc,
a unit test fails when the two disagree).

A section is in force when present, unless it says ``enable: false``. LSE pods use the
``lsrClass`` strategy (as in Koordinator); SYSTEM pods are left alone. The live watcher that
re-reads the file runs on trio, in :mod:`krproxy.hookserver._policywatch`.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import yaml

from ._context import QoSClass


class PolicyError(ValueError):
    """The policy file is not a valid node policy."""


# -- the schema ---------------------------------------------------------------------------------


@attrs.frozen
class Key:
    """One key of the policy file. Strictly read-only.

    Attributes:
        name: the key as written in the file.
        meaning: one sentence for the docs.
        unit: the value's unit ("" when it has none).
        default: the value when the key is absent (``None``: "not set", the setting is left alone).
        lo / hi: the inclusive range of an integer.
        choices: the allowed strings of a choice.
        keys: the keys of a section (a mapping); a section also takes ``enable``.
        example: the value in the documented example (sections: from their keys).
        koordinator: keys Koordinator's NodeSLO has in this section that this hook server does
            not implement: refused as such, never "corrected" into a key that means something else.
    """

    name: str
    meaning: str
    unit: str = ""
    default: Any = None
    lo: int | None = None
    hi: int | None = None
    choices: tuple[str, ...] = ()
    keys: tuple[Key, ...] = ()
    example: Any = None
    koordinator: tuple[str, ...] = ()

    @property
    def is_section(self) -> bool:
        return bool(self.keys)

    def allowed(self) -> str:
        """The allowed values, for messages and the docs."""
        if self.is_section:
            return "a mapping"
        if self.choices:
            return " or ".join(self.choices)
        if self.lo is None:
            return "true or false"
        return f"an integer in [{self.lo}, {self.hi}]"


#: Every section's on/off switch (Koordinator's ``enable``).
ENABLE = Key("enable", "false switches the section off as if it were absent", default=True)


def _class_keys(group_identity: int, cat_end: int, mba: int) -> tuple[Key, ...]:
    return (
        Key(
            "cpuQOS",
            "CPU priority of the class's pod cgroups",
            koordinator=("schedIdle", "coreExpeller"),
            keys=(
                Key(
                    "groupIdentity",
                    "group identity (cpu.bvt_warp_ns) of the pod cgroup: 2 highest … -1 lowest; without"
                    " bvt, -1 becomes cpu.idle=1 (else cpu.shares=2) and ≥ 0 cpu.idle=0",
                    lo=-1,
                    hi=2,
                    example=group_identity,
                ),
            ),
        ),
        Key(
            "resctrlQOS",
            "LLC ways and memory bandwidth of the class's resctrl group (needs /sys/fs/resctrl)",
            keys=(
                Key(
                    "catRangeStartPercent", "first LLC way, as a share of the ways", "%", 0, 0, 100, example=0
                ),
                Key(
                    "catRangeEndPercent",
                    "end of the LLC ways (exclusive), above catRangeStartPercent",
                    "%",
                    100,
                    0,
                    100,
                    example=cat_end,
                ),
                Key(
                    "mbaPercent", "memory bandwidth cap (MB: line; needs MBA)", "%", 100, 1, 100, example=mba
                ),
            ),
        ),
    )


#: A class section's (Koordinator's ResourceQOS) keys not implemented here.
_CLASS_NOT_DONE = ("memoryQOS", "blkioQOS", "networkQOS")

#: The top-level keys of a whole Kubernetes object (``kubectl get nodeslo -o yaml``).
_OBJECT_KEYS = frozenset({"apiVersion", "kind", "metadata", "spec", "status"})

#: The policy file, top down.
SCHEMA = Key(
    "",
    "the node policy",
    keys=(
        Key(
            "resourceQOSStrategy",
            "per-QoS-class settings (LSE pods use lsrClass; SYSTEM pods are left alone)",
            keys=(
                Key(
                    "lsrClass",
                    "pods labelled LSR or LSE",
                    keys=_class_keys(2, 100, 100),
                    koordinator=_CLASS_NOT_DONE,
                ),
                Key(
                    "lsClass",
                    "pods labelled LS or not labelled",
                    keys=_class_keys(2, 100, 100),
                    koordinator=_CLASS_NOT_DONE,
                ),
                Key("beClass", "pods labelled BE", keys=_class_keys(-1, 30, 50), koordinator=_CLASS_NOT_DONE),
            ),
            koordinator=("policies", "systemClass", "cgroupRoot"),
        ),
        Key(
            "resourceUsedThresholdWithBE",
            "BE CPU suppress: BE pods get what LS pods and the system leave of a share of the node",
            keys=(
                Key(
                    "cpuSuppressThresholdPercent",
                    "share of the node's CPUs that LS + system + BE may use together",
                    "% of all CPUs",
                    65,
                    0,
                    100,
                    example=65,
                ),
                Key(
                    "cpuSuppressPolicy",
                    "how BE is held to the budget: cfsQuota (pod CFS quota) or cpuset (BE containers"
                    " on the highest-numbered CPUs no LS pod is pinned to)",
                    default="cfsQuota",
                    choices=("cfsQuota", "cpuset"),
                    example="cfsQuota",
                ),
                Key(
                    "cpuSuppressMinQuota",
                    "the least CFS quota a BE pod is ever given (scaled to the pod cgroup's own CFS"
                    " period: 2000 is 1000 µs per 50 ms period)",
                    "µs per 100 ms period",
                    2000,
                    1000,
                    2**40,
                    example=2000,
                ),
            ),
            koordinator=(
                "cpuSuppressMinPercent",
                "memoryEvictThresholdPercent",
                "memoryEvictLowerPercent",
                "cpuEvictBESatisfactionUpperPercent",
                "cpuEvictBESatisfactionLowerPercent",
                "cpuEvictBEUsageThresholdPercent",
                "cpuEvictTimeWindowSeconds",
                "cpuEvictPolicy",
            ),
        ),
    ),
    koordinator=("cpuBurstStrategy", "systemStrategy", "extensions", "hostApplications"),
)


def _did_you_mean(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if not close:
        lowered = {k.lower(): k for k in known}
        close = [lowered[name.lower()]] if name.lower() in lowered else []
    return f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(known)})"


def _value(key: Key, value: Any, where: str) -> Any:
    if key.choices:
        if value not in key.choices:
            raise PolicyError(f"{where} must be {key.allowed()}, not {value!r}")
        return value
    if key.lo is None:  # a switch
        if not isinstance(value, bool):
            raise PolicyError(f"{where} must be {key.allowed()}, not {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not key.lo <= value <= key.hi:  # type: ignore[operator]
        raise PolicyError(f"{where} must be {key.allowed()}, not {value!r}")
    return value


def validate(section: Key, data: Any, where: str = "") -> dict[str, Any] | None:
    """``data`` checked against ``section``: every key known and every value allowed.

    Returns the section's values with defaults filled in (sub-sections: their own dict, or
    ``None`` when absent or ``enable: false``); ``None`` when the section itself is switched off.

    Raises:
        PolicyError: naming every unknown key (with the nearest known one) or the first bad value.
    """
    if not isinstance(data, Mapping):
        raise PolicyError(f"{where or 'the policy'} must be a mapping, not {type(data).__name__}")
    known = {k.name: k for k in section.keys}
    if where:
        known[ENABLE.name] = ENABLE
    unknown = [str(name) for name in data if name not in known]
    if unknown:
        if not where and "spec" in unknown and set(unknown) <= _OBJECT_KEYS:
            raise PolicyError(
                "this is a whole NodeSLO object: the policy file holds what is under its 'spec:'"
                " (its keys one level up, without apiVersion, kind and metadata)"
            )
        raise PolicyError("; ".join(_unknown(section, where, name, list(known)) for name in unknown))
    enable = data.get(ENABLE.name)
    if where and enable is not None and _value(ENABLE, enable, _join(where, ENABLE.name)) is False:
        return None
    values: dict[str, Any] = {}
    for key in section.keys:
        path = _join(where, key.name)
        raw = data.get(key.name)
        if key.is_section:
            values[key.name] = None if raw is None else validate(key, raw, path)
        else:
            values[key.name] = key.default if raw is None else _value(key, raw, path)
    return values


def _unknown(section: Key, where: str, name: str, known: Sequence[str]) -> str:
    path = _join(where, name)
    if name in section.koordinator:
        return (
            f"key {path!r} is a Koordinator NodeSLO key this hook server does not implement; remove it"
            f" (implemented here: {', '.join(known)})"
        )
    return f"unknown key {path!r}{_did_you_mean(name, known)}"


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


# -- the parsed policy --------------------------------------------------------------------------


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


def _class_strategy(values: Mapping[str, Any], where: str) -> ClassStrategy:
    cpu, rdt = values["cpuQOS"], values["resctrlQOS"]
    cpu_qos = None
    if cpu is not None and cpu["groupIdentity"] is not None:
        cpu_qos = CPUQoS(cpu["groupIdentity"])
    resctrl_qos = None
    if rdt is not None:
        resctrl_qos = ResctrlQoS(rdt["catRangeStartPercent"], rdt["catRangeEndPercent"], rdt["mbaPercent"])
        if resctrl_qos.cat_range_start_percent >= resctrl_qos.cat_range_end_percent:
            raise PolicyError(
                f"{where}.resctrlQOS: catRangeStartPercent ({resctrl_qos.cat_range_start_percent}) must be"
                f" below catRangeEndPercent ({resctrl_qos.cat_range_end_percent})"
            )
    return ClassStrategy(cpu_qos, resctrl_qos)


@attrs.frozen
class NodePolicy:
    """The parsed policy. Build it with :meth:`from_mapping` / :meth:`from_text` / :meth:`load`."""

    classes: Mapping[QoSClass, ClassStrategy] = attrs.field(factory=dict)
    cpu_suppress: CPUSuppress | None = None

    @classmethod
    def from_mapping(cls, data: Any) -> NodePolicy:
        """Validate ``data`` against :data:`SCHEMA` and build the policy.

        Raises:
            PolicyError: an unknown key (named, with the nearest known one) or a bad value.
        """
        if data is None:
            return cls()
        values = validate(SCHEMA, data)
        assert values is not None  # the top level has no ``enable``
        classes = {}
        strategy = values["resourceQOSStrategy"] or {}
        for key, qos in _CLASS_KEYS.items():
            if strategy.get(key) is not None:
                classes[qos] = _class_strategy(strategy[key], f"resourceQOSStrategy.{key}")
        suppress = None
        threshold = values["resourceUsedThresholdWithBE"]
        if threshold is not None:
            suppress = CPUSuppress(
                threshold["cpuSuppressThresholdPercent"],
                threshold["cpuSuppressPolicy"],
                threshold["cpuSuppressMinQuota"],
            )
        return cls(classes, suppress)

    @classmethod
    def from_text(cls, text: str) -> NodePolicy:
        """Parse YAML (which includes JSON).

        Raises:
            PolicyError: also for an empty text (only blanks or comments): a file caught between a
                writer's truncate and write would switch everything off; "nothing" is ``{}``.
        """
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PolicyError(f"not YAML/JSON: {exc}") from exc
        if data is None:
            raise PolicyError(
                "the file is empty (or only comments); a policy with nothing in force is {} — and write"
                " the file atomically (a temporary file renamed over it)"
            )
        return cls.from_mapping(data)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> NodePolicy:
        with open(path) as f:
            return cls.from_text(f.read())

    def strategy(self, qos: QoSClass) -> ClassStrategy | None:
        """The strategy for a pod of class ``qos`` (LSE → LSR; SYSTEM → none)."""
        return self.classes.get(QoSClass.LSR if qos is QoSClass.LSE else qos)

    def strategies(self) -> list[ClassStrategy]:
        """The strategies the policy sets, of the classes it can set (LSR, LS, BE in that order)."""
        return [s for qos in _CLASS_KEYS.values() if (s := self.strategy(qos)) is not None]


# -- the generated reference --------------------------------------------------------------------


def _default_text(key: Key) -> str:
    if key.default is None:
        return "not set (left alone)"
    if isinstance(key.default, bool):
        return "true" if key.default else "false"
    return str(key.default)


def _comment(key: Key) -> str:
    parts = [key.meaning]
    if not key.is_section:
        if key.unit:
            parts.append(f"unit: {key.unit}")
        parts.append(f"{key.allowed()}; default {_default_text(key)}")
    return "# " + "; ".join(parts)


def annotated_example() -> str:
    """A complete policy file with every key, each preceded by a comment saying what it means."""
    lines: list[str] = []
    commented: set[str] = set()

    def walk(section: Key, indent: str, where: str) -> None:
        for key in section.keys:
            path = _join(where, "<class>" if key.name in _CLASS_KEYS else key.name)
            if key.name in _CLASS_KEYS or path not in commented:  # the classes' keys: once
                lines.append(indent + _comment(key))
                commented.add(path)
            if key.is_section:
                lines.append(f"{indent}{key.name}:")
                walk(key, indent + "  ", path)
            else:
                example = key.example if key.example is not None else key.default
                lines.append(f"{indent}{key.name}: {example}")

    walk(SCHEMA, "", "")
    return "\n".join(lines) + "\n"


def _rows(section: Key, where: str) -> list[str]:
    rows = []
    seen: set[str] = set()
    for key in section.keys:
        # The three class sections share their keys: one set of rows for <class>.
        name = "<class>" if key.name in _CLASS_KEYS else key.name
        path = _join(where, name)
        if path in seen:
            continue
        seen.add(path)
        if key.is_section:
            meaning = key.meaning
            if name == "<class>":
                meaning = "; ".join(f"`{k.name}`: {k.meaning}" for k in section.keys if k.name in _CLASS_KEYS)
            rows.append(f"| `{path}` | {meaning} | | a mapping | absent (off) |")
            rows += _rows(key, path)
        else:
            allowed = " or ".join(f"`{c}`" for c in key.choices) if key.choices else key.allowed()
            rows.append(f"| `{path}` | {key.meaning} | {key.unit} | {allowed} | {_default_text(key)} |")
    return rows


def _not_implemented(section: Key, where: str) -> list[str]:
    found = [f"`{_join(where, name)}`" for name in section.koordinator]
    seen: set[str] = set()
    for key in section.keys:
        name = "<class>" if key.name in _CLASS_KEYS else key.name
        if name not in seen:
            seen.add(name)
            found += _not_implemented(key, _join(where, name))
    return found


def schema_markdown() -> str:
    """The policy reference of ``docs/plugin-authoring.md``: the annotated example and the key table."""
    return "\n".join(
        [
            "```yaml",
            annotated_example().rstrip("\n"),
            "```",
            "",
            "Every section also takes `enable` (default `true`; `false` switches the section off as if it"
            " were absent). A key not in this table is refused, like a bad value: the file is not taken"
            " and the last good policy stays in force. So are the keys of Koordinator's NodeSLO spec"
            " this hook server does not implement (the message says so), which are: "
            + "; ".join(_not_implemented(SCHEMA, ""))
            + ". A whole NodeSLO object is refused too: give what is under its `spec:`.",
            "",
            "| key | meaning | unit | allowed | default |",
            "|---|---|---|---|---|",
            *_rows(SCHEMA, ""),
        ]
    )
