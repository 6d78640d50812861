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

if TYPE_CHECKING:
    from krproxy.relay.route import Route
    from krproxy.relay.transport import Transport

#: What a watched call's compressed answer may decompress to (on the reader's turn): its watcher
#: reads one id, and no reply of a watched method comes near.
_WATCHED_REPLY_LIMIT = 64 * 1024

#: What :meth:`LocalCall.hand_over` gives the interceptor to return: the relay answers the call.
_HANDED_OVER = Reply(b"")

LOGGER = logging.getLogger("krproxy.relay")


class LocalCall(Call):
    """A call with hook points: the relay collects the request and runs the interceptor.

    The interceptor runs in a task of its own; its ``forward`` makes a unary call on the
    runtime route (:meth:`Transport.unary`), with the caller's metadata and what is left of the
    caller's deadline. Its reply, or the runtime's error answer, goes back unchanged.

    Unless the path's ``watch`` (:data:`krproxy.forward.Watch`), shown the whole request first,
    gives a watcher: then the call goes upstream as the caller sent it (its header block, its
    message), its answer is relayed frame by frame as a passthrough :class:`Call`'s, and the
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
        "_encoding",
        "_handed",
        "_headers",
        "_interceptor",
        "_refusals",
        "_reply_encoding",
        "_started",
        "_watch",
        "ctx",
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
        super().__init__(transport, path, route, unary)
        self.request_tap = Tap(KEEP_FIRST, transport.max_request)  # the interceptor needs the request
        self.reply_tap = None
        self._interceptor = interceptor
        self._headers = headers
        self._watch = watch
        self.watcher = None
        self._encoding = next((value for name, value in headers if name == b"grpc-encoding"), b"identity")
        self._reply_encoding = b"identity"  # a watched call's answer's, which the runtime may compress
        self._started = False
        self._handed: bytes | None = None  # the framed request the interceptor handed over (hand_over)
        self._refusals = 0
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
                if not self._pass_watched():
                    self.transport.nursery.start_soon(self._handle)

    def _pass_watched(self) -> bool:
        """Send the call upstream as the caller's bytes if its path's watch gives a watcher for its
        request (one whole uncompressed message); False: the interceptor is to handle it."""
        tap = self.request_tap
        route = self.route
        if self._watch is None or route is None or tap is None or tap.compressed:
            return False
        if tap.first is None or tap.messages != 1:
            return False
        request = bytes(tap.first)
        try:
            watcher = self._watch(request)
        except Exception:  # a bug of ours: the interceptor handles the call, as without a watch
            LOGGER.exception("watch of %s failed", self.path)
            return False
        if watcher is None:
            return False
        self.watcher = watcher
        try:
            ep = route.endpoint()
        except OSError as err:
            self.fail(Status.UNAVAILABLE, f"{route.describe} is unavailable: {err}")
            return True
        self.reply_tap = Tap(KEEP_ALL)  # the watcher and the record get the reply
        client = self.client
        upstream = self.upstream = Half(ep, 0, self)
        # The caller's request was granted back as it arrived (it was held here): only the answer's
        # credit goes back to the upstream as the caller takes it, hence no upstream.peer.
        client.peer = upstream
        ep.open_stream(upstream, f.encode_headers(self._headers), False)
        upstream.send_data(grpc_message(request), True)
        return True

    def on_request_trailers(self, headers: Headers) -> None:
        self.on_request_data(b"", True)

    def on_reply_headers(self, headers: Headers, end: bool) -> None:
        # Only a watched call has an upstream half of its own (the interceptor's calls are _Exchanges).
        if not end:
            self._reply_encoding = next((v for n, v in headers if n == b"grpc-encoding"), b"identity")
        super().on_reply_headers(headers, end)

    def reply_message(self) -> bytes | None:
        """As :meth:`Call.reply_message`, decompressed: a watched call carries the caller's
        ``grpc-accept-encoding``, so the runtime may compress the answer its watcher must read. None
        (logged) if it does not decompress, or to more than :data:`_WATCHED_REPLY_LIMIT`."""
        message = super().reply_message()
        tap = self.reply_tap
        if message is None or tap is None or not tap.compressed:
            return message
        try:
            return decompress_inline(self._reply_encoding, message, _WATCHED_REPLY_LIMIT)
        except (GRPCError, MessageTooLarge) as err:
            LOGGER.warning("%s: the runtime's compressed answer is unreadable here: %s", self.path, err)
            return None

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
                reply = await self._interceptor(
                    self.path, ctx.request, CallForward(self._forward, self.hand_over)
                )
                if reply is _HANDED_OVER:
                    if not self.answered:  # (the deadline may have passed meanwhile)
                        self._send_handed()
                    return
                ctx.reply, ctx.replies = reply.message, 1  # before answering: that may finish the call
                self._answer(
                    reply.headers or PLAIN_HEADERS,
                    grpc_message(reply.message),
                    reply.trailers or PLAIN_TRAILERS,
                )
        except CloseConnection:
            self.client.ep.close("the handler closed the connection")
        except BackendError as err:
            self._answer(err.headers, None, err.trailers, err)
            forget_traceback(err)
        except GRPCError as err:
            details = err.details if isinstance(err.details, bytes) else None
            self._answer(None, None, status_fields(err.status, err.message, details), err)
            forget_traceback(err)
        except Exception as err:  # a bug of ours: answer UNKNOWN, keep serving
            LOGGER.exception("interceptor for %s failed", self.path)
            unknown = GRPCError(Status.UNKNOWN, f"{type(err).__name__}: {err}")
            self._answer(None, None, status_fields(unknown.status, unknown.message, None), unknown)
            forget_traceback(err)
        finally:
            self.transport.flush()

    async def _decompressed(self, data: bytes) -> bytes:
        """A request message that came compressed (gzip or deflate, as gRPC clients may send),
        decompressed: the interceptor reads protobuf, and forwards it uncompressed."""
        try:
            return await decompress_message(self._encoding, data, self.transport.max_request)
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
        # The call finishes as its end is queued: its record waits for the relay's next flush (which
        # _handle makes), so the answer goes out first, as for calls the readers finish.
        transport = self.transport
        deferring, transport.defer_records = transport.defer_records, True
        try:
            if headers is None:  # trailers-only; a runtime's own such answer has its :status already
                whole = trailers if trailers and trailers[0][0] == b":status" else [*PLAIN_HEADERS, *trailers]
                client.send_headers(f.encode_headers(whole), True)
                return
            client.send_headers(f.encode_headers(headers), False)
            if body is not None:
                client.send_data(body, False)
            client.send_trailers(f.encode_headers(trailers))
        finally:
            transport.defer_records = deferring

    async def _forward(self, data: bytes) -> Reply:
        ctx = self.ctx
        if data is not ctx.request:
            ctx.forwarded = data  # an interceptor changed it
        if self.route is None:
            raise GRPCError(Status.UNIMPLEMENTED, f"{self.path}: nothing to forward to")
        started = time.perf_counter()
        try:
            answer = await self.transport.unary(
                self.route, self.path, data, self._metadata(), self.deadline, watched=True
            )
        except TimeoutError:  # (an OSError: first)
            raise GRPCError(
                Status.DEADLINE_EXCEEDED, f"deadline exceeded waiting for {self.describe}"
            ) from None
        except StreamReset as err:  # the runtime reset this call's stream: the status grpc-go gives it
            raise GRPCError(RESET_STATUS.get(err.code, Status.INTERNAL), str(err)) from None
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

    def _metadata(self) -> Headers:
        """The caller's header fields the relay passes on in a forward of its own."""
        return [field for field in self._headers if field[0] not in OWN_FIELDS]

    def hand_over(self, data: bytes, watcher: Watcher) -> Reply:
        """Take the interceptor's last step: *data* goes upstream as the call's request once the
        interceptor returns what this returns, the answer goes to the caller as a watched call's,
        and *watcher* is told its end (:data:`krproxy.forward.Watcher`)."""
        ctx = self.ctx
        if data is not ctx.request:
            ctx.forwarded = data  # an interceptor changed it
        if self.route is None:
            raise GRPCError(Status.UNIMPLEMENTED, f"{self.path}: nothing to forward to")
        self.watcher = watcher
        self.reply_tap = Tap(KEEP_ALL)  # the watcher and the record get the reply
        self._handed = grpc_message(data)
        return _HANDED_OVER

    def _send_handed(self) -> None:
        """Open the upstream stream of a handed-over call and send its request (again, if refused)."""
        route, request = self.route, self._handed
        assert route is not None and request is not None
        try:
            ep = route.endpoint()
        except OSError as err:
            self.fail(Status.UNAVAILABLE, f"{route.describe} is unavailable: {err}")
            return
        # As the relay's own calls are sent: the caller's metadata, what is left of its deadline.
        fields = own_call_headers(self.path, self.deadline, self._metadata())
        upstream = self.upstream = Half(ep, 0, self)
        self.client.peer = upstream  # (the request was granted back as it arrived: see _pass_watched)
        ep.open_stream(upstream, f.encode_headers(fields), False)
        upstream.send_data(request, True)

    def upstream_gone(self, reason: str, refused: bool = False, reset_code: int | None = None) -> None:
        upstream, client = self.upstream, self.client
        if not refused or self._handed is None or upstream is None or self.answered or client.s.headers_sent:
            super().upstream_gone(reason, refused, reset_code)
            return
        upstream.reset = True
        upstream.ep.forget(upstream)
        upstream.release()
        self.upstream = None
        if self.backend_clock:  # this attempt's time counts, as Transport.unary counts every attempt's
            self.ctx.backend_seconds += time.perf_counter() - self.backend_clock
            self.backend_clock = 0.0
        self._refusals += 1
        if self._refusals >= REFUSED_ATTEMPTS:  # even without a deadline, not forever
            self.fail(
                Status.UNAVAILABLE, f"{self.describe} refused the call {self._refusals} times: {reason}"
            )
            return
        self.transport.nursery.start_soon(self._send_again)

    async def _send_again(self) -> None:
        await trio.sleep(REFUSED_PAUSE)
        if not self.answered and not self.finished:  # (the caller gone, the deadline passed: no more)
            self._send_handed()
            self.transport.flush()

    def record(self) -> calls.CallRecord:
        ctx = self.ctx
        if self._handed is not None:  # relayed as a watched call, after the hooks ctx holds
            ctx.backend_seconds += self.backend_seconds
            ctx.reply = self.reply_message()
            ctx.replies = 1 if ctx.reply is not None else 0
        elif self.watcher is not None:  # relayed as a passthrough call: its taps hold what it carried
            return super().record()
        if self.status is not Status.OK:
            ctx.fail(self.status, self.message)
        return ctx.finish()
