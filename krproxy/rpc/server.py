"""A gRPC server on krproxy's relay: handlers by method path, bytes in and out.

Connections, streams, flow control, settings and GOAWAY are the relay's
(:mod:`krproxy.relay.connection`); this module adds what makes a server of it. The relay here
routes nowhere: every stream it accepts becomes a :class:`_ServerCall` (a
:class:`krproxy.relay.rpc.Call` without an upstream), whose handler runs in a task of its own
and talks to the caller through a :class:`Stream`: request messages as they arrive, reply
messages as the handler sends them, trailers at the end. Deadlines (``grpc-timeout``) are the
relay's deadline heap; the caller going away (RST_STREAM, a closed connection) cancels the
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

import contextlib
import inspect
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import NoReturn, cast

import trio

from krproxy.grpcstatus import GRPCError, Status
from krproxy.h2 import frames as f
from krproxy.relay import connection
from krproxy.relay._grpc import (
    _PLAIN_HEADERS,
    CloseConnection,
    MessageTooLarge,
    _forget_traceback,
    _status_fields,
    decompress_message,
    grpc_message,
    grpc_timeout,
)
from krproxy.relay._local import HandledCall
from krproxy.relay.connection import Endpoint, Headers
from krproxy.relay.half import Half
from krproxy.relay.relay import Relay
from krproxy.rpc._messages import Inbox
from krproxy.unixsock import bind_unix_socket, unlink_if_ours

__all__ = ["Handler", "Server", "Stream", "unary", "unary_stream"]

LOGGER = logging.getLogger("krproxy.rpc")

#: Largest request message by default: containerd's limit (grpc-go's own default is 4 MiB).
MAX_REQUEST = 16 * 1024 * 1024
#: Reply bytes a handler may have queued beyond the caller's windows before send_message waits.
_SEND_AHEAD = 256 * 1024

_PLAIN_BLOCK = f.encode_headers(_PLAIN_HEADERS)
_OK_BLOCK = f.encode_headers([(b"grpc-status", b"0")])
_OK_ONLY_BLOCK = f.encode_headers([*_PLAIN_HEADERS, (b"grpc-status", b"0")])


class Stream:
    """One call, server side: what a handler reads the request from and answers through.

    Attributes:
        path: the method path (``:path``), e.g. ``/runtime.v1.RuntimeService/Version``.
        headers: the request's header block as it came, pseudo-headers included, in order.
        deadline: ``trio.current_time()`` plus the caller's ``grpc-timeout``; None without one.
        headers_ended: whether the request's HEADERS frame ended the stream (no message follows).
    """

    __slots__ = ("_call", "deadline", "headers", "headers_ended", "path")

    def __init__(
        self, call: _ServerCall, path: str, headers: Headers, end: bool, deadline: float | None
    ) -> None:
        self._call = call
        self.path = path
        self.headers = headers
        self.headers_ended = end
        self.deadline = deadline

    @property
    def metadata(self) -> Headers:
        """The request's header fields without the pseudo-headers."""
        return [field for field in self.headers if not field[0].startswith(b":")]

    async def recv_message(self) -> bytes | None:
        """The next request message; None once the request has ended (or the call is over).

        A message with the compressed flag is decompressed (gzip, deflate); see
        :func:`krproxy.relay.rpc.decompress_message` for the errors, raised as :class:`GRPCError`
        (RESOURCE_EXHAUSTED when it decompresses to more than ``max_request``).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        call = self._call
        inbox = call.inbox
        while True:
            taken = inbox.take()
            if taken is not None:
                compressed, message = taken
                call.took(len(message) + 5)
                if compressed:
                    encoding = next((v for k, v in self.headers if k == b"grpc-encoding"), b"")
                    limit = call.server.max_request
                    try:
                        return await decompress_message(encoding, message, limit)
                    except MessageTooLarge:
                        raise GRPCError(
                            Status.RESOURCE_EXHAUSTED,
                            f"grpc: received message after decompression larger than max ({limit + 1}+ vs. {limit})",
                        ) from None
                return message
            client = call.client
            if call.finished or client.reset:
                return None
            if client.recv_ended:
                if inbox.messages.incomplete:
                    raise GRPCError(Status.INTERNAL, "the request ended in the middle of a message")
                return None
            await inbox.wait()

    async def send_initial_metadata(self, metadata: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Send the response headers (``:status`` 200, gRPC's content-type, then ``metadata``).
        Optional: :meth:`send_message` sends the plain ones first if none were sent."""
        await trio.lowlevel.checkpoint_if_cancelled()
        call = self._call
        call.check_open()
        client = call.client
        if client.headers_sent:
            raise RuntimeError(f"{self.path}: the response headers were sent already")
        client.send_headers(
            f.encode_headers([*_PLAIN_HEADERS, *metadata]) if metadata else _PLAIN_BLOCK, False
        )
        call.relay.flush()

    async def send_message(self, message: bytes) -> None:
        """Send one reply message; waits while the caller is far behind in reading."""
        await trio.lowlevel.checkpoint_if_cancelled()  # a call ended by its caller ends its handler
        call = self._call
        call.check_open()
        client = call.client
        if not client.headers_sent:
            client.send_headers(_PLAIN_BLOCK, False)
        framed = grpc_message(message)
        call.unsent += len(framed)
        client.send_data(framed, False)
        call.relay.flush()
        while call.unsent > _SEND_AHEAD and not call.finished and not client.reset:
            await call.inbox.wait()  # woken by grant() below as the caller's windows open

    async def send_trailing_metadata(
        self,
        status: Status = Status.OK,
        message: str | None = None,
        details: bytes | None = None,
        metadata: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        """End the call with ``status``; after any reply messages still queued. Without response
        headers sent before, a trailers-only answer (one header block), as grpc-go sends errors."""
        await trio.lowlevel.checkpoint_if_cancelled()
        call = self._call
        call.check_open()
        call.end(status, message, details, metadata)
        call.relay.flush()

    def refuse(self, headers: Headers) -> None:
        """End the call at once with exactly ``headers`` as a trailers-only answer (``:status``
        included), as grpc-go's transport refuses a request it cannot take (HTTP 400/405 and
        ``grpc-status`` INTERNAL, :class:`krproxy.fakes.strict.Rejection`). RST_STREAM NO_ERROR follows
        if the request had not ended, as after any answer (RFC 9113 §8.1)."""
        call = self._call
        call.check_open()
        if call.client.headers_sent:
            raise RuntimeError(f"{self.path}: the response headers were sent already")
        call.ended_here = True
        if call.answered:  # the call ended already (its caller went away)
            return
        call.answered = True
        call.status = Status.INTERNAL
        call.client.send_headers(f.encode_headers(headers), True)
        call.relay.flush()

    def reset(self, error_code: int) -> None:
        """Reset the stream (RST_STREAM ``error_code``, e.g. PROTOCOL_ERROR as grpc-go's framer
        does to a header block it refuses); the handler, if running, is cancelled."""
        self._call.reset(error_code)

    def close_connection(self) -> None:
        """Close the caller's whole connection at once, every call on it ending (fakes that crash)."""
        self._call.client.ep.close("the handler closed the connection")


Handler = Callable[[Stream], Awaitable[None]]


def unary(fn: Callable[[bytes], Awaitable[bytes]]) -> Handler:
    """A handler for a unary method: ``fn`` takes the request message and returns the reply's."""

    async def handle(stream: Stream) -> None:
        request = await stream.recv_message()
        if request is None:
            raise GRPCError(Status.INTERNAL, "the request carried no message")
        reply = await fn(request)
        stream._call.reply(reply)  # headers, message and OK trailers written at once

    return handle


def unary_stream(fn: Callable[[bytes], AsyncIterator[bytes]]) -> Handler:
    """A handler for a server-streaming method: ``fn`` takes the request message and yields
    the reply messages; the call ends OK when it is exhausted."""

    async def handle(stream: Stream) -> None:
        request = await stream.recv_message()
        if request is None:
            raise GRPCError(Status.INTERNAL, "the request carried no message")
        replies = fn(request)
        async with contextlib.AsyncExitStack() as stack:
            if hasattr(replies, "aclose"):
                stack.push_async_callback(replies.aclose)
            async for reply in replies:
                await stream.send_message(reply)

    return handle


class _ServerCall(HandledCall):
    """A call the server answers: the caller's half and no upstream (the relay's :class:`Call`
    gives the ending rules: answering early resets the rest of the request, a reset ends it)."""

    __slots__ = ("ended_here", "inbox", "server", "stream", "unsent")

    def __init__(self, server: Server, path: str) -> None:
        super().__init__(server.relay, path, None)
        self.request_tap = self.reply_tap = None
        self.server = server
        self.inbox: Inbox = None  # type: ignore[assignment]  # set with `client`, right after
        self.unsent = 0  # reply bytes queued beyond the caller's windows
        self.ended_here = False  # the handler (or check_headers) ended the call: no more sends
        self.stream: Stream = None  # type: ignore[assignment]  # set right after construction

    @property
    def describe(self) -> str:
        return f"the handler of {self.path}"

    # -- from the connection -------------------------------------------------------------

    def on_request_data(self, data: bytes, end: bool) -> None:
        if data:
            client = self.client
            ep = client.ep
            size = len(data)
            if ep.collected + size > connection.MAX_HELD:
                client.grant(size)
                self.fail(
                    Status.RESOURCE_EXHAUSTED,
                    f"the server already holds {ep.collected} bytes of requests from this connection",
                )
                return
            try:
                self.inbox.arrived(data)
            except MessageTooLarge as err:
                client.grant(size)
                self.fail(
                    Status.RESOURCE_EXHAUSTED,
                    f"grpc: received message larger than max ({err.size} vs. {err.limit})",
                )
                return
            except GRPCError as err:  # not gRPC's framing
                client.grant(size)
                self.fail(err.status, err.message or "")
                return
            ep.grant(size)  # the connection's credit at once; the stream's as messages are taken
            ep.collected += size
            self._collected += size
        if end:
            self.inbox.wake()
            self.settle()

    def on_request_trailers(self, headers: Headers) -> None:
        self.inbox.wake()

    def grant(self, size: int) -> None:
        """Reply bytes queued on the caller's half were written (or dropped): room to send more."""
        self.unsent -= size
        if self.unsent <= _SEND_AHEAD:
            self.inbox.wake()

    def took(self, size: int) -> None:
        """The handler took a request message of ``size`` bytes (prefix included)."""
        size = min(size, self._collected)
        self.client.ep.collected -= size
        self._collected -= size

    def finish(self) -> None:
        self.inbox.wake()
        super().finish()

    # -- from the handler ----------------------------------------------------------------

    def check_open(self) -> None:
        if self.ended_here:
            raise RuntimeError(f"{self.path}: the handler ended this call already")

    def reply(self, message: bytes) -> None:
        """A unary answer: headers, ``message`` and OK trailers, in one write."""
        client = self.client
        self.ended_here = True
        if self.answered or client.send_ended or client.reset:
            return
        self.answered = True
        if not client.headers_sent:
            client.send_headers(_PLAIN_BLOCK, False)
        client.send_data(grpc_message(message), False)
        client.send_trailers(_OK_BLOCK)

    def end(
        self,
        status: Status,
        message: str | None,
        details: bytes | None,
        metadata: Sequence[tuple[bytes, bytes]],
    ) -> None:
        """Trailers with ``status`` after what is queued; trailers-only if no headers went out."""
        client = self.client
        self.ended_here = True
        if self.answered or client.send_ended or client.reset:
            return
        self.answered = True
        self.status, self.message = status, message
        if status is Status.OK and not message and not details and not metadata:
            if client.headers_sent:
                client.send_trailers(_OK_BLOCK)
            else:
                client.send_headers(_OK_ONLY_BLOCK, True)
            return
        fields = [*_status_fields(status, message, details), *metadata]
        if client.headers_sent:
            client.send_trailers(f.encode_headers(fields))
        else:
            client.send_headers(f.encode_headers([*_PLAIN_HEADERS, *fields]), True)

    def reset(self, code: int) -> None:
        self.ended_here = True
        if self._scope is not None:
            self._scope.cancel()
        client = self.client
        if self.finished or client.reset:
            return
        if not self.answered:
            self.answered = True
            self.status, self.message = (
                Status.CANCELLED,
                f"reset by the server ({f.ERROR_NAMES.get(code, code)})",
            )
        if client.done:  # answered and the request over: nothing to reset
            self.settle()
            return
        client.abort(code)
        self.settle()
        self.relay.flush()

    # -- the handler's task --------------------------------------------------------------

    async def run(self, check: Callable[[Stream], Awaitable[bool]] | None) -> None:
        if self.finished or self.answered:  # reset or failed before this task ran
            return
        stream = self.stream
        try:
            with trio.CancelScope() as self._scope:
                if check is not None and not await check(stream):
                    if not self.answered and not self.finished:
                        self.reset(f.PROTOCOL_ERROR)
                    return
                handler = self.server.handler_for(self.path)
                if handler is None:
                    raise GRPCError(Status.UNIMPLEMENTED, f"unknown method {self.path}")
                await handler(stream)
                self.end(Status.OK, None, None, ())
        except CloseConnection:
            self.client.ep.close("the handler closed the connection")
        except Exception as err:  # a handler's error is its call's, never the server's
            self._ended_by(err)
        finally:
            self.relay.flush()

    def _ended_by(self, err: Exception) -> None:
        grpc_error = _grpc_error(err)
        if self.answered or self.finished:
            if grpc_error is None:
                LOGGER.exception("handler of %s failed after its call ended", self.path)
        elif grpc_error is not None:
            details = grpc_error.details if isinstance(grpc_error.details, bytes) else None
            self.end(grpc_error.status, grpc_error.message, details, ())
        else:
            LOGGER.exception("handler of %s failed", self.path)
            self.end(Status.UNKNOWN, f"{type(err).__name__}: {err}", None, ())
        _forget_traceback(err)


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


class _ServerRelay(Relay):
    """The relay of a :class:`Server`: every stream it accepts is a call of the server's."""

    def __init__(self, server: Server, *, enforce_deadlines: bool) -> None:
        super().__init__(enforce_deadlines=enforce_deadlines)
        self.server = server

    def open_call(self, ep: Endpoint, stream_id: int, headers: Headers, end: bool) -> None:
        path = None
        timeout = None
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"grpc-timeout":
                timeout = grpc_timeout(value)
        server = self.server
        text = path.decode("utf-8", "replace") if path is not None else ""
        call = _ServerCall(server, text)
        client = call.client = Half(ep, stream_id, call)
        call.inbox = Inbox(client, server.max_request)
        client.peer = call  # told as reply bytes are written: send_message's room to send
        ep.halves[stream_id] = client
        self.in_flight += 1
        deadline = None
        if timeout is not None:
            deadline = trio.current_time() + timeout
            if self.enforce_deadlines:
                self._add_deadline(call, deadline)
        stream = call.stream = Stream(call, text, headers, end, deadline)
        check = server.check_headers
        if check is not None and not server.check_is_async:
            try:
                passed = check(stream)
            except Exception:  # the check's bug: this stream's end, never the connection's
                LOGGER.exception("check_headers failed on a request for %s", text)
                passed = False
                call.reset(f.INTERNAL_ERROR)
            if not passed:
                if not call.answered and not call.finished:
                    call.reset(f.PROTOCOL_ERROR)
                return
        if path is None:
            call.reset(f.PROTOCOL_ERROR)  # (the relay's own checks refuse it before, when on)
            return
        self.nursery.start_soon(call.run, check if server.check_is_async else None)  # type: ignore[arg-type]


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
        self.relay = _ServerRelay(self, enforce_deadlines=enforce_deadlines)
        self.relay.max_request = max_request
        self.relay.caller_max_streams = max_streams
        self.relay.check_request_headers = check_headers is None

    def handler_for(self, path: str) -> Handler | None:
        handler = self.handlers.get(path)
        if handler is None and self.fallback is not None:
            handler = self.fallback(path)
        return handler

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
        relay = self.relay
        relay.start_draining()
        with trio.move_on_after(grace):
            await relay.wait_drained(round_trip=min(1.0, grace))
            return True
        return False

    async def serve_socket(
        self, sock: socket.socket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        """Serve on ``sock``, bound and listening, until cancelled; the socket is left to the caller."""
        await self.relay.serve(sock, task_status=task_status)
        raise AssertionError("Relay.serve returned")  # it runs until cancelled
