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
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any, TypeVar

import betterproto2

__all__ = ["FrozenRecordError", "frozen", "is_frozen", "thaw"]

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
    if not isinstance(other, betterproto2.Message) or _base(type(other)) is not _base(type(self)):
        return NotImplemented
    return bool(bytes(self) == bytes(other))


def _bool(self: Any) -> bool:
    return bool(bytes(self))  # any field set (betterproto2's own test compares tuples with lists)


def _repr(self: Any) -> str:
    return f"frozen({thaw(self)!r})"


def _same(self: Any, memo: Any = None) -> Any:
    return self  # a frozen record is its own copy


def _base(cls: type[Any]) -> type[Any]:
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
    if isinstance(value, betterproto2.Message):
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
    cls: type[M] = _base(type(message))
    return cls.parse(bytes(message))
