"""NRI's answers serialized by a plan made once per message class: the bytes ``bytes(message)`` gives,
without betterproto2's cost per field.

A plugin's answer (a ``CreateContainerResponse`` with its adjustment, ``ContainerUpdate``\\ s) is a
betterproto2 message, and betterproto2 serializes it in pure Python with a fresh default value and a
``warnings.catch_warnings()`` per field: ~80 µs for a ``CreateContainerResponse`` adding one env var, of
the ~0.1 ms the SDK's stub then spent on the whole call, while the runtime waited. :func:`encode` walks
the same fields in the same order with what it needs computed beforehand (each field's tag and default),
and writes what betterproto2 writes: a field equal to its default is left out (a sub-message that is set
is written, even empty); repeated numbers and enums packed; map entries with key and value both
written; the message's unknown fields last. Frozen records (:mod:`krproxy.nri.records`) encode as the
messages they view.

NRI's schema has no oneof, wrapper or optional scalar fields and no zig-zag or fixed-width numbers;
:func:`encode` refuses a class that has any (``TypeError``) rather than guess, and a number outside
protobuf's 64 bits (``ValueError``), which betterproto2 would write as a varint no reader takes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import betterproto2

from krproxy.nri import records
from krproxy.protowire import varint

__all__ = ["encode", "prepare"]

_VARINT_KINDS = frozenset({"enum", "bool", "int32", "int64", "uint32", "uint64"})

#: Write one field's (non-default) value at the end of the buffer.
_Write = Callable[[bytearray, Any], None]
#: Per class: (attribute, its default, how to write it), in betterproto2's order.
_Plan = tuple[tuple[str, Any, _Write], ...]
_PLANS: dict[type[Any], _Plan] = {}


def encode(message: betterproto2.Message) -> bytes:
    """``message`` serialized: the same bytes as ``bytes(message)``."""
    out = bytearray()
    _write_message(out, message)
    return bytes(out)


def _write_message(out: bytearray, message: Any) -> None:
    cls = type(message)
    plan = _PLANS.get(cls) or _plan(cls)
    for attribute, default, write in plan:
        value = getattr(message, attribute)
        # A sub-message's default is None: compared only by identity (a message's == is costly).
        if value is None or (default is not None and value == default):
            continue
        write(out, value)
    out += message._unknown_fields


def _varint(value: int) -> bytes:
    if not -(1 << 63) <= value < 1 << 64:
        raise ValueError(f"{value} does not fit protobuf's 64-bit numbers")
    return varint(value)


def _delimited(out: bytearray, key: bytes, data: bytes) -> None:
    out += key
    out += _varint(len(data))
    out += data


def _single(number: int, kind: str) -> Callable[[Any], bytes]:
    """How one value of ``kind`` is written as field ``number`` (tag included), as a map entry's key or
    value is: always, default or not."""
    if kind in _VARINT_KINDS:
        key = _varint(number << 3)
        return lambda value: key + _varint(int(value))
    key = _varint(number << 3 | 2)
    if kind == "string":
        return lambda value: key + _varint(len(raw := value.encode("utf-8"))) + raw
    if kind == "bytes":
        return lambda value: key + _varint(len(value)) + bytes(value)
    if kind == "message":
        return lambda value: key + _varint(len(raw := encode(value))) + raw
    raise TypeError(f"protobuf type {kind} is not in NRI's schema: encode() does not write it")


def _writer(meta: Any, name: str) -> _Write:
    """How the field with betterproto2's metadata ``meta`` is written."""
    if meta.group is not None or meta.unwrap is not None or (meta.optional and meta.proto_type != "message"):
        raise TypeError(f"{name}: oneof, wrapper and optional scalar fields are not in NRI's schema")
    kind, number = meta.proto_type, meta.number
    if meta.map_meta:
        key_of, value_of = _single(1, meta.map_meta[0].proto_type), _single(2, meta.map_meta[1].proto_type)
        if meta.map_meta[1].unwrap is not None:
            raise TypeError(f"{name}: maps of wrappers are not in NRI's schema")
        entry_key = _varint(number << 3 | 2)

        def write_map(out: bytearray, value: Any) -> None:
            for k, v in value.items():
                _delimited(out, entry_key, key_of(k) + value_of(v))

        return write_map
    if meta.repeated and kind in _VARINT_KINDS:  # packed, as proto3 and betterproto2 write them
        packed_key = _varint(number << 3 | 2)

        def write_packed(out: bytearray, value: Any) -> None:
            _delimited(out, packed_key, b"".join(_varint(int(item)) for item in value))

        return write_packed
    one = _single(number, kind)
    if meta.repeated:

        def write_each(out: bytearray, value: Any) -> None:
            for item in value:
                out += one(item)

        return write_each
    return lambda out, value: out.extend(one(value))


def _plan(cls: type[Any]) -> _Plan:
    meta = records.message_class(cls)._betterproto  # a frozen record's: its message class's
    plan = tuple(
        (name, meta.default_gen[name](), _writer(field_meta, name))
        for name, field_meta in meta.meta_by_field_name.items()
    )
    _PLANS[cls] = plan
    return plan


def prepare(cls: type[Any]) -> int:
    """Make the plans of ``cls`` and every message it holds now, rather than at the first answer (~1 ms
    for a ``CreateContainerResponse``); the number of classes."""
    todo, seen = [cls], set()
    while todo:
        each = todo.pop()
        if each in seen:
            continue
        seen.add(each)
        if each not in _PLANS:
            _plan(each)
        meta = records.message_class(each)._betterproto
        for name, field_meta in meta.meta_by_field_name.items():
            if field_meta.map_meta:
                if field_meta.map_meta[1].proto_type == "message":
                    todo.append(meta.cls_by_field[f"{name}.value"])
            elif field_meta.proto_type == "message":
                todo.append(meta.cls_by_field[name])
    return len(seen)
