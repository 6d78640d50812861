"""What a handler of :class:`krproxy.rpc.Server` holds: the call's :class:`Stream`, and the
``unary`` and ``unary_stream`` adapters that make a handler of a plain async function."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import outcome
import trio

from krproxy.grpcstatus import GRPCError, Status
from krproxy.h2 import frames as f
from krproxy.relay.grpc import PLAIN_HEADERS, MessageTooLarge, decompress_message, grpc_message
from krproxy.relay.half import Headers
from krproxy.relay.served import PLAIN_BLOCK, SEND_AHEAD, Done, Served

__all__ = ["Handler", "Stream", "UnaryJob", "unary", "unary_stream"]


class Stream:
    """One call, server side: what a handler reads the request from and answers through.

    Attributes:
        path: the method path (``:path``), e.g. ``/runtime.v1.RuntimeService/Version``.
        headers: the request's header block as it came, pseudo-headers included, in order.
        deadline: ``trio.current_time()`` plus the caller's ``grpc-timeout``; None without one.
        headers_ended: whether the request's HEADERS frame ended the stream (no message follows).
    """

    __slots__ = ("_call", "_state", "deadline", "headers", "headers_ended", "path")

    def __init__(self, call: Served, path: str, headers: Headers, end: bool, deadline: float | None) -> None:
        self._call = call
        self._state = call.state
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
        call, state = self._call, self._state
        inbox = call.inbox
        while True:
            taken = inbox.take()
            if taken is not None:
                compressed, message = taken
                call.took(len(message) + 5)
                if compressed:
                    encoding = next((v for k, v in self.headers if k == b"grpc-encoding"), b"")
                    limit = call.max_request
                    try:
                        return await decompress_message(encoding, message, limit)
                    except MessageTooLarge:
                        raise GRPCError(
                            Status.RESOURCE_EXHAUSTED,
                            f"grpc: received message after decompression larger than max ({limit + 1}+ vs. {limit})",
                        ) from None
                return message
            client = state.client
            if state.finished or client.reset:
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
        self._call.check_open()
        state = self._state
        client = state.client
        if client.headers_sent:
            raise RuntimeError(f"{self.path}: the response headers were sent already")
        client.send_headers(f.encode_headers([*PLAIN_HEADERS, *metadata]) if metadata else PLAIN_BLOCK, False)
        state.transport.flush()

    async def send_message(self, message: bytes) -> None:
        """Send one reply message; waits while the caller is far behind in reading."""
        await trio.lowlevel.checkpoint_if_cancelled()  # a call ended by its caller ends its handler
        call, state = self._call, self._state
        call.check_open()
        client = state.client
        if not client.headers_sent:
            client.send_headers(PLAIN_BLOCK, False)
        framed = grpc_message(message)
        call.unsent += len(framed)
        client.send_data(framed, False)
        state.transport.flush()
        while call.unsent > SEND_AHEAD and not state.finished and not client.reset:
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
        self._state.transport.flush()

    def refuse(self, headers: Headers) -> None:
        """End the call at once with exactly ``headers`` as a trailers-only answer (``:status``
        included), as grpc-go's transport refuses a request it cannot take (HTTP 400/405 and
        ``grpc-status`` INTERNAL, :class:`krproxy.fakes.strict.Rejection`). RST_STREAM NO_ERROR follows
        if the request had not ended, as after any answer (RFC 9113 §8.1)."""
        call, state = self._call, self._state
        call.check_open()
        if state.client.headers_sent:
            raise RuntimeError(f"{self.path}: the response headers were sent already")
        call.ended_here = True
        if state.answered:  # the call ended already (its caller went away)
            return
        state.answered = True
        state.status = Status.INTERNAL
        state.client.send_headers(f.encode_headers(headers), True)
        state.transport.flush()

    def reset(self, error_code: int) -> None:
        """Reset the stream (RST_STREAM ``error_code``, e.g. PROTOCOL_ERROR as grpc-go's framer
        does to a header block it refuses); the handler, if running, is cancelled."""
        self._call.reset(error_code)

    def close_connection(self) -> None:
        """Close the caller's whole connection at once, every call on it ending (fakes that crash)."""
        self._state.client.ep.close("the handler closed the connection")


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


class UnaryJob:
    """A unary method answered without a task of its own: ``start(request, done)`` starts the
    work for a request message and must not block the event loop (it hands the work to a
    thread, or answers at once). It returns the outcome (the reply message or the error) if
    it has it already, else None, and then calls ``done(outcome)`` once, later, on the event
    loop's thread (e.g. through ``TrioToken.run_sync_soon``).

    The server starts it from the connection's own task as the request's last DATA frame is
    handled, so a call costs no trio task, cancel scope or scheduler pass. The rules of
    :mod:`krproxy.rpc.server` hold as for :func:`unary`: the answer's status, trailers and
    errors alike; the caller's deadline ends the call DEADLINE_EXCEEDED and its reset ends it,
    at once in both cases, while the work runs on (it cannot be cancelled) and its answer,
    when it comes, is dropped. A request that is not one plain message (none, compressed, cut
    off) and a server with an ``async def`` check_headers take :func:`unary`'s path, in a task
    (:meth:`__call__`), with the same answers as :func:`unary`.
    """

    __slots__ = ("start",)

    def __init__(self, start: Callable[[bytes, Done], outcome.Outcome[bytes] | None]) -> None:
        self.start = start

    async def __call__(self, stream: Stream) -> None:
        """The same call as a task's handler (see the class docstring for when)."""
        request = await stream.recv_message()
        if request is None:
            raise GRPCError(Status.INTERNAL, "the request carried no message")
        task = trio.lowlevel.current_task()
        waiting = False  # the task waits for done(): only then, and once, may done() wake it

        def done(result: outcome.Outcome[bytes]) -> None:
            nonlocal waiting
            if waiting:
                waiting = False
                trio.lowlevel.reschedule(task, result)

        def abort(_: Any) -> trio.lowlevel.Abort:
            # The call ended (its deadline, its reset, the server's end): the task ends now, as
            # a job's call without a task does; the work runs on and its answer is dropped.
            nonlocal waiting
            waiting = False
            return trio.lowlevel.Abort.SUCCEEDED

        result = self.start(request, done)
        if result is None:
            waiting = True
            reply = await trio.lowlevel.wait_task_rescheduled(abort)  # unwraps the outcome
        else:
            reply = result.unwrap()
        stream._call.reply(reply)


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
