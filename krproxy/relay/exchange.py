"""The call kinds of streams the transport opens itself: :class:`Exchange`, a unary call of our own
(to the runtime for an intercepted call, to a plugin, for store recovery), read back as an
:class:`Answer`; and :class:`Reading`, a server-streaming call read message by message (a
:class:`krproxy.rpc.Channel`'s). Both end the same way (:func:`settle_own`)."""

from __future__ import annotations

import trio

from krproxy.grpcstatus import GRPCError, Status
from krproxy.h2 import frames as f
from krproxy.relay.grpc import (
    MAX_OWN_ANSWER,
    RESET_STATUS,
    Answer,
    AnswerTooLarge,
    BadAnswer,
    MessageTooLarge,
    UpstreamError,
    read_status,
)
from krproxy.relay.half import Half, Headers
from krproxy.relay.messages import Inbox


def settle_own(stream: Exchange | Reading) -> None:
    """Reset what the server still sends to an answer read whole; forget the stream once done."""
    upstream = stream.upstream
    if upstream.recv_ended and not upstream.send_ended and not upstream.reset:
        upstream.abort(f.CANCEL)
    if upstream.done and not stream.finished:
        stream.finished = True
        upstream.ep.forget(upstream)
        upstream.release()  # no cycle (stream <-> half)


class _OwnSide:
    """The steps and the end of a caller's half, which a stream of our own never gets: it is its
    half's :class:`~krproxy.relay.half.CallSide` and its half's state alike (``Half.state``)."""

    __slots__ = ()

    def on_request_data(self, data: bytes, end: bool) -> None:
        pass

    def on_request_trailers(self, headers: Headers) -> None:
        pass

    def caller_gone(self) -> None:
        pass


class Exchange(_OwnSide):
    """Our side of a unary call we make; the upstream half reports here."""

    __slots__ = (
        "backend_clock",
        "body",
        "done",
        "error",
        "error_type",
        "finished",
        "headers",
        "limit",
        "refused",
        "reset_code",
        "timed_out",
        "trailers",
        "upstream",
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
        self.timed_out = False  # the deadline passed before the answer came (expire)

    def settle(self) -> None:
        settle_own(self)

    def expire(self) -> None:
        """The call's deadline passed (the transport's timer): done, without an answer."""
        if not self.done.is_set():
            self.timed_out = True
            self.done.set()

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
        status, message, details = read_status(trailers)
        if status is None:
            status, message = Status.UNKNOWN, message or "the answer carried no valid grpc-status"
        body = b""
        if status is Status.OK:
            raw = self.body
            if len(raw) < 5 or raw[0] != 0 or int.from_bytes(raw[1:5], "big") != len(raw) - 5:
                raise BadAnswer("the answer is not one uncompressed gRPC message")
            body = bytes(raw[5:])
        return Answer(status, message, details, body, self.headers, trailers)


def reset_status(code: int) -> Status:
    """The status of a call whose stream the server reset with ``code``, as grpc-go's client
    maps it (http2ErrConvTab): CANCEL is CANCELLED, REFUSED_STREAM UNAVAILABLE... others INTERNAL."""
    return RESET_STATUS.get(code, Status.INTERNAL)


class Reading(_OwnSide):
    """Our side of a server-streaming call: the stream's half reports here, its messages queue
    in :attr:`inbox` for the caller iterating them (:class:`krproxy.rpc.Channel`)."""

    __slots__ = (
        "backend_clock",
        "error",
        "finished",
        "headers",
        "inbox",
        "limit",
        "refused",
        "trailers",
        "upstream",
    )

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.upstream: Half = None  # type: ignore[assignment]  # set right after construction
        self.inbox: Inbox = None  # type: ignore[assignment]
        self.headers: Headers | None = None
        self.trailers: Headers | None = None
        self.error: GRPCError | None = None
        self.refused = False  # the server did not process it (REFUSED_STREAM, GOAWAY): sent again
        self.finished = False
        self.backend_clock = 0.0

    def settle(self) -> None:
        settle_own(self)

    def on_reply_headers(self, headers: Headers, end: bool) -> None:
        if end:
            self.trailers = headers
        else:
            self.headers = headers
        self.inbox.wake()

    def on_reply_data(self, data: bytes, end: bool) -> None:
        if self.error is not None:
            return
        try:
            self.inbox.arrived(data)
        except MessageTooLarge as err:
            self.error = GRPCError(
                Status.RESOURCE_EXHAUSTED, f"received message larger than max ({err.size} vs. {err.limit})"
            )
            self.upstream.abort(f.CANCEL)
        except GRPCError as err:  # not gRPC's framing
            self.error = err
            self.upstream.abort(f.CANCEL)
        if end and self.error is None:  # gRPC ends with trailers; an answer without them is broken
            self.error = GRPCError(Status.INTERNAL, "the server ended the stream without a status")
        self.inbox.wake()
        self.settle()

    def upstream_gone(self, reason: str, refused: bool = False, reset_code: int | None = None) -> None:
        self.upstream.reset = True
        if self.error is None and self.trailers is None:
            status = Status.UNAVAILABLE if reset_code is None else reset_status(reset_code)
            self.error = GRPCError(status, reason)
            self.refused = refused and self.headers is None
        self.inbox.wake()
        self.settle()
