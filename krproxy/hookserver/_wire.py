"""The served SDK's hook calls decoded and answered with upb (protobuf's C implementation).

A hook call used to be decoded into betterproto2 messages, turned into a :class:`ContainerInfo` /
:class:`PodInfo`, answered as a betterproto2 message and encoded: pure Python, about 100 µs of a call's
CPU for a small request (betterproto2 opens a ``warnings.catch_warnings`` per field it reads), more for
the few KiB of annotations and envs that kubelet's requests carry. Here the request is read with upb
straight into the plugin-facing records and the answer is built as a upb message from the request and
the plugins' changes, with the rules of :func:`._done.pod_response` and :func:`._done.container_response`
(which stay the betterproto2 form, for :meth:`HookServer.handle_pod` and its callers); the two are
held equal by ``tests/unit/test_hookserver_wire.py``.

The classes are built at import from the descriptor of our own ``protos/runtime_hook_v1alpha1.proto``
(:mod:`krproxy.proto.descriptors`) in a private pool with maps read as their entries, as
:mod:`krproxy.hooks.wire` does, so labels, annotations and envs keep the order of the wire (as
betterproto2's dicts do) and plugins see the same dicts as before.

A record's maps are :class:`LazyMap` objects, read into their dicts only when something uses them (a
plugin that reads one label does not pay for 40 envs), and the answer never reads them: it echoes a
request's map by copying its entries as they came, in C (every string map's entries are of one message
type in our pool, ``StringEntry``, so upb's ``extend`` takes them), then the plugins' changes. A key the
plugins changed is then written twice, the request's value first; a map decoder takes the later one in
the first one's place, so the answer decodes to what :func:`._done.container_response` gives (the map
``{**request, **changes}``, in its order), as the proxy and koord-runtime-proxy decode it.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, message_factory
from google.protobuf.message import DecodeError

from krproxy.hooks.wire import entries, private_pool
from krproxy.proto import descriptors

from ._context import (
    ContainerContext,
    ContainerInfo,
    LazyMap,
    PodContext,
    PodInfo,
    PodMeta,
    ResourceChanges,
    Resources,
)

__all__ = ["DecodeError", "container_info", "container_reply", "pod_info", "pod_reply"]


def _one_entry_type(serialized: bytes) -> bytes:
    """The file descriptor with a top-level ``StringEntry`` (key, value) as the entry type of every
    map field (each map's own entry type stays, unused): upb copies entries from one field into
    another only between fields of one message type. All of this file's maps are string to string."""
    file = descriptor_pb2.FileDescriptorProto.FromString(serialized)
    string = descriptor_pb2.FieldDescriptorProto.TYPE_STRING
    entry = file.message_type.add(name="StringEntry")
    entry.field.add(name="key", number=1, type=string, json_name="key")
    entry.field.add(name="value", number=2, type=string, json_name="value")
    for message in file.message_type:
        maps = {
            f".{file.package}.{message.name}.{n.name}" for n in message.nested_type if n.options.map_entry
        }
        for field in message.field:
            if field.type_name in maps:
                field.type_name = f".{file.package}.StringEntry"
    return bytes(file.SerializeToString())


_POOL = private_pool(_one_entry_type(descriptors.RUNTIME_HOOK_V1ALPHA1))


def _message_class(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"runtime.v1alpha1.{name}"))


PodSandboxHookRequest = _message_class("PodSandboxHookRequest")
PodSandboxHookResponse = _message_class("PodSandboxHookResponse")
ContainerResourceHookRequest = _message_class("ContainerResourceHookRequest")
ContainerResourceHookResponse = _message_class("ContainerResourceHookResponse")


def pod_info(request: bytes) -> tuple[Any, PodInfo]:
    """A PodSandboxHookRequest's bytes: the upb message (for :func:`pod_reply`) and the plugins' record,
    as :meth:`PodInfo.from_proto` makes it. Raises :class:`DecodeError` when the bytes are no such message."""
    req = PodSandboxHookRequest.FromString(request)
    has = req.HasField
    m = req.pod_meta  # an unset one reads as empty ("", "", "", 0): PodMeta()
    info = PodInfo(
        meta=PodMeta(name=m.name, namespace=m.namespace, uid=m.uid, attempt=m.attempt),
        labels=LazyMap(entries, req.labels),
        annotations=LazyMap(entries, req.annotations),
        cgroup_parent=req.cgroup_parent,
        runtime_handler=req.runtime_handler,
        resources=Resources.from_proto(req.resources) if has("resources") else None,
        overhead=Resources.from_proto(req.overhead) if has("overhead") else None,
    )
    return req, info


def container_info(request: bytes) -> tuple[Any, ContainerInfo]:
    """A ContainerResourceHookRequest's bytes: the upb message and the plugins' record, as
    :meth:`ContainerInfo.from_proto` makes it. Raises :class:`DecodeError`."""
    req = ContainerResourceHookRequest.FromString(request)
    has = req.HasField
    m = req.pod_meta  # (as in pod_info)
    pod = PodInfo(
        meta=PodMeta(name=m.name, namespace=m.namespace, uid=m.uid, attempt=m.attempt),
        labels=LazyMap(entries, req.pod_labels),
        annotations=LazyMap(entries, req.pod_annotations),
        cgroup_parent=req.pod_cgroup_parent,
        resources=Resources.from_proto(req.pod_resources) if has("pod_resources") else None,
    )
    meta = req.container_meta  # an unset one reads as empty: "", "", 0, as from_proto gives
    info = ContainerInfo(
        pod=pod,
        name=meta.name,
        id=meta.id,
        attempt=meta.attempt,
        annotations=LazyMap(entries, req.container_annotations),
        resources=Resources.from_proto(req.container_resources),
        envs=LazyMap(entries, req.container_envs),
    )
    return req, info


def _echo(out: Any, request: Any, changes: dict[Any, Any], name: str) -> None:  # (a plugin may put anything)
    """The answer's map field ``out``: the request's field ``request`` with ``changes`` laid over it,
    as entries (see the module's notes). A key or value in ``changes`` that is no str is a TypeError
    naming the key and the type, as betterproto2's encoding refused it (upb would send None as "",
    take bytes as text, and say only "bad argument type" of an int)."""
    out.extend(request)
    add = out.add
    for key, value in changes.items():
        if not (isinstance(key, str) and isinstance(value, str)):
            wrong, what = (value, "value") if isinstance(key, str) else (key, "key")
            raise TypeError(  # the value unquoted: it may be a credential
                f"a plugin set {name}[{key!r}] with a {type(wrong).__name__} as its {what}: keys and "
                "values are str; to leave a key as the request has it, do not set it"
            )
        add(key=key, value=value)


def _put_resources(out: Any, req: Any, name: str, changes: ResourceChanges) -> None:
    """The response's ``name`` (the request's field of the same name) as the request's (when it had one) with the CRI-expressible changes
    applied, as ``_done._with_cri_changes`` does; left unset when the request had none and nothing changed."""
    cpuset, quota, shares, memory = (
        changes.cpuset,
        changes.cfs_quota,
        changes.cpu_shares,
        changes.memory_limit,
    )
    had = req.HasField(name)
    if not had and cpuset is None and quota is None and shares is None and memory is None:
        return
    res = getattr(out, name)
    if had:
        res.CopyFrom(getattr(req, name))
    else:
        res.SetInParent()
    if cpuset is not None:
        res.cpuset_cpus = cpuset
    if quota is not None:
        res.cpu_quota = quota
    if shares is not None:
        res.cpu_shares = shares
    if memory is not None:
        res.memory_limit_in_bytes = memory


def pod_reply(req: Any, ctx: PodContext) -> bytes:
    """The encoded PodSandboxHookResponse :func:`._done.pod_response` gives for ``req`` (the upb
    message of :func:`pod_info`) and ``ctx``."""
    changes = ctx.response
    out = PodSandboxHookResponse()
    _echo(out.labels, req.labels, changes.labels, "labels")
    _echo(out.annotations, req.annotations, changes.annotations, "annotations")
    out.cgroup_parent = changes.cgroup_parent or req.cgroup_parent
    _put_resources(out, req, "resources", changes.resources)
    return bytes(out.SerializeToString())


def container_reply(req: Any, ctx: ContainerContext) -> bytes:
    """The encoded ContainerResourceHookResponse :func:`._done.container_response` gives for ``req``
    (the upb message of :func:`container_info`) and ``ctx``."""
    changes = ctx.response
    out = ContainerResourceHookResponse()
    _echo(out.container_annotations, req.container_annotations, changes.annotations, "annotations")
    _put_resources(out, req, "container_resources", changes.resources)
    out.pod_cgroup_parent = req.pod_cgroup_parent
    _echo(out.container_envs, req.container_envs, changes.add_envs, "add_envs")
    return bytes(out.SerializeToString())
