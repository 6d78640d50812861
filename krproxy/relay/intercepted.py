"""Calls the relay answers itself and calls it makes.

- :class:`LocalCall`: a call with hook points; the relay collects the request and runs the
  interceptor, whose ``forward`` is a call of the relay's own.
  (:mod:`krproxy.relay.exchange` holds the relay's side of such calls.)
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio

from krproxy import calls
from krproxy.forward import BackendError, CallForward, Interceptor, Reply, Watch, Watcher
from krproxy.grpcstatus import GRPCError, Status
from krproxy.h2 import frames as f
from krproxy.relay import connection
from krproxy.relay.call import Call
from krproxy.relay.grpc import (
    KEEP_ALL,
    KEEP_FIRST,
    OWN_FIELDS,
    PLAIN_HEADERS,
    PLAIN_TRAILERS,
    REFUSED_ATTEMPTS,
    REFUSED_PAUSE,
    RESET_STATUS,
    CloseConnection,
    MessageTooLarge,
    StreamReset,
    Tap,
    UpstreamError,
    decompress_inline,
    decompress_message,
    forget_traceback,
    grpc_message,
    own_call_headers,
    status_fields,
)
from krproxy.relay.half import Half, Headers
from krproxy.relay.state import CallState

if TYPE_CHECKING:
    from krproxy.relay.route import Route
    from krproxy.relay.transport import Transport

#: What a watched call's compressed answer may decompress to (on the reader's turn): its watcher
#: reads one id, and no reply of a watched method comes near.
_WATCHED_REPLY_LIMIT = 64 * 1024

#: What :meth:`LocalCall.hand_over` gives the interceptor to return: the relay answers the call.
_HANDED_OVER = Reply(b"")

LOGGER = logging.getLogger("krproxy.relay")


class LocalCall:
    """A call with hook points: the relay collects the request and runs the interceptor.

    The interceptor runs in a task of its own; its ``forward`` makes a unary call on the
    runtime route (:meth:`Transport.unary`), with the caller's metadata and what is left of the
    caller's deadline. Its reply, or the runtime's error answer, goes back unchanged.

    Unless the path's ``watch`` (:data:`krproxy.forward.Watch`), shown the whole request first,
    gives a watcher: then the call goes upstream as the caller sent it (its header block, its
    message), its answer is relayed frame by frame by a passthrough :class:`Call` over this call's
    state (its halves, status and end: :attr:`state`, a :class:`CallState`), and the
    watcher is told how it ended once the answer is out (:meth:`Transport.flush`). No task, no
    re-encoding, no call of the relay's own: a hook point without plugins costs about what a
    passthrough call does.

    An interceptor whose last step is to forward and tell the store may hand that step over
    (:meth:`hand_over`, offered through its :class:`krproxy.forward.CallForward`): once it returns, its request goes upstream
    from this call's own half and the answer is relayed as a watched call's, without the relay's
    own unary call, its ``Exchange`` and the answer's re-encoding. Its hooks have run, so a refusal
    of the runtime's (REFUSED_STREAM, GOAWAY) is not passed to the caller, whose retry would run them
    again: the same bytes are sent again, as :meth:`Transport.unary` does.
    """

    __slots__ = (
        "_ctx",
        "_handed",
        "_headers",
        "_interceptor",
        "_refusals",
        "_relayed",
        "_started",
        "_watch",
        "request_tap",
        "state",
        "unary",
        "watcher",
    )

    def __init__(
        self,
        transport: Transport,
        path: str,
        route: Route | None,
        unary: bool,
        interceptor: Interceptor,
        headers: Headers,
        watch: Watch | None = None,
    ) -> None:
        self.state = CallState(transport, path, route, self)
        self.unary = unary
        self.request_tap = Tap(KEEP_FIRST, transport.max_request)  # the interceptor needs the request
        self._interceptor = interceptor
        self._headers = headers
        self._watch = watch
        self.watcher: Watcher | None = None
        self._started = False
        self._handed: bytes | None = None  # the framed request the interceptor handed over (hand_over)
        self._relayed: Call | None = None  # what relays the answer of a watched or handed-over call
        self._refusals = 0
        self._ctx: calls.CallContext | None = None  # made when first read (a watched call has none)

    @property
    def ctx(self) -> calls.CallContext:
        """The call's context, for its interceptor and its record; its clocks are the state's (as though it
        had been made with the call: a watched call goes upstream and is recorded without one)."""
        ctx = self._ctx
        if ctx is None:
            state = self.state
            ctx = self._ctx = calls.CallContext(state.path, started=state.started, clock_start=state.clock)
        return ctx

    def on_request_data(self, data: bytes, end: bool) -> None:
        state = self.state
        if data:
            client = state.client
            ep = client.ep
            size = len(data)
            if ep.collected + size > connection.MAX_HELD:
                # Its windows are granted as it arrives, so bound it here: a caller sending many
                # large requests and never finishing them would otherwise fill our memory.
                client.grant(size)
                state.fail(
                    Status.RESOURCE_EXHAUSTED,
                    f"krproxy already holds {ep.collected} bytes of requests from this connection"
                    f" (limit {connection.MAX_HELD}); send fewer large calls at once",
                )
                return
            try:
                self.request_tap.feed(data)
            except MessageTooLarge as err:
                state.too_large(data, err)
                return
            ep.collected += size
            state.collected += size
            client.grant(size)
        if end:
            state.client.recv_ended = True
            if not self._started and not state.finished and not state.answered:
                self._started = True
                if not self._pass_watched():
                    state.transport.handlers.start(self._handle)

    def on_request_trailers(self, headers: Headers) -> None:
        self.on_request_data(b"", True)

    # The answer of a watched or handed-over call reaches its relayed part (_relayed), not this.

    def on_reply_headers(self, headers: Headers, end: bool) -> None:
        pass

    def on_reply_data(self, data: bytes, end: bool) -> None:
        pass

    def _relay_answer(self) -> Call:
        """What relays this call's answer from the runtime, as a passthrough call's (its reply
        kept for the watcher and the record)."""
        state = self.state
        relayed = Call(
            state.transport, state.path, state.route, self.unary, answering=state, reply_tap=Tap(KEEP_ALL)
        )
        self._relayed = relayed
        return relayed

    def _pass_watched(self) -> bool:
        """Send the call upstream as the caller's bytes if its path's watch gives a watcher for its
        request (one whole uncompressed message); False: the interceptor is to handle it."""
        tap = self.request_tap
        state = self.state
        route = state.route
        if self._watch is None or route is None or tap.flag:  # (compressed, or a flag grpc-go refuses)
            return False
        if tap.first is None or tap.messages != 1:
            return False
        request = bytes(tap.first)
        try:
            watcher = self._watch(request)
        except Exception:  # a bug of ours: the interceptor handles the call, as without a watch
            LOGGER.exception("watch of %s failed", state.path)
            return False
        if watcher is None:
            return False
        self.watcher = watcher
        try:
            ep = route.endpoint()
        except OSError as err:
            state.fail(Status.UNAVAILABLE, f"{route.describe} is unavailable: {err}")
            return True
        client = state.client
        upstream = state.upstream = Half(ep, 0, self._relay_answer(), state)
        # The caller's request was granted back as it arrived (it was held here): only the answer's
        # credit goes back to the upstream as the caller takes it, hence no upstream.peer.
        client.peer = upstream
        ep.open_stream(upstream, f.encode_headers(self._headers), False)
        upstream.send_data(grpc_message(request), True)
        return True

    def reply_message(self) -> bytes | None:
        """The answer of a watched or handed-over call, as :meth:`Call.reply_message` gives it,
        decompressed: such a call carries the caller's ``grpc-accept-encoding``, so the runtime may
        compress the answer its watcher must read. None (logged) if it does not decompress, or to
        more than :data:`_WATCHED_REPLY_LIMIT`; None for an answer of the interceptor's."""
        relayed = self._relayed
        if relayed is None:
            return None
        message = relayed.reply_message()
        tap = relayed.reply_tap
        if message is None or tap is None or not tap.compressed:
            return message
        headers = relayed.answer_headers or ()
        encoding = next((v for n, v in headers if n == b"grpc-encoding"), b"identity")
        try:
            return decompress_inline(encoding, message, _WATCHED_REPLY_LIMIT)
        except (GRPCError, MessageTooLarge) as err:
            LOGGER.warning("%s: the runtime's compressed answer is unreadable here: %s", self.state.path, err)
            return None

    async def _handle(self, scope: trio.CancelScope) -> None:
        """Run the interceptor in *scope* (its task's: :class:`~krproxy.relay._handlers.HandlerTasks`), which the call's
        state cancels (the caller gone, the deadline passed) until the interceptor is done."""
        state = self.state
        if state.finished or state.answered:  # reset or failed before this task ran: cancelled
            return
        tap = self.request_tap
        ctx = self.ctx
        calls.CURRENT.set(ctx)  # this task's own context: calls never share one
        ctx.deadline = state.deadline
        try:
            if tap.first is None or tap.messages < 1:
                raise GRPCError(Status.INTERNAL, "the request carried no complete message")
            if tap.flag > 1:  # as grpc-go's checkRecvPayload answers it (containerd 1.6-2.1, measured)
                raise GRPCError(Status.INTERNAL, f"grpc: received unexpected payload format {tap.flag}")
            ctx.request = bytes(tap.first)
            state.scope = scope
            if tap.compressed:
                ctx.request = await self._decompressed(ctx.request)
            reply = await self._interceptor(
                state.path, ctx.request, CallForward(self._forward, self.hand_over)
            )
            if reply is _HANDED_OVER:
                if not state.answered:  # (the deadline may have passed meanwhile)
                    self._send_handed()
                return
            ctx.reply, ctx.replies = reply.message, 1  # before answering: that may finish the call
            self._answer(
                reply.headers or PLAIN_HEADERS,
                grpc_message(reply.message),
                reply.trailers or PLAIN_TRAILERS,
            )
        except CloseConnection:
            state.client.ep.close("the handler closed the connection")
        except BackendError as err:
            self._answer(err.headers, None, err.trailers, err)
            forget_traceback(err)
        except GRPCError as err:
            details = err.details if isinstance(err.details, bytes) else None
            self._answer(None, None, status_fields(err.status, err.message, details), err)
            forget_traceback(err)
        except Exception as err:  # a bug of ours: answer UNKNOWN, keep serving
            LOGGER.exception("interceptor for %s failed", state.path)
            unknown = GRPCError(Status.UNKNOWN, f"{type(err).__name__}: {err}")
            self._answer(None, None, status_fields(unknown.status, unknown.message, None), unknown)
            forget_traceback(err)
        finally:
            state.scope = None  # the task's next handler runs in it: this call cancels it no more
            state.transport.flush()

    async def _decompressed(self, data: bytes) -> bytes:
        """A request message that came compressed (gzip or deflate, as gRPC clients may send),
        decompressed: the interceptor reads protobuf, and forwards it uncompressed."""
        try:
            encoding = next((value for name, value in self._headers if name == b"grpc-encoding"), b"identity")
            return await decompress_message(encoding, data, self.state.transport.max_request)
        except MessageTooLarge as err:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"request message decompressed is larger than krproxy's limit of {err.limit} bytes"
                " (--max-request-message-size)",
            ) from None

    def _answer(
        self, headers: Headers | None, body: bytes | None, trailers: Headers, err: GRPCError | None = None
    ) -> None:
        state = self.state
        client = state.client
        if state.answered or client.done or client.send_ended:
            return
        # Every block is encoded before the call counts as answered: one that cannot be (a header
        # field that is not bytes, a bug of ours) raises here, and _handle answers UNKNOWN instead.
        if headers is None:  # trailers-only; a runtime's own such answer has its :status already
            whole = trailers if trailers and trailers[0][0] == b":status" else [*PLAIN_HEADERS, *trailers]
            head, tail = f.encode_headers(whole), None
        else:
            head, tail = f.encode_headers(headers), f.encode_headers(trailers)
        state.answered = True
        if err is not None:
            state.status, state.message = err.status, err.message
        # The call finishes as its end is queued: its record waits for the relay's next flush (which
        # _handle makes), so the answer goes out first, as for calls the readers finish.
        transport = state.transport
        deferring, transport.defer_records = transport.defer_records, True
        try:
            if tail is None:
                client.send_headers(head, True)
                return
            client.send_headers(head, False)
            if body is not None:
                client.send_data(body, False)
            client.send_trailers(tail)
        finally:
            transport.defer_records = deferring

    async def _forward(self, data: bytes) -> Reply:
        ctx = self.ctx
        state = self.state
        if data is not ctx.request:
            ctx.forwarded = data  # an interceptor changed it
        if state.route is None:
            raise GRPCError(Status.UNIMPLEMENTED, f"{state.path}: nothing to forward to")
        started = time.perf_counter()
        try:
            answer = await state.transport.unary(
                state.route, state.path, data, self._metadata(), state.deadline, watched=True
            )
        except TimeoutError:  # (an OSError: first)
            raise GRPCError(
                Status.DEADLINE_EXCEEDED, f"deadline exceeded waiting for {state.describe}"
            ) from None
        except StreamReset as err:  # the runtime reset this call's stream: the status grpc-go gives it
            raise GRPCError(RESET_STATUS.get(err.code, Status.INTERNAL), str(err)) from None
        except (OSError, UpstreamError) as err:  # unreachable, or the connection broke: as for relayed calls
            raise GRPCError(Status.UNAVAILABLE, f"{state.describe} is unavailable: {err}") from None
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

    def _metadata(self) -> Headers:
        """The caller's header fields the relay passes on in a forward of its own."""
        return [field for field in self._headers if field[0] not in OWN_FIELDS]

    def hand_over(self, data: bytes, watcher: Watcher) -> Reply:
        """Take the interceptor's last step: *data* goes upstream as the call's request once the
        interceptor returns what this returns, the answer goes to the caller as a watched call's,
        and *watcher* is told its end (:data:`krproxy.forward.Watcher`)."""
        ctx = self.ctx
        state = self.state
        if data is not ctx.request:
            ctx.forwarded = data  # an interceptor changed it
        if state.route is None:
            raise GRPCError(Status.UNIMPLEMENTED, f"{state.path}: nothing to forward to")
        self.watcher = watcher
        self._relay_answer()
        self._handed = grpc_message(data)
        state.resend = self._refused  # its hooks ran: a refusal is sent again, not passed on
        return _HANDED_OVER

    def _send_handed(self) -> None:
        """Open the upstream stream of a handed-over call and send its request (again, if refused)."""
        state = self.state
        route, request, relayed = state.route, self._handed, self._relayed
        assert route is not None and request is not None and relayed is not None
        try:
            ep = route.endpoint()
        except OSError as err:
            state.fail(Status.UNAVAILABLE, f"{route.describe} is unavailable: {err}")
            return
        # As the relay's own calls are sent: the caller's metadata, what is left of its deadline.
        fields = own_call_headers(state.path, state.deadline, self._metadata())
        upstream = state.upstream = Half(ep, 0, relayed, state)
        state.client.peer = upstream  # (the request was granted back as it arrived: see _pass_watched)
        ep.open_stream(upstream, f.encode_headers(fields), False)
        upstream.send_data(request, True)

    def _refused(self, reason: str) -> None:
        """The runtime refused the handed-over request unprocessed (:attr:`CallState.resend`; its
        upstream half is gone): send it again after a pause, a few times at most."""
        state = self.state
        if state.backend_clock:  # this attempt's time counts, as Transport.unary counts every attempt's
            self.ctx.backend_seconds += time.perf_counter() - state.backend_clock
            state.backend_clock = 0.0
        self._refusals += 1
        if self._refusals >= REFUSED_ATTEMPTS:  # even without a deadline, not forever
            state.fail(
                Status.UNAVAILABLE, f"{state.describe} refused the call {self._refusals} times: {reason}"
            )
            return
        state.transport.nursery.start_soon(self._send_again)

    async def _send_again(self) -> None:
        await trio.sleep(REFUSED_PAUSE)
        state = self.state
        if not state.answered and not state.finished:  # (the caller gone, the deadline passed: no more)
            self._send_handed()
            state.transport.flush()

    def record(self) -> calls.CallRecord:
        ctx = self.ctx
        state = self.state
        if self._handed is not None:  # relayed as a watched call, after the hooks ctx holds
            ctx.backend_seconds += state.backend_seconds
            ctx.reply = self.reply_message()
            ctx.replies = 1 if ctx.reply is not None else 0
        elif self.watcher is not None:  # relayed as a passthrough call: its taps hold what it carried
            request, relayed = self.request_tap.first, self._relayed
            replies = (
                relayed.reply_tap.messages if relayed is not None and relayed.reply_tap is not None else 0
            )
            return state.record(bytes(request) if request is not None else b"", self.reply_message(), replies)
        if state.status is not Status.OK:
            ctx.fail(state.status, state.message)
        return ctx.finish()
