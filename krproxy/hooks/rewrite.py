"""The merged CreateContainer request, written into kubelet's bytes with upb (the request path's encoder).

:func:`krproxy.hooks.merge.write_create` says what a merged container record changes in a CreateContainer
request; re-encoding a betterproto2 message costs ~0.4 ms for a small request (pure Python, each field's
work inside ``warnings.catch_warnings``), most of what a hooked CreateContainer added over direct.
:func:`create_request` makes the same changes on kubelet's bytes parsed by upb (:mod:`krproxy.hooks.wire`,
maps read as their entries) and serializes that: a few microseconds.

What kubelet sent and the merge does not touch is re-encoded as upb read it: known fields in field-number
order, then unknown fields, as betterproto2 writes them. Two differences from encoding the betterproto2
decode, both of input no Go client produces: a map (other than those rewritten here) that repeats a key
keeps every entry (betterproto2 kept the last value), and a field sent with a default value explicitly keeps
it (betterproto2 dropped it). Either way the runtime reads the same request.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import DecodeError

from krproxy.hooks import wire
from krproxy.hooks.merge import create_envs
from krproxy.hooks.model import ContainerInfo, Resources

__all__ = ["create_request"]

_CreateContainerRequest = wire.message_class("CreateContainerRequest", writing=True)


def _set_map(field: Any, values: dict[str, str]) -> None:
    del field[:]
    for key, value in values.items():
        field.add(key=key, value=value)


def _write_resources(target: Any, resources: Resources) -> None:
    """Every field of a CRI LinuxContainerResources (as :func:`krproxy.hooks.convert.write_resources`)."""
    target.cpu_period = resources.cpu_period
    target.cpu_quota = resources.cpu_quota
    target.cpu_shares = resources.cpu_shares
    target.memory_limit_in_bytes = resources.memory_limit_in_bytes
    target.oom_score_adj = resources.oom_score_adj
    target.cpuset_cpus = resources.cpuset_cpus
    target.cpuset_mems = resources.cpuset_mems
    del target.hugepage_limits[:]
    for page_size, limit in resources.hugepage_limits:
        target.hugepage_limits.add(page_size=page_size, limit=limit)
    _set_map(target.unified, dict(resources.unified))
    target.memory_swap_limit_in_bytes = resources.memory_swap_limit_in_bytes


def create_request(data: bytes, info: ContainerInfo) -> bytes:
    """Kubelet's CreateContainer request *data* carrying the merged record *info*, as
    :func:`krproxy.hooks.merge.apply_create` writes it: annotations, the whole ``config.linux.resources`` (if
    known), the pod cgroup parent (if non-empty) and ``config.envs`` rebuilt from the record's envs.

    Raises ``ValueError`` if upb cannot parse *data* (betterproto2 could, or the call would not be here).
    """
    message = _CreateContainerRequest()
    try:
        message.ParseFromString(data)
    except DecodeError as err:
        raise ValueError(f"cannot decode CreateContainerRequest: {err}") from None
    config = message.config  # sent from here on, even if empty: clearing a field in it marks it set
    _set_map(config.annotations, dict(info.annotations))
    if info.resources is not None:
        _write_resources(config.linux.resources, info.resources)
    if info.pod_cgroup_parent:
        message.sandbox_config.linux.cgroup_parent = info.pod_cgroup_parent
    envs = create_envs((kv.key for kv in config.envs), info.envs)
    del config.envs[:]
    for key, value in envs.items():
        config.envs.add(key=key, value=value.encode("utf-8", "surrogateescape"))
    return bytes(message.SerializeToString())
