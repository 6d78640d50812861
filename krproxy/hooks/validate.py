"""Checking a plugin's answer before it is applied: pure functions on records, no I/O.

A hook plugin is trusted to adjust pods and containers, but not to hand the runtime values that
no kubelet would send: a cgroup path that climbs out with ``..``, a negative memory limit, an
environment variable whose name contains ``=``. :func:`check_answer` lists what is wrong with one
pre-hook answer (an answer record, :class:`PodAnswer` or :class:`ContainerAnswer`, which
:mod:`krproxy.hooks.convert` reads from the wire once :func:`krproxy.hooks.convert.wrong_types` found every
field of its declared type); the dispatcher treats a non-empty list like any other plugin failure, under the
plugin's failure policy (``Fail`` rejects the CRI call naming plugin, hook and violation;
``Ignore`` drops that plugin's answer and goes on).

Only the fields that the merge rules (:mod:`krproxy.hooks.merge`) would apply are checked:
an empty ``cgroup_parent`` changes nothing and is fine; a pod answer's ``resources`` and every
answer's ``hugepage_limits`` are never applied, so are not checked — except that a
PreUpdatePodSandboxResources answer's ``resources`` are applied and checked, while its labels,
annotations and cgroup parent are not applied and not checked.

Rules (the bounds are the kernel's and runc's where they have one):

- pod ``cgroup_parent``: an absolute, clean path (no ``.``, ``..`` or empty components, not ``/``
  itself) or a systemd slice name (``kubepods-burstable.slice``; not the root slice ``-.slice``,
  nor a name runc cannot expand, such as ``a--b.slice`` or ``a-.slice``). Where a pod goes is the plugin's
  call (koordlet moves pods between QoS parents), so no subtree is imposed on pods.
- container ``pod_cgroup_parent``: as above, and equal to or below the pod's cgroup parent: the
  one kubelet sent in the sandbox config, or the one the pod's record holds (a PreRunPodSandbox
  plugin may have moved the pod). Unchecked against a subtree when neither is known.
- ``cpu_period`` 0 (unset) or 1000..1000000 µs; ``cpu_quota`` ≥ −1 (−1 unlimited, 0 unset);
  ``cpu_shares`` 0 (unset) or 2..262144.
- ``memory_limit_in_bytes`` 0..1 PiB; ``memory_swap_limit_in_bytes`` −1..1 PiB (−1 unlimited).
- ``oom_score_adj`` −1000..1000.
- ``cpuset_cpus`` / ``cpuset_mems``: ``""`` or a Linux cpu list such as ``0-3,8,10-15:2/4``.
- ``unified`` keys are cgroup file names: non-empty, no ``/``, not ``.``/``..``, no NUL.
- env names non-empty, without ``=`` or NUL; label, annotation keys non-empty, without NUL; no
  value contains NUL.
- sizes: a label, annotation or env key is at most :data:`MAX_KEY` (4096) characters, a value at
  most :data:`MAX_VALUE` (262144: Kubernetes' limit for all of a pod's annotations together, so
  no value kubelet sends is larger). The whole answer is at most 4 MiB
  (:data:`krproxy.hooks.dispatch.MAX_PLUGIN_ANSWER`), checked before it is decoded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from krproxy.hooks.model import ContainerAnswer, ContainerInfo, PodAnswer, PodInfo, PodResize, Resources
from krproxy.hooks.slices import ROOT, is_slice_name, slice_path

__all__ = [
    "INVALID_ANSWER",
    "MAX_BYTES",
    "MAX_KEY",
    "MAX_VALUE",
    "check_answer",
    "check_cgroup_parent",
    "check_container_answer",
    "check_cpu_list",
    "check_pod_answer",
    "check_pod_resize_answer",
    "check_resources",
    "is_below",
]

#: Largest key and value (characters) a plugin may set in labels, annotations and envs.
MAX_KEY = 4096
MAX_VALUE = 256 * 1024

#: How a violation's cause starts in logs, statuses and metrics.
INVALID_ANSWER = "invalid answer"

#: Largest memory or swap limit accepted: 1 PiB, far beyond any node, well below overflow.
MAX_BYTES = 1 << 50

#: Longest cgroup path accepted (the kernel's PATH_MAX).
_MAX_PATH = 4096

#: A systemd slice unit name: unit-name characters, ending in ``.slice``.
_SLICE = re.compile(r"[A-Za-z0-9:_.\\-]+\.slice")

#: One element of a Linux cpu list (``bitmap_parselist``): ``N``, ``N-M`` or ``N-M:used/group``.
_CPU_RANGE = re.compile(r"(\d{1,5})(?:-(\d{1,5})(?::(\d{1,5})/(\d{1,5}))?)?")


def _as_path(cgroup_parent: str) -> str:
    return cgroup_parent if "/" in cgroup_parent else slice_path(cgroup_parent)


def is_below(child: str, parent: str) -> bool:
    """Whether cgroup *child* is *parent* or lies under it (either may be a path or a slice name)."""
    c, p = _as_path(child), _as_path(parent)
    return c == p or c.startswith(p.rstrip("/") + "/")


def check_cgroup_parent(value: str) -> str | None:
    """What is wrong with a non-empty cgroup parent, or None if it is a clean absolute path or slice name."""
    if len(value) > _MAX_PATH:
        return f"longer than {_MAX_PATH} bytes"
    if "\0" in value:
        return "contains a NUL character"
    if "/" not in value:
        if not _SLICE.fullmatch(value) or not is_slice_name(value) or value == ROOT:
            return "neither an absolute path nor a systemd slice name"
        return None
    if not value.startswith("/"):
        return "not an absolute path"
    if value == "/":
        return "the root cgroup"
    parts = value[1:].split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "not a clean path (empty, '.' or '..' components)"
    return None


def check_cpu_list(value: str) -> str | None:
    """What is wrong with a cpuset string (``cpuset_cpus``/``cpuset_mems``), or None; ``""`` is fine."""
    if not value:
        return None
    for item in value.split(","):
        match = _CPU_RANGE.fullmatch(item)
        if match is None:
            return f"{item!r} is not a cpu number or range"
        first, last, used, group = match.groups()
        if last is not None and int(last) < int(first):
            return f"range {item!r} runs backwards"
        if group is not None and not (0 < int(used) <= int(group)):
            return f"stride {item!r} is not used/group with 0 < used <= group"
    return None


def check_resources(resources: Resources, prefix: str = "resources") -> list[str]:
    """Every out-of-range value in a hook answer's resources."""
    r = resources
    problems: list[str] = []

    def bad(field: str, value: object, allowed: str) -> None:
        problems.append(f"{prefix}.{field}={value!r} is not {allowed}")

    if r.cpu_period != 0 and not 1000 <= r.cpu_period <= 1_000_000:
        bad("cpu_period", r.cpu_period, "0 or 1000..1000000 µs")
    if r.cpu_quota < -1:
        bad("cpu_quota", r.cpu_quota, "-1 (unlimited) or more")
    if r.cpu_shares != 0 and not 2 <= r.cpu_shares <= 262_144:
        bad("cpu_shares", r.cpu_shares, "0 or 2..262144")
    if not 0 <= r.memory_limit_in_bytes <= MAX_BYTES:
        bad("memory_limit_in_bytes", r.memory_limit_in_bytes, "0..1 PiB")
    if not -1 <= r.memory_swap_limit_in_bytes <= MAX_BYTES:
        bad("memory_swap_limit_in_bytes", r.memory_swap_limit_in_bytes, "-1..1 PiB")
    if not -1000 <= r.oom_score_adj <= 1000:
        bad("oom_score_adj", r.oom_score_adj, "-1000..1000")
    for field in ("cpuset_cpus", "cpuset_mems"):
        problem = check_cpu_list(getattr(r, field))
        if problem is not None:
            problems.append(f"{prefix}.{field}: {problem}")
    for key, value in r.unified.items():
        if not key or "/" in key or "\0" in key or key in (".", ".."):
            problems.append(f"{prefix}.unified key {key!r} is not a cgroup file name")
        elif "\0" in value:
            problems.append(f"{prefix}.unified[{key}] contains a NUL character")
    return problems


def _check_map(name: str, values: Mapping[str, str]) -> list[str]:
    problems: list[str] = []
    for key, value in values.items():
        if not key:
            problems.append(f"{name} has an empty key")
        elif "\0" in key:
            problems.append(f"{name} key {key!r} contains a NUL character")
        elif "\0" in value:
            problems.append(f"{name}[{key}] contains a NUL character")
        problems += _check_sizes(name, key, value)
    return problems


def _check_sizes(name: str, key: str, value: str) -> list[str]:
    if len(key) > MAX_KEY:
        return [f"{name} key {key[:40]!r}... is longer than {MAX_KEY} characters"]
    if len(value) > MAX_VALUE:
        return [f"{name}[{key}] is longer than {MAX_VALUE} characters ({len(value)})"]
    return []


def _check_envs(envs: Mapping[str, str]) -> list[str]:
    problems: list[str] = []
    for key, value in envs.items():
        if not key or "=" in key or "\0" in key:
            problems.append(f"env name {key!r} is not a name (empty, or contains '=' or NUL)")
        elif "\0" in value:
            problems.append(f"env {key} value contains a NUL character")
        problems += _check_sizes("env", key, value)
    return problems


def check_pod_answer(pod: PodInfo, answer: PodAnswer) -> list[str]:
    """Violations in a PreRunPodSandbox answer for *pod* (the pod as the previous plugins left it)."""
    problems = _check_map("labels", answer.labels) + _check_map("annotations", answer.annotations)
    if answer.cgroup_parent and answer.cgroup_parent != pod.cgroup_parent:  # an echo is never wrong
        problem = check_cgroup_parent(answer.cgroup_parent)
        if problem is not None:
            problems.append(f"cgroup_parent {answer.cgroup_parent!r}: {problem}")
    return problems


def check_pod_resize_answer(resize: PodResize, answer: PodAnswer) -> list[str]:
    """Violations in a PreUpdatePodSandboxResources answer: only its ``resources`` are applied, so checked."""
    if answer.resources is None or resize.pod.resources is None:
        return []
    return check_resources(answer.resources, "resources")


def check_container_answer(info: ContainerInfo, answer: ContainerAnswer) -> list[str]:
    """Violations in a container pre-hook answer for *info* (as the previous plugins left it); a violation
    names the field as the hook protocol does (``container_annotations``, ``container_resources``)."""
    problems = _check_map("container_annotations", answer.annotations)
    if answer.resources is not None:
        problems += check_resources(answer.resources, "container_resources")
    problems += _check_envs(answer.envs)
    parent = answer.pod_cgroup_parent
    if parent and parent != info.pod_cgroup_parent:  # an echo is never wrong
        problem = check_cgroup_parent(parent)
        allowed = [p for p in (info.pod_cgroup_parent, info.pod.cgroup_parent) if p]
        if problem is None and allowed and not any(is_below(parent, p) for p in allowed):
            problem = "outside the pod's cgroup " + " / ".join(repr(p) for p in dict.fromkeys(allowed))
        if problem is not None:
            problems.append(f"pod_cgroup_parent {parent!r}: {problem}")
    return problems


def check_answer(record: object, answer: object) -> list[str]:
    """Violations in a pre-hook *answer* to a plugin called with *record* (a pod or container record).

    Answers of other types (and records of other kinds) are not checked: nothing is known about them.
    """
    if isinstance(record, PodInfo) and isinstance(answer, PodAnswer):
        return check_pod_answer(record, answer)
    if isinstance(record, ContainerInfo) and isinstance(answer, ContainerAnswer):
        return check_container_answer(record, answer)
    if isinstance(record, PodResize) and isinstance(answer, PodAnswer):
        return check_pod_resize_answer(record, answer)
    return []
