"""HTTP/2 frames and header blocks, as much of RFC 9113 / RFC 7541 as a gRPC hop needs.

Only bytes in, bytes out: no I/O and no connection state (that is :mod:`krproxy.h2.connection`).

Header blocks are *decoded* with the ``hpack`` package (a peer may use the dynamic table and
Huffman coding) but *encoded* here, without either: every field is a full static-table match
or a literal "without indexing". Such a block never touches the peer's dynamic table, so the
relay has no encoder state to keep, and repeated fields come from a small cache.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from hpack import NeverIndexedHeaderTuple

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 §6).
DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9

# Flags.
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# Error codes (RFC 9113 §7).
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB

#: Error code names, for messages.
ERROR_NAMES = {
    0x0: "NO_ERROR",
    0x1: "PROTOCOL_ERROR",
    0x2: "INTERNAL_ERROR",
    0x3: "FLOW_CONTROL_ERROR",
    0x4: "SETTINGS_TIMEOUT",
    0x5: "STREAM_CLOSED",
    0x6: "FRAME_SIZE_ERROR",
    0x7: "REFUSED_STREAM",
    0x8: "CANCEL",
    0x9: "COMPRESSION_ERROR",
    0xA: "CONNECT_ERROR",
    0xB: "ENHANCE_YOUR_CALM",
    0xC: "INADEQUATE_SECURITY",
    0xD: "HTTP_1_1_REQUIRED",
}

# Settings (RFC 9113 §6.5.2).
HEADER_TABLE_SIZE = 0x1
ENABLE_PUSH = 0x2
MAX_CONCURRENT_STREAMS = 0x3
INITIAL_WINDOW_SIZE = 0x4
MAX_FRAME_SIZE = 0x5
MAX_HEADER_LIST_SIZE = 0x6

DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = 2**31 - 1
MAX_STREAM_ID = 2**31 - 1

HEAD = struct.Struct(">BHBBL")  # length (24 bits as 8 + 16), type, flags, stream id
HEAD_SIZE = HEAD.size
_SETTING = struct.Struct(">HL")
_U32 = struct.Struct(">L")
_GOAWAY = struct.Struct(">LL")


class ProtocolError(Exception):
    """The peer broke HTTP/2; ends the whole connection with GOAWAY(code)."""

    def __init__(self, message: str, code: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes | bytearray | memoryview = b"") -> bytes:
    size = len(payload)
    return HEAD.pack(size >> 16, size & 0xFFFF, kind, flags, stream_id) + payload


def settings(values: Iterable[tuple[int, int]]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(key, value) for key, value in values))


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    if len(payload) % 6:
        raise ProtocolError("SETTINGS payload is not a multiple of 6 bytes", FRAME_SIZE_ERROR)
    return [_SETTING.unpack_from(payload, offset) for offset in range(0, len(payload), 6)]


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def parse_u32(payload: bytes) -> int:
    if len(payload) != 4:
        raise ProtocolError(f"frame payload of {len(payload)} bytes where 4 were due", FRAME_SIZE_ERROR)
    return int(_U32.unpack(payload)[0]) & 0x7FFF_FFFF


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(code))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, _GOAWAY.pack(last_stream_id, code) + debug)


def parse_goaway(payload: bytes) -> tuple[int, int]:
    if len(payload) < 8:
        raise ProtocolError("GOAWAY shorter than 8 bytes", FRAME_SIZE_ERROR)
    last, code = _GOAWAY.unpack_from(payload)
    return last & 0x7FFF_FFFF, code


def take_preface(buf: bytearray) -> bool:
    """Remove the client's connection preface from the start of ``buf``; False while it is
    incomplete there. Raises :class:`ProtocolError` if ``buf`` starts with anything else."""
    if len(buf) < len(PREFACE):
        if not PREFACE.startswith(bytes(buf)):
            raise ProtocolError("not an HTTP/2 connection preface")
        return False
    if not buf.startswith(PREFACE):
        raise ProtocolError("not an HTTP/2 connection preface")
    del buf[: len(PREFACE)]
    return True


def unpad(flags: int, payload: bytes) -> bytes:
    """The payload of a DATA or HEADERS frame without its padding (PADDED flag)."""
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ProtocolError("padding longer than the frame")
    return payload[1 : len(payload) - payload[0]]


def header_fragment(flags: int, payload: bytes) -> tuple[bytes, int | None]:
    """The header block fragment of a HEADERS frame (padding and priority removed), and the
    stream the priority fields say it depends on (None without the PRIORITY flag)."""
    payload = unpad(flags, payload)
    if flags & PRIORITY_FLAG:
        if len(payload) < 5:
            raise ProtocolError("HEADERS with priority shorter than 5 bytes", FRAME_SIZE_ERROR)
        return payload[5:], int(_U32.unpack_from(payload)[0]) & 0x7FFF_FFFF
    return payload, None


def parse_priority(payload: bytes) -> int:
    """The stream a PRIORITY frame's stream depends on. Raises :class:`StreamError` for a wrong
    length (RFC 9113 §6.3: a stream error of type FRAME_SIZE_ERROR)."""
    if len(payload) != 5:
        raise StreamError(f"PRIORITY of {len(payload)} bytes, not 5", FRAME_SIZE_ERROR)
    return int(_U32.unpack_from(payload)[0]) & 0x7FFF_FFFF


class StreamError(Exception):
    """The peer broke HTTP/2 on one stream only: RST_STREAM(code) on it, the connection goes on."""

    def __init__(self, message: str, code: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


#: Header fields specific to a connection (RFC 9113 §8.2.2): an HTTP/2 request carrying one is malformed.
_CONNECTION_SPECIFIC = frozenset(
    (b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade")
)
_REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority"))
_REQUIRED_PSEUDO = frozenset((b":method", b":scheme", b":path"))
#: The octets a regular field name may hold: RFC 9110's token characters but uppercase letters.
#: RFC 9113 §8.2.1 forbids 0x00-0x20, 0x41-0x5a (uppercase), 0x7f-0xff and ':'; grpc-go's framer
#: (containerd's, ``validWireHeaderFieldName``) takes token characters only, which also leaves
#: out ``"(),/;<=>?@[\]{}``. A request either refuses is malformed.
_NAME_OCTETS = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
#: The octets a field value may hold: all but the controls other than HTAB, and DEL. RFC 9113
#: §8.2.1 forbids NUL, LF and CR; grpc-go's framer (``httpguts.ValidHeaderFieldValue``) every
#: control but HTAB (and SP, which is no control), DEL too.
_VALUE_OCTETS = bytes(c for c in range(256) if c == 0x09 or 0x20 <= c != 0x7F)
_WHITESPACE = (0x20, 0x09)


def field_problem(name: bytes, value: bytes) -> str | None:
    """What RFC 9113 §8.2.1 (and grpc-go's framer) find wrong in one field, or None.

    Pseudo-header names are judged by :func:`request_header_problem` (a known few); a value is
    never quoted, as it may be a credential."""
    if not name.startswith(b":") and (not name or name.translate(None, _NAME_OCTETS)):
        return f"header field name {name!r} is not lowercase token characters"
    if value:
        bad = value.translate(None, _VALUE_OCTETS)
        if bad:
            return f"header field {name!r} has a control character (0x{bad[0]:02x}) in its value"
        if value[0] in _WHITESPACE or value[-1] in _WHITESPACE:
            # RFC 9113 §8.2.1 and h2 refuse it; grpc-go's framer lets it through.
            return f"header field {name!r} has a value starting or ending with whitespace"
    return None


#: Fields :func:`field_problem` found nothing wrong in: a call of one method sends the same ones
#: every time (grpc-timeout aside, never remembered). Bounded; started over when full.
_GOOD_FIELDS: set[tuple[bytes, bytes]] = set()
_GOOD_FIELDS_LIMIT = 1024
_NOT_REMEMBERED = frozenset({b"grpc-timeout"})


def request_header_problem(headers: Iterable[tuple[bytes, bytes]], trailers: bool = False) -> str | None:
    """What makes a request's header list (or its trailers) malformed (RFC 9113 §8.2, §8.3.1),
    or None. A malformed request is a stream error of type PROTOCOL_ERROR (§8.1.1)."""
    regular = False
    seen: set[bytes] = set()
    good = _GOOD_FIELDS
    for field in headers:
        name, value = field
        if field not in good:
            problem = field_problem(name, value)
            if problem is not None:
                return problem
            if name not in _NOT_REMEMBERED and len(name) + len(value) <= 256:
                if len(good) >= _GOOD_FIELDS_LIMIT:
                    good.clear()
                good.add(field)
        if name.startswith(b":"):
            if trailers:
                return f"pseudo-header {name!r} in trailers"
            if regular:
                return f"pseudo-header {name!r} after a regular header field"
            if name not in _REQUEST_PSEUDO:
                return f"pseudo-header {name!r} is not a request pseudo-header"
            if name in seen:
                return f"pseudo-header {name!r} twice"
            if name == b":path" and not value:  # §8.3.1: never empty for http and https URIs
                return "empty :path"
            seen.add(name)
            continue
        regular = True
        if name in _CONNECTION_SPECIFIC:
            return f"connection-specific header field {name!r}"
        if name == b"te" and value != b"trailers":
            return f"te header field {value!r} (only 'trailers' is allowed)"
        if name == b"content-length":
            if not value.isdigit() or len(value) > 18:
                return "content-length is not a number"
            if name in seen:
                return "content-length twice"
            seen.add(name)
    if not trailers and not _REQUIRED_PSEUDO <= seen:
        return "no " + ", ".join(n.decode() for n in (b":method", b":scheme", b":path") if n not in seen)
    return None


def content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """The request's content-length, or None (also for a value that is no number, which
    :func:`request_header_problem` refuses). The DATA received must add up to it (RFC 9113 §8.1.1)."""
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() and len(value) <= 18 else None
    return None


def table_size_update(size: int) -> bytes:
    """An HPACK dynamic table size update (RFC 7541 §6.3), which starts a header block."""
    return _integer(size, 5, 0x20)


def header_frames(stream_id: int, block: bytes, end_stream: bool, max_frame: int) -> bytes:
    """HEADERS (+ CONTINUATION) frames carrying ``block``."""
    flags = END_STREAM if end_stream else 0
    if len(block) <= max_frame:
        return frame(HEADERS, flags | END_HEADERS, stream_id, block)
    chunks = [block[i : i + max_frame] for i in range(0, len(block), max_frame)]
    out = [frame(HEADERS, flags, stream_id, chunks[0])]
    out += [frame(CONTINUATION, 0, stream_id, chunk) for chunk in chunks[1:-1]]
    out.append(frame(CONTINUATION, END_HEADERS, stream_id, chunks[-1]))
    return b"".join(out)


# -- HPACK encoding without the dynamic table ------------------------------------------------

#: Fields the HPACK static table (RFC 7541 Appendix A) holds whole, by index.
_STATIC_FIELDS = {
    (b":method", b"GET"): 2,
    (b":method", b"POST"): 3,
    (b":path", b"/"): 4,
    (b":scheme", b"http"): 6,
    (b":scheme", b"https"): 7,
    (b":status", b"200"): 8,
    (b":status", b"204"): 9,
    (b":status", b"206"): 10,
    (b":status", b"304"): 11,
    (b":status", b"400"): 12,
    (b":status", b"404"): 13,
    (b":status", b"500"): 14,
}

_CACHE_LIMIT = 4096
_field_cache: dict[tuple[bytes, bytes], bytes] = {}


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """RFC 7541 §5.1 integer with an N-bit prefix; ``first`` holds the bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(name: bytes, value: bytes) -> bytes:
    index = _STATIC_FIELDS.get((name, value))
    if index is not None:
        return bytes((0x80 | index,))  # indexed header field
    # Literal header field without indexing, new name (first byte 0x00), no Huffman coding.
    return b"\x00" + _integer(len(name), 7, 0) + name + _integer(len(value), 7, 0) + value


def _never_indexed(name: bytes, value: bytes) -> bytes:
    # Literal header field never indexed, new name (RFC 7541 §6.2.3): the flag tells every
    # later hop to keep the field out of its tables too (credentials, cookies).
    return b"\x10" + _integer(len(name), 7, 0) + name + _integer(len(value), 7, 0) + value


def encode_headers(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A header block for ``headers`` that leaves the peer's dynamic table alone."""
    parts = []
    cache = _field_cache
    for field in headers:
        if field.__class__ is NeverIndexedHeaderTuple:  # decoded with that flag: keep it
            parts.append(_never_indexed(*field))
            continue
        encoded = cache.get(field)
        if encoded is None:
            encoded = _field(*field)
            if len(encoded) < 256:
                if len(cache) >= _CACHE_LIMIT:  # e.g. grpc-timeout values: start over
                    cache.clear()
                cache[field] = encoded
        parts.append(encoded)
    return b"".join(parts)
