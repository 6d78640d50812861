"""The intercepted CreateContainer request in upb: decoded, and written back with a merged record.

The request path reads kubelet's CreateContainer as a :data:`CreateContainerRequest` (the record comes from
:func:`krproxy.hooks.convert.container_from_wire_create`) and, when a plugin changed something, writes the
merged record into that same message and encodes it (:func:`create_request`). The changes are
those of the betterproto2 reference, tests/oracles.py's ``apply_create``, and so are the bytes
(tests/unit/test_hooks_rewrite.py); RestorePod's containers and pod config are written here too (:func:`write_create`,
:func:`write_pod_config`). With
betterproto2 (pure Python, each field's work inside ``warnings.catch_warnings``) decoding a 4 KB request of
kubelet's size took ~1.5 ms and encoding the merged one ~3.6 ms; upb does each in tens of microseconds
(``python -m krproxy.bench.merge``).

The message comes from :mod:`krproxy.hooks.wire`'s writing pool: maps are read as their entries (kubelet's
order kept) and entry keys and values have presence (an empty one is written, as Go writes it). What the
merge does not touch is re-encoded as upb read it: known fields in field-number order, then unknown fields,
as betterproto2 wrote them. Differences from the betterproto2 path, all for input no Go client produces: a
map (other than those rewritten here) that repeats a key keeps every entry (betterproto2 kept the last
value; the runtime reads the same map), a field sent with a default value explicitly keeps it, and a field
sent with the wrong wire type is kept as an unknown field, as the runtime's Go decoder keeps it
(betterproto2 read a value of the wrong type, which the request path refused with INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from krproxy.hooks import wire
from krproxy.hooks.merge import create_envs
from krproxy.hooks.model import ContainerInfo, PodInfo, Resources
from krproxy.hooks.writeback import write_scalars

__all__ = ["CreateContainerRequest", "create_request", "write_create", "write_pod_config"]

#: Kubelet's CreateContainer request as a upb message class (``CreateContainerRequest.FromString(data)``; raises
#: ``google.protobuf.message.DecodeError`` on bytes that are none). A field sent with a wire type other than
#: its own is kept as an unknown field, as the runtime's Go decoder keeps it.
CreateContainerRequest = wire.message_class("CreateContainerRequest", writing=True)


def _set_map(field: Any, values: Mapping[str, str]) -> None:
    """Replace the entries of a upb map *field* (kept as repeated entries) by *values*' items, in order
    (a record's FrozenMap is passed as it is: its ``items`` are its dict's)."""
    del field[:]
    for key, value in values.items():
        field.add(key=key, value=value)


def _write_resources(target: Any, resources: Resources) -> None:
    """Every field of a CRI LinuxContainerResources (as :func:`krproxy.hooks.writeback.write_resources` in betterproto2)."""
    write_scalars(target, resources)
    del target.hugepage_limits[:]
    for page_size, limit in resources.hugepage_limits:
        target.hugepage_limits.add(page_size=page_size, limit=limit)
    _set_map(target.unified, resources.unified)


def write_create(message: Any, info: ContainerInfo) -> None:
    """Write the merged record *info* into the CreateContainer *message* (a :data:`CreateContainerRequest`),
    as :func:`create_request` does before encoding it."""
    config = message.config  # sent from here on, even if empty: clearing a field in it marks it set
    _set_map(config.annotations, info.annotations)
    if info.resources is not None:
        _write_resources(config.linux.resources, info.resources)
    if info.pod_cgroup_parent:
        message.sandbox_config.linux.cgroup_parent = info.pod_cgroup_parent
    envs = create_envs((kv.key for kv in config.envs), info.envs)
    del config.envs[:]
    for key, value in envs.items():
        config.envs.add(key=key, value=value.encode("utf-8", "surrogateescape"))


def create_request(message: Any, info: ContainerInfo) -> bytes:
    """The CreateContainer *message* (a :data:`CreateContainerRequest`; changed in place) carrying the merged record
    *info*, encoded: annotations, the whole ``config.linux.resources`` (if known), the pod cgroup parent (if
    non-empty) and ``config.envs`` rebuilt from the record's envs (:func:`write_create`).
    """
    write_create(message, info)
    return bytes(message.SerializeToString())


def write_pod_config(config: Any, pod: PodInfo) -> None:
    """Write the merged pod record *pod* into a upb PodSandboxConfig *config* (marked sent): its labels,
    annotations and, if non-empty, cgroup parent, as a RunPodSandbox's config gets them."""
    config.SetInParent()
    _set_map(config.labels, pod.labels)
    _set_map(config.annotations, pod.annotations)
    if pod.cgroup_parent:
        config.linux.cgroup_parent = pod.cgroup_parent
