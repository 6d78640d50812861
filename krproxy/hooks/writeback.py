"""Writing records back into betterproto2 messages: the merged record into the CRI request it came from
(:func:`apply_run_pod`, :func:`apply_update`, :func:`apply_pod_resize`), and resources and envs into new CRI
or hook-protocol messages.

:mod:`krproxy.hooks.convert` reads wire messages into records, this module writes records into them;
CreateContainer and RestorePod are written with upb instead (:mod:`krproxy.hooks.rewrite`; the betterproto2
form it is held to, ``apply_create``, lives in tests/oracles.py). The merge rules themselves
(:mod:`krproxy.hooks.merge`) see records only.

Requests are cloned through their wire form (``copy.deepcopy`` of a betterproto2 message drops its unknown
fields) and resource messages are rewritten field by field, so unknown fields a newer kubelet sent survive;
a missing ``config.linux``/``sandbox_config.linux`` is created when something must be written into it.

:func:`merge_pod` and :func:`merge_update_container` merge one wire answer into one wire request (read, merge,
write back): the reference path of the tests and the fuzzers (tests/oracles.py has CreateContainer's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from krproxy.hooks.convert import (
    container_answer,
    pod_answer,
    pod_from_run_request,
    update_request_resources,
)
from krproxy.hooks.merge import Merged, merge_container_info, merge_pod_info, prepare_update
from krproxy.hooks.model import ContainerInfo, PodInfo, PodResize, Resources
from krproxy.proto.runtime import v1, v1alpha1

__all__ = [
    "apply_pod_resize",
    "apply_run_pod",
    "apply_update",
    "envs_to_cri",
    "merge_pod",
    "merge_update_container",
    "resources_to_cri",
    "resources_to_hook",
    "write_resources",
    "write_scalars",
]

_M = TypeVar(
    "_M",
    v1.RunPodSandboxRequest,
    v1.UpdateContainerResourcesRequest,
    v1.UpdatePodSandboxResourcesRequest,
)
_AnyResources = v1.LinuxContainerResources | v1alpha1.LinuxContainerResources


# --- resources and envs ------------------------------------------------------------------------------------


def write_scalars(target: Any, resources: Resources) -> None:
    """Set the one-value fields of a LinuxContainerResources *target* (betterproto2 or upb, CRI or hook
    protocol: the same field names) from *resources*; hugepage limits and ``unified`` are each API's own.

    The fields of :data:`RESOURCE_SCALARS`, written one by one rather than by ``setattr`` over the names
    (two calls a field, on every hooked CreateContainer's rewrite)."""
    target.cpu_period = resources.cpu_period
    target.cpu_quota = resources.cpu_quota
    target.cpu_shares = resources.cpu_shares
    target.memory_limit_in_bytes = resources.memory_limit_in_bytes
    target.oom_score_adj = resources.oom_score_adj
    target.cpuset_cpus = resources.cpuset_cpus
    target.cpuset_mems = resources.cpuset_mems
    target.memory_swap_limit_in_bytes = resources.memory_swap_limit_in_bytes


def write_resources(target: _AnyResources, resources: Resources) -> None:
    """Set every field of *target* (a CRI or hook message) from *resources*, keeping its unknown fields."""
    write_scalars(target, resources)
    target.unified = dict(resources.unified)
    if isinstance(target, v1.LinuxContainerResources):
        target.hugepage_limits = [
            v1.HugepageLimit(page_size=s, limit=n) for s, n in resources.hugepage_limits
        ]
    else:
        target.hugepage_limits = [
            v1alpha1.HugepageLimit(page_size=s, limit=n) for s, n in resources.hugepage_limits
        ]


def resources_to_cri(resources: Resources) -> v1.LinuxContainerResources:
    """:class:`Resources` → a new CRI ``LinuxContainerResources``."""
    message = v1.LinuxContainerResources()
    write_resources(message, resources)
    return message


def resources_to_hook(resources: Resources) -> v1alpha1.LinuxContainerResources:
    """:class:`Resources` → a new hook-protocol ``LinuxContainerResources``."""
    message = v1alpha1.LinuxContainerResources()
    write_resources(message, resources)
    return message


def envs_to_cri(envs: Mapping[str, str]) -> list[v1.KeyValue]:
    """Map → CRI env list, in the map's order."""
    return [v1.KeyValue(key=k, value=v.encode("utf-8", "surrogateescape")) for k, v in envs.items()]


# --- the merged record into its request --------------------------------------------------------------------


def _clone(message: _M) -> _M:
    """A deep copy that keeps unknown fields (``copy.deepcopy`` of a betterproto2 message loses them)."""
    return type(message).FromString(message.SerializeToString())


def apply_run_pod(request: v1.RunPodSandboxRequest, pod: PodInfo) -> v1.RunPodSandboxRequest:
    """A copy of *request* with the pod record's labels, annotations and (if non-empty) cgroup parent."""
    out = _clone(request)
    if out.config is None:
        out.config = v1.PodSandboxConfig()
    out.config.labels = dict(pod.labels)
    out.config.annotations = dict(pod.annotations)
    if pod.cgroup_parent:
        if out.config.linux is None:
            out.config.linux = v1.LinuxPodSandboxConfig()
        out.config.linux.cgroup_parent = pod.cgroup_parent
    return out


def apply_update(
    request: v1.UpdateContainerResourcesRequest, info: ContainerInfo
) -> v1.UpdateContainerResourcesRequest:
    """A copy of *request* whose ``linux`` is the record's resources (if known) and whose annotations are the
    request's with the record's added/overwritten."""
    out = _clone(request)
    if info.resources is not None:
        if out.linux is None:
            out.linux = v1.LinuxContainerResources()
        write_resources(out.linux, info.resources)
    out.annotations = {**out.annotations, **info.annotations}
    return out


def apply_pod_resize(
    request: v1.UpdatePodSandboxResourcesRequest, resize: PodResize
) -> v1.UpdatePodSandboxResourcesRequest:
    """A copy of *request* whose ``resources`` are the resize's (every field; unknown fields kept)."""
    out = _clone(request)
    if resize.pod.resources is not None:
        if out.resources is None:
            out.resources = v1.LinuxContainerResources()
        write_resources(out.resources, resize.pod.resources)
    return out


def merge_pod(
    request: v1.RunPodSandboxRequest, response: v1alpha1.PodSandboxHookResponse
) -> Merged[v1.RunPodSandboxRequest]:
    """Merge one PreRunPodSandbox answer into a RunPodSandbox request."""
    merged = merge_pod_info(pod_from_run_request(request), pod_answer(response))
    return Merged(apply_run_pod(request, merged.value), merged.changes)


def merge_update_container(
    request: v1.UpdateContainerResourcesRequest,
    stored: ContainerInfo,
    response: v1alpha1.ContainerResourceHookResponse,
) -> Merged[v1.UpdateContainerResourcesRequest]:
    """Merge one PreUpdateContainerResources answer into an UpdateContainerResources request, given the
    stored record (the request is first merged into it by :func:`prepare_update`)."""
    prepared = prepare_update(stored, update_request_resources(request))
    merged = merge_container_info(prepared, container_answer(response))
    return Merged(apply_update(request, merged.value), merged.changes)
