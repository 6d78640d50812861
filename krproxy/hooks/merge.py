"""Koordinator's merge rules: how a plugin's answer changes the pod/container record.

Pure functions on records (:mod:`krproxy.hooks.model`); nothing here mutates its arguments or touches a wire
message. Each merge takes the record and a hook server's answer record (:class:`PodAnswer`,
:class:`ContainerAnswer`, read from the wire by :mod:`krproxy.hooks.convert`) and returns a :class:`Merged`
value: the new record plus the :class:`Change` list that describes the hook's decision (for logs and traces).
Chaining several plugins, each sees the previous one's result: :func:`merge_pod_info`,
:func:`merge_container_info`, :func:`merge_pod_resize`, :func:`prepare_update`, and the field rules
:func:`update_resource` / :func:`update_resource_by_update_request`. Writing the merged record back into the
CRI request is :mod:`krproxy.hooks.writeback`'s (betterproto2) and :mod:`krproxy.hooks.rewrite`'s (upb,
CreateContainer on the request path); :func:`create_envs` is the env order both write.

Rules (koord-runtime-proxy v1.8, ``resexecutor/cri``; see shared/notes/hook-semantics.md 2.4):

* Pod: labels and annotations add/overwrite, never delete; ``cgroup_parent`` replaced if the answer's is
  non-empty; the answer's ``resources`` are ignored (CRI mode).
* Container: annotations add/overwrite; resources by :func:`update_resource`, then the *whole*
  ``config.linux.resources`` (CreateContainer) / ``linux`` (UpdateContainerResources) is replaced by the
  merged values; ``pod_cgroup_parent`` non-empty → ``sandbox_config.linux.cgroup_parent``; a non-empty
  ``container_envs`` map replaces the env set (proto3 cannot tell an empty map from an absent one, and Go's
  ``!= nil`` test sees both as nil, so an empty map changes nothing), and CreateContainer's ``config.envs`` is
  always rebuilt from the map — duplicates collapse even when no plugin touched the envs.
* Env order (Go's is random): names that were in the request keep their first position, names a plugin added
  follow, sorted by name. Deterministic, and a request no plugin changed keeps its order.
* UpdatePodSandboxResources (krproxy's PreUpdatePodSandboxResources, no reference): only the answer's
  ``resources`` are applied, merged into the requested ones by :func:`update_resource` (the container rules:
  echo what you keep), and only when the request carries resources; the request's ``resources`` are then
  replaced by the result. The answer's labels, annotations and cgroup parent have nowhere to go in the CRI
  request (a running pod is not relabelled or moved) and are ignored; the overhead is not in the answer.
* UpdateContainerResources: the stored resources are first updated by the request
  (:func:`prepare_update`), then by the answer. Annotations: the reference *replaces* the request's
  annotations by stored ∪ answer; we keep the request's own annotations underneath (stored ∪ answer win on
  conflict), so the values the reference would send are sent and nothing is silently dropped.

Beyond the reference: unknown fields a newer kubelet sent survive a merge, and a missing
``config.linux``/``sandbox_config.linux`` (a nil dereference in the reference) is created when something must be
written into it (see :mod:`krproxy.hooks.writeback`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Generic, TypeVar

import attrs

from krproxy.hooks.model import (
    RESOURCE_SCALARS,
    ContainerAnswer,
    ContainerInfo,
    PodAnswer,
    PodInfo,
    PodResize,
    Resources,
    evolve,
)

__all__ = [
    "Change",
    "Merged",
    "create_envs",
    "merge_container_info",
    "merge_pod_info",
    "merge_pod_resize",
    "prepare_update",
    "update_resource",
    "update_resource_by_update_request",
]

T = TypeVar("T")


@attrs.frozen
class Change:
    """One field a hook changed.

    Attributes:
        field: record field path, e.g. ``"annotations[a.b/c]"``, ``"resources.cpu_quota"``, ``"envs[PATH]"``.
        old: the value before; ``None`` if the key was absent.
        new: the value after; ``None`` if the key is gone (only envs can lose keys).
    """

    field: str
    old: str | int | None
    new: str | int | None


@attrs.frozen
class Merged(Generic[T]):
    """The result of a merge: the new *value* and the *changes* that led to it (empty if none).

    *changes* are never reported for a *value* equal to the record merged into (the dispatcher takes a
    merge with changes as one that changed the record, without comparing the two)."""

    value: T
    changes: tuple[Change, ...] = ()


# --- field rules -------------------------------------------------------------------------------------------


def _alike(a: Resources, b: Resources) -> dict[str, Any]:
    """The fields both of Koordinator's resource rules treat alike: cpu_period, cpu_shares, memory limit and
    swap if b > 0; cpu_quota if b ≠ 0 (−1 = unlimited); unified add/overwrite."""
    return {
        "cpu_period": b.cpu_period if b.cpu_period > 0 else a.cpu_period,
        "cpu_quota": b.cpu_quota if b.cpu_quota != 0 else a.cpu_quota,
        "cpu_shares": b.cpu_shares if b.cpu_shares > 0 else a.cpu_shares,
        "memory_limit_in_bytes": b.memory_limit_in_bytes
        if b.memory_limit_in_bytes > 0
        else a.memory_limit_in_bytes,
        "unified": a.unified.merged(b.unified),
        "memory_swap_limit_in_bytes": (
            b.memory_swap_limit_in_bytes if b.memory_swap_limit_in_bytes > 0 else a.memory_swap_limit_in_bytes
        ),
    }


def update_resource(a: Resources, b: Resources | None) -> Resources:
    """Koordinator's ``updateResource``: merge a hook answer's resources *b* into *a*.

    The fields of :func:`_alike`; oom_score_adj if −1000 ≤ b ≤ 1000 (so a 0 resets it); cpuset_cpus and
    cpuset_mems always, even ""; hugepage_limits never. ``b is None`` leaves *a* as is.
    """
    if b is None:
        return a
    return evolve(
        a,
        **_alike(a, b),
        oom_score_adj=b.oom_score_adj if -1000 <= b.oom_score_adj <= 1000 else a.oom_score_adj,
        cpuset_cpus=b.cpuset_cpus,
        cpuset_mems=b.cpuset_mems,
    )


def update_resource_by_update_request(a: Resources, b: Resources) -> Resources:
    """Koordinator's ``updateResourceByUpdateContainerResourceRequest``: merge an UpdateContainerResources
    request's resources *b* into the stored *a*.

    Like :func:`update_resource` except: cpusets only if non-empty, oom_score_adj never.
    """
    return evolve(
        a,
        **_alike(a, b),
        cpuset_cpus=b.cpuset_cpus or a.cpuset_cpus,
        cpuset_mems=b.cpuset_mems or a.cpuset_mems,
    )


# --- change descriptions -----------------------------------------------------------------------------------


def _diff_map(prefix: str, old: Mapping[str, str], new: Mapping[str, str]) -> list[Change]:
    changes = [Change(f"{prefix}[{k}]", old.get(k), v) for k, v in new.items() if old.get(k) != v]
    changes += [Change(f"{prefix}[{k}]", v, None) for k, v in old.items() if k not in new]
    return changes


def _diff_resources(prefix: str, old: Resources | None, new: Resources | None) -> list[Change]:
    if old == new:
        return []
    before, after = old or Resources(), new or Resources()
    changes = [
        Change(f"{prefix}.{name}", getattr(before, name), getattr(after, name))
        for name in RESOURCE_SCALARS
        if getattr(before, name) != getattr(after, name) or old is None or new is None
    ]
    if before.hugepage_limits != after.hugepage_limits:
        changes.append(
            Change(f"{prefix}.hugepage_limits", repr(before.hugepage_limits), repr(after.hugepage_limits))
        )
    return changes + _diff_map(f"{prefix}.unified", before.unified, after.unified)


def _diff_pod(old: PodInfo, new: PodInfo) -> tuple[Change, ...]:
    changes = _diff_map("labels", old.labels, new.labels) + _diff_map(
        "annotations", old.annotations, new.annotations
    )
    if old.cgroup_parent != new.cgroup_parent:
        changes.append(Change("cgroup_parent", old.cgroup_parent, new.cgroup_parent))
    return tuple(changes)


def _diff_container(old: ContainerInfo, new: ContainerInfo) -> tuple[Change, ...]:
    changes = _diff_map("annotations", old.annotations, new.annotations)
    changes += _diff_resources("resources", old.resources, new.resources)
    if old.pod_cgroup_parent != new.pod_cgroup_parent:
        changes.append(Change("pod_cgroup_parent", old.pod_cgroup_parent, new.pod_cgroup_parent))
    changes += _diff_map("envs", old.envs, new.envs)
    return tuple(changes)


# --- record level ------------------------------------------------------------------------------------------


def merge_pod_info(pod: PodInfo, answer: PodAnswer) -> Merged[PodInfo]:
    """Merge a PreRunPodSandbox answer into the pod record (its ``resources`` are ignored in CRI mode)."""
    merged = evolve(
        pod,
        labels=pod.labels.merged(answer.labels),
        annotations=pod.annotations.merged(answer.annotations),
        cgroup_parent=answer.cgroup_parent or pod.cgroup_parent,
    )
    return Merged(merged, _diff_pod(pod, merged))


def merge_pod_resize(resize: PodResize, answer: PodAnswer) -> Merged[PodResize]:
    """Merge a PreUpdatePodSandboxResources answer into the resize: its ``resources`` by :func:`update_resource`
    (when the request carried resources); everything else in the answer is ignored."""
    requested = resize.pod.resources
    if requested is None:
        return Merged(resize)
    resources = update_resource(requested, answer.resources)
    if resources == requested:
        return Merged(resize)
    merged = evolve(resize, pod=evolve(resize.pod, resources=resources))
    return Merged(merged, tuple(_diff_resources("resources", requested, resources)))


def merge_container_info(info: ContainerInfo, answer: ContainerAnswer) -> Merged[ContainerInfo]:
    """Merge a container hook's answer into the container record.

    Resources are merged only when both the record and the answer have them (Koordinator: ``a == nil ||
    b == nil`` → unchanged). PreStartContainer uses exactly this: the answer changes the stored record only.
    """
    resources = info.resources
    if resources is not None:
        resources = update_resource(resources, answer.resources)
    merged = evolve(
        info,
        annotations=info.annotations.merged(answer.annotations),
        resources=resources,
        pod_cgroup_parent=answer.pod_cgroup_parent or info.pod_cgroup_parent,
        envs=answer.envs if answer.envs else info.envs,
    )
    return Merged(merged, _diff_container(info, merged))


def prepare_update(info: ContainerInfo, requested: Resources | None) -> ContainerInfo:
    """The record a PreUpdateContainerResources hook sees: the stored *info* with the resources the
    UpdateContainerResources request asks for (*requested*: its ``linux``, ``None`` when it carries none)
    merged in by :func:`update_resource_by_update_request`.

    If the stored resources are unknown (recovered without them) the requested resources are taken as they
    are — the reference would send none and then drop the plugin's resource changes.
    """
    if info.resources is None:
        if requested is None:
            return info
        return evolve(info, resources=requested)
    return evolve(
        info,
        resources=update_resource_by_update_request(
            info.resources, requested if requested is not None else Resources()
        ),
    )


# --- the CreateContainer environment ---------------------------------------------------------------------


def create_envs(sent: Iterable[str], envs: Mapping[str, str]) -> dict[str, str]:
    """The record's *envs* in the order CreateContainer's ``config.envs`` is rebuilt in: the names the request
    *sent* (in its order, first place of a repeated name) that are still set, then the added ones by name."""
    seen = list(dict.fromkeys(sent))
    known = set(seen)
    ordered = [k for k in seen if k in envs] + sorted(k for k in envs if k not in known)
    return {k: envs[k] for k in ordered}
