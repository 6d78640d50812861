"""What every call of a caller's is, whatever answers it (:class:`CallState`): its two halves,
its status, how it fails, settles and finishes, its deadline entry and its times.

Each call kind holds one (:class:`~krproxy.relay.call.Call` relayed,
:class:`~krproxy.relay.intercepted.LocalCall` intercepted, :class:`~krproxy.relay.served.Served`
served) and gives it only what is its own: the request's frames, the answer's. Whatever ends a
call reaches its state directly, not through its kind: the halves (:attr:`Half.state
<krproxy.relay.half.Half.state>`: ``settle``, ``caller_gone``, ``upstream_gone``), the
transport's deadline heap (``fail``), a handler answering it. Once the call is over the state
hands its kind to the transport, for the record (:func:`krproxy.relay.call.report`), and lets
go of it: a finished call holds no reference cycle.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from krproxy import calls
from krproxy.grpcstatus import Status
from krproxy.h2 import frames as f
from krproxy.relay.grpc import PLAIN_HEADERS, RESET_STATUS, MessageTooLarge, status_fields
from krproxy.relay.half import Half

if TYPE_CHECKING:
    from krproxy.relay.call import Call
    from krproxy.relay.intercepted import LocalCall
    from krproxy.relay.route import Route
    from krproxy.relay.served import Served
    from krproxy.relay.transport import Transport

__all__ = ["CallState"]


class CallState:
    """One call of a caller's: the caller's half, the upstream half (if any), and what is known.

    Attributes:
        kind: the call kind holding this state, until the call is over.
        describe: what the call goes to, for messages (a route's name, ``krproxy``, a handler).
        answered: the caller got a status (trailers), from upstream or from us.
        scope: the cancel scope of a task of ours answering the call (an interceptor's, a
            handler's), cancelled when the call ends without it (failed, or its caller gone).
        collected: request bytes such a task holds, counted in the caller connection's
            ``collected`` until the call finishes.
        resend: a call whose request must not be refused back to its caller (a handed-over
            one: its hooks ran): told the upstream's refusal instead, it sends the request again.
        on_end: told once the call is over (a served call's reader waiting for messages or room).
    """

    __slots__ = (
        "answered",
        "backend_clock",
        "backend_seconds",
        "client",
        "clock",
        "collected",
        "deadline",
        "describe",
        "finished",
        "kind",
        "message",
        "on_end",
        "path",
        "resend",
        "route",
        "scope",
        "started",
        "status",
        "timer",
        "transport",
        "upstream",
    )

    def __init__(
        self,
        transport: Transport,
        path: str,
        route: Route | None,
        kind: Call | LocalCall | Served,
        describe: str | None = None,
    ) -> None:
        self.transport = transport
        self.path = path
        self.route = route
        self.kind: Call | LocalCall | Served | None = kind
        if describe is None:
            describe = route.describe if route is not None else "krproxy"
        self.describe = describe
        self.client: Half = None  # type: ignore[assignment]  # set right after construction
        self.upstream: Half | None = None
        self.started = time.time()
        self.clock = time.perf_counter()
        self.backend_clock = 0.0
        self.backend_seconds = 0.0
        self.status = Status.OK
        self.message: str | None = None
        self.answered = False
        self.finished = False
        self.deadline = math.inf
        self.timer: list[Any] | None = None  # its entry in the transport's deadline heap
        self.scope: trio.CancelScope | None = None
        self.collected = 0
        self.resend: Callable[[str], None] | None = None
        self.on_end: Callable[[], None] | None = None

    def too_large(self, data: bytes, err: MessageTooLarge) -> None:
        """The request announced a message above the limit: RESOURCE_EXHAUSTED, as grpc-go
        (containerd) answers, before any more of it is buffered or sent on."""
        self.client.grant(len(data))
        self.fail(
            Status.RESOURCE_EXHAUSTED,
            f"request message of {err.size} bytes is larger than krproxy's limit of {err.limit} bytes"
            " (--max-request-message-size)",
        )

    def fail(self, status: Status, message: str) -> None:
        """End the call with ``status`` for the caller and reset the upstream stream."""
        if self.scope is not None:
            self.scope.cancel()
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

    def expire(self) -> None:
        """The caller's deadline passed (the transport's timer)."""
        self.fail(Status.DEADLINE_EXCEEDED, f"deadline exceeded waiting for {self.describe}")

    def caller_gone(self) -> None:
        """The caller reset the stream or its connection closed."""
        if self.scope is not None:
            self.scope.cancel()
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
        clients take as leave to send the call again (grpc-go's transparent retry); a call with
        :attr:`resend` sends it again itself.
        ``reset_code``: the upstream reset the stream with this HTTP/2 error code; the caller
        gets the status grpc-go gives such a reset (INTERNAL for a protocol error, CANCELLED,
        RESOURCE_EXHAUSTED for ENHANCE_YOUR_CALM...), not UNAVAILABLE.
        """
        upstream = self.upstream
        if upstream is not None:
            upstream.reset = True
        client = self.client
        resend = self.resend
        if (
            refused
            and resend is not None
            and upstream is not None
            and not self.answered
            and not client.headers_sent
        ):
            upstream.ep.forget(upstream)
            upstream.release()
            self.upstream = None
            resend(reason)
        elif refused and not self.answered and not client.headers_sent and not client.done:
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
        if self.collected:
            client.ep.collected -= self.collected
            self.collected = 0
        client.ep.forget(client)  # (the upstream half was forgotten by settle(), which alone calls this)
        # No reference cycles (state <-> kind, state <-> half): the call's bytes are freed as soon
        # as it is over, not at the next full garbage collection.
        kind, self.kind, self.resend = self.kind, None, None
        on_end, self.on_end = self.on_end, None
        assert kind is not None
        self.transport.call_finished(self, kind)
        if on_end is not None:
            on_end()
        client.release()
        if upstream is not None:
            upstream.release()

    def record(self, request: bytes, reply: bytes | None, replies: int) -> calls.CallRecord:
        """The call record of this call, carrying what its kind kept of its messages."""
        return calls.CallRecord(
            path=self.path,
            started=self.started,
            seconds=time.perf_counter() - self.clock,
            backend_seconds=self.backend_seconds,
            request=request,
            forwarded=None,
            reply=reply,
            replies=replies,
            status=self.status,
            message=self.message,
            hooks=(),
        )
