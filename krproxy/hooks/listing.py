"""Reading the runtime's list and status answers record by record, as its decoder reads them (store recovery).

A ``ListPodSandbox`` answer is one message, but each of its items is a pod. Decoded as a whole, one item
krproxy cannot read fails the whole answer, and recovery, retried forever, never lets a hooked call through
(measured: a pod annotation that is not UTF-8, which containerd 1.6 stores and lists back, kept /readyz at
503 and every call at a hook point waiting out its deadline). So the answer's framing is read first
(:func:`read_list`: it must decode, else the answer is unreadable and recovery retries), then each item on
its own (:func:`read`), by these rules:

- **As Go reads it.** upb decodes it as Go's protobuf does: a known field sent with another wire type and a
  group are unknown fields, a message field sent twice is merged, the last of a scalar wins.
- **A string that is not UTF-8** (gogo protobuf, containerd 1.6's, stores and lists it; upb, Go's protobuf
  APIv2 and containerd 2.x refuse it) is read with each invalid sequence replaced by U+FFFD
  (``errors="replace"``), and the record is kept: that is what hook servers are shown. What a hook server
  receives must be UTF-8 (the hook protocol is proto3 and a Go hook server's decoder refuses anything else;
  a Python string holding ``surrogateescape``'s lone surrogates cannot be encoded at all), and U+FFFD is no
  ASCII character, so replacement never makes a value say something the bytes did not (a skip label, a
  ``required-plugins`` annotation or a ``true`` can only come from the bytes themselves; a required-plugins
  annotation so changed no longer parses, and its pod's calls are refused, not let through). Logged once
  (``recovery_record_repaired``). An **id** that is not UTF-8 is the exception: kubelet's own decoder refuses
  it, so no call can name it; the record is left out.
- **Left out** (``recovery_record_left_out``, once, by id with the reason), the record unusable: a known field
  sent with another wire type, or a group (Go would read the record without that field, and what is
  missing may be what its hooks need, such as the annotation requiring a hook server); a label or
  annotation longer than hook answers may carry (:data:`~krproxy.hooks.validate.MAX_KEY`,
  :data:`~krproxy.hooks.validate.MAX_VALUE`: Kubernetes' limit for all of a pod's annotations, so no
  kubelet's pod has one); bytes that do not decode at all (an item cut short: its id as far as it could be
  read); no id. What a left-out record's later calls get is :mod:`krproxy.hooks.startup`'s rule.
"""

from __future__ import annotations

from typing import Any

import attrs
from google.protobuf.descriptor import FieldDescriptor

from krproxy import protowire
from krproxy.hooks import validate, wire

__all__ = ["Listed", "Read", "Unusable", "read", "read_list"]

#: The field number of the items of ``ListPodSandboxResponse`` and ``ListContainersResponse``, and of
#: ``id`` in ``PodSandbox`` and ``Container``.
_ITEMS = _ID = 1
_LENGTH_DELIMITED = 2

#: The map fields whose entries a record's hooks carry, checked against the hook answers' limits.
_CHECKED_MAPS = frozenset({"labels", "annotations"})


@attrs.frozen
class Unusable:
    """A record recovery could not use as it came: *kind* ``"pod"`` or ``"container"``, its *id*
    (``"(item N)"`` when none could be read), and why (*reason*)."""

    kind: str
    id: str
    reason: str


@attrs.frozen
class Read:
    """One message as recovery reads it: *message* (upb, strict schema), or None and *problem* (why it
    cannot be used); *repaired* names the strings read with U+FFFD, if any."""

    message: Any | None
    problem: str = ""
    repaired: str = ""


@attrs.frozen
class Listed:
    """The usable items of a list answer (upb messages), and the records left out or repaired."""

    items: list[Any]
    left_out: list[Unusable]
    repaired: list[Unusable]


def read_list(data: bytes, item: str, kind: str) -> Listed:
    """The items of a ``ListPodSandboxResponse`` or ``ListContainersResponse`` *data* whose item message is
    *item* (``"PodSandbox"``, ``"Container"``), each read by :func:`read`.

    Raises:
        protowire.DecodeError: the answer's own framing does not decode (nothing can be told apart).
    """
    listed = Listed([], [], [])
    for index, raw in enumerate(_items(data)):
        got = read(raw, item)
        ident = got.message.id if got.message is not None else _scanned_id(raw)
        problem = got.problem or ("" if ident else "no id")
        if not problem and "\ufffd" in ident:
            problem = "its id is not UTF-8 (no caller can name it)"
        shown = ident or f"(item {index})"
        if problem:
            listed.left_out.append(Unusable(kind, shown, problem))
            continue
        if got.repaired:
            listed.repaired.append(Unusable(kind, shown, got.repaired))
        listed.items.append(got.message)
    return listed


def read(data: bytes, name: str) -> Read:
    """The ``runtime.v1`` message *name* in *data*, read by the module's rules (a list item, or a status
    answer, whose record is then the list item's: :mod:`krproxy.hooks.recovery`)."""
    strict = wire.message_class(name)
    repaired = ""
    try:
        message = strict.FromString(data)
    except Exception as err:  # not UTF-8 somewhere, or not protobuf at all
        message, repaired, problem = _repaired(data, name, f"{type(err).__name__}: {err}")
        if message is None:
            return Read(None, problem)
    problem = _unusable(message)
    if problem:
        return Read(None, problem)
    return Read(message, repaired=repaired)


def _items(data: bytes) -> list[bytes]:
    return [
        raw
        for number, wire_type, raw in protowire.fields(data)
        if number == _ITEMS and wire_type == _LENGTH_DELIMITED and isinstance(raw, bytes)
    ]  # anything else in the answer is an unknown field, skipped as Go skips it


def _repaired(data: bytes, name: str, error: str) -> tuple[Any | None, str, str]:
    """*data* read with its strings as bytes, each not UTF-8 replaced: ``(message, what was repaired, "")``,
    or ``(None, "", problem)`` when even that does not decode."""
    try:
        lenient = wire.message_class(name, lenient=True).FromString(data)
    except Exception:
        return None, "", f"does not decode ({error})"
    strict = wire.message_class(name)
    fixed = _replace_invalid(lenient, strict.DESCRIPTOR)
    if not fixed:  # upb refused it for another reason it has only with strings (none known): be strict
        return None, "", f"does not decode ({error})"
    message = strict.FromString(lenient.SerializeToString())
    return message, "not UTF-8, read with U+FFFD: " + ", ".join(fixed), ""


def _replace_invalid(message: Any, strict: Any, where: str = "") -> list[str]:
    """Replace, in place, each string of *message* (lenient: strings are bytes; *strict* its descriptor in
    the strict schema) that is not UTF-8 by its U+FFFD reading; return where each was."""
    fixed: list[str] = []
    for field, value in message.ListFields():
        own = strict.fields_by_number[field.number]
        repeated = field.is_repeated
        values = list(value) if repeated else [value]
        if own.type == FieldDescriptor.TYPE_STRING:
            read = [v.decode("utf-8", "replace").encode() for v in values]
            if read != values:
                fixed.append(_place(message, strict, where, own.name))
                if repeated:
                    value[:] = read
                else:
                    setattr(message, field.name, read[0])
        elif own.message_type is not None:
            for each in values:
                fixed += _replace_invalid(each, own.message_type, f"{where}{own.name}.")
    return fixed


def _place(message: Any, strict: Any, where: str, name: str) -> str:
    """Where a string is, for the log: a map entry's by its key (``annotations["k"]``)."""
    if strict.name.endswith("Entry") and name == "value" and where:
        key = message.key.decode("utf-8", "replace")
        return f"{where[:-1]}[{key[:64]!r}]"
    return where + name


def _unusable(message: Any) -> str:
    """Why the record *message* (strict upb) cannot be used, or ``""``."""
    misread = wire.misread_unknown(message)
    if misread is not None:
        return misread + ": Go reads the record without it"
    return _oversized(message)


def _oversized(message: Any, where: str = "") -> str:
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if field.name in _CHECKED_MAPS:
            for entry in value:
                if len(entry.key) > validate.MAX_KEY:
                    return f"{where}{field.name}: a key of {len(entry.key)} characters (at most {validate.MAX_KEY})"
                if len(entry.value) > validate.MAX_VALUE:
                    return (
                        f"{where}{field.name}[{entry.key[:64]!r}]: {len(entry.value)} characters "
                        f"(at most {validate.MAX_VALUE}, Kubernetes' limit for all of a pod's annotations)"
                    )
            continue
        for each in value if field.is_repeated else (value,):
            found = _oversized(each, f"{where}{field.name}.")
            if found:
                return found
    return ""


def _scanned_id(data: bytes) -> str:
    """The ``id`` (field 1) of an item that does not decode, as far as its bytes can be read, or ``""``."""
    ident = ""
    try:
        for number, wire_type, raw in protowire.fields(data):
            if number == _ID and wire_type == _LENGTH_DELIMITED and isinstance(raw, bytes):
                ident = raw.decode("utf-8", "replace")
    except protowire.DecodeError:
        pass
    return ident
