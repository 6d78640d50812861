"""A relayed gRPC call (:class:`Call`): a caller's stream paired with a stream to the runtime;
frames are passed on, the status is read from the trailers for the call record. And the report
of any finished call of a caller's (:func:`report`): its watcher, its record to the observers."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from krproxy import calls
from krproxy.grpcstatus import Status
from krproxy.h2 import frames as f
from krproxy.relay.grpc import (
    KEEP_ALL,
    KEEP_FIRST,
    KEEP_NONE,
    MessageTooLarge,
    Tap,
    read_status,
)
from krproxy.relay.half import Headers
from krproxy.relay.state import CallState

if TYPE_CHECKING:
    from krproxy.forward import Watcher  # forward loads the CRI's messages: the transport need not
    from krproxy.relay.intercepted import LocalCall
    from krproxy.relay.route import Route
    from krproxy.relay.served import Served
    from krproxy.relay.transport import Transport

LOGGER = logging.getLogger("krproxy.relay")


class Call:
    """A relayed gRPC call: the caller's request passed upstream and the answer back, frame by
    frame, its status read from the trailers. Its halves, status and end are its :attr:`state`.

    A :class:`~krproxy.relay.intercepted.LocalCall` whose request goes upstream as one message
    (watched, or handed over) has its answer relayed by a ``Call`` over its own state, whose
    request side it never uses (``request_tap`` None)."""

    __slots__ = ("answer_headers", "reply_tap", "request_tap", "state", "unary")

    #: A relayed call has no watcher (:func:`report`): only a call with hook points that went upstream
    #: as the caller's bytes has one (:class:`~krproxy.relay.intercepted.LocalCall`).
    watcher: Watcher | None = None

    def __init__(
        self,
        transport: Transport,
        path: str,
        route: Route | None,
        unary: bool,
        *,
        answering: CallState | None = None,
        reply_tap: Tap | None = None,
    ) -> None:
        """``answering``: the state of another kind's call whose answer this one relays (the
        reply kept in ``reply_tap``); else the call is a relayed one of its own."""
        self.state = answering if answering is not None else CallState(transport, path, route, self)
        self.unary = unary  # a unary method: its reply may be kept for the record
        self.answer_headers: Headers | None = None  # the answer's header block, once it came
        if answering is not None:
            self.request_tap: Tap | None = None
            self.reply_tap = reply_tap
            return
        # Message bytes only if records are to carry them (relay.keep_messages: e.g. recording).
        keep = transport.keep_messages
        self.request_tap = Tap(KEEP_FIRST if keep else KEEP_NONE, transport.max_request)
        self.reply_tap = Tap(KEEP_ALL if keep and unary else KEEP_NONE)

    def on_request_data(self, data: bytes, end: bool) -> None:
        state = self.state
        if self.request_tap is not None and data:
            try:
                self.request_tap.feed(data)
            except MessageTooLarge as err:
                state.too_large(data, err)
                return
        upstream = state.upstream
        if upstream is None or upstream.s.done:
            state.client.grant(len(data))
            return
        upstream.send_data(data, end)

    def on_reply_data(self, data: bytes, end: bool) -> None:
        state = self.state
        if self.reply_tap is not None and data:
            self.reply_tap.feed(data)
        if end and state.backend_clock:
            state.backend_seconds = time.perf_counter() - state.backend_clock
        state.client.send_data(data, end)

    def on_reply_headers(self, headers: Headers, end: bool) -> None:
        state = self.state
        route = state.route
        if route is not None and route.reachable is not True:  # (tested here: once per reply)
            route.mark_reachable()
        block = f.encode_headers(headers)
        client = state.client
        if end:
            if state.backend_clock:
                state.backend_seconds = time.perf_counter() - state.backend_clock
            state.answered = True
            status, state.message, _ = read_status(headers)
            state.status = status if status is not None else Status.UNKNOWN
            if client.s.headers_sent:
                client.send_trailers(block)
            else:
                client.send_headers(block, True)
        else:
            self.answer_headers = headers
            client.send_headers(block, False)

    def on_request_trailers(self, headers: Headers) -> None:
        # gRPC callers end a request with END_STREAM on DATA; a header block is legal though.
        upstream = self.state.upstream
        if upstream is not None and not upstream.done:
            upstream.send_trailers(f.encode_headers(headers))

    def reply_message(self) -> bytes | None:
        """The reply of a unary call that succeeded, if its reply tap kept it; else None."""
        reply_tap = self.reply_tap
        ok = self.state.status is Status.OK and self.unary
        if ok and reply_tap is not None and reply_tap.first is not None and reply_tap.messages == 1:
            return bytes(reply_tap.first)
        return None

    def record(self) -> calls.CallRecord:
        request = self.request_tap.first if self.request_tap is not None else None
        reply_tap = self.reply_tap
        return self.state.record(
            bytes(request) if request is not None else b"",
            self.reply_message(),
            reply_tap.messages if reply_tap is not None else 0,
        )


def report(call: Call | LocalCall | Served, observers: list[calls.Observer]) -> None:
    """A finished call: tell its watcher how it ended, then hand its record to every observer."""
    if call.watcher is not None:
        try:
            call.watcher(call.state.status, call.reply_message())
        except Exception:  # a bug of ours; the call itself is over and fine
            LOGGER.exception("watcher of %s failed", call.state.path)
    if not observers:
        return
    try:
        record = call.record()
    except Exception:  # a bug of ours; the call itself is over and fine
        LOGGER.exception("call record of %s failed", call.state.path)
        return
    for observer in observers:
        try:
            observer(record)
        except Exception:  # an observer must never break a call
            LOGGER.exception("observer %r failed", observer)
