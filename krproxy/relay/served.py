"""The served call kind: one call a handler answers, the caller's half its only one.

A :class:`Served` is what a :class:`krproxy.rpc.Server` makes of each stream its transport
accepts: it takes the request's DATA into an :class:`~krproxy.relay.messages.Inbox`, runs the
method's handler in a cancel scope, and ends the call as the rules of :mod:`krproxy.rpc.server`
say (the handler's error as its status, a trailers-only answer before any reply message, a reset
cancelling the handler). The handler's view of it is :class:`krproxy.rpc.Stream`, which the
server gives it (:attr:`Served.stream`); the transport knows no handler type.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import outcome
import trio

from krproxy import calls
from krproxy.grpcstatus import GRPCError, Status
from krproxy.h2 import frames as f
from krproxy.relay import connection
from krproxy.relay.grpc import (
    PLAIN_HEADERS,
    CloseConnection,
    MessageTooLarge,
    forget_traceback,
    grpc_message,
    status_fields,
)
from krproxy.relay.half import Headers
from krproxy.relay.messages import Inbox
from krproxy.relay.state import CallState

if TYPE_CHECKING:
    from krproxy.relay.transport import Transport

#: A handler as the transport runs it: ``await handler(stream)`` (:data:`krproxy.rpc.Handler`).
Handler = Callable[[Any], Awaitable[None]]
#: How a job hands its answer back: the reply message, or the error, as an outcome.
Done = Callable[["outcome.Outcome[bytes]"], None]
#: A unary job's start (:class:`krproxy.rpc.UnaryJob`): ``start(request, done)``, the outcome or None.
JobStart = Callable[[bytes, Done], "outcome.Outcome[bytes] | None"]

LOGGER = logging.getLogger("krproxy.rpc")

#: Reply bytes a handler may have queued beyond the caller's windows before send_message waits.
SEND_AHEAD = 256 * 1024

#: An answer's headers and its OK trailers, encoded (what a unary answer sends around its message).
PLAIN_BLOCK = f.encode_headers(PLAIN_HEADERS)
OK_BLOCK = f.encode_headers([(b"grpc-status", b"0")])
_OK_ONLY_BLOCK = f.encode_headers([*PLAIN_HEADERS, (b"grpc-status", b"0")])


class Served:
    """A call a handler answers: the caller's half and no upstream. Its halves, status and end
    are its :attr:`state` (:class:`~krproxy.relay.state.CallState`), whose rules are the relayed
    call's: answering early resets the rest of the request, a reset ends it.

    ``handler_for(path)`` gives the path's handler (None: UNIMPLEMENTED); ``max_request`` bounds
    a request message after decompression (the Inbox bounds it before)."""

    __slots__ = ("ended_here", "handler_for", "inbox", "job", "max_request", "state", "stream", "unsent")

    #: A served call has no watcher (:func:`krproxy.relay.call.report`).
    watcher: None = None

    def __init__(
        self,
        transport: Transport,
        path: str,
        handler_for: Callable[[str], Handler | None],
        max_request: int,
    ) -> None:
        self.state = CallState(transport, path, None, self, f"the handler of {path}")
        self.handler_for = handler_for
        self.max_request = max_request
        self.inbox: Inbox = None  # type: ignore[assignment]  # set with `client`, right after
        self.unsent = 0  # reply bytes queued beyond the caller's windows
        self.ended_here = False  # the handler (or check_headers) ended the call: no more sends
        self.stream: Any = None  # the handler's view (krproxy.rpc.Stream): set right after construction
        self.job: JobStart | None = None  # to start once the request has ended (no task then)

    # -- from the connection -------------------------------------------------------------

    def on_request_data(self, data: bytes, end: bool) -> None:
        state = self.state
        if data:
            client = state.client
            ep = client.ep
            size = len(data)
            if ep.collected + size > connection.MAX_HELD:
                client.grant(size)
                state.fail(
                    Status.RESOURCE_EXHAUSTED,
                    f"the server already holds {ep.collected} bytes of requests from this connection",
                )
                return
            try:
                self.inbox.arrived(data)
            except MessageTooLarge as err:
                client.grant(size)
                state.fail(
                    Status.RESOURCE_EXHAUSTED,
                    f"grpc: received message larger than max ({err.size} vs. {err.limit})",
                )
                return
            except GRPCError as err:  # not gRPC's framing
                client.grant(size)
                state.fail(err.status, err.message or "")
                return
            ep.grant(size)  # the connection's credit at once; the stream's as messages are taken
            ep.collected += size
            state.collected += size
        if end:
            if self.job is not None:  # (no reader waits on a job's inbox: it has no task yet)
                self.start_job()
            else:
                self.inbox.wake()
            if not state.finished:  # (a job answered at once has finished it)
                state.settle()

    def on_request_trailers(self, headers: Headers) -> None:
        self.inbox.wake()
        if self.job is not None:
            self.start_job()

    # A served call has no upstream half: no answer's frames reach it.

    def on_reply_headers(self, headers: Headers, end: bool) -> None:
        pass

    def on_reply_data(self, data: bytes, end: bool) -> None:
        pass

    def grant(self, size: int) -> None:
        """Reply bytes queued on the caller's half were written (or dropped): room to send more."""
        self.unsent -= size
        if self.unsent <= SEND_AHEAD:
            self.inbox.wake()

    def took(self, size: int) -> None:
        """The handler took a request message of ``size`` bytes (prefix included)."""
        state = self.state
        size = min(size, state.collected)
        state.client.ep.collected -= size
        state.collected -= size

    def ended(self) -> None:
        """The call is over (its state's ``on_end``): a reader waiting for messages or room looks
        again, and the handler's view is let go (no cycle with it: the call is freed as it ends)."""
        self.inbox.wake()
        self.stream = None

    def reply_message(self) -> None:
        """A served call's reply is not kept for its record."""
        return None

    def record(self) -> calls.CallRecord:
        return self.state.record(b"", None, 0)

    # -- from the handler ----------------------------------------------------------------

    def check_open(self) -> None:
        if self.ended_here:
            raise RuntimeError(f"{self.state.path}: the handler ended this call already")

    def reply(self, message: bytes) -> None:
        """A unary answer: headers, ``message`` and OK trailers, in one write."""
        state = self.state
        client = state.client
        s = client.s  # (its stream's state read directly: the Half's properties are calls)
        self.ended_here = True
        if state.answered or s.send_ended or s.reset:
            return
        state.answered = True
        data = grpc_message(message)
        if client.opened:  # the three frames in one step where they go out at once (send_answer)
            ep = client.ep
            if ep.h2.send_answer(s.id, None if s.headers_sent else PLAIN_BLOCK, data, OK_BLOCK):
                if not ep.dirty:
                    ep.touch()
                state.settle()
                return
        if not s.headers_sent:
            client.send_headers(PLAIN_BLOCK, False)
        client.send_data(data, False)
        client.send_trailers(OK_BLOCK)

    def end(
        self,
        status: Status,
        message: str | None,
        details: bytes | None,
        metadata: Sequence[tuple[bytes, bytes]],
    ) -> None:
        """Trailers with ``status`` after what is queued; trailers-only if no headers went out."""
        state = self.state
        client = state.client
        self.ended_here = True
        if state.answered or client.send_ended or client.reset:
            return
        state.answered = True
        state.status, state.message = status, message
        if status is Status.OK and not message and not details and not metadata:
            if client.headers_sent:
                client.send_trailers(OK_BLOCK)
            else:
                client.send_headers(_OK_ONLY_BLOCK, True)
            return
        fields = [*status_fields(status, message, details), *metadata]
        if client.headers_sent:
            client.send_trailers(f.encode_headers(fields))
        else:
            client.send_headers(f.encode_headers([*PLAIN_HEADERS, *fields]), True)

    def reset(self, code: int) -> None:
        self.ended_here = True
        state = self.state
        if state.scope is not None:
            state.scope.cancel()
        client = state.client
        if state.finished or client.reset:
            return
        if not state.answered:
            state.answered = True
            state.status, state.message = (
                Status.CANCELLED,
                f"reset by the server ({f.ERROR_NAMES.get(code, code)})",
            )
        if client.done:  # answered and the request over: nothing to reset
            state.settle()
            return
        client.abort(code)
        state.settle()
        state.transport.flush()

    # -- a UnaryJob, without a task ------------------------------------------------------

    def start_job(self) -> None:
        """The request has ended: start :attr:`job` on its message, from the connection's task
        (see :class:`krproxy.rpc.UnaryJob`: :attr:`job` is its ``start``); anything but one plain message goes to :meth:`run`."""
        job, self.job = self.job, None
        assert job is not None
        state = self.state
        if state.finished or state.answered:  # failed or reset before it ended
            return
        message = self.inbox.take_sole()  # (the request has ended: no stream credit to give back)
        if message is None:
            state.transport.nursery.start_soon(self.run, None)  # unary's answers, in a task
            return
        size = min(len(message) + 5, state.collected)  # took(), inline
        state.client.ep.collected -= size
        state.collected -= size
        try:
            result = job(message, self.job_done)
        except Exception as err:  # the job's bug is its call's, never the connection's
            self._ended_by(err)
            return
        if result is not None:
            self._answer_job(result)  # the connection's task flushes once its frames are handled

    def adopt_job(self, result: outcome.Outcome[bytes] | Exception | None) -> None:
        """Its job was started before this call was made, on the request's one message (a
        whole request, :class:`krproxy.rpc.Server`), and its start gave ``result``: the answer
        (or its error), the exception the start raised, or None if the answer comes later
        (through :meth:`job_done`). The call goes on as :meth:`start_job` would have left it."""
        self.job = None
        state = self.state
        if isinstance(result, Exception):  # the job's bug is its call's, never the connection's
            self._ended_by(result)
        elif result is not None:
            self._answer_job(result)
        if not state.finished:  # (as on_request_data settles after start_job)
            state.settle()

    def job_done(self, result: outcome.Outcome[bytes]) -> None:
        """The job's late answer, on the event loop's thread (a ``run_sync_soon`` callback, where
        an exception would end the whole server: a bug of ours ends the connection, as
        :meth:`krproxy.relay.connection.Endpoint.run` ends it)."""
        state = self.state
        try:
            self._answer_job(result)
        except Exception as err:
            LOGGER.exception(connection.BUG_MESSAGE, f"caller of {state.path}")
            state.client.ep.close(f"internal error: {type(err).__name__}: {err}")
        state.transport.flush()

    def _answer_job(self, result: outcome.Outcome[bytes]) -> None:
        # The outcome read, not unwrapped (unwrap() is two calls more, for a guard against
        # reading it twice that this one reader does not need).
        if type(result) is outcome.Value:  # (not isinstance: an ABC's check is two calls more)
            value: Any = result.value  # (typed bytes; a job may give anything)
            if value.__class__ is not bytes:
                if not isinstance(value, (bytearray, memoryview)):
                    # The job's bug, its call's as a unary handler's send_message of it would be.
                    self._ended_by(
                        TypeError(f"a UnaryJob's answer must be bytes, not {type(value).__name__}")
                    )
                    return
                value = bytes(value)
            self.reply(value)  # dropped if the call ended meanwhile (deadline, reset)
            return
        if not isinstance(result, outcome.Error):  # the job's bug (bytes, a coroutine): its call's
            given: object = result  # (typed as an outcome: what the job gave, whatever it is)
            if inspect.iscoroutine(given):
                given.close()  # (never awaited: no warning of it)
            self._ended_by(
                TypeError(f"a UnaryJob's start must give an outcome or None, not {type(result).__name__}")
            )
            return
        err = result.error
        if isinstance(err, CloseConnection):
            if not self.state.finished:
                self.state.client.ep.close("the handler closed the connection")
        elif isinstance(err, Exception):
            self._ended_by(err)
        else:  # (a BaseException, as unwrap() would raise it)
            raise err

    # -- the handler's task --------------------------------------------------------------

    async def run(self, check: Callable[[Any], Awaitable[bool]] | None) -> None:
        state = self.state
        if state.finished or state.answered:  # reset or failed before this task ran
            return
        stream = self.stream
        try:
            with trio.CancelScope() as state.scope:
                if check is not None and not await check(stream):
                    if not state.answered and not state.finished:
                        self.reset(f.PROTOCOL_ERROR)
                    return
                handler = self.handler_for(state.path)
                if handler is None:
                    raise GRPCError(Status.UNIMPLEMENTED, f"unknown method {state.path}")
                await handler(stream)
                self.end(Status.OK, None, None, ())
        except CloseConnection:
            state.client.ep.close("the handler closed the connection")
        except Exception as err:  # a handler's error is its call's, never the server's
            self._ended_by(err)
        finally:
            state.transport.flush()

    def _ended_by(self, err: Exception) -> None:
        grpc_error = _grpc_error(err)
        state = self.state
        if state.answered or state.finished:
            if grpc_error is None:
                LOGGER.exception("handler of %s failed after its call ended", state.path, exc_info=err)
        elif grpc_error is not None:
            details = grpc_error.details if isinstance(grpc_error.details, bytes) else None
            self.end(grpc_error.status, grpc_error.message, details, ())
        else:
            LOGGER.exception("handler of %s failed", state.path, exc_info=err)  # (also outside an except)
            self.end(Status.UNKNOWN, f"{type(err).__name__}: {err}", None, ())
        forget_traceback(err)


def _grpc_error(err: Exception) -> GRPCError | None:
    """The GRPCError ``err`` is, or the one a group of only GRPCErrors holds (a handler's nursery)."""
    if isinstance(err, GRPCError):
        return err
    if isinstance(err, ExceptionGroup):
        matched, rest = err.split(GRPCError)
        if matched is not None and rest is None:
            leaf: BaseException = matched
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            return cast(GRPCError, leaf)
    return None
