"""Read-only NRI records: what an NRI plugin's handlers are shown of pods, containers and resources.

A handler of :class:`krproxy.hookserver.nri.NriStub` gets the runtime's records as NRI defines them, with
NRI's names and types (``api.PodSandbox``, ``api.Container``, ``api.LinuxResources``...: the messages of
:mod:`krproxy.proto.nri.pkg.api.v1alpha1`), but frozen: :func:`frozen` makes a view of a message that is an
instance of the message's own class (so ``isinstance``, type hints, ``bytes(record)`` and every field
NRI adds in a release work unchanged), whose fields cannot be set or deleted, whose repeated fields are
tuples and whose maps are read-only mappings, all the way down.

Why views and not a second set of classes: plugin authors read NRI's documentation and Go plugins, so the
records keep NRI's field names and nesting exactly, and a hand-kept mirror of NRI's schema would fall
behind it. Why frozen: changing a record changes nothing in the runtime (NRI applies only what a plugin
answers), and a plugin that did so by mistake would believe it had adjusted the container. Setting a field
raises :class:`FrozenRecordError` saying what to answer instead. :func:`thaw` gives a mutable copy, for a
handler that wants to build on one.

:func:`parse_frozen` decodes a runtime's request straight into such views: upb (:mod:`krproxy.nri.wire`)
decodes, and each field of a view is read from upb's message when the handler first reads it (then kept
on the view), where betterproto2's decoding and then :func:`frozen`'s copy took ~1 ms for one
CreateContainer request from containerd (pure Python, some 50 messages deep) while the runtime waited
for the plugin's answer; filling every view at once still took ~0.17 ms of it, though a handler reads a
few fields (the pod's name and annotations, the container's name). A handler that reads everything pays
that much, no more. What a view shows does not depend on when it is read: upb's messages are not
changed after decoding, and a view holds its own.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import betterproto2
from google.protobuf.message import DecodeError

from krproxy.nri import wire

__all__ = [
    "FrozenRecordError",
    "frozen",
    "is_frozen",
    "is_message",
    "message_class",
    "parse_frozen",
    "prepare",
    "thaw",
]

M = TypeVar("M", bound=betterproto2.Message)

#: The read-only subclass made for each message class, made once.
_FROZEN: dict[type[Any], type[Any]] = {}


class FrozenRecordError(AttributeError):
    """A handler tried to change a record the runtime showed it."""


def _refuse(self: Any, name: str, value: Any = None) -> None:
    raise FrozenRecordError(
        f"{type(self).__name__}.{name} is read-only: NRI records say what the runtime has; answer a change "
        "instead (a ContainerAdjustment at creation, ContainerUpdates otherwise), or thaw() a copy"
    )


def _eq(self: Any, other: Any) -> Any:
    """Equal to a frozen or mutable message of the same class with the same content."""
    if not is_message(other) or message_class(type(other)) is not message_class(type(self)):
        return NotImplemented
    return bool(bytes(self) == bytes(other))


def _bool(self: Any) -> bool:
    return bool(bytes(self))  # any field set (betterproto2's own test compares tuples with lists)


def _repr(self: Any) -> str:
    return f"frozen({thaw(self)!r})"


def _same(self: Any, memo: Any = None) -> Any:
    return self  # a frozen record is its own copy


def is_message(value: Any) -> bool:
    """Whether ``value`` is a betterproto2 message (a frozen record too), without ``isinstance``:
    betterproto2's ``Message`` is an ABC with some 360 NRI subclasses, and the first ``isinstance`` of each
    new type against it walks them all (~1 ms: 3 ms in the first CreateContainer of each plugin start)."""
    return betterproto2.Message in type(value).__mro__


def message_class(cls: type[Any]) -> type[Any]:
    """The message class NRI defines of ``cls``: ``cls`` itself, or the one a frozen class views."""
    return cls.__bases__[0] if getattr(cls, "_krproxy_frozen", False) else cls


def _frozen_class(cls: type[M]) -> type[M]:
    made = _FROZEN.get(cls)
    if made is None:
        namespace = {
            "__setattr__": _refuse,
            "__delattr__": _refuse,
            "__eq__": _eq,
            "__hash__": None,
            "__bool__": _bool,
            "__repr__": _repr,
            "__copy__": _same,
            "__deepcopy__": _same,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_krproxy_frozen": True,
        }
        made = _FROZEN[cls] = types.new_class(cls.__name__, (cls,), {}, lambda ns: ns.update(namespace))
    return made


def _freeze_value(value: Any) -> Any:
    if is_message(value):
        return frozen(value)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze_value(item) for item in value)
    if isinstance(value, Mapping):
        return types.MappingProxyType({key: _freeze_value(item) for key, item in value.items()})
    return value


def frozen(message: M) -> M:
    """A read-only view of ``message`` (a copy: later changes to ``message`` do not show)."""
    if is_frozen(message):
        return message
    view = object.__new__(_frozen_class(type(message)))
    data: Any = message  # betterproto2's messages are dataclasses (not typed as such)
    for field in dataclasses.fields(data):
        object.__setattr__(view, field.name, _freeze_value(getattr(message, field.name)))
    object.__setattr__(view, "_unknown_fields", message._unknown_fields)
    return view


def is_frozen(message: Any) -> bool:
    return bool(getattr(type(message), "_krproxy_frozen", False))


def thaw(message: M) -> M:
    """A mutable copy of a record (frozen or not), of the message class NRI defines."""
    cls: type[M] = message_class(type(message))
    return cls.parse(bytes(message))


def parse_frozen(cls: type[M], payload: bytes) -> M:
    """``payload`` decoded as the NRI message ``cls``, read-only: what ``frozen(cls.parse(payload))`` gives,
    a view of the same class with the same content, a few times faster (see the module).

    A payload betterproto2 would read differently goes through betterproto2 itself: one upb cannot decode
    (invalid UTF-8, say: betterproto2 then raises its own error), and one with fields our schema lacks (a
    newer runtime's), which betterproto2 keeps as unknown fields and upb's reading would lose.
    """
    try:
        message = wire.parse(cls.__name__, payload)
    except DecodeError:
        return frozen(cls.parse(payload))
    size = message.ByteSize()
    message.DiscardUnknownFields()
    if message.ByteSize() != size:
        return frozen(cls.parse(payload))
    view: M = _view(cls, message)
    return view


def prepare(cls: type[Any]) -> int:
    """Make what :func:`parse_frozen` of ``cls`` needs (the plans and frozen classes of ``cls`` and every
    message it holds) now, rather than at the first request (a few ms); the number of classes."""
    todo = [(cls, wire.message_class(cls.__name__).DESCRIPTOR)]
    seen: set[type[Any]] = set()
    while todo:
        each, descriptor = todo.pop()
        if each in seen:
            continue
        seen.add(each)
        _frozen_class(each)
        _PLANS.get(each) or _plan(each, descriptor)
        classes = each._betterproto.cls_by_field
        for field in descriptor.fields:
            if field.message_type is None:
                continue
            name = _attribute(each, field.number)
            if field.message_type.GetOptions().map_entry:
                value = field.message_type.fields_by_name["value"]
                if value.message_type is not None:
                    todo.append((classes[f"{name}.value"], value.message_type))
            else:
                todo.append((classes[name], field.message_type))
    return len(seen)


def _attribute(cls: type[Any], number: int) -> str:
    """The attribute of betterproto2's ``cls`` for field ``number``."""
    name: str = cls._betterproto.field_name_by_number[number]
    return name


#: How each field of a message class is read from a upb message: (attribute, upb field name, reader).
_Plan = tuple[tuple[str, str, Callable[[Any, str], Any]], ...]
_PLANS: dict[type[Any], _Plan] = {}


#: Where a view made by :func:`parse_frozen` keeps its upb message.
_UPB = "_krproxy_upb"


class _Lazy:
    """A field of the frozen class of a message, read from a view's upb message at its first read and
    then kept on the view (whose own value, set at once by :func:`frozen`, hides this from then on)."""

    __slots__ = ("attribute", "name", "read")

    def __init__(self, attribute: str, name: str, read: Callable[[Any, str], Any]) -> None:
        self.attribute, self.name, self.read = attribute, name, read

    def __get__(self, view: Any, owner: type[Any] | None = None) -> Any:
        if view is None:  # on the class: what the message's own class has there
            return getattr(message_class(owner), self.attribute) if owner is not None else self
        value = self.read(view.__dict__[_UPB], self.name)
        object.__setattr__(view, self.attribute, value)
        return value


def _view(cls: type[Any], message: Any) -> Any:
    """The frozen view of ``cls`` holding what the upb ``message`` holds (each field read at first use)."""
    if cls not in _PLANS:
        _plan(cls, message.DESCRIPTOR)
    view = object.__new__(_frozen_class(cls))
    object.__setattr__(view, _UPB, message)
    object.__setattr__(view, "_unknown_fields", b"")
    return view


def _plan(cls: type[Any], descriptor: Any) -> _Plan:
    """The plan of ``cls``, whose upb messages are of ``descriptor`` (names may differ: ``LinuxCpu`` is
    ``LinuxCPU``; field numbers do not); each field becomes a :class:`_Lazy` of the frozen class."""
    meta = cls._betterproto
    by_number = descriptor.fields_by_number
    plan = []
    frozen_cls = _frozen_class(cls)
    for field in dataclasses.fields(cls):
        field_meta = meta.meta_by_field_name[field.name]
        reader = _reader(field_meta, meta.cls_by_field, field.name)
        name = by_number[field_meta.number].name
        plan.append((field.name, name, reader))
        type.__setattr__(frozen_cls, field.name, _Lazy(field.name, name, reader))
    _PLANS[cls] = made = tuple(plan)
    return made


def _reader(meta: Any, classes: Mapping[str, Any], name: str) -> Callable[[Any, str], Any]:
    """How a field with betterproto2's metadata ``meta`` is read as :func:`frozen` would hold it."""
    if meta.group is not None or meta.unwrap is not None or (meta.optional and meta.proto_type != "message"):
        raise TypeError(f"{name}: oneof, wrapper and optional scalar fields are not in NRI's schema")
    kind = meta.proto_type
    if kind == "map":
        entry = classes[name]
        value_kind = entry._betterproto.meta_by_field_name["value"].proto_type
        if value_kind == "message":
            value_cls = classes[f"{name}.value"]
            return lambda m, n: types.MappingProxyType(
                {e.key: _view(value_cls, e.value) for e in getattr(m, n)}
            )
        if value_kind == "enum":
            enum_cls = classes[f"{name}.value"]
            return lambda m, n: types.MappingProxyType({e.key: enum_cls(e.value) for e in getattr(m, n)})
        return lambda m, n: types.MappingProxyType({e.key: e.value for e in getattr(m, n)})
    if kind == "message":
        sub = classes[name]
        if meta.repeated:
            return lambda m, n: tuple(_view(sub, item) for item in getattr(m, n))
        return lambda m, n: _view(sub, getattr(m, n)) if m.HasField(n) else None
    if kind == "enum":
        enum_cls = classes[name]
        if meta.repeated:
            return lambda m, n: tuple(enum_cls(item) for item in getattr(m, n))
        return lambda m, n: enum_cls(getattr(m, n))
    if meta.repeated:
        return lambda m, n: tuple(getattr(m, n))
    return getattr
