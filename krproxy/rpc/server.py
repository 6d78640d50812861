"""A gRPC server on krproxy's relay: handlers by method path, bytes in and out.

Connections, streams, flow control, settings and GOAWAY are the transport's
(:class:`krproxy.relay.transport.Transport`, which a :class:`Server` holds); this module adds what
makes a server of it: every stream the transport accepts becomes a served call
(:class:`krproxy.relay.served.Served`, a call without an upstream), whose handler runs in a task of its own
and talks to the caller through a :class:`Stream`: request messages as they arrive, reply
messages as the handler sends them, trailers at the end. A :class:`UnaryJob` handler runs
without a task: it is started from the connection's task once the request has ended, and
answers at once or later from a thread of its own (the SDK's hook server: no trio task,
cancel scope or scheduler pass per call); a UnaryJob's request read whole with its headers
(the transport's ``whole_requests``: its one DATA frame, ending the stream, in the same read) is
answered at once without even the served call, when the job answers at once
(:meth:`Server._answer_whole`). Deadlines (``grpc-timeout``) are the
transport's deadline heap; the caller going away (RST_STREAM, a closed connection) cancels the
handler as it cancels an interceptor of the daemon's.

Rules:

- a handler raising :class:`~krproxy.grpcstatus.GRPCError` ends the call with its status,
  message and details; any other exception ends it UNKNOWN and is logged with its traceback;
  a handler that returns without trailers gets OK trailers;
- an error before any reply message is a trailers-only answer (as grpc-go answers);
- the caller's deadline cancels the handler and ends the call DEADLINE_EXCEEDED (unless the
  server is built with ``enforce_deadlines=False``, for fakes that hang as a server that ignores
  deadlines does);
- a request message larger than ``max_request`` ends the call RESOURCE_EXHAUSTED before any of
  it is buffered;
- paths neither in the handlers nor answered by ``fallback`` are UNIMPLEMENTED.

Used by the SDK's hook server, ``krproxy trace serve``, ``krproxy demo`` and the fakes.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import NoReturn

import outcome
import trio

from krproxy.h2 import frames as f
from krproxy.relay.connection import MAX_HELD, Endpoint, Headers
from krproxy.relay.grpc import grpc_message, grpc_timeout
from krproxy.relay.half import Half
from krproxy.relay.messages import Inbox
from krproxy.relay.served import OK_BLOCK, PLAIN_BLOCK, JobStart, Served
from krproxy.relay.transport import Transport
from krproxy.rpc._stream import Handler, Stream, UnaryJob, unary, unary_stream
from krproxy.unixsock import bind_unix_socket, unlink_if_ours

__all__ = ["Handler", "Server", "Stream", "UnaryJob", "unary", "unary_stream"]

LOGGER = logging.getLogger("krproxy.rpc")

#: Largest request message by default: containerd's limit (grpc-go's own default is 4 MiB).
MAX_REQUEST = 16 * 1024 * 1024


class Server:
    """A gRPC server over unix sockets (see the module docstring for the rules).

    Args:
        handlers: the handler of each method path.
        fallback: asked for paths not in ``handlers``; None from it (or no fallback): UNIMPLEMENTED.
        check_headers: judges each request's header block before anything else happens to it,
            in place of the relay's RFC 9113 §8.2 checks (for fakes as strict as grpc-go). A plain
            function runs as the HEADERS frame is handled, before any DATA of the stream
            (:attr:`Stream.headers_ended` is then whether the request already ended); an
            ``async def`` runs in the call's task, before the handler. It may answer or reset the
            stream itself (:meth:`Stream.refuse`, :meth:`Stream.reset`); returning False stops
            the call there (reset PROTOCOL_ERROR if it did neither).
        max_request: a larger request message ends the call RESOURCE_EXHAUSTED.
        max_streams: SETTINGS_MAX_CONCURRENT_STREAMS advertised and kept per connection (streams
            beyond it are refused, REFUSED_STREAM); None: none advertised, as grpc-go.
        enforce_deadlines: False: the caller's ``grpc-timeout`` is read (:attr:`Stream.deadline`)
            but the handler is not cancelled at it.
    """

    def __init__(
        self,
        handlers: Mapping[str, Handler],
        *,
        fallback: Callable[[str], Handler | None] | None = None,
        check_headers: Callable[[Stream], bool] | Callable[[Stream], Awaitable[bool]] | None = None,
        max_request: int = MAX_REQUEST,
        max_streams: int | None = None,
        enforce_deadlines: bool = True,
    ) -> None:
        if max_request <= 0:
            raise ValueError(f"max_request must be positive, not {max_request}")
        if max_streams is not None and max_streams <= 0:
            raise ValueError(f"max_streams must be positive or None, not {max_streams}")
        self.handlers = dict(handlers)
        self.fallback = fallback
        self.check_headers = check_headers
        self.check_is_async = check_headers is not None and inspect.iscoroutinefunction(check_headers)
        self.max_request = max_request
        # The run's clock, as trio.current_time() reads it (two calls fewer per call with a
        # deadline): taken as serving starts, since a server may serve in one run after another.
        self._clock: trio.abc.Clock | None = None
        transport = self.transport = Transport(self._open_call, enforce_deadlines=enforce_deadlines)
        transport.max_request = max_request
        transport.caller_max_streams = max_streams
        transport.check_request_headers = check_headers is None
        # A request read whole comes with its body (_open_call): none where a check may reset
        # a stream on its headers alone, before its DATA is read.
        transport.whole_requests = check_headers is None

    def handler_for(self, path: str) -> Handler | None:
        handler = self.handlers.get(path)
        if handler is None and self.fallback is not None:
            handler = self.fallback(path)
        return handler

    def _open_call(
        self, ep: Endpoint, stream_id: int, headers: Headers, end: bool, body: bytes | None
    ) -> bool:
        """A caller's new stream (the transport's ``open_call``): a served call of its path, or,
        for a UnaryJob's whole request (``body``), its answer at once (:meth:`_answer_whole`).
        Returns whether it took ``body``."""
        path = None
        timeout = None  # grpc-timeout's value, read where a deadline is wanted
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"grpc-timeout":
                timeout = value
        text = path.decode("utf-8", "replace") if path is not None else ""
        if body is not None and path is not None:  # (no check_headers: see Transport.whole_requests)
            handler = self.handlers.get(text)
            if handler.__class__ is UnaryJob and self._answer_whole(
                ep, stream_id, headers, text, timeout, body, handler.start
            ):
                return True
        self._served_call(ep, stream_id, headers, end, text, self._deadline(timeout), path is not None)
        return False

    def _answer_whole(
        self,
        ep: Endpoint,
        stream_id: int,
        headers: Headers,
        text: str,
        timeout: bytes | None,
        body: bytes,
        job: JobStart,
    ) -> bool:
        """A UnaryJob's request whose body came whole with its headers: if it is one plain
        message within the limits (and no observer wants the call's record), the job starts on it
        here and an answer at once goes out with no served call (no CallState, Half, Inbox,
        Stream or deadline entry: the stream is released as the reader sees no half for it). Any
        other outcome (an error, an answer later, windows too small) makes the served call the
        headers would have made, with the same deadline, and hands it the job's start
        (:meth:`Served.adopt_job <krproxy.relay.served.Served.adopt_job>`). False, having done
        nothing: the served call's path, as for any request."""
        size = len(body)
        if (
            size < 5
            or body[0]  # compressed (or not gRPC's framing)
            or int.from_bytes(body[1:5], "big") != size - 5
            or size - 5 > self.max_request
            or ep.collected + size > MAX_HELD
            or self.transport.observers  # (the record is a served call's)
        ):
            return False
        since = 0.0 if timeout is None else time.perf_counter()  # the deadline's start, if one is made
        call: Served | None = None
        early: outcome.Outcome[bytes] | None = None  # done() called before the start returned

        def done(result: outcome.Outcome[bytes]) -> None:
            nonlocal early
            if call is not None:  # (made right after the job's start returned)
                call.job_done(result)
            elif early is None:  # its answer, as job_done would have given it at once
                early = result

        # The connection's credit (none for the stream, which its sender ended). What it and the
        # answer queue is written out by the reader, which touches its connection once its
        # events are handled: this runs in its dispatch, never later.
        ep.h2.acknowledge_connection_data(size)
        try:
            result: outcome.Outcome[bytes] | Exception | None = job(body[5:], done)
        except Exception as err:  # the job's bug is its call's (the served call's)
            if early is None:
                result = err
            else:  # answered through done() first: the answer stands, the bug is logged
                LOGGER.exception("handler of %s failed after its call ended", text, exc_info=err)
        if early is not None:
            result = early  # (what the job returned as well comes after it: dropped)
        if (
            type(result) is outcome.Value
            and result.value.__class__ is bytes  # (else its call's error: Served._answer_job)
            and ep.h2.send_answer(stream_id, PLAIN_BLOCK, grpc_message(result.value), OK_BLOCK)
        ):
            return True
        deadline = self._deadline(timeout, since)
        call = self._served_call(ep, stream_id, headers, False, text, deadline, True)
        call.adopt_job(result)
        return True

    def _deadline(self, timeout: bytes | None, since: float | None = None) -> float | None:
        """The trio time a call with ``timeout`` (its ``grpc-timeout``) ends at; None without one
        (or a malformed one). ``since``: when its headers were read (``time.perf_counter()``,
        trio's system clock), if not just now."""
        if timeout is None:
            return None
        seconds = grpc_timeout(timeout)
        if seconds is None:
            return None
        clock = self._clock
        if clock is None:
            clock = self._clock = trio.lowlevel.current_clock()
        now = clock.current_time()
        if since is not None:
            now -= time.perf_counter() - since
        return now + seconds

    def _served_call(
        self,
        ep: Endpoint,
        stream_id: int,
        headers: Headers,
        end: bool,
        text: str,
        deadline: float | None,
        has_path: bool,
    ) -> Served:
        """The served call of a caller's new stream (its half in ``ep.halves``), started."""
        transport = self.transport
        call = Served(transport, text, self.handler_for, self.max_request)
        state = call.state
        client = state.client = Half(ep, stream_id, call, state)
        call.inbox = Inbox(client, self.max_request)
        state.on_end = call.ended  # its reader looks again; its view of the call let go
        client.peer = call  # told as reply bytes are written: send_message's room to send
        ep.halves[stream_id] = client
        transport.call_started(state, deadline)
        stream = call.stream = Stream(call, text, headers, end, deadline)
        check = self.check_headers
        if check is not None and not self.check_is_async:
            try:
                passed = check(stream)
            except Exception:  # the check's bug: this stream's end, never the connection's
                LOGGER.exception("check_headers failed on a request for %s", text)
                passed = False
                call.reset(f.INTERNAL_ERROR)
            if not passed:
                if not state.answered and not state.finished:
                    call.reset(f.PROTOCOL_ERROR)
                return call
        if not has_path:
            call.reset(f.PROTOCOL_ERROR)  # (the transport's own checks refuse it before, when on)
            return call
        if self.check_is_async:
            transport.nursery.start_soon(call.run, check)  # type: ignore[arg-type]
            return call
        handler = self.handlers.get(text)
        if handler.__class__ is UnaryJob:  # no task: started as the request ends
            call.job = handler.start
            if end:
                call.start_job()
            return call
        transport.nursery.start_soon(call.run, None)
        return call

    async def serve(
        self, path: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        """Serve on a unix socket at ``path`` until cancelled.

        Resource handling: the socket is bound with :func:`krproxy.unixsock.bind_unix_socket` (a
        stale file is replaced, a live one refused with ``SocketInUseError``); ``started()`` is
        reported once it accepts connections. On cancellation every connection is closed (running
        handlers are cancelled) and the socket file is removed if it is still ours.
        """
        sock = bind_unix_socket(path)
        inode = os.stat(path).st_ino
        try:
            await self.serve_socket(sock, task_status=task_status)
        finally:
            sock.close()
            unlink_if_ours(path, inode)

    async def drain(self, grace: float) -> bool:
        """Stop gracefully, the first part (then cancel :meth:`serve`): accept no more
        connections, send every connection the two-step GOAWAY (RFC 9113 §6.8: calls already
        sent are served, later ones are refused unprocessed, which clients send again elsewhere),
        and wait up to ``grace`` seconds for the running calls to end and their answers to be
        written. True if everything ended in time."""
        transport = self.transport
        transport.start_draining()
        with trio.move_on_after(grace):
            await transport.wait_drained(round_trip=min(1.0, grace))
            return True
        return False

    async def serve_socket(
        self, sock: socket.socket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        """Serve on ``sock``, bound and listening, until cancelled; the socket is left to the caller."""
        self._clock = trio.lowlevel.current_clock()
        await self.transport.serve(sock, task_status=task_status)
        raise AssertionError("Transport.serve returned")  # it runs until cancelled
