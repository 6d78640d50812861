"""The trace file format: pure encoding and decoding, no I/O (see docs/trace-format.md).

A trace file is a header followed by length-prefixed records, each with a CRC32::

    header   "KRPTRACE" | version u16 | flags u16 | meta length u32 | meta (JSON) | CRC32 u32
    record   payload length u32 | CRC32(payload) u32 | payload
    ...

All integers are big-endian. A call record's payload is a fixed part (kind, flags, status,
reply count, three doubles, six lengths) followed by six byte strings: method path, request,
forwarded request, reply, status message (UTF-8) and hook outcomes (UTF-8 JSON, empty when no
plugin was called).

Encoding (:func:`encode_call`) runs on the request path, once per call: one ``struct.pack``,
an incremental CRC over the parts and one ``bytes.join``; nothing is decoded. Decoding
(:func:`read_records`) happens offline.

Error handling: :func:`read_records` stops at the first record it cannot trust. A record the
file ends in the middle of (a crash mid-write) is a *torn tail*: reported in
:attr:`ReadResult.torn`, the records before it are returned. A complete record whose CRC or
structure is wrong raises :class:`CorruptRecordError` naming its record number and offset; with
``skip_corrupt`` (what ``trace show`` reads with) it is named in :attr:`ReadResult.corrupt` instead and
reading goes on after it, where its length says it ends. A damaged length leaves no way to find the
next record: the rest of the file is then reported unread (:attr:`ReadResult.unread`).
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from krproxy.calls import CallFacts, CallRecord
from krproxy.grpcstatus import Status
from krproxy.hooks.outcomes import Outcome

MAGIC = b"KRPTRACE"
#: The format version this module writes; readers accept files of this version only.
VERSION = 1

_HEADER = struct.Struct(">8sHHI")  # magic, version, flags, meta length
_FRAME = struct.Struct(">II")  # payload length, CRC32 of the payload
#: kind, flags, status, replies, started, seconds, backend seconds, then six part lengths.
_CALL = struct.Struct(">BBHIddd6I")
_CRC = struct.Struct(">I")

#: Record kinds. Readers skip kinds they do not know (a newer writer may add some).
KIND_CALL = 1

_HAS_FORWARDED = 0x01
_HAS_REPLY = 0x02
_HAS_MESSAGE = 0x04

#: Upper bound of a record's payload. A length above it can only be damage: kubelet's own
#: message limit is 16 MiB, and a record holds at most request, forwarded request and reply.
MAX_PAYLOAD = 256 << 20

#: Header metadata longer than this is taken for damage, not a header.
MAX_META = 1 << 20


class TraceError(Exception):
    """A trace file cannot be read."""


class TraceFormatError(TraceError):
    """Not a trace file, or one written by an incompatible version."""


class CorruptRecordError(TraceError):
    """A complete record failed its check: the file is damaged at that record.

    Attributes:
        number: the record's number in its file, counting from 1.
        offset: the byte offset of the record's frame in the file.
        reason: what was wrong.
        resumes: whether the next record can be found (the damaged one's length is plausible).
    """

    def __init__(self, number: int, offset: int, reason: str, *, resumes: bool = True) -> None:
        super().__init__(f"record {number} (byte offset {offset}) is corrupt: {reason}")
        self.number = number
        self.offset = offset
        self.reason = reason
        self.resumes = resumes


# --- header -----------------------------------------------------------------------------------------


def encode_header(meta: Mapping[str, Any]) -> bytes:
    """The file header carrying ``meta`` (a JSON object: writer, creation time, ...)."""
    body = json.dumps(dict(meta), separators=(",", ":"), sort_keys=True).encode()
    head = _HEADER.pack(MAGIC, VERSION, 0, len(body)) + body
    return head + _CRC.pack(zlib.crc32(head))


@attrs.frozen
class Header:
    """A file's header: format version, writer metadata, and where the first record starts."""

    version: int
    meta: Mapping[str, Any]
    size: int


def decode_header(data: bytes | memoryview) -> Header:
    """Parse the header at the start of ``data``.

    Raises:
        TraceFormatError: wrong magic, unsupported version, or a damaged header.
    """
    view = memoryview(data)
    if not view:  # e.g. created by `krproxy serve --record-paused`, not yet switched on
        raise TraceFormatError("the file is empty: nothing has been recorded into it")
    if len(view) < _HEADER.size or bytes(view[:8]) != MAGIC:
        raise TraceFormatError("not a krproxy trace file (no KRPTRACE header)")
    _, version, _flags, meta_len = _HEADER.unpack_from(view)
    if version != VERSION:
        raise TraceFormatError(
            f"trace format version {version} is not supported (this krproxy reads {VERSION})"
        )
    end = _HEADER.size + meta_len
    if meta_len > MAX_META or len(view) < end + _CRC.size:
        raise TraceFormatError("the trace header is truncated")
    (crc,) = _CRC.unpack_from(view, end)
    if crc != zlib.crc32(view[:end]):
        raise TraceFormatError("the trace header is damaged (CRC mismatch)")
    try:
        meta = json.loads(bytes(view[_HEADER.size : end]))
    except ValueError as err:
        raise TraceFormatError(f"the trace header's metadata is not JSON: {err}") from None
    return Header(version, meta, end + _CRC.size)


# --- call records -------------------------------------------------------------------------------------


def _hooks_json(hooks: tuple[Outcome, ...]) -> bytes:
    return json.dumps(
        [
            {
                "plugin": o.plugin,
                "point": o.point.value,
                "result": o.result,
                "seconds": o.seconds,
                "detail": o.detail,
                "changes": [[c.field, c.old, c.new] for c in o.changes],
            }
            for o in hooks
        ],
        separators=(",", ":"),
    ).encode()


#: Method paths encoded once: the set of paths a proxy sees is small.
_PATHS: dict[str, bytes] = {}


def encode_call(record: CallRecord) -> bytes:
    """One framed record (frame header included) for ``record``; bytes are copied, never decoded."""
    path = _PATHS.get(record.path)
    if path is None:
        path = (
            _PATHS.setdefault(record.path, record.path.encode())
            if len(_PATHS) < 1024
            else record.path.encode()
        )
    flags = 0
    forwarded = record.forwarded
    if forwarded is not None:
        flags |= _HAS_FORWARDED
    else:
        forwarded = b""
    reply = record.reply
    if reply is not None:
        flags |= _HAS_REPLY
    else:
        reply = b""
    if record.message is not None:
        flags |= _HAS_MESSAGE
        message = record.message.encode("utf-8", "replace")
    else:
        message = b""
    hooks = _hooks_json(record.hooks) if record.hooks else b""
    request = record.request
    head = _CALL.pack(
        KIND_CALL,
        flags,
        record.status.value,
        record.replies,
        record.started,
        record.seconds,
        record.backend_seconds,
        len(path),
        len(request),
        len(forwarded),
        len(reply),
        len(message),
        len(hooks),
    )
    parts = (head, path, request, forwarded, reply, message, hooks)
    crc = 0
    size = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
        size += len(part)
    return b"".join((_FRAME.pack(size, crc), *parts))


@attrs.frozen
class FieldChange:
    """One field a plugin changed (see :class:`krproxy.hooks.merge.Change`)."""

    field: str
    old: str | int | None
    new: str | int | None


@attrs.frozen
class HookRecord:
    """One plugin call made during a CRI call."""

    plugin: str
    point: str
    result: str
    seconds: float
    detail: str
    changes: tuple[FieldChange, ...]

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> HookRecord:
        return cls(
            plugin=str(obj["plugin"]),
            point=str(obj["point"]),
            result=str(obj["result"]),
            seconds=float(obj["seconds"]),
            detail=str(obj.get("detail", "")),
            changes=tuple(FieldChange(str(f), o, n) for f, o, n in obj.get("changes", ())),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "plugin": self.plugin,
            "point": self.point,
            "result": self.result,
            "seconds": self.seconds,
            "detail": self.detail,
            "changes": [{"field": c.field, "old": c.old, "new": c.new} for c in self.changes],
        }


@attrs.frozen
class TraceRecord(CallFacts):
    """One recorded CRI call, as read back from a trace (messages still raw bytes): the
    :class:`~krproxy.calls.CallFacts` of the call that was recorded, and

    Attributes:
        number: the record's number in its file, counting from 1.
        hooks: the plugin calls made, in order.
    """

    number: int
    hooks: tuple[HookRecord, ...]

    @property
    def method(self) -> str:
        """The method's short name, e.g. ``"CreateContainer"``."""
        return self.path.rpartition("/")[2]

    @property
    def runtime_request(self) -> bytes:
        """The request the runtime received: the forwarded one if hooks changed it."""
        return self.forwarded if self.forwarded is not None else self.request


def _status(code: int) -> Status:
    try:
        return Status(code)
    except ValueError:
        return Status.UNKNOWN


def decode_call(number: int, offset: int, payload: bytes | memoryview) -> TraceRecord:
    """Decode a call record's payload (its CRC already checked).

    Raises:
        CorruptRecordError: the payload's structure is inconsistent.
    """
    view = memoryview(payload)
    if len(view) < _CALL.size:
        raise CorruptRecordError(number, offset, "call record shorter than its fixed part")
    (_kind, flags, status, replies, started, seconds, backend, *lengths) = _CALL.unpack_from(view)
    if _CALL.size + sum(lengths) != len(view):
        raise CorruptRecordError(number, offset, "part lengths do not add up to the record length")
    parts = []
    pos = _CALL.size
    for length in lengths:
        parts.append(bytes(view[pos : pos + length]))
        pos += length
    path_b, request, forwarded, reply, message_b, hooks_b = parts
    try:
        path = path_b.decode()
        message = message_b.decode() if flags & _HAS_MESSAGE else None
        hooks = tuple(HookRecord.from_json(h) for h in json.loads(hooks_b)) if hooks_b else ()
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptRecordError(number, offset, f"undecodable text: {err}") from None
    return TraceRecord(
        number=number,
        path=path,
        started=started,
        seconds=seconds,
        backend_seconds=backend,
        request=request,
        forwarded=forwarded if flags & _HAS_FORWARDED else None,
        reply=reply if flags & _HAS_REPLY else None,
        replies=replies,
        status=_status(status),
        message=message,
        hooks=hooks,
    )


# --- reading a whole file -------------------------------------------------------------------------


@attrs.frozen
class TornTail:
    """The file ends inside a record (a crash mid-write): that record was skipped.

    Attributes:
        number: the number the torn record would have had.
        offset: where it starts.
        size: how many bytes of it are in the file.
    """

    number: int
    offset: int
    size: int

    def describe(self) -> str:
        return (
            f"torn last record {self.number} at byte offset {self.offset} "
            f"({self.size} bytes, incomplete) was skipped"
        )


@attrs.frozen
class Frame:
    """A record's payload, checked against its CRC, with its place in the file."""

    number: int
    offset: int
    payload: memoryview
    end: int


def iter_frames(
    data: bytes | memoryview, start: int, *, skip_corrupt: bool = False
) -> Iterator[Frame | TornTail | CorruptRecordError]:
    """Check and yield the records of ``data`` from offset ``start`` (just after the header).

    Yields a :class:`TornTail` last if the data ends inside a record (or in a run of zero
    bytes, as a file system may leave after a crash). With ``skip_corrupt`` a damaged record is
    yielded as its :class:`CorruptRecordError` and the records after it follow; one whose length is
    impossible is yielded last (nothing after it can be found).

    Raises:
        CorruptRecordError: without ``skip_corrupt``, a complete record failed its CRC or has an
            impossible length.
    """
    view = memoryview(data)
    pos, number, total = start, 0, len(view)
    while pos < total:
        number += 1
        rest = total - pos
        if rest < _FRAME.size or not any(view[pos:]):
            yield TornTail(number, pos, rest)
            return
        length, crc = _FRAME.unpack_from(view, pos)
        if length == 0 or length > MAX_PAYLOAD:
            error = CorruptRecordError(number, pos, f"impossible record length {length}", resumes=False)
            if not skip_corrupt:
                raise error
            yield error
            return
        end = pos + _FRAME.size + length
        if end > total:
            yield TornTail(number, pos, rest)
            return
        payload = view[pos + _FRAME.size : end]
        if zlib.crc32(payload) == crc:
            yield Frame(number, pos, payload, end)
        elif skip_corrupt:
            yield CorruptRecordError(number, pos, "CRC mismatch")
        else:
            raise CorruptRecordError(number, pos, "CRC mismatch")
        pos = end


@attrs.frozen
class ReadResult:
    """What :func:`read_records` found in one file."""

    header: Header
    records: tuple[TraceRecord, ...]
    torn: TornTail | None = None
    unknown_kinds: int = 0
    #: With ``skip_corrupt``: the damaged records left out, in file order.
    corrupt: tuple[CorruptRecordError, ...] = ()
    #: With ``skip_corrupt``: bytes after a damaged record length, which could not be read.
    unread: int = 0


def read_records(data: bytes, *, skip_corrupt: bool = False) -> ReadResult:
    """Decode a whole trace file held in memory.

    With ``skip_corrupt`` a damaged record is left out and named in :attr:`ReadResult.corrupt`, and the
    good records before and after it are returned.

    Raises:
        TraceFormatError: no valid header.
        CorruptRecordError: without ``skip_corrupt``, a record is damaged (its number and offset are
            in the error).
    """
    header = decode_header(data)
    records: list[TraceRecord] = []
    corrupt: list[CorruptRecordError] = []
    torn: TornTail | None = None
    unknown = unread = 0
    for item in iter_frames(data, header.size, skip_corrupt=skip_corrupt):
        if isinstance(item, TornTail):
            torn = item
            break
        if isinstance(item, CorruptRecordError):
            corrupt.append(item)
            if not item.resumes:
                unread = len(data) - item.offset
            continue
        if item.payload[0] != KIND_CALL:
            unknown += 1
            continue
        try:
            records.append(decode_call(item.number, item.offset, item.payload))
        except CorruptRecordError as err:
            if not skip_corrupt:
                raise
            corrupt.append(err)
    return ReadResult(header, tuple(records), torn, unknown, tuple(corrupt), unread)


def valid_end(data: bytes | memoryview, start: int) -> int:
    """The offset just after the last intact record: where a writer may append (a torn tail is cut).

    Raises:
        CorruptRecordError: a record before the end is damaged; appending would bury it.
    """
    end = start
    for item in iter_frames(data, start):
        if isinstance(item, Frame):
            end = item.end
    return end
