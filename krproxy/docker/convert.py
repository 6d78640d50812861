"""Docker Engine JSON ⇄ the hook records of :mod:`krproxy.hooks.model` (koord-runtime-proxy's Docker mode).

Pure functions on decoded JSON (``dict``/``list`` values as :func:`json.loads` returns them); nothing here
mutates its arguments. Every Docker-specific fact the hook path relies on lives in this module:

* kubelet's dockershim names containers ``k8s_<container>_<pod>_<namespace>_<uid>_<attempt>``
  (:func:`parse_k8s_name`); a pod sandbox is the container labelled ``io.kubernetes.docker.type=podsandbox``
  and its container name is ``POD``; an app container names its sandbox in label ``io.kubernetes.sandbox.id``.
* dockershim stores pod labels as Docker labels and pod/container annotations as Docker labels prefixed
  ``annotation.`` (:func:`split_labels`). The reference's split never matches (its ``HasPrefix`` arguments
  are swapped, so every annotation stays a label); ours does.
* Resources are the HostConfig fields ``CpuPeriod``, ``CpuQuota``, ``CpuShares``, ``Memory``,
  ``OomScoreAdj``, ``CpusetCpus``, ``CpusetMems`` and ``MemorySwap`` (:data:`RESOURCE_FIELDS`); an
  ``/update`` body (Docker's ``UpdateConfig``) carries the same names at top level, without
  ``OomScoreAdj``.
* Cgroup parents: hooks see the CRI form; with the systemd cgroup driver Docker's ``CgroupParent`` is a
  slice name (``kubepods-burstable-pod<uid>.slice``) which :func:`to_cri_cgroup_parent` expands to the
  CRI path and :func:`to_docker_cgroup_parent` turns back into its base name (the reference's
  ``ToCriCgroupPath`` / ``generateExpectedCgroupParent``).
* ``Env`` is a ``NAME=value`` list (:func:`envs_from_docker`, :func:`rebuild_env`).

Go's ``encoding/json`` matches an object's keys to struct fields by Unicode simple folding, so dockerd
accepts ``cpushares`` and ``CpuShareſ`` (U+017F) for ``CpuShares``; we read keys the same way
(:func:`_key`) and, when writing, replace the key the client used. Go decodes each key naming a field
into it in turn, a later object merged into the earlier one: a field under two spellings is refused
(:class:`AmbiguousKey`, 400), as a key sent twice in one object is (``krproxy.docker.hooks``), since
krproxy's reading of one value would show hooks a request dockerd reads otherwise.

Writing answers back (:func:`apply_pod`, :func:`apply_container`, :func:`apply_update`) only touches the
fields whose value the hooks changed, so a body no plugin changed is forwarded as the original bytes.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Mapping
from typing import Any

import attrs

from krproxy import gojson, log
from krproxy.hooks import merge, validate
from krproxy.hooks.merge import Change, Merged
from krproxy.hooks.model import (
    ContainerInfo,
    FrozenMap,
    PodAnswer,
    PodInfo,
    Resources,
    json_str,
    resource_scalar,
)
from krproxy.hooks.slices import ROOT, is_slice_name, slice_path

LOGGER = logging.getLogger("krproxy.docker.convert")

__all__ = [
    "ANNOTATION_PREFIX",
    "RESOURCE_FIELDS",
    "RUNTIME_HANDLER",
    "SANDBOX_ID_LABEL",
    "SANDBOX_TYPE_LABEL",
    "AmbiguousKey",
    "K8sName",
    "apply_container",
    "apply_pod",
    "apply_update",
    "container_from_create",
    "container_from_inspect",
    "envs_from_docker",
    "is_sandbox",
    "labels_of",
    "merge_docker_pod",
    "parse_k8s_name",
    "pod_from_create",
    "pod_from_inspect",
    "pod_from_name",
    "rebuild_env",
    "resources_from_docker",
    "split_labels",
    "to_cri_cgroup_parent",
    "to_docker_cgroup_parent",
    "update_from_docker",
]

#: Label dockershim puts on sandbox containers (value ``podsandbox``) and app containers (``container``).
SANDBOX_TYPE_LABEL = "io.kubernetes.docker.type"
#: Label naming an app container's sandbox (its Docker id).
SANDBOX_ID_LABEL = "io.kubernetes.sandbox.id"
#: Prefix of the Docker labels that carry Kubernetes annotations.
ANNOTATION_PREFIX = "annotation."
#: ``runtime_handler`` of pods in Docker mode (what the reference sends plugins on create).
RUNTIME_HANDLER = "docker"

#: Record field → Docker HostConfig / UpdateConfig key.
RESOURCE_FIELDS: tuple[tuple[str, str], ...] = (
    ("cpu_period", "CpuPeriod"),
    ("cpu_quota", "CpuQuota"),
    ("cpu_shares", "CpuShares"),
    ("memory_limit_in_bytes", "Memory"),
    ("oom_score_adj", "OomScoreAdj"),
    ("cpuset_cpus", "CpusetCpus"),
    ("cpuset_mems", "CpusetMems"),
    ("memory_swap_limit_in_bytes", "MemorySwap"),
)
#: ``docker update`` cannot change the OOM score adjustment: UpdateConfig has no such field.
_NOT_UPDATABLE = frozenset({"oom_score_adj"})


# --- case-insensitive JSON access (Go's encoding/json rules) -------------------------------------------------


class AmbiguousKey(ValueError):
    """A JSON object holds a struct field dockerd reads under more than one spelling of its name."""


def _key(document: Mapping[str, Any], name: str) -> str | None:
    """The key of *document* that dockerd reads as the struct field *name*: the one key equal to it as
    Go folds names (``HoſtConfig`` is ``HostConfig``). Go decodes every such key in turn into the one
    field, a later object merged into an earlier one, which a reading of one key does not give:
    :class:`AmbiguousKey` if there are several (kubelet and the docker CLI send each name once)."""
    wanted = gojson.fold_name(name)
    found = [k for k in document if gojson.fold_name(k) == wanted]
    if len(found) > 1:
        raise AmbiguousKey(
            f"{' and '.join(map(repr, found))} name the same field, which dockerd reads as one, merging"
            " them; krproxy does not: send the field once"
        )
    return found[0] if found else None


def _get(document: Any, name: str) -> Any:
    if not isinstance(document, Mapping):
        return None
    key = _key(document, name)
    return None if key is None else document[key]


def _put(document: dict[str, Any], name: str, value: Any) -> None:
    document[_key(document, name) or name] = value


# --- names, labels, envs, cgroups ----------------------------------------------------------------------------


@attrs.frozen
class K8sName:
    """The parts of a dockershim container name ``k8s_<container>_<pod>_<namespace>_<uid>_<attempt>``."""

    container: str
    pod: str
    namespace: str
    uid: str
    attempt: int


def parse_k8s_name(name: str) -> K8sName | None:
    """The parts of a kubelet-made container name (``/`` prefix of inspect output allowed), or None."""
    tokens = name.removeprefix("/").split("_")
    if len(tokens) != 6 or tokens[0] != "k8s" or not all(tokens[1:5]):
        return None
    try:
        attempt = int(tokens[5])
    except ValueError:
        return None
    return K8sName(tokens[1], tokens[2], tokens[3], tokens[4], attempt)


def labels_of(config: Any) -> dict[str, str]:
    """The ``Labels`` of a create body or an inspect ``Config`` (non-string values dropped)."""
    labels = _get(config, "Labels")
    if not isinstance(labels, Mapping):
        return {}
    return {k: v for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)}


def is_sandbox(labels: Mapping[str, str]) -> bool:
    """Whether a container with these Docker labels is a pod sandbox."""
    return labels.get(SANDBOX_TYPE_LABEL) == "podsandbox"


def split_labels(labels: Mapping[str, str]) -> tuple[FrozenMap[str, str], FrozenMap[str, str]]:
    """Docker labels → (Kubernetes labels, annotations): ``annotation.<key>`` labels are annotations."""
    plain = {k: v for k, v in labels.items() if not k.startswith(ANNOTATION_PREFIX)}
    annotations = {
        k.removeprefix(ANNOTATION_PREFIX): v for k, v in labels.items() if k.startswith(ANNOTATION_PREFIX)
    }
    return FrozenMap(plain), FrozenMap(annotations)


def envs_from_docker(env: Any) -> FrozenMap[str, str]:
    """``["NAME=value", ...]`` → map; the later value of a repeated name wins, first-seen order kept.

    Entries without ``=`` (Docker: "take it from the daemon's environment") are not part of the map.
    """
    if not isinstance(env, list):
        return FrozenMap()
    pairs: dict[str, str] = {}
    for entry in env:
        if isinstance(entry, str) and "=" in entry:
            name, _, value = entry.partition("=")
            pairs[name] = value
    return FrozenMap(pairs)


def rebuild_env(original: Any, envs: Mapping[str, str]) -> list[str]:
    """The ``Env`` list for *envs*: names of *original* keep their first position (later duplicates go),
    entries without ``=`` stay, names a plugin added follow sorted by name (as CRI mode orders them)."""
    out: list[str] = []
    seen: set[str] = set()
    for entry in original if isinstance(original, list) else []:
        if not isinstance(entry, str):
            continue
        if "=" not in entry:
            out.append(entry)
            continue
        name = entry.partition("=")[0]
        if name in envs and name not in seen:
            out.append(f"{name}={envs[name]}")
        seen.add(name)
    out += [f"{name}={envs[name]}" for name in sorted(envs) if name not in seen]
    return out


def to_cri_cgroup_parent(driver: str, parent: str) -> str:
    """Docker's ``CgroupParent`` → the CRI path hooks see (only the systemd driver differs).

    With the systemd driver a slice name becomes the path of the slice hierarchy it names
    (:func:`krproxy.hooks.slices.slice_path`): ``kubepods-burstable-pod1.slice`` →
    ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice``. Anything else
    (empty, a path, a name dockerd would refuse) is passed on unchanged.
    """
    if driver != "systemd" or not is_slice_name(parent):
        return parent
    return slice_path(parent)


def to_docker_cgroup_parent(driver: str, parent: str) -> str:
    """A CRI cgroup parent → Docker's ``CgroupParent`` (systemd driver: the slice's base name; the
    root cgroup ``/`` is the root slice ``-.slice``)."""
    if driver == "systemd":
        return posixpath.basename(parent.rstrip("/")) or (ROOT if parent.startswith("/") else "")
    return parent


# --- resources -----------------------------------------------------------------------------------------------


def resources_from_docker(host_config: Any) -> Resources:
    """Resources of a HostConfig (or of an UpdateConfig: same keys); absent keys are zero."""
    return Resources(
        **{field: resource_scalar(field, _get(host_config, key)) for field, key in RESOURCE_FIELDS}
    )


def update_from_docker(update_config: Any) -> Resources:
    """Resources requested by an ``/update`` body (zero / ``""``: not changed; no OOM score)."""
    return attrs.evolve(resources_from_docker(update_config), oom_score_adj=0)


def _write_resources(
    target: dict[str, Any], old: Resources, new: Resources, skip: frozenset[str] = frozenset()
) -> None:
    for field, key in RESOURCE_FIELDS:
        value = getattr(new, field)
        if field not in skip and value != getattr(old, field):
            _put(target, key, value)


# --- records from a create body ------------------------------------------------------------------------------


def pod_from_name(name: K8sName) -> PodInfo:
    """The least we know of a pod: what its containers' names tell (used when the sandbox is not stored)."""
    return PodInfo(
        name=name.pod,
        namespace=name.namespace,
        uid=name.uid,
        attempt=name.attempt,
        runtime_handler=RUNTIME_HANDLER,
    )


def pod_from_create(name: K8sName, body: Mapping[str, Any], driver: str) -> PodInfo:
    """The pod record of a sandbox's ``/containers/create`` body."""
    labels, annotations = split_labels(labels_of(body))
    host_config = _get(body, "HostConfig")
    return attrs.evolve(
        pod_from_name(name),
        labels=labels,
        annotations=annotations,
        cgroup_parent=to_cri_cgroup_parent(driver, json_str(_get(host_config, "CgroupParent"))),
        resources=resources_from_docker(host_config),
    )


def container_from_create(name: K8sName, body: Mapping[str, Any], pod: PodInfo) -> ContainerInfo:
    """The container record of an app container's ``/containers/create`` body; *pod* is its sandbox's."""
    labels = labels_of(body)
    return ContainerInfo(
        pod_sandbox_id=labels.get(SANDBOX_ID_LABEL, ""),
        pod=pod,
        name=name.container,
        attempt=name.attempt,
        annotations=split_labels(labels)[1],
        resources=resources_from_docker(_get(body, "HostConfig")),
        envs=envs_from_docker(_get(body, "Env")),
        pod_cgroup_parent=pod.cgroup_parent,
    )


# --- records from inspect output (recovery) ------------------------------------------------------------------


def pod_from_inspect(inspect: Mapping[str, Any], driver: str) -> PodInfo:
    """The pod record of a sandbox's ``GET /containers/{id}/json``.

    The reference stores the Docker name as pod name and the Docker id as uid; we take name, namespace,
    uid and attempt from the dockershim name when it parses, and fall back to the reference's values.
    """
    docker_name = json_str(_get(inspect, "Name"))
    name = parse_k8s_name(docker_name)
    base = (
        pod_from_name(name)
        if name is not None
        else PodInfo(
            name=docker_name.removeprefix("/"),
            uid=json_str(_get(inspect, "Id")),
            runtime_handler=RUNTIME_HANDLER,
        )
    )
    labels, annotations = split_labels(labels_of(_get(inspect, "Config")))
    host_config = _get(inspect, "HostConfig")
    return attrs.evolve(
        base,
        labels=labels,
        annotations=annotations,
        cgroup_parent=to_cri_cgroup_parent(driver, json_str(_get(host_config, "CgroupParent"))),
        resources=resources_from_docker(host_config),
    )


def container_from_inspect(inspect: Mapping[str, Any], pod: PodInfo) -> ContainerInfo:
    """The container record of an app container's ``GET /containers/{id}/json``; *pod* is its sandbox's.

    Unlike CRI recovery nothing is lost: inspect reports current resources and the envs.
    """
    config = _get(inspect, "Config")
    labels = labels_of(config)
    name = parse_k8s_name(json_str(_get(inspect, "Name")))
    return ContainerInfo(
        pod_sandbox_id=labels.get(SANDBOX_ID_LABEL, ""),
        pod=pod,
        name=name.container if name is not None else json_str(_get(inspect, "Name")).removeprefix("/"),
        attempt=name.attempt if name is not None else 0,
        id=json_str(_get(inspect, "Id")),
        annotations=split_labels(labels)[1],
        resources=resources_from_docker(_get(inspect, "HostConfig")),
        envs=envs_from_docker(_get(config, "Env")),
        pod_cgroup_parent=pod.cgroup_parent,
    )


# --- merging answers -----------------------------------------------------------------------------------------


def _resource_changes(old: Resources | None, new: Resources | None) -> list[Change]:
    before, after = old or Resources(), new or Resources()
    return [
        Change(f"resources.{field}", getattr(before, field), getattr(after, field))
        for field, _ in RESOURCE_FIELDS
        if getattr(before, field) != getattr(after, field)
    ]


def merge_docker_pod(pod: PodInfo, answer: PodAnswer) -> Merged[PodInfo]:
    """Merge a PreRunPodSandbox answer into a Docker pod record: CRI mode's rules (labels, annotations,
    cgroup parent), plus the answer's ``resources`` by Koordinator's ``updateResource`` rule — in Docker
    mode the sandbox container's HostConfig carries them (the reference overwrites all eight fields).
    Resources that :func:`krproxy.hooks.validate.check_resources` rejects are ignored (logged)."""
    merged = merge.merge_pod_info(pod, answer)
    if pod.resources is None or answer.resources is None:
        return merged
    if problems := validate.check_resources(answer.resources, "resources"):
        # The dispatcher checks what CRI mode applies, which excludes a pod answer's resources.
        log.warning(LOGGER, "pod_resources_ignored", pod=pod.name, problems="; ".join(problems))
        return merged
    resources = merge.update_resource(pod.resources, answer.resources)
    return Merged(
        attrs.evolve(merged.value, resources=resources),
        merged.changes + tuple(_resource_changes(pod.resources, resources)),
    )


# --- writing records back into request bodies ----------------------------------------------------------------


def _copy_body(body: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A shallow copy of *body* whose HostConfig (created if missing) is a copy too."""
    out = dict(body)
    host_config = _get(out, "HostConfig")
    host_config = dict(host_config) if isinstance(host_config, Mapping) else {}
    _put(out, "HostConfig", host_config)
    return out, host_config


def _write_labels(out: dict[str, Any], labels: Mapping[str, str], annotations: Mapping[str, str]) -> None:
    """Set *labels* and *annotations* (as ``annotation.`` labels) in the body's ``Labels``; other plain
    labels stay, annotations not in *annotations* go (hooks only add or overwrite, so none is lost)."""
    current = _get(out, "Labels")
    result = {
        k: v
        for k, v in (current.items() if isinstance(current, Mapping) else ())
        if not k.startswith(ANNOTATION_PREFIX)
    }
    result.update(labels)
    result.update({ANNOTATION_PREFIX + k: v for k, v in annotations.items()})
    _put(out, "Labels", result)


def apply_pod(body: Mapping[str, Any], old: PodInfo, new: PodInfo, driver: str) -> dict[str, Any]:
    """A copy of a sandbox's create *body* carrying what hooks changed from *old* to *new*: HostConfig
    resources and ``CgroupParent``, and labels/annotations (which hooks only add or overwrite)."""
    out, host_config = _copy_body(body)
    _write_resources(host_config, old.resources or Resources(), new.resources or Resources())
    if new.cgroup_parent != old.cgroup_parent:
        _put(host_config, "CgroupParent", to_docker_cgroup_parent(driver, new.cgroup_parent))
    if new.labels != old.labels or new.annotations != old.annotations:
        _write_labels(out, new.labels, new.annotations)
    return out


def apply_container(
    body: Mapping[str, Any], old: ContainerInfo, new: ContainerInfo, driver: str
) -> dict[str, Any]:
    """A copy of an app container's create *body* carrying what hooks changed from *old* to *new*:
    HostConfig resources and ``CgroupParent``, ``Env``, and annotations (as ``annotation.`` labels)."""
    out, host_config = _copy_body(body)
    _write_resources(host_config, old.resources or Resources(), new.resources or Resources())
    if new.pod_cgroup_parent != old.pod_cgroup_parent:
        _put(host_config, "CgroupParent", to_docker_cgroup_parent(driver, new.pod_cgroup_parent))
    if new.envs != old.envs:
        _put(out, "Env", rebuild_env(_get(out, "Env"), new.envs))
    if new.annotations != old.annotations:
        _write_labels(out, {}, new.annotations)
    return out


def apply_update(body: Mapping[str, Any], old: Resources, new: Resources) -> dict[str, Any]:
    """A copy of an ``/update`` *body* with the resource fields hooks changed (never ``OomScoreAdj``)."""
    out = dict(body)
    _write_resources(out, old, new, _NOT_UPDATABLE)
    return out
