"""Plugin answers decoded with upb, read straight into their records (:func:`read`, the dispatcher's) or
into the betterproto2 messages ``FromString`` would give (:func:`decode`).

Every hooked call decodes its plugins' answers (``ContainerResourceHookResponse``, ``PodSandboxHookResponse``).
betterproto2 decodes in pure Python, each field inside ``warnings.catch_warnings``: 45 µs for a 33-byte
answer setting an annotation, two envs and a CPU share, 100 µs for 61 bytes with hugepage limits, a
unified entry and a cgroup parent (best of 5 rounds, load ~9), on the request path of every
CreateContainer. upb (protobuf's C implementation, the classes built from our own
``runtime_hook_v1alpha1.proto`` descriptor, as :mod:`krproxy.hooks.wire` builds the CRI ones) decodes
them and builds the betterproto2 message from the decoded fields in 10 and 16 µs.

:func:`decode` gives the message ``FromString`` would give, and :func:`read` that message's record.
Where the two decoders read the wire differently, each leaves the answer to betterproto2: bytes upb
refuses, and any field upb did not know — a field number the schema lacks, or a known field sent with a
wire type other than its own (betterproto2 reads the latter as a value of the wrong type, which
:func:`krproxy.hooks.convert.wrong_types` then reports), a map entry's key or value included; and an
answer with its resources sent more than once (upb merges the occurrences, as protobuf says; betterproto2
keeps the last, and the fallback must not change the reading). Maps are read as their entries
(:func:`krproxy.hooks.wire.entries`: wire order, a repeated key's later value in its first place), as
betterproto2 reads them. ``tests/unit/test_hooks_answers.py`` holds the two decoders equal.
"""

from __future__ import annotations

from typing import Any, TypeVar

from google.protobuf import descriptor_pb2, message_factory, unknown_fields
from google.protobuf.message import DecodeError

from krproxy import protowire
from krproxy.hooks import convert, wire
from krproxy.hooks.model import ContainerAnswer, PodAnswer, Resources
from krproxy.proto import descriptors
from krproxy.proto.runtime import v1alpha1 as hookapi

__all__ = ["decode", "read"]

M = TypeVar("M", hookapi.ContainerResourceHookResponse, hookapi.PodSandboxHookResponse)

_PACKAGE = "runtime.v1alpha1"
_POOL = wire.private_pool(descriptors.RUNTIME_HOOK_V1ALPHA1)


def _field_kinds() -> dict[str, dict[str, str]]:
    """Per message, per field: ``map`` (read as entries), ``messages``, ``message``, ``scalars`` or ``scalar``."""
    file = descriptor_pb2.FileDescriptorProto.FromString(descriptors.RUNTIME_HOOK_V1ALPHA1)
    kinds: dict[str, dict[str, str]] = {}
    for message in file.message_type:
        entries = {nested.name for nested in message.nested_type if nested.options.map_entry}
        kinds[message.name] = fields = {}
        for field in message.field:
            repeated = field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
            if field.type_name.rsplit(".", 1)[-1] in entries:
                fields[field.name] = "map"
            elif field.type == descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE:
                fields[field.name] = "messages" if repeated else "message"
            else:
                fields[field.name] = "scalars" if repeated else "scalar"
    return kinds


def _singular_messages() -> dict[str, tuple[tuple[str, ...], bytes]]:
    """Per answer type, the names of its singular message fields (the resources) and their tags, one byte
    each. The messages inside an answer have none (checked here): a field sent twice can only be at the top."""
    file = descriptor_pb2.FileDescriptorProto.FromString(descriptors.RUNTIME_HOOK_V1ALPHA1)
    answer_types = (hookapi.ContainerResourceHookResponse.__name__, hookapi.PodSandboxHookResponse.__name__)
    found: dict[str, tuple[tuple[str, ...], bytes]] = {}
    for message in file.message_type:
        singular = [
            f
            for f in message.field
            if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
            and f.label != descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
        ]
        if message.name in answer_types:
            assert all(f.number < 16 for f in singular), "a tag of more than one byte"
            found[message.name] = (
                tuple(f.name for f in singular),
                bytes(f.number << 3 | 2 for f in singular),
            )
        elif message.name.startswith(("LinuxContainerResources", "HugepageLimit")):
            assert not singular, f"{message.name} has a singular message field: check it in _a_message_twice"
    return found


_KINDS = _field_kinds()
_SINGULAR = _singular_messages()
_UPB: dict[type[Any], Any] = {
    cls: message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{_PACKAGE}.{cls.__name__}"))
    for cls in (hookapi.ContainerResourceHookResponse, hookapi.PodSandboxHookResponse)
}


class _Unknown(Exception):
    """upb did not know a field of the answer: betterproto2 reads it."""


def _a_message_twice(message: Any, data: bytes) -> bool:
    """Whether a singular message field of the answer (its resources) occurs more than once: upb merges the
    occurrences, as protobuf says; betterproto2 keeps the last. Called once upb knew every field: each
    field of an answer is length-delimited with a one-byte tag, so the loop only hops from tag to tag
    (anything else is left to betterproto2)."""
    names, tags = _SINGULAR[message.DESCRIPTOR.name]
    if not any(message.HasField(name) for name in names) or all(data.count(tag) < 2 for tag in tags):
        return False
    seen = bytearray()
    pos, end = 0, len(data)
    try:
        while pos < end:
            tag = data[pos]
            if tag & 0x87 != 2:  # not a length-delimited field with a one-byte tag
                return True
            if tag in tags:
                if tag in seen:
                    return True
                seen.append(tag)
            length, pos = protowire.read_varint(data, pos + 1)
            pos += length
    except protowire.DecodeError:
        return True
    return False


def _build(message: Any) -> Any:
    """The betterproto2 message with *message*'s fields (:func:`_fields`)."""
    return getattr(hookapi, message.DESCRIPTOR.name)(**_fields(message))


def _fields(message: Any) -> dict[str, Any]:
    """*message*'s fields set, as the betterproto2 message's constructor takes them (the messages in it
    built). Raises :class:`_Unknown` for a field upb did not know, in the message, the messages in it or a
    map entry (a key or value sent with another wire type is an unknown field of the entry, which upb reads
    as ``""`` where betterproto2 reads the wrong-typed value :func:`krproxy.hooks.convert.wrong_types`
    reports)."""
    _known(message)
    kinds = _KINDS[message.DESCRIPTOR.name]
    fields: dict[str, Any] = {}
    for field, value in message.ListFields():
        kind = kinds[field.name]
        if kind == "map":
            fields[field.name] = _map(value)
        elif kind == "message":
            fields[field.name] = _build(value)
        elif kind == "messages":
            fields[field.name] = [_build(v) for v in value]
        else:
            fields[field.name] = list(value) if kind == "scalars" else value
    return fields


def _known(message: Any) -> None:
    """Raise :class:`_Unknown` if upb kept a field of *message* it did not know."""
    if len(unknown_fields.UnknownFieldSet(message)):
        raise _Unknown


def _map(entries: Any) -> dict[str, str]:
    """A map field read as its entries, as :func:`krproxy.hooks.wire.entries` reads it (wire order, a
    repeated key's later value in its first place); :class:`_Unknown` for an entry with a field upb did not
    know."""
    read = {}
    for entry in entries:
        _known(entry)
        read[entry.key] = entry.value
    return read


def _resources(message: Any) -> Resources:
    """The record of a upb ``LinuxContainerResources``, as :func:`krproxy.hooks.convert.resources_from_hook`
    makes it of the message :func:`_build` gives, without building that message; :class:`_Unknown` as
    :func:`_fields` raises it."""
    _known(message)
    for page in message.hugepage_limits:
        _known(page)
    return convert.resources_from_wire(message, _map(message.unified))


def _upb_message(cls: type[M], data: bytes) -> Any:
    """The answer as upb reads it; None where betterproto2 is to read it (bytes upb refuses: betterproto2's
    own error, or its reading; resources sent twice)."""
    try:
        message = _UPB[cls].FromString(data)
    except DecodeError:
        return None
    return None if _a_message_twice(message, data) else message


def _upb_fields(cls: type[M], data: bytes) -> dict[str, Any] | None:
    """The answer's fields as upb reads them (:func:`_fields`); None where betterproto2 is to read it."""
    message = _upb_message(cls, data)
    if message is None:
        return None
    try:
        return _fields(message)
    except _Unknown:
        return None


def decode(cls: type[M], data: bytes) -> M:
    """``cls.FromString(data)``, through upb where it reads the wire as betterproto2 does."""
    fields = _upb_fields(cls, data)
    return cls.FromString(data) if fields is None else cls(**fields)


#: Per answer type, the record :func:`krproxy.hooks.convert.answer_from_hook` makes of it, and the record's
#: name of each of the answer's fields.
_RECORDS: dict[type[Any], tuple[type[Any], dict[str, str]]] = {
    hookapi.ContainerResourceHookResponse: (
        ContainerAnswer,
        {
            "container_annotations": "annotations",
            "container_resources": "resources",
            "pod_cgroup_parent": "pod_cgroup_parent",
            "container_envs": "envs",
        },
    ),
    hookapi.PodSandboxHookResponse: (
        PodAnswer,
        {
            "labels": "labels",
            "annotations": "annotations",
            "cgroup_parent": "cgroup_parent",
            "resources": "resources",
        },
    ),
}


def _readable_as_records() -> None:
    """What :func:`read`'s loop assumes of the answers: each field has its record's name and is a map, a
    scalar or resources (a ``LinuxContainerResources``)."""
    for cls, (_, names) in _RECORDS.items():
        kinds = _KINDS[cls.__name__]
        assert set(kinds) == set(names), f"{cls.__name__}: fields {sorted(kinds)}, names {sorted(names)}"
        fields = _UPB[cls].DESCRIPTOR.fields_by_name
        for name, kind in kinds.items():
            resources = kind == "message" and fields[name].message_type.name == "LinuxContainerResources"
            assert kind in ("map", "scalar") or resources, f"{cls.__name__}.{name} is read as {kind}"


_readable_as_records()


def read(cls: type[M], data: bytes) -> ContainerAnswer | PodAnswer | M:
    """The answer's record, as :func:`krproxy.hooks.convert.answer_from_hook` makes it of :func:`decode`'s
    message, where upb reads it as betterproto2 does: no betterproto2 message is built (neither the answer
    nor its resources), and its fields have their types (nothing for
    :func:`krproxy.hooks.convert.wrong_types` to find). Elsewhere betterproto2's message (or its error),
    which the caller checks and converts. On the path of every hooked call: 11 µs in a loop, 64 µs (median)
    in the daemon between two creates; building the resources' betterproto2 message first cost 4 and 12 µs
    more (docs/performance.md, "Cold steps")."""
    message = _upb_message(cls, data)
    if message is None:
        return cls.FromString(data)
    record, names = _RECORDS[cls]
    kinds = _KINDS[message.DESCRIPTOR.name]
    values: dict[str, Any] = {}
    try:
        _known(message)
        for field, value in message.ListFields():
            name = field.name
            kind = kinds[name]
            if kind == "map":
                values[names[name]] = _map(value)
            elif kind == "message":  # the resources (_RECORDS: an answer has no other message field)
                values[names[name]] = _resources(value)
            else:
                values[names[name]] = value
    except _Unknown:
        return cls.FromString(data)
    answer: ContainerAnswer | PodAnswer = record(**values)
    return answer
