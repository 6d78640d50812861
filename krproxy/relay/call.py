"""A relayed gRPC call (:class:`Call`): a caller's stream paired with a stream to the runtime;
frames are passed on, the status is read from the trailers for the call record."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

import trio

from krproxy import calls
from krproxy.forward import Watcher
from krproxy.grpcstatus import Status
from krproxy.h2 import frames as f
from krproxy.relay.grpc import (
    KEEP_ALL,
    KEEP_FIRST,
    KEEP_NONE,
    PLAIN_HEADERS,
    RESET_STATUS,
    MessageTooLarge,
    Tap,
    read_status,
    status_fields,
)
from krproxy.relay.half import Half, Headers

if TYPE_CHECKING:
    from krproxy.relay.route import Route
    from krproxy.relay.transport import Transport

LOGGER = logging.getLogger("krproxy.relay")


class Call:
    """A gRPC call in the relay: the caller's half, the upstream half, and what is known."""

    __slots__ = (
        "_collected",
        "_scope",
        "answered",
        "backend_clock",
        "backend_seconds",
        "client",
        "clock",
        "deadline",
        "finished",
        "message",
        "path",
        "reply_tap",
        "request_tap",
        "route",
        "started",
        "status",
        "timer",
        "transport",
        "unary",
        "upstream",
    )

    #: Told the call's end once its answer is out (:data:`krproxy.forward.Watcher`): only a call with
    #: hook points that went upstream as the caller's bytes has one (:class:`~krproxy.relay.intercepted.LocalCall`).
    watcher: Watcher | None = None

    def __init__(self, transport: Transport, path: str, route: Route | None, unary: bool) -> None:
        self.transport = transport
        self.path = path
        self.unary = unary  # a unary method: its reply may be kept for the record
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
        # A call answered by a handler task of ours (an interceptor's, a served one's): the task's
        # cancel scope, cancelled when the call ends without it (failed, or its caller gone); and
        # the request bytes it holds, counted in the caller connection's ``collected`` until the
        # call finishes. A relayed call has neither.
        self._scope: trio.CancelScope | None = None
        self._collected = 0
        # Message bytes only if records are to carry them (relay.keep_messages: e.g. recording).
        keep = transport.keep_messages
        self.request_tap: Tap | None = Tap(KEEP_FIRST if keep else KEEP_NONE, transport.max_request)
        self.reply_tap: Tap | None = Tap(KEEP_ALL if keep and unary else KEEP_NONE)

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
        status, self.message, _ = read_status(headers)
        self.status = status if status is not None else Status.UNKNOWN

    def fail(self, status: Status, message: str) -> None:
        """End the call with ``status`` for the caller and reset the upstream stream."""
        if self._scope is not None:
            self._scope.cancel()
        if self.finished:
            return
        client = self.client
        if not client.done and not client.send_ended and not self.answered:
            self.answered = True
            self.status, self.message = status, message
            client.drop_pending()  # queued data, its end and trailers: this status ends it instead
            fields = status_fields(status, message, None)
            block = f.encode_headers(fields if client.headers_sent else [*PLAIN_HEADERS, *fields])
            client.send_headers(block, True)
        if self.upstream is not None:
            self.upstream.abort(f.CANCEL)
        self.settle()

    def caller_gone(self) -> None:
        """The caller reset the stream or its connection closed."""
        if self._scope is not None:
            self._scope.cancel()
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
            self.fail(RESET_STATUS.get(reset_code, Status.INTERNAL), reason)
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
        if self._collected:
            client.ep.collected -= self._collected
            self._collected = 0
        client.ep.forget(client)
        if upstream is not None:
            upstream.ep.forget(upstream)
        self.transport.call_finished(self)
        # No reference cycles (call <-> half): the call's bytes are freed as soon as it is over,
        # not at the next full garbage collection.
        client.release()
        if upstream is not None:
            upstream.release()

    def reply_message(self) -> bytes | None:
        """The reply of a unary call that succeeded, if its reply tap kept it; else None."""
        reply_tap = self.reply_tap
        ok = self.status is Status.OK and self.unary
        if ok and reply_tap is not None and reply_tap.first is not None and reply_tap.messages == 1:
            return bytes(reply_tap.first)
        return None

    def record(self) -> calls.CallRecord:
        request = self.request_tap.first if self.request_tap is not None else None
        reply_tap = self.reply_tap
        reply = self.reply_message()
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


def report(call: Call, observers: list[calls.Observer]) -> None:
    """A finished call: tell its watcher how it ended, then hand its record to every observer."""
    if call.watcher is not None:
        try:
            call.watcher(call.status, call.reply_message())
        except Exception:  # a bug of ours; the call itself is over and fine
            LOGGER.exception("watcher of %s failed", call.path)
    if not observers:
        return
    try:
        record = call.record()
    except Exception:  # a bug of ours; the call itself is over and fine
        LOGGER.exception("call record of %s failed", call.path)
        return
    for observer in observers:
        try:
            observer(record)
        except Exception:  # an observer must never break a call
            LOGGER.exception("observer %r failed", observer)
