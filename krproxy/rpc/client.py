"""A gRPC client on krproxy's relay: unary and server-streaming calls to a unix socket.

A :class:`Channel` holds a transport of its own that serves no caller
(:class:`krproxy.relay.transport.Transport` run without a listener) and one
:class:`krproxy.relay.Route` to the socket: the connection is opened on the first call and again
after it was lost. Unary calls are the transport's own (:meth:`Transport.unary`: REFUSED_STREAM and
GOAWAY refusals sent again, deadlines, an answer size limit); a server-streaming call is a stream
on the same connection read message by message (:class:`krproxy.relay.exchange.Reading`), its
stream credit given back as the caller takes the messages, opened again if the server refused it
unprocessed.

The transport's tasks run in a trio system task started on the first call, so a channel works
with or without ``async with``; :meth:`Channel.aclose` (or leaving the ``async with``) closes
the connection. Every failure is a :class:`~krproxy.grpcstatus.GRPCError`: the status the
server answered, UNAVAILABLE naming the socket when it cannot be reached or the connection
broke, DEADLINE_EXCEEDED past the timeout.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Callable, Iterable
from types import TracebackType

import trio

from krproxy.grpcstatus import GRPCError, Status
from krproxy.h2 import frames as f
from krproxy.relay.exchange import Reading, reset_status
from krproxy.relay.grpc import (
    MAX_OWN_ANSWER,
    REFUSED_ATTEMPTS,
    REFUSED_PAUSE,
    AnswerTooLarge,
    BadAnswer,
    StreamReset,
    UpstreamError,
    grpc_message,
    own_call_headers,
    read_status,
)
from krproxy.relay.half import Half
from krproxy.relay.messages import Inbox
from krproxy.relay.route import Route, connect_unix
from krproxy.relay.transport import Transport
from krproxy.unixsock import strip_unix_scheme

__all__ = ["Channel"]


class Channel:
    """Calls to the gRPC server on the unix socket ``path`` (``unix://`` prefix allowed).

    Args:
        max_answer: largest reply message accepted (a larger one fails the call, RESOURCE_EXHAUSTED).
    """

    def __init__(self, path: str, *, max_answer: int = MAX_OWN_ANSWER) -> None:
        self.path = strip_unix_scheme(path)
        self.max_answer = max_answer
        self._transport = Transport()
        self._route = Route(self._transport, self.path, connect_unix(self.path))
        self._scope: trio.CancelScope | None = None
        self._started: trio.Event | None = None
        self._stopped: trio.Event | None = None
        self._closed = False

    async def __aenter__(self) -> Channel:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection; calls still running end UNAVAILABLE. The channel takes no more calls."""
        self._closed = True
        if self._scope is not None and self._stopped is not None:
            self._scope.cancel()
            await self._stopped.wait()

    async def _start(self) -> None:
        if self._closed:
            raise RuntimeError(f"the channel to {self.path} is closed")
        if self._started is not None:
            await self._started.wait()  # (at once, but for the calls racing the first one)
            return
        scope = self._scope = trio.CancelScope()
        started = self._started = trio.Event()
        stopped = self._stopped = trio.Event()

        async def run() -> None:
            try:
                with scope:
                    async with trio.open_nursery() as nursery:
                        await nursery.start(self._transport.run)
                        started.set()
            finally:
                stopped.set()
                started.set()

        trio.lowlevel.spawn_system_task(run, name=f"krproxy.rpc.Channel({self.path})")
        await started.wait()

    def _deadline(self, timeout: float | None) -> float:
        if timeout is None:
            return math.inf
        return trio.current_time() + timeout

    async def unary(
        self,
        method: str,
        request: bytes,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the call's deadline: sent as grpc-timeout
        metadata: Iterable[tuple[bytes, bytes]] = (),
    ) -> bytes:
        """Call ``method`` (its path, ``/pkg.Service/Method``) with ``request``; the reply message.

        Raises :class:`GRPCError`: the server's status, UNAVAILABLE (socket unreachable, connection
        lost), DEADLINE_EXCEEDED (``timeout`` seconds passed; the server is told the deadline too).
        """
        await self._start()
        deadline = self._deadline(timeout)
        try:
            answer = await self._transport.unary(
                self._route, method, request, metadata, deadline, self.max_answer
            )
        except TimeoutError:
            raise GRPCError(
                Status.DEADLINE_EXCEEDED, f"deadline exceeded calling {method} on {self.path}"
            ) from None
        except OSError as err:
            raise self._unreachable(err) from None
        except AnswerTooLarge as err:  # as grpc-go's client: not a reason to try again
            raise GRPCError(Status.RESOURCE_EXHAUSTED, f"{method} on {self.path}: {err}") from None
        except BadAnswer as err:  # the server did answer: as grpc-go, not a reason to try again
            raise GRPCError(Status.INTERNAL, f"{method} on {self.path}: {err}") from None
        except StreamReset as err:
            raise GRPCError(reset_status(err.code), f"{method} on {self.path}: {err}") from None
        except UpstreamError as err:
            raise GRPCError(Status.UNAVAILABLE, f"{method} on {self.path}: {err}") from None
        if answer.status is not Status.OK:
            raise GRPCError(answer.status, answer.message, answer.details)
        return answer.body

    @contextlib.asynccontextmanager
    async def server_stream(
        self,
        method: str,
        request: bytes,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the call's deadline: sent as grpc-timeout
        metadata: Iterable[tuple[bytes, bytes]] = (),
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """A server-streaming call: ``async with ch.server_stream(m, req) as replies: async for
        message in replies: ...``. The iteration raises :class:`GRPCError` for an error status,
        after the messages that came before it. Leaving the block early cancels the call."""
        await self._start()
        deadline = self._deadline(timeout)
        extra = list(metadata)

        def open_stream() -> Reading:
            reading = Reading(self.max_answer)
            try:
                ep = self._route.endpoint()
            except OSError as err:
                raise self._unreachable(err) from None
            half = reading.upstream = Half(ep, 0, reading, reading)
            reading.inbox = Inbox(half, self.max_answer)
            ep.open_stream(half, f.encode_headers(own_call_headers(method, deadline, extra)), False)
            half.send_data(grpc_message(request), True)
            self._transport.flush()
            return reading

        replies = _Replies(open_stream, method, self.path, deadline)
        try:
            yield replies
        finally:
            reading = replies.reading
            if not reading.finished:
                reading.upstream.abort(f.CANCEL)
                reading.settle()
                self._transport.flush()

    def _unreachable(self, err: OSError) -> GRPCError:
        return GRPCError(Status.UNAVAILABLE, f"cannot reach {self.path}: {err.strerror or err}")


class _Replies:
    """The reply messages of a server-streaming call, then its status. A stream the server
    refused unprocessed is opened again (as :meth:`Transport.unary` sends a refused call again)."""

    def __init__(self, open_stream: Callable[[], Reading], method: str, path: str, deadline: float) -> None:
        self._open = open_stream
        self._method = method
        self._path = path
        self._deadline = deadline
        self._attempts = 1
        self.reading = open_stream()

    def __aiter__(self) -> _Replies:
        return self

    async def __anext__(self) -> bytes:
        while True:
            reading = self.reading
            inbox = reading.inbox
            taken = inbox.take()
            if taken is not None:
                compressed, reply = taken
                if compressed:
                    raise GRPCError(
                        Status.INTERNAL, "the server sent a compressed message, which was not asked for"
                    )
                return reply
            if reading.error is not None:
                if reading.refused and self._attempts < REFUSED_ATTEMPTS:
                    self._attempts += 1
                    with trio.move_on_at(self._deadline):
                        await trio.sleep(REFUSED_PAUSE)
                    if trio.current_time() < self._deadline:
                        self.reading = self._open()
                        continue
                error = reading.error
                raise GRPCError(error.status, f"{self._method} on {self._path}: {error.message}")
            if reading.trailers is not None:
                status, message, details = read_status(reading.trailers)
                if status is None:
                    raise GRPCError(Status.UNKNOWN, message or "the answer carried no valid grpc-status")
                if status is not Status.OK:
                    raise GRPCError(status, message, details)
                raise StopAsyncIteration
            with trio.move_on_at(self._deadline):
                await inbox.wait()
            if (
                trio.current_time() >= self._deadline
                and not inbox.messages.ready
                and reading.trailers is None
            ):
                reading.upstream.abort(f.CANCEL)
                reading.settle()
                reading.upstream.ep.transport.flush()
                raise GRPCError(
                    Status.DEADLINE_EXCEEDED, f"deadline exceeded calling {self._method} on {self._path}"
                )
