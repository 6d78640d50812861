"""gRPC on the relay's streams, without the streams: ``grpc-timeout``, status trailers, message
framing and decompression, the message counter of a relayed call (:class:`Tap`), and what the
relay's own calls answer or raise (:class:`Answer`, :class:`UpstreamError`)."""

from __future__ import annotations

import base64
import binascii
import logging
import math
import urllib.parse
import zlib
from collections.abc import Iterable

import attrs
import trio

from krproxy.grpcstatus import GRPCError, Status
from krproxy.h2 import frames as f
from krproxy.relay.half import Headers

LOGGER = logging.getLogger("krproxy.relay")

_GRPC_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_STATUS_BY_CODE = {status.value: status for status in Status}


#: The gRPC spec allows at most 8 digits in ``grpc-timeout``; grpc-go (containerd, koordlet)
#: resets a stream whose value is longer (1.6: RST_STREAM PROTOCOL_ERROR; 2.x: INTERNAL).
_GRPC_TIMEOUT_MAX = 10**8 - 1
#: Units from the finest, as grpc-go's ``encodeTimeout`` tries them, with their size in ns.
_GRPC_TIMEOUT_ENCODE = (
    (b"n", 1),
    (b"u", 10**3),
    (b"m", 10**6),
    (b"S", 10**9),
    (b"M", 60 * 10**9),
    (b"H", 3600 * 10**9),
)


def grpc_timeout(value: bytes) -> float | None:
    """Seconds in a ``grpc-timeout`` header value (``"100m"``), None if malformed."""
    unit = _GRPC_TIMEOUT_UNITS.get(value[-1:])
    if unit is None or not value[:-1].isdigit() or len(value) > 9:
        return None
    return int(value[:-1]) * unit


def encode_grpc_timeout(seconds: float) -> bytes:
    """A ``grpc-timeout`` header value for ``seconds``, as the gRPC spec and grpc-go write it.

    The finest unit whose count fits in 8 digits, rounded up (a peer never sees a deadline
    earlier than ours); ``0n`` for a deadline already past, 99999999 hours at most.
    """
    if seconds <= 0:
        return b"0n"
    nanos = math.ceil(seconds * 1e9)
    for unit, size in _GRPC_TIMEOUT_ENCODE:
        count = -(-nanos // size)
        if count <= _GRPC_TIMEOUT_MAX:
            return b"%d%s" % (count, unit)
    return b"%d%s" % (_GRPC_TIMEOUT_MAX, b"H")


PLAIN_HEADERS: Headers = [(b":status", b"200"), (b"content-type", b"application/grpc")]
PLAIN_TRAILERS: Headers = [(b"grpc-status", b"0")]


#: The most bytes of ``grpc-message`` krproxy writes (percent-encoded). A client bounds the header block a
#: status arrives in: grpcio refuses one above 16 KiB (the caller sees RESOURCE_EXHAUSTED "received metadata
#: size exceeds hard limit" instead of the status krproxy sent), and grpc-go 1.82 starts moving its default
#: from 16 MiB to 8 KiB (a later release makes it the default; kubelet's client then answers INTERNAL). A
#: hook server's error message, which a Fail plugin's status carries to kubelet, can be any length: past
#: this it is cut, and says so. 4 KiB leaves room under 8 KiB for the other fields.
MAX_STATUS_MESSAGE = 4096


def status_message(message: str) -> bytes:
    """*message* as a ``grpc-message`` value: percent-encoded, at most :data:`MAX_STATUS_MESSAGE` bytes.

    A longer one keeps its start (the status krproxy words names the plugin and hook first) and ends
    with how many characters were cut. A character UTF-8 cannot encode (a lone surrogate) is sent
    escaped (``\\udcff``).
    """
    encoded = urllib.parse.quote(message, safe=" ", errors="backslashreplace").encode()
    if len(encoded) <= MAX_STATUS_MESSAGE:
        return encoded
    budget = MAX_STATUS_MESSAGE - len(_quoted_cut_note(len(message)))
    kept = size = 0
    for char in message:
        size += len(urllib.parse.quote(char, safe=" ", errors="backslashreplace"))
        if size > budget:
            break
        kept += 1
    kept_part = urllib.parse.quote(message[:kept], safe=" ", errors="backslashreplace").encode()
    return kept_part + _quoted_cut_note(len(message) - kept)


def _quoted_cut_note(cut: int) -> bytes:
    return urllib.parse.quote(f" ... ({cut} more characters cut by krproxy)", safe=" ").encode()


#: The most bytes of ``grpc-status-details-bin`` krproxy writes (base64, unpadded). Details are one
#: ``google.rpc.Status`` and cannot be cut as a message is: longer ones are left out (logged), the status
#: and message still go. With the longest ``grpc-message`` the status fields stay under 8 KiB of header
#: list (RFC 7541 §4.1), the limit gRPC suggests for trailers and grpc-go's coming default (grpc-go
#: PR 9019, on from 1.82); grpc-go itself bounds details by the header list alone, and a block over a
#: client's limit costs that client the whole status (grpc-go resets the stream, grpcio answers
#: RESOURCE_EXHAUSTED).
MAX_STATUS_DETAILS = 3072


def status_fields(status: Status, message: str | None, details: bytes | None) -> Headers:
    fields = [(b"grpc-status", b"%d" % status.value)]
    if message:
        fields.append((b"grpc-message", status_message(message)))
    if details:
        encoded = base64.b64encode(details).rstrip(b"=")
        if len(encoded) <= MAX_STATUS_DETAILS:
            fields.append((b"grpc-status-details-bin", encoded))
        else:
            LOGGER.warning(
                "event=status_details_left_out status=%s bytes=%d limit=%d",
                status.name,
                len(encoded),
                MAX_STATUS_DETAILS,
            )
    return fields


def read_status(headers: Headers) -> tuple[Status | None, str | None, bytes | None]:
    """``grpc-status`` (None if missing or unknown), ``grpc-message`` and ``grpc-status-details-bin``."""
    code = message = details = None
    for name, value in headers:
        if name == b"grpc-status":
            code = value
        elif name == b"grpc-message":
            message = urllib.parse.unquote(value.decode("utf-8", "replace"))
        elif name == b"grpc-status-details-bin":
            try:
                details = base64.b64decode(value + b"=" * (-len(value) % 4))
            except binascii.Error:  # not base64: the status and message still stand
                details = None
    status = _STATUS_BY_CODE.get(int(code)) if code is not None and code.isdigit() else None
    return status, message, details


#: The status of a call whose stream the upstream reset, by HTTP/2 error code (as grpc-go's
#: http2ErrConvTab); codes not listed are INTERNAL. REFUSED_STREAM is handled apart (a retry).
RESET_STATUS = {
    f.CANCEL: Status.CANCELLED,
    f.FLOW_CONTROL_ERROR: Status.RESOURCE_EXHAUSTED,
    f.ENHANCE_YOUR_CALM: Status.RESOURCE_EXHAUSTED,
    0xC: Status.PERMISSION_DENIED,  # INADEQUATE_SECURITY
    f.REFUSED_STREAM: Status.UNAVAILABLE,
}

KEEP_NONE, KEEP_FIRST, KEEP_ALL = 0, 1, 2


class MessageTooLarge(Exception):
    """A message's length prefix announced more than a :class:`Tap`'s limit."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"a message of {size} bytes is larger than the limit of {limit} bytes")
        self.size, self.limit = size, limit


class Tap:
    """Counts the gRPC messages in one direction of a call; keeps their bytes if asked to.

    ``keep``: :data:`KEEP_NONE` (count only), :data:`KEEP_FIRST` (the first message: a request,
    or what an interceptor needs) or :data:`KEEP_ALL` (every message's bytes, for unary replies
    in call records). ``limit``: a message whose 5-byte prefix announces more raises
    :class:`MessageTooLarge` before any of it is kept.
    """

    __slots__ = ("_head", "_keep", "_left", "_limit", "compressed", "first", "flag", "messages")

    def __init__(self, keep: int, limit: int = 2**32) -> None:
        self._head = bytearray()
        self._left = 0
        self._keep = keep
        self._limit = limit
        self.first: bytearray | None = None
        self.compressed = False  # the first message's compressed flag (grpc-encoding applies)
        self.flag = 0  # the first message's flag byte (gRPC knows 0 and 1; grpc-go refuses any other)
        self.messages = 0

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        if n >= 5 and not self._left and not self._head:
            size = int.from_bytes(data[1:5], "big")
            if size == n - 5:  # one whole message, the usual chunk of a unary call: read at once
                if size > self._limit:
                    raise MessageTooLarge(size, self._limit)
                if self.first is None:
                    if self._keep != KEEP_NONE:
                        self.first = bytearray(data[5:])
                        self.flag = data[0]
                        self.compressed = bool(data[0] & 1)
                elif self.messages == 0 or self._keep == KEEP_ALL:
                    self.first += data[5:]
                self.messages += 1
                return
        while i < n:
            if self._left:
                take = min(self._left, n - i)
                if self.first is not None and (self.messages == 0 or self._keep == KEEP_ALL):
                    self.first += data[i : i + take]
                i += take
                self._left -= take
                if not self._left:
                    self.messages += 1
                continue
            need = 5 - len(self._head)
            self._head += data[i : i + need]
            i += need
            if len(self._head) == 5:
                self._left = int.from_bytes(self._head[1:5], "big")
                if self._left > self._limit:
                    raise MessageTooLarge(self._left, self._limit)
                if self.first is None and self._keep != KEEP_NONE:
                    self.first = bytearray()
                    self.flag = self._head[0]
                    self.compressed = bool(self._head[0] & 1)
                self._head.clear()
                if not self._left:
                    self.messages += 1


#: Seconds before a call the upstream refused unprocessed is sent again, and how often at most.
REFUSED_PAUSE = 0.005
REFUSED_ATTEMPTS = 200

#: Request header fields not passed on when the relay makes a call of its own (which it sends
#: uncompressed, and whose answer it can only read uncompressed; its request is the interceptor's,
#: whose length a caller's content-length does not give).
OWN_FIELDS = frozenset(
    (
        b":method",
        b":scheme",
        b":path",
        b":authority",
        b"content-type",
        b"content-length",
        b"te",
        b"grpc-timeout",
        b"grpc-encoding",
        b"grpc-accept-encoding",
    )
)

#: The zlib ``wbits`` of each grpc-encoding a compressed request may come in (gRPC's
#: compression.md): gzip has a gzip header, deflate is zlib's format.
_DECOMPRESS_WBITS = {b"gzip": 31, b"deflate": 15}
#: Compressed requests at least this large are decompressed in a worker thread.
_THREAD_DECOMPRESS_AT = 64 * 1024


def _decompress(data: bytes, wbits: int, limit: int) -> bytes:
    """``data`` decompressed, at most ``limit`` bytes of it (more: :class:`MessageTooLarge`).

    gzip data of several members is read as one stream, as Go's ``gzip.Reader`` (grpc-go's, in
    containerd 1.7 and 2.1) reads it: their outputs one after the other; bytes after a member that
    do not start another are refused, as Go refuses them."""
    out = b""
    while True:
        inflater = zlib.decompressobj(wbits)
        try:
            out += inflater.decompress(data, limit + 1 - len(out))  # (never 0, which is no limit)
        except zlib.error as err:
            problem = f"grpc: failed to decompress the received message: {err}"
            break
        if len(out) > limit:
            raise MessageTooLarge(len(out), limit)
        if not inflater.eof:
            problem = "grpc: failed to decompress the received message: it is truncated"
            break
        data = inflater.unused_data
        if not data or wbits != _DECOMPRESS_WBITS[b"gzip"]:
            return out
    raise GRPCError(Status.INTERNAL, problem)


def _wbits(encoding: bytes) -> int:
    """The zlib ``wbits`` for a compressed message's ``grpc-encoding``; :class:`GRPCError` as grpc-go
    answers: INTERNAL for no encoding (or ``identity``), UNIMPLEMENTED for one krproxy does not read."""
    if encoding in (b"", b"identity"):
        raise GRPCError(Status.INTERNAL, "grpc: compressed flag set with identity or empty encoding")
    wbits = _DECOMPRESS_WBITS.get(encoding)
    if wbits is None:
        raise GRPCError(
            Status.UNIMPLEMENTED,
            f"grpc: Decompressor is not installed for grpc-encoding {encoding.decode('ascii', 'replace')!r}"
            " (krproxy reads gzip and deflate)",
        )
    return wbits


def decompress_inline(encoding: bytes, data: bytes, limit: int) -> bytes:
    """A small message that came with the compressed flag, decompressed here, as :func:`decompress_message`
    does (its errors too); for callers that may not wait."""
    return _decompress(data, _wbits(encoding), limit)


async def decompress_message(encoding: bytes, data: bytes, limit: int) -> bytes:
    """A message that came with the compressed flag, decompressed as its ``grpc-encoding``
    says (gzip or deflate; a large one in a worker thread), at most ``limit`` bytes of it.

    Raises :class:`GRPCError` as grpc-go answers: INTERNAL for the flag with no encoding (or
    ``identity``) and for bytes that do not decompress, UNIMPLEMENTED for another encoding;
    :class:`MessageTooLarge` when it decompresses to more than ``limit`` (each caller words that).
    """
    wbits = _wbits(encoding)
    if len(data) < _THREAD_DECOMPRESS_AT:
        return _decompress(data, wbits, limit)
    return await trio.to_thread.run_sync(_decompress, data, wbits, limit)


def grpc_message(data: bytes) -> bytes:
    """gRPC's length-prefixed framing of one uncompressed message."""
    return b"\x00" + len(data).to_bytes(4, "big") + data


def request_headers(path: str, authority: bytes = b"localhost") -> Headers:
    """The header fields that open a gRPC call of ``path``: the pseudo-headers first (RFC 9113
    §8.3.1), then gRPC's ``content-type`` and ``te``; a caller appends ``grpc-timeout`` and metadata."""
    return [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path.encode()),
        (b":authority", authority),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ]


def own_call_headers(path: str, deadline: float, metadata: Iterable[tuple[bytes, bytes]]) -> Headers:
    """The header fields of a call the relay makes itself: :func:`request_headers`, ``grpc-timeout`` for
    what is left until *deadline* (trio's clock; none without one), then *metadata*."""
    fields = request_headers(path)
    if deadline != math.inf:
        fields.append((b"grpc-timeout", encode_grpc_timeout(deadline - trio.current_time())))
    fields += metadata
    return fields


class CloseConnection(Exception):
    """Raised by an interceptor to close the caller's connection instead of answering.

    For test doubles that play a peer that crashes mid-call (the fake plugin's ``drop``).
    """


def forget_traceback(err: BaseException) -> None:
    """Drop what an exception that ended a call holds: its traceback's frames hold the call and
    its request, in reference cycles (a frame holding the exception) that only a full garbage
    collection would free."""
    chain: BaseException | None = err
    while chain is not None:
        context = chain.__context__
        chain.__traceback__ = chain.__cause__ = chain.__context__ = None
        chain = context


@attrs.frozen
class Answer:
    """What an upstream answered to a unary call the relay made (any status)."""

    status: Status
    message: str | None
    details: bytes | None
    body: bytes
    headers: Headers | None  # None for a trailers-only answer
    trailers: Headers


#: Largest answer the relay accepts to a call of its own by default: a node's ListContainers is
#: a few MB. Plugin calls pass a smaller limit (krproxy.hooks.dispatch.MAX_PLUGIN_ANSWER).
MAX_OWN_ANSWER = 64 * 1024 * 1024


class UpstreamError(Exception):
    """A call the relay made got no answer: the stream or the connection ended first."""


class StreamReset(UpstreamError):
    """The upstream reset the stream of a call the relay made (RST_STREAM ``code``) before answering."""

    def __init__(self, reason: str, code: int) -> None:
        super().__init__(reason)
        self.code = code


class BadAnswer(UpstreamError):
    """A call the relay made was answered, but not as gRPC answers: OK without one uncompressed
    message, or an answer ending without its trailers."""


class AnswerTooLarge(UpstreamError):
    """A call the relay made was answered more than its ``max_answer`` bytes (the stream is reset)."""
