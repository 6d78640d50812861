"""Named conversions from wire messages (CRI ``runtime.v1``, hook protocol ``runtime.v1alpha1``) to the
domain records of :mod:`krproxy.hooks.model`. Every wire message the hook core reads passes here; records are
written back by :mod:`krproxy.hooks.writeback` (betterproto2) and :mod:`krproxy.hooks.rewrite` (upb), and
into hook requests by :mod:`krproxy.hooks.encode`, the one encoder of every front end.

From CRI requests (the live path, koord-runtime-proxy's ``ParseRequest``):

* :func:`pod_from_run_request` — RunPodSandbox → :class:`PodInfo`: name, uid, namespace, runtime handler,
  labels, annotations, ``config.linux.cgroup_parent``. ``resources``/``overhead`` stay ``None`` (the reference
  fills them in Docker mode only). Unlike the reference we also keep the metadata ``attempt`` and pass it on
  in ``pod_meta`` (an additive field no plugin is known to read).
* :func:`container_from_wire_create` — CreateContainer (decoded with upb, :mod:`krproxy.hooks.rewrite`) + the
  stored pod → :class:`ContainerInfo`: name, attempt, annotations, ``config.linux.resources`` (always present,
  zero when absent), envs (list → map, the later value of a duplicated name wins, first-seen order kept),
  ``sandbox_config.linux.cgroup_parent``; :func:`pod_from_wire_config` for a pod the store lacks. RestorePod
  (:mod:`krproxy.hooks.restore`) reads each container it restores the same way.

Why two decoders. A request the proxy rewrites with :mod:`krproxy.hooks.writeback` (RunPodSandbox,
UpdateContainerResources, UpdatePodSandboxResources) is decoded with betterproto2; CreateContainer (the most
frequent, the largest), RestorePod and recovery's answers with upb, for speed. The two decoders show a message
differently: betterproto2 gives ``None`` for an absent sub-message and a dict for a map, upb an empty message
and the map's repeated entries; so a pod has a reader for each (``pod_from_run_request`` / ``_wire_pod``),
built in one place, ``_pod``. CreateContainer's betterproto2 reader, the reference the upb one is held to for
the same bytes, lives in tests/oracles.py (``container_from_create_request``, with tests/unit/test_hooks_rewrite.py).

From CRI List/Status answers (store recovery after a restart; the reference recovers only metadata, labels and
annotations and loses cgroup parent, resources and envs). Recovery decodes thousands of these, so they arrive
as upb messages (:mod:`krproxy.hooks.wire`, about 100× faster than betterproto2), not betterproto2 ones:

* :func:`pod_from_wire_sandbox` / :func:`container_from_wire_list` — what ``ListPodSandbox``/``ListContainers``
  carry (reference parity: no cgroup parent, resources unknown, no envs).
* :func:`pod_from_wire_status` / :func:`container_from_wire_status` — ``PodSandboxStatus``/``ContainerStatus``
  plus the ``info`` map of a ``verbose=true`` status call. What each runtime reports:

  - ``PodSandboxStatus`` has no cgroup parent field. containerd (1.6 and later) puts a JSON document under
    ``info["info"]`` whose ``config`` is the PodSandboxConfig it received (so ``config.linux.cgroup_parent``
    is exactly what the proxy forwarded, after hooks) and whose ``runtimeSpec.linux.cgroupsPath`` is the OCI
    cgroup path. We take ``config.linux.cgroup_parent`` first, else derive the parent from ``cgroupsPath``
    (``parent:prefix:id`` systemd form → ``parent``; a cgroupfs path ending in the sandbox id → its
    directory), else ``""``.
  - ``ContainerStatus.resources.linux`` is the runtime's view of the current resources (containerd 1.6.20
    fills it, as do later versions and CRI-O; older ones leave it empty). Then we fall back to the verbose
    ``config.linux.resources`` — the creation-time values, stale if UpdateContainerResources ran since —
    else ``None`` (unknown). The swap limit is the exception: runtimes report a *derived* value there
    (containerd 1.6 reports swap = memory limit when none was asked for), and carrying that into later
    update requests would send a limit nobody set; so swap is always taken from the verbose config (what
    was actually requested), 0 when absent. We do not read ``runtimeSpec.linux.resources`` at all:
    containerd rewrites values there too.
  - envs come from the verbose ``config.envs`` (the CRI envs; ``runtimeSpec.process.env`` also holds the
    image's variables, so it is not used); absent → empty.
  - a pod's resources and overhead as the last UpdatePodSandboxResources set them: containerd 2.3 reports
    them in ``info["info"]`` as ``resources.linux`` / ``overhead.linux``; absent (older runtimes, no resize
    yet) → ``None``, as in the live path.
  Malformed or missing verbose info is never an error: the field is simply not recovered.

* :func:`pod_resize_from_request` — UpdatePodSandboxResources + the stored pod → :class:`PodResize`: the
  stored record with ``resources`` and ``overhead`` set to the requested ones (``None`` where absent).

From hook servers' answers: :func:`wrong_types` lists the fields betterproto2 decoded with a type not their
own, and :func:`pod_answer` / :func:`container_answer` read a well-typed answer into its record.

CRI ``KeyValue.value`` is ``bytes`` in our schema while hook-protocol envs are strings: values are decoded as
UTF-8 with ``surrogateescape`` (so they encode back to the same bytes; :mod:`krproxy.hooks.encode` sends any
undecodable byte as U+FFFD).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from krproxy.hooks.model import (
    RESOURCE_SCALARS,
    RESOURCE_STRINGS,
    ContainerAnswer,
    ContainerInfo,
    FrozenMap,
    PodAnswer,
    PodInfo,
    PodResize,
    Resources,
    json_int,
    json_str,
    resource_scalar,
)
from krproxy.proto.runtime import v1, v1alpha1

__all__ = [
    "WRONG_TYPES",
    "answer_from_hook",
    "cgroup_parent_from_verbose",
    "container_answer",
    "container_from_wire_create",
    "container_from_wire_list",
    "container_from_wire_status",
    "envs_from_cri",
    "pod_answer",
    "pod_from_run_request",
    "pod_from_wire_config",
    "pod_from_wire_sandbox",
    "pod_from_wire_status",
    "pod_resize_from_request",
    "resources_from_cri",
    "resources_from_hook",
    "resources_from_wire",
    "update_request_resources",
    "wrong_types",
]

#: How the violation of :func:`wrong_types` starts.
WRONG_TYPES = "answer has fields of the wrong type"


# --- resources and envs ------------------------------------------------------------------------------------


def _resources_from(r: Any, unified: Mapping[str, str] | None = None) -> Resources:
    """Resources of a CRI or hook message (betterproto2, or upb with ``unified`` read as a dict).

    The fields of :data:`RESOURCE_SCALARS` are read one by one, not by ``getattr`` over the names: this
    runs for the request and each answer of every hooked call (tests/unit/test_hooks_convert.py holds the
    two lists together)."""
    pages = r.hugepage_limits
    return Resources(
        cpu_period=r.cpu_period,
        cpu_quota=r.cpu_quota,
        cpu_shares=r.cpu_shares,
        memory_limit_in_bytes=r.memory_limit_in_bytes,
        oom_score_adj=r.oom_score_adj,
        cpuset_cpus=r.cpuset_cpus,
        cpuset_mems=r.cpuset_mems,
        hugepage_limits=[(h.page_size, h.limit) for h in pages] if pages else (),
        unified=r.unified if unified is None else unified,
        memory_swap_limit_in_bytes=r.memory_swap_limit_in_bytes,
    )


def resources_from_cri(resources: v1.LinuxContainerResources | None) -> Resources:
    """CRI resources → :class:`Resources`; ``None`` gives all-zero resources (like Go's nil-safe getters)."""
    return _resources_from(resources) if resources is not None else Resources()


def resources_from_hook(resources: v1alpha1.LinuxContainerResources | None) -> Resources | None:
    """Hook-protocol resources → :class:`Resources`; ``None`` stays ``None`` (the plugin sent none)."""
    return _resources_from(resources) if resources is not None else None


def resources_from_wire(resources: Any, unified: Mapping[str, str]) -> Resources:
    """A upb ``LinuxContainerResources`` (CRI's or the hook protocol's) → :class:`Resources`, its ``unified``
    map read as *unified* (its entries: :func:`_entries`)."""
    return _resources_from(resources, unified)


def envs_from_cri(envs: Iterable[v1.KeyValue]) -> FrozenMap[str, str]:
    """CRI env list → map: a later value of a duplicated name wins, names keep their first-seen position."""
    return FrozenMap((kv.key, kv.value.decode("utf-8", "surrogateescape")) for kv in envs)


# --- from CRI requests -------------------------------------------------------------------------------------


def _pod(meta: Any, labels: Mapping[str, str], annotations: Mapping[str, str], **more: Any) -> PodInfo:
    """The pod record of a PodSandboxMetadata *meta* (either decoder's) and the maps read beside it, with the
    fields *more* gives: every reader of a pod, betterproto2 or upb, builds it here."""
    return PodInfo(
        name=meta.name,
        uid=meta.uid,
        namespace=meta.namespace,
        attempt=meta.attempt,
        labels=labels,
        annotations=annotations,
        **more,
    )


def pod_from_run_request(request: v1.RunPodSandboxRequest) -> PodInfo:
    """The pod record of a RunPodSandbox request (before or after hooks were merged into it)."""
    config = request.config or v1.PodSandboxConfig()
    return _pod(
        config.metadata or v1.PodSandboxMetadata(),
        config.labels,
        config.annotations,
        runtime_handler=request.runtime_handler,
        cgroup_parent=config.linux.cgroup_parent if config.linux is not None else "",
    )


def update_request_resources(request: v1.UpdateContainerResourcesRequest) -> Resources | None:
    """The resources an UpdateContainerResources request asks for (its ``linux``); ``None`` if it carries none."""
    return resources_from_cri(request.linux) if request.linux is not None else None


def pod_resize_from_request(request: v1.UpdatePodSandboxResourcesRequest, pod: PodInfo) -> PodResize:
    """The resize an UpdatePodSandboxResources request asks for; *pod* is the stored record of its sandbox."""
    return PodResize(
        pod_sandbox_id=request.pod_sandbox_id,
        pod=attrs.evolve(
            pod,
            resources=resources_from_cri(request.resources) if request.resources is not None else None,
            overhead=resources_from_cri(request.overhead) if request.overhead is not None else None,
        ),
    )


# --- from CRI List/Status answers (recovery) ---------------------------------------------------------------


def _verbose(info: Mapping[str, str] | None) -> dict[str, Any]:
    """The JSON document a runtime puts under ``info["info"]`` of a verbose status, or ``{}``."""
    if not info or "info" not in info:
        return {}
    try:
        document = json.loads(info["info"])
    except (ValueError, RecursionError):
        return {}
    return document if isinstance(document, dict) else {}


def _dig(document: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(document, dict):
            return None
        document = document.get(key)
    return document


def _cgroup_parent_from_path(cgroups_path: str, sandbox_id: str) -> str:
    parts = cgroups_path.split(":")
    if len(parts) == 3:  # systemd driver: "<parent slice>:<prefix>:<id>"
        return parts[0]
    head, _, tail = cgroups_path.rstrip("/").rpartition("/")
    if sandbox_id and sandbox_id in tail:  # cgroupfs driver: "<parent>/<id>" (CRI-O: "<parent>/crio-<id>")
        return head
    return ""


def cgroup_parent_from_verbose(info: Mapping[str, str] | None, sandbox_id: str) -> str:
    """A sandbox's cgroup parent from a verbose ``PodSandboxStatus`` *info* map ("" if not found):
    containerd's ``config.linux.cgroup_parent``, else derived from ``runtimeSpec.linux.cgroupsPath``."""
    return _cgroup_parent_from_document(_verbose(info), sandbox_id)


def _cgroup_parent_from_document(document: dict[str, Any], sandbox_id: str) -> str:
    cgroup_parent = _dig(document, "config", "linux", "cgroup_parent")
    if isinstance(cgroup_parent, str) and cgroup_parent:
        return cgroup_parent
    cgroups_path = _dig(document, "runtimeSpec", "linux", "cgroupsPath")
    return _cgroup_parent_from_path(cgroups_path, sandbox_id) if isinstance(cgroups_path, str) else ""


def cgroups_path_from_verbose(info: Mapping[str, str] | None) -> str:
    """A container's (or sandbox's) OCI ``linux.cgroupsPath`` from a verbose status *info* map
    (containerd and CRI-O: ``runtimeSpec.linux.cgroupsPath`` in ``info["info"]``), "" if not found."""
    cgroups_path = _dig(_verbose(info), "runtimeSpec", "linux", "cgroupsPath")
    return cgroups_path if isinstance(cgroups_path, str) else ""


def _resources_from_json(document: Any) -> Resources | None:
    """Resources from the Go-JSON form of a CRI LinuxContainerResources (snake_case keys, omitempty)."""
    if not isinstance(document, dict):
        return None
    hugepages = document.get("hugepage_limits")
    unified = document.get("unified")
    return Resources(
        **{name: resource_scalar(name, document.get(name)) for name in RESOURCE_SCALARS},
        hugepage_limits=[
            (json_str(h.get("page_size")), json_int(h.get("limit")))
            for h in (hugepages if isinstance(hugepages, list) else [])
            if isinstance(h, dict)
        ],
        unified=(
            {k: v for k, v in unified.items() if isinstance(v, str)} if isinstance(unified, dict) else None
        ),
    )


def _envs_from_json(document: Any) -> FrozenMap[str, str]:
    if not isinstance(document, list):
        return FrozenMap()
    return FrozenMap(
        (json_str(kv.get("key")), json_str(kv.get("value")))
        for kv in document
        if isinstance(kv, dict) and isinstance(kv.get("key"), str)
    )


def _recovered_resources(reported: Resources | None, document: Any) -> Resources | None:
    """A recovered container's resources: those the runtime reports (with the swap limit of the requested
    config, 0 when absent), else the requested ones of the verbose *document*, else ``None``."""
    requested = _resources_from_json(_dig(document, "config", "linux", "resources"))
    if reported is None:
        return requested
    return attrs.evolve(
        reported,
        memory_swap_limit_in_bytes=requested.memory_swap_limit_in_bytes if requested is not None else 0,
    )


# --- from upb-decoded messages (recovery and the CreateContainer request, krproxy.hooks.wire) --------------
#
# upb reads an unset sub-message as an empty one (hence HasField where "absent" differs from "empty"), and
# map fields come as repeated key/value entries (a key sent twice: the later value, in the first place).


def _entries(field: Iterable[Any]) -> dict[str, Any]:
    """A map field read as its repeated entries → the dict betterproto2 decodes (see ``wire.entries``)."""
    return {entry.key: entry.value for entry in field}


def container_from_wire_create(request: Any, pod: PodInfo) -> ContainerInfo:
    """The container record of a upb-decoded CreateContainer (:mod:`krproxy.hooks.rewrite`, the request path;
    RestorePod's containers); *pod* is the stored record of its sandbox."""
    config = request.config
    meta = config.metadata
    resources = config.linux.resources
    return ContainerInfo(
        pod_sandbox_id=request.pod_sandbox_id,
        pod=pod,
        name=meta.name,
        attempt=meta.attempt,
        annotations=_entries(config.annotations),
        resources=_resources_from(resources, _entries(resources.unified)),
        envs=envs_from_cri(config.envs),
        pod_cgroup_parent=request.sandbox_config.linux.cgroup_parent,
    )


def _wire_pod(item: Any, **more: Any) -> PodInfo:
    """The pod record of a upb message with a PodSandboxMetadata ``metadata``, ``labels`` and ``annotations``
    (a PodSandboxConfig, a ListPodSandbox item, a PodSandboxStatus), with the fields *more* gives."""
    return _pod(item.metadata, _entries(item.labels), _entries(item.annotations), **more)


def pod_from_wire_config(config: Any, runtime_handler: str = "") -> PodInfo:
    """:func:`pod_from_run_request` of a RunPodSandbox carrying the upb-decoded *config* (a watched
    RunPodSandbox's, a CreateContainer's ``sandbox_config`` for a pod the store does not know)."""
    return _wire_pod(config, runtime_handler=runtime_handler, cgroup_parent=config.linux.cgroup_parent)


def pod_from_wire_sandbox(sandbox: Any) -> PodInfo:
    """The pod record recoverable from a ListPodSandbox item (no cgroup parent: the list does not carry it)."""
    return _wire_pod(sandbox, runtime_handler=sandbox.runtime_handler)


def pod_from_wire_status(status: Any, info: Mapping[str, str] | None = None) -> PodInfo:
    """The pod record recoverable from PodSandboxStatus and its verbose *info* (see the module docstring)."""
    document = _verbose(info)
    return _wire_pod(
        status,
        runtime_handler=status.runtime_handler,
        cgroup_parent=_cgroup_parent_from_document(document, status.id),
        resources=_resources_from_json(_dig(document, "resources", "linux")),
        overhead=_resources_from_json(_dig(document, "overhead", "linux")),
    )


def _wire_container(item: Any, pod_sandbox_id: str, pod: PodInfo, **more: Any) -> ContainerInfo:
    """The container record of a upb ListContainers item or ContainerStatus (``metadata``, ``id``,
    ``annotations``) in sandbox *pod_sandbox_id* of *pod*, with the fields *more* gives."""
    return ContainerInfo(
        pod_sandbox_id=pod_sandbox_id,
        pod=pod,
        name=item.metadata.name,
        attempt=item.metadata.attempt,
        id=item.id,
        annotations=_entries(item.annotations),
        pod_cgroup_parent=pod.cgroup_parent,
        **more,
    )


def container_from_wire_list(container: Any, pod: PodInfo) -> ContainerInfo:
    """The container record recoverable from a ListContainers item (resources unknown, no envs)."""
    return _wire_container(container, container.pod_sandbox_id, pod, resources=None)


def container_from_wire_status(
    status: Any,
    pod_sandbox_id: str,
    pod: PodInfo,
    info: Mapping[str, str] | None = None,
) -> ContainerInfo:
    """The container record recoverable from ContainerStatus and its verbose *info* (see the module docstring).

    ContainerStatus does not name the sandbox: pass *pod_sandbox_id* from the ListContainers item.
    """
    document = _verbose(info)
    reported = None
    if status.HasField("resources") and status.resources.HasField("linux"):
        reported = _resources_from(status.resources.linux, _entries(status.resources.linux.unified))
    return _wire_container(
        status,
        pod_sandbox_id,
        pod,
        resources=_recovered_resources(reported, document),
        envs=_envs_from_json(_dig(document, "config", "envs")),
    )


# --- hook answers ------------------------------------------------------------------------------------------
#
# betterproto2 does not check wire types when decoding: a varint sent for a string field decodes as an int
# (``cgroup_parent=5``), a varint for a message field as an int. Such a value would only fail later — when the
# merged CRI request is encoded, outside the failure policy — or not at all. So every field an answer can carry
# is checked for its declared type (:func:`wrong_types`) before it is read into an answer record.

_INT_RESOURCES = tuple(name for name in RESOURCE_SCALARS if name not in RESOURCE_STRINGS)


def _is_str_map(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _resources_types(r: object, name: str) -> list[str]:
    if r is None:
        return []
    if not isinstance(r, v1alpha1.LinuxContainerResources):
        return [name]
    wrong = [f"{name}.{f}" for f in _INT_RESOURCES if not isinstance(getattr(r, f), int)]
    wrong += [f"{name}.{f}" for f in RESOURCE_STRINGS if not isinstance(getattr(r, f), str)]
    if not _is_str_map(r.unified):
        wrong.append(f"{name}.unified")
    pages = r.hugepage_limits
    if not isinstance(pages, list) or not all(
        isinstance(p, v1alpha1.HugepageLimit) and isinstance(p.page_size, str) and isinstance(p.limit, int)
        for p in pages
    ):
        wrong.append(f"{name}.hugepage_limits")
    return wrong


def wrong_types(answer: object) -> list[str]:
    """The fields of a decoded hook answer whose value is not of the field's type (see above); answers of
    other types are not checked."""
    if isinstance(answer, v1alpha1.ContainerResourceHookResponse):
        maps = ("container_annotations", "container_envs")
        resources, parent = "container_resources", "pod_cgroup_parent"
    elif isinstance(answer, v1alpha1.PodSandboxHookResponse):
        maps, resources, parent = ("labels", "annotations"), "resources", "cgroup_parent"
    else:
        return []
    wrong = [f for f in maps if not _is_str_map(getattr(answer, f))]
    wrong += _resources_types(getattr(answer, resources), resources)
    if not isinstance(getattr(answer, parent), str):
        wrong.append(parent)
    return wrong


def pod_answer(response: v1alpha1.PodSandboxHookResponse) -> PodAnswer:
    """A pod hook's answer → :class:`PodAnswer` (``resources`` ``None`` when the answer carries none)."""
    return PodAnswer(
        labels=response.labels,
        annotations=response.annotations,
        cgroup_parent=response.cgroup_parent,
        resources=resources_from_hook(response.resources),
    )


def container_answer(response: v1alpha1.ContainerResourceHookResponse) -> ContainerAnswer:
    """A container hook's answer → :class:`ContainerAnswer` (``resources`` ``None`` when it carries none)."""
    return ContainerAnswer(
        annotations=response.container_annotations,
        resources=resources_from_hook(response.container_resources),
        pod_cgroup_parent=response.pod_cgroup_parent,
        envs=response.container_envs,
    )


def answer_from_hook(
    response: v1alpha1.PodSandboxHookResponse | v1alpha1.ContainerResourceHookResponse,
) -> PodAnswer | ContainerAnswer:
    """:func:`pod_answer` or :func:`container_answer`, by the answer's type (check :func:`wrong_types` first)."""
    if isinstance(response, v1alpha1.PodSandboxHookResponse):
        return pod_answer(response)
    return container_answer(response)
