"""The relay's side of a unary call it makes itself (to the runtime for an intercepted call, to a
plugin, for store recovery): :class:`_Exchange`, read back as an :class:`Answer`; and
:class:`OwnStream`, what every stream the relay opens itself has."""

from __future__ import annotations

import trio

from krproxy.grpcstatus import Status
from krproxy.h2 import frames as f
from krproxy.relay.grpc import (
    MAX_OWN_ANSWER,
    Answer,
    AnswerTooLarge,
    BadAnswer,
    UpstreamError,
    read_status,
)
from krproxy.relay.half import Half, Headers


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
