"""gRPC calls in the relay: relayed ones, ones the relay answers itself, ones it makes.

- :class:`Call`: a caller's stream paired with a stream to the runtime; frames are passed on,
  the status is read from the trailers for the call record.
- :class:`LocalCall`: a call with hook points; the relay collects the request and runs the
  interceptor, whose ``forward`` is a call of the relay's own.
- :class:`_Exchange`: the relay's side of a unary call it makes (to the runtime for an
  intercepted call, to a plugin, for store recovery), read back as an :class:`Answer`.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import time
import urllib.parse
import zlib
from collections.abc import Iterable
from typing import Any, Protocol

import attrs
import trio

from krproxy import calls
from krproxy.forward import BackendError, Interceptor, Reply
from krproxy.grpcstatus import GRPCError, Status
from krproxy.h2 import frames as f
from krproxy.relay import connection
from krproxy.relay.connection import Half, Headers, Route

LOGGER = logging.getLogger("krproxy.relay")


class Relay(Protocol):
    """What a call needs of the relay that runs it (:class:`krproxy.relay.relay.Relay`): named
    here so that this module does not import that one (no import cycle, not even for the type
    checker)."""

    keep_messages: bool
    max_request: int
    nursery: trio.Nursery

    def is_unary(self, path: str) -> bool: ...
    def flush(self) -> None: ...
    def call_finished(self, call: Call) -> None: ...
    async def unary(
        self,
        route: Route,
        path: str,
        message: bytes,
        metadata: Iterable[tuple[bytes, bytes]] = ...,
        deadline: float = ...,
        max_answer: int = ...,
    ) -> Answer: ...


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


_PLAIN_HEADERS: Headers = [(b":status", b"200"), (b"content-type", b"application/grpc")]
_PLAIN_TRAILERS: Headers = [(b"grpc-status", b"0")]


def _status_fields(status: Status, message: str | None, details: bytes | None) -> Headers:
    fields = [(b"grpc-status", b"%d" % status.value)]
    if message:
        fields.append((b"grpc-message", urllib.parse.quote(message, safe=" ").encode()))
    if details:
        fields.append((b"grpc-status-details-bin", base64.b64encode(details).rstrip(b"=")))
    return fields


def _read_status(headers: Headers) -> tuple[Status | None, str | None, bytes | None]:
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
_RESET_STATUS = {
    f.CANCEL: Status.CANCELLED,
    f.FLOW_CONTROL_ERROR: Status.RESOURCE_EXHAUSTED,
    f.ENHANCE_YOUR_CALM: Status.RESOURCE_EXHAUSTED,
    0xC: Status.PERMISSION_DENIED,  # INADEQUATE_SECURITY
    f.REFUSED_STREAM: Status.UNAVAILABLE,
}

KEEP_NONE, KEEP_FIRST, KEEP_ALL = 0, 1, 2


class MessageTooLarge(Exception):
    """A message's length prefix announced more than a :class:`_Tap`'s limit."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"a message of {size} bytes is larger than the limit of {limit} bytes")
        self.size, self.limit = size, limit


class _Tap:
    """Counts the gRPC messages in one direction of a call; keeps their bytes if asked to.

    ``keep``: :data:`KEEP_NONE` (count only), :data:`KEEP_FIRST` (the first message: a request,
    or what an interceptor needs) or :data:`KEEP_ALL` (every message's bytes, for unary replies
    in call records). ``limit``: a message whose 5-byte prefix announces more raises
    :class:`MessageTooLarge` before any of it is kept.
    """

    __slots__ = ("_head", "_keep", "_left", "_limit", "compressed", "first", "messages")

    def __init__(self, keep: int, limit: int = 2**32) -> None:
        self._head = bytearray()
        self._left = 0
        self._keep = keep
        self._limit = limit
        self.first: bytearray | None = None
        self.compressed = False  # the first message's compressed flag (grpc-encoding applies)
        self.messages = 0

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
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
                    self.compressed = bool(self._head[0] & 1)
                self._head.clear()
                if not self._left:
                    self.messages += 1


class Call:
    """A gRPC call in the relay: the caller's half, the upstream half, and what is known."""

    __slots__ = (
        "answered",
        "backend_clock",
        "backend_seconds",
        "client",
        "clock",
        "deadline",
        "finished",
        "message",
        "path",
        "relay",
        "reply_tap",
        "request_tap",
        "route",
        "started",
        "status",
        "timer",
        "upstream",
    )

    def __init__(self, relay: Relay, path: str, route: Route | None) -> None:
        self.relay = relay
        self.path = path
        self.route = route
        self.client: Half = None  # type: ignore[assignment]  # set right after construction
        self.upstream: Half | None = None
        self.started = time.time()
        self.clock = time.perf_counter()
        self.backend_clock = 0.0
        self.backend_seconds = 0.0
        self.status = Status.OK
        self.message: str | None = None
        self.answered = False  # the caller got a status (trailers), from upstream or from us
        self.finished = False
        self.deadline = math.inf
        self.timer: list[Any] | None = None  # its entry in the relay's deadline heap
        # Message bytes only if records are to carry them (relay.keep_messages: e.g. recording).
        keep = relay.keep_messages
        self.request_tap: _Tap | None = _Tap(KEEP_FIRST if keep else KEEP_NONE, relay.max_request)
        self.reply_tap: _Tap | None = _Tap(KEEP_ALL if keep and relay.is_unary(path) else KEEP_NONE)

    @property
    def describe(self) -> str:
        """What the call goes to, for messages."""
        return self.route.describe if self.route is not None else "krproxy"

    def on_request_data(self, data: bytes, end: bool) -> None:
        if self.request_tap is not None and data:
            try:
                self.request_tap.feed(data)
            except MessageTooLarge as err:
                self.too_large(data, err)
                return
        upstream = self.upstream
        if upstream is None or upstream.s.done:
            self.client.grant(len(data))
            return
        upstream.send_data(data, end)

    def on_reply_data(self, data: bytes, end: bool) -> None:
        if self.reply_tap is not None and data:
            self.reply_tap.feed(data)
        if end:
            self._backend_done()
        self.client.send_data(data, end)

    def on_reply_headers(self, headers: Headers, end: bool) -> None:
        if self.route is not None:
            self.route.mark_reachable()
        block = f.encode_headers(headers)
        if end:
            self._backend_done()
            self._take_status(headers)
            if self.client.s.headers_sent:
                self.client.send_trailers(block)
            else:
                self.client.send_headers(block, True)
        else:
            self.client.send_headers(block, False)

    def on_request_trailers(self, headers: Headers) -> None:
        # gRPC callers end a request with END_STREAM on DATA; a header block is legal though.
        if self.upstream is not None and not self.upstream.done:
            self.upstream.send_trailers(f.encode_headers(headers))

    def too_large(self, data: bytes, err: MessageTooLarge) -> None:
        """The request announced a message above the limit: RESOURCE_EXHAUSTED, as grpc-go
        (containerd) answers, before any more of it is buffered or sent on."""
        self.client.grant(len(data))
        self.fail(
            Status.RESOURCE_EXHAUSTED,
            f"request message of {err.size} bytes is larger than krproxy's limit of {err.limit} bytes"
            " (--max-request-message-size)",
        )

    def _backend_done(self) -> None:
        if self.backend_clock:
            self.backend_seconds = time.perf_counter() - self.backend_clock

    def _take_status(self, headers: Headers) -> None:
        self.answered = True
        status, self.message, _ = _read_status(headers)
        self.status = status if status is not None else Status.UNKNOWN

    def fail(self, status: Status, message: str) -> None:
        """End the call with ``status`` for the caller and reset the upstream stream."""
        if self.finished:
            return
        client = self.client
        if not client.done and not client.send_ended and not self.answered:
            self.answered = True
            self.status, self.message = status, message
            client.drop_pending()  # queued data, its end and trailers: this status ends it instead
            fields = _status_fields(status, message, None)
            block = f.encode_headers(fields if client.headers_sent else [*_PLAIN_HEADERS, *fields])
            client.send_headers(block, True)
        if self.upstream is not None:
            self.upstream.abort(f.CANCEL)
        self.settle()

    def caller_gone(self) -> None:
        """The caller reset the stream or its connection closed."""
        if not self.answered:
            self.answered = True
            self.status, self.message = Status.CANCELLED, "the call ended before an answer was sent"
        self.client.reset = True
        if self.upstream is not None:
            self.upstream.abort(f.CANCEL)
        self.settle()

    def upstream_gone(self, reason: str, refused: bool = False, reset_code: int | None = None) -> None:
        """The upstream stream was reset or its connection lost, before the call ended.

        ``refused``: the upstream did not process the call (REFUSED_STREAM, or above a GOAWAY's
        last stream). If the caller has had no answer yet it gets REFUSED_STREAM too, which gRPC
        clients take as leave to send the call again (grpc-go's transparent retry).
        ``reset_code``: the upstream reset the stream with this HTTP/2 error code; the caller
        gets the status grpc-go gives such a reset (INTERNAL for a protocol error, CANCELLED,
        RESOURCE_EXHAUSTED for ENHANCE_YOUR_CALM...), not UNAVAILABLE.
        """
        upstream = self.upstream
        if upstream is not None:
            upstream.reset = True
        client = self.client
        if refused and not self.answered and not client.headers_sent and not client.done:
            self.answered = True
            self.status, self.message = Status.UNAVAILABLE, f"{self.describe} refused the call: {reason}"
            client.abort(f.REFUSED_STREAM)
            self.settle()
        elif not self.answered and reset_code is not None:
            self.fail(_RESET_STATUS.get(reset_code, Status.INTERNAL), reason)
        elif not self.answered:
            self.fail(Status.UNAVAILABLE, f"{self.describe} is unavailable: {reason}")
        else:
            self.settle()

    def settle(self) -> None:
        """Close what is over; once both halves are, the call is finished."""
        if self.finished:
            return
        # The halves' stream states are read directly (``half.s``): this runs several times
        # per call, and each property read would be one more function call.
        client, upstream = self.client, self.upstream
        c = client.s
        if c.send_ended and not c.recv_ended and not c.reset:
            # We answered before the caller finished sending: close its side (RFC 9113 §8.1).
            client.abort(f.NO_ERROR)
        upstream_done = True
        if upstream is not None:
            u = upstream.s
            if u.recv_ended and not u.send_ended and not u.reset:
                upstream.abort(f.CANCEL)  # the upstream answered; nothing more of the request matters
            upstream_done = u.reset or (u.send_ended and u.recv_ended)
            if upstream_done:
                # The runtime's half is over: free its stream slot now, not once the caller has
                # read the answer (a caller that never reads would hold the runtime's slots).
                upstream.ep.forget(upstream)
        if upstream_done and (c.reset or (c.send_ended and c.recv_ended)):
            self.finish()

    def finish(self) -> None:
        self.finished = True
        client, upstream = self.client, self.upstream
        client.ep.forget(client)
        if upstream is not None:
            upstream.ep.forget(upstream)
        self.relay.call_finished(self)
        # No reference cycles (call <-> half): the call's bytes are freed as soon as it is over,
        # not at the next full garbage collection.
        client.release()
        if upstream is not None:
            upstream.release()

    def record(self) -> calls.CallRecord:
        request = self.request_tap.first if self.request_tap is not None else None
        reply_tap = self.reply_tap
        reply = None
        ok = self.status is Status.OK and self.relay.is_unary(self.path)
        if ok and reply_tap is not None and reply_tap.first is not None and reply_tap.messages == 1:
            reply = bytes(reply_tap.first)
        return calls.CallRecord(
            path=self.path,
            started=self.started,
            seconds=time.perf_counter() - self.clock,
            backend_seconds=self.backend_seconds,
            request=bytes(request) if request is not None else b"",
            forwarded=None,
            reply=reply,
            replies=reply_tap.messages if reply_tap is not None else 0,
            status=self.status,
            message=self.message,
            hooks=(),
        )


# -- calls the relay answers itself, and calls it makes ---------------------------------------

#: Request header fields not passed on when the relay makes a call of its own (which it sends
#: uncompressed, and whose answer it can only read uncompressed).
_OWN_FIELDS = frozenset(
    (
        b":method",
        b":scheme",
        b":path",
        b":authority",
        b"content-type",
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
    """``data`` decompressed, at most ``limit`` bytes of it (more: :class:`MessageTooLarge`)."""
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as err:
        problem = f"grpc: failed to decompress the received message: {err}"
    else:
        if len(out) > limit:
            raise MessageTooLarge(len(out), limit)
        if not inflater.eof:
            problem = "grpc: failed to decompress the received message: it is truncated"
        else:
            return out
    raise GRPCError(Status.INTERNAL, problem)


async def decompress_message(encoding: bytes, data: bytes, limit: int) -> bytes:
    """A message that came with the compressed flag, decompressed as its ``grpc-encoding``
    says (gzip or deflate; a large one in a worker thread), at most ``limit`` bytes of it.

    Raises :class:`GRPCError` as grpc-go answers: INTERNAL for the flag with no encoding (or
    ``identity``) and for bytes that do not decompress, UNIMPLEMENTED for another encoding;
    :class:`MessageTooLarge` when it decompresses to more than ``limit`` (each caller words that).
    """
    if encoding in (b"", b"identity"):
        raise GRPCError(Status.INTERNAL, "grpc: compressed flag set with identity or empty encoding")
    wbits = _DECOMPRESS_WBITS.get(encoding)
    if wbits is None:
        raise GRPCError(
            Status.UNIMPLEMENTED,
            f"grpc: Decompressor is not installed for grpc-encoding {encoding.decode('ascii', 'replace')!r}"
            " (krproxy reads gzip and deflate)",
        )
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


class CloseConnection(Exception):
    """Raised by an interceptor to close the caller's connection instead of answering.

    For test doubles that play a peer that crashes mid-call (the fake plugin's ``drop``).
    """


def _forget_traceback(err: BaseException) -> None:
    """Drop what an exception that ended a call holds: its traceback's frames hold the call and
    its request, in reference cycles (a frame holding the exception) that only a full garbage
    collection would free."""
    chain: BaseException | None = err
    while chain is not None:
        context = chain.__context__
        chain.__traceback__ = chain.__cause__ = chain.__context__ = None
        chain = context


class HandledCall(Call):
    """A call answered by a handler task of ours (an interceptor, a :mod:`krproxy.rpc` handler):
    ``_scope`` is the task's cancel scope, cancelled when the call ends without it (failed, or
    its caller gone); ``_collected`` the request bytes it holds, counted in the caller
    connection's ``collected`` until the call finishes."""

    __slots__ = ("_collected", "_scope")

    def __init__(self, relay: Relay, path: str, route: Route | None) -> None:
        super().__init__(relay, path, route)
        self._scope: trio.CancelScope | None = None
        self._collected = 0

    def fail(self, status: Status, message: str) -> None:
        if self._scope is not None:
            self._scope.cancel()
        super().fail(status, message)

    def finish(self) -> None:
        self.client.ep.collected -= self._collected
        self._collected = 0
        super().finish()

    def caller_gone(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
        super().caller_gone()


class LocalCall(HandledCall):
    """A call with hook points: the relay collects the request and runs the interceptor.

    The interceptor runs in a task of its own; its ``forward`` makes a unary call on the
    runtime route (:meth:`Relay.unary`), with the caller's metadata and what is left of the
    caller's deadline. Its reply, or the runtime's error answer, goes back unchanged.
    """

    __slots__ = ("_encoding", "_interceptor", "_metadata", "_started", "ctx")

    def __init__(
        self, relay: Relay, path: str, route: Route | None, interceptor: Interceptor, headers: Headers
    ) -> None:
        super().__init__(relay, path, route)
        self.request_tap = _Tap(KEEP_FIRST, relay.max_request)  # the interceptor needs the request
        self.reply_tap = None
        self._interceptor = interceptor
        self._metadata = [field for field in headers if field[0] not in _OWN_FIELDS]
        self._encoding = next((value for name, value in headers if name == b"grpc-encoding"), b"identity")
        self._started = False
        self.ctx = calls.CallContext(path)

    def on_request_data(self, data: bytes, end: bool) -> None:
        assert self.request_tap is not None
        if data:
            ep = self.client.ep
            if ep.collected + len(data) > connection.MAX_HELD:
                # Its windows are granted as it arrives, so bound it here: a caller sending many
                # large requests and never finishing them would otherwise fill our memory.
                self.client.grant(len(data))
                self.fail(
                    Status.RESOURCE_EXHAUSTED,
                    f"krproxy already holds {ep.collected} bytes of requests from this connection"
                    f" (limit {connection.MAX_HELD}); send fewer large calls at once",
                )
                return
            try:
                self.request_tap.feed(data)
            except MessageTooLarge as err:
                self.too_large(data, err)
                return
            ep.collected += len(data)
            self._collected += len(data)
            self.client.grant(len(data))
        if end:
            self.client.recv_ended = True
            if not self._started and not self.finished and not self.answered:
                self._started = True
                self.relay.nursery.start_soon(self._handle)

    def on_request_trailers(self, headers: Headers) -> None:
        self.on_request_data(b"", True)

    async def _handle(self) -> None:
        if self.finished or self.answered:  # reset or failed before this task ran: cancelled
            return
        tap = self.request_tap
        assert tap is not None
        ctx = self.ctx
        calls.CURRENT.set(ctx)  # this task's own context: calls never share one
        ctx.deadline = self.deadline
        try:
            if tap.first is None or tap.messages < 1:
                raise GRPCError(Status.INTERNAL, "the request carried no complete message")
            ctx.request = bytes(tap.first)
            with trio.CancelScope() as self._scope:
                if tap.compressed:
                    ctx.request = await self._decompressed(ctx.request)
                reply = await self._interceptor(self.path, ctx.request, self._forward)
                ctx.reply, ctx.replies = reply.message, 1  # before answering: that may finish the call
                self._answer(
                    reply.headers or _PLAIN_HEADERS,
                    grpc_message(reply.message),
                    reply.trailers or _PLAIN_TRAILERS,
                )
        except CloseConnection:
            self.client.ep.close("the handler closed the connection")
        except BackendError as err:
            self._answer(err.headers, None, err.trailers, err)
            _forget_traceback(err)
        except GRPCError as err:
            details = err.details if isinstance(err.details, bytes) else None
            self._answer(None, None, _status_fields(err.status, err.message, details), err)
            _forget_traceback(err)
        except Exception as err:  # a bug of ours: answer UNKNOWN, keep serving
            LOGGER.exception("interceptor for %s failed", self.path)
            unknown = GRPCError(Status.UNKNOWN, f"{type(err).__name__}: {err}")
            self._answer(None, None, _status_fields(unknown.status, unknown.message, None), unknown)
            _forget_traceback(err)
        finally:
            self.relay.flush()

    async def _decompressed(self, data: bytes) -> bytes:
        """A request message that came compressed (gzip or deflate, as gRPC clients may send),
        decompressed: the interceptor reads protobuf, and forwards it uncompressed."""
        try:
            return await decompress_message(self._encoding, data, self.relay.max_request)
        except MessageTooLarge as err:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"request message decompressed is larger than krproxy's limit of {err.limit} bytes"
                " (--max-request-message-size)",
            ) from None

    def _answer(
        self, headers: Headers | None, body: bytes | None, trailers: Headers, err: GRPCError | None = None
    ) -> None:
        client = self.client
        if self.answered or client.done or client.send_ended:
            return
        self.answered = True
        if err is not None:
            self.status, self.message = err.status, err.message
        if headers is None:  # trailers-only; a runtime's own such answer has its :status already
            whole = trailers if trailers and trailers[0][0] == b":status" else [*_PLAIN_HEADERS, *trailers]
            client.send_headers(f.encode_headers(whole), True)
            return
        client.send_headers(f.encode_headers(headers), False)
        if body is not None:
            client.send_data(body, False)
        client.send_trailers(f.encode_headers(trailers))

    async def _forward(self, data: bytes) -> Reply:
        ctx = self.ctx
        if data is not ctx.request:
            ctx.forwarded = data  # an interceptor changed it
        if self.route is None:
            raise GRPCError(Status.UNIMPLEMENTED, f"{self.path}: nothing to forward to")
        started = time.perf_counter()
        try:
            answer = await self.relay.unary(self.route, self.path, data, self._metadata, self.deadline)
        except TimeoutError:  # (an OSError: first)
            raise GRPCError(
                Status.DEADLINE_EXCEEDED, f"deadline exceeded waiting for {self.describe}"
            ) from None
        except (OSError, UpstreamError) as err:  # unreachable, or the connection broke: as for relayed calls
            raise GRPCError(Status.UNAVAILABLE, f"{self.describe} is unavailable: {err}") from None
        finally:
            ctx.backend_seconds += time.perf_counter() - started
        if answer.status is not Status.OK:
            raise BackendError(
                answer.status,
                answer.message,
                answer.details,
                headers=answer.headers,
                trailers=answer.trailers,
            )
        return Reply(answer.body, answer.headers or [], answer.trailers)

    def record(self) -> calls.CallRecord:
        ctx = self.ctx
        if self.status is not Status.OK:
            ctx.fail(self.status, self.message)
        return ctx.finish()


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


class OwnStream:
    """A stream the relay opened itself (a unary call of its own, a client's server stream):
    its ``upstream`` half reports to it; ``finished`` once the stream is forgotten."""

    __slots__ = ("finished", "upstream")
    upstream: Half
    finished: bool

    def settle(self) -> None:
        """Reset what the server still sends to an answer read whole; forget the stream once done."""
        upstream = self.upstream
        if upstream.recv_ended and not upstream.send_ended and not upstream.reset:
            upstream.abort(f.CANCEL)
        if upstream.done and not self.finished:
            self.finished = True
            upstream.ep.forget(upstream)
            upstream.release()  # no cycle (stream <-> half)


class _Exchange(OwnStream):
    """The relay's side of a unary call it makes itself; the upstream half reports here."""

    __slots__ = (
        "backend_clock",
        "body",
        "done",
        "error",
        "error_type",
        "headers",
        "limit",
        "refused",
        "reset_code",
        "trailers",
    )

    def __init__(self, limit: int = MAX_OWN_ANSWER) -> None:
        self.limit = limit
        self.upstream: Half = None  # type: ignore[assignment]  # set right after construction
        self.headers: Headers | None = None
        self.trailers: Headers | None = None
        self.body = bytearray()
        self.error: str | None = None
        self.refused = False  # the upstream did not process it: safe to send again
        self.error_type: type[UpstreamError] = UpstreamError  # what `error` is raised as
        self.reset_code: int | None = None  # the upstream reset the stream before answering
        self.done = trio.Event()
        self.finished = False
        self.backend_clock = 0.0

    def on_reply_headers(self, headers: Headers, end: bool) -> None:
        if end:
            self.trailers = headers
            self.done.set()
        else:
            self.headers = headers

    def on_reply_data(self, data: bytes, end: bool) -> None:
        if self.done.is_set():
            return
        self.body += data
        self.upstream.grant(len(data))
        if len(self.body) > self.limit:  # a peer that would fill our memory: stop reading it
            self.error = f"the answer is larger than {self.limit} bytes"
            self.error_type = AnswerTooLarge
            self.done.set()
            self.upstream.abort(f.CANCEL)
            self.settle()
            return
        if end:  # gRPC ends with trailers; an answer without them is broken
            self.error = "the answer ended without a status"
            self.error_type = BadAnswer
            self.done.set()
            self.settle()  # the stream is over: free its slot

    def upstream_gone(self, reason: str, refused: bool = False, reset_code: int | None = None) -> None:
        self.upstream.reset = True
        if not self.done.is_set():
            self.error, self.refused, self.reset_code = reason, refused, reset_code
            self.done.set()
        self.settle()

    def answer(self) -> Answer:
        trailers = self.trailers or []
        status, message, details = _read_status(trailers)
        if status is None:
            status, message = Status.UNKNOWN, message or "the answer carried no valid grpc-status"
        body = b""
        if status is Status.OK:
            raw = self.body
            if len(raw) < 5 or raw[0] != 0 or int.from_bytes(raw[1:5], "big") != len(raw) - 5:
                raise BadAnswer("the answer is not one uncompressed gRPC message")
            body = bytes(raw[5:])
        return Answer(status, message, details, body, self.headers, trailers)
