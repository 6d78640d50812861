"""Forwarding CRI calls to the backend runtime, as raw bytes.

Every RuntimeService and ImageService method is routed here, and so is every method path
krproxy has never heard of (a newer kubelet may call RPCs our protos lack). Requests and
replies are never decoded: they travel as ``bytes`` (see :class:`krproxy._grpc.BytesCodec`),
so unknown fields survive by construction and large lists cost no parsing. The few methods
that carry hook points are handed to an :data:`Interceptor`, which may decode, change and
forward the request through the same path.

What passes through unchanged, both ways: messages (byte for byte), request metadata,
reply initial and trailing metadata, status code, message and details. The caller's
deadline is passed on, and a caller that goes away cancels the backend call.

Error handling: a backend that cannot be reached, or drops the connection mid-call, makes
the call fail with UNAVAILABLE and a message naming the backend socket; the channel
reconnects on the next call, so the proxy recovers by itself when the runtime returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import grpclib.client
import grpclib.server
import h2.exceptions
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.metadata import Deadline
from multidict import MultiDict

from krproxy import calls, log
from krproxy._grpc import BytesCodec, Raw, RawStatusDetailsCodec
from krproxy.proto.runtime import v1 as cri

LOGGER = logging.getLogger("krproxy.forward")

Metadata = MultiDict[str | bytes]
ServerStream = grpclib.server.Stream[bytes, bytes]


@attrs.frozen
class Reply:
    """A successful unary answer from the backend, ready to relay."""

    message: bytes
    initial_metadata: Metadata = attrs.field(factory=MultiDict)
    trailing_metadata: Metadata = attrs.field(factory=MultiDict)


class BackendError(GRPCError):
    """The backend answered with an error status; relayed to the caller unchanged."""

    def __init__(
        self,
        status: Status,
        message: str | None = None,
        details: Any = None,
        trailing_metadata: Metadata | None = None,
    ) -> None:
        super().__init__(status, message, details)
        self.trailing_metadata: Metadata = trailing_metadata if trailing_metadata is not None else MultiDict()


#: Sends a (possibly changed) request to the backend and returns its reply.
Forward = Callable[[bytes], Awaitable[Reply]]

#: Handles one intercepted unary call: ``interceptor(path, request, forward) -> Reply``.
#: It may raise :class:`GRPCError` to reject the call without forwarding it.
Interceptor = Callable[[str, bytes, Forward], Awaitable[Reply]]


def known_routes() -> dict[str, Cardinality]:
    """Every RuntimeService and ImageService method path of our protos, with its cardinality."""
    mapping = {**cri.RuntimeServiceBase().__mapping__(), **cri.ImageServiceBase().__mapping__()}
    return {path: handler.cardinality for path, handler in mapping.items()}


class Backend:
    """One runtime socket and the grpclib channel to it.

    The channel connects on first use and reconnects after the connection was lost, so a
    restarted runtime is picked up by the next call. Create inside the asyncio loop.

    :attr:`reachable` is what the last call learned: True once the runtime answered (any
    status), False after it could not be reached, None before the first call;
    :attr:`last_error` says why it was last unreachable.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.reachable: bool | None = None
        self.last_error = ""
        self.channel = grpclib.client.Channel(
            path=path, codec=BytesCodec(), status_details_codec=RawStatusDetailsCodec()
        )

    def close(self) -> None:
        self.channel.close()

    @contextlib.asynccontextmanager
    async def call(
        self,
        path: str,
        cardinality: Cardinality,
        *,
        metadata: Metadata | None,
        deadline: Deadline | None,
    ) -> AsyncIterator[grpclib.client.Stream[bytes, bytes]]:
        """Open a call to the backend, translating transport failures into gRPC statuses.

        Raises:
            BackendError: the backend answered with a non-OK status (with its trailers).
            GRPCError: UNAVAILABLE if the backend cannot be reached or the connection
                broke; DEADLINE_EXCEEDED if the caller's deadline passed first.
        """
        upstream: grpclib.client.Stream[bytes, bytes] | None = None
        try:
            async with self.channel.request(
                path, cardinality, Raw, Raw, metadata=metadata, deadline=deadline
            ) as upstream:
                yield upstream
            self.reachable = True
        except BackendError:
            self.reachable = True
            raise
        except GRPCError as err:
            self.reachable = True
            trailers = upstream.trailing_metadata if upstream is not None else None
            raise BackendError(err.status, err.message, err.details, trailers) from None
        except TimeoutError:
            # Before OSError, of which TimeoutError is a subclass: the caller's deadline passed,
            # which says nothing about the runtime's health.
            raise GRPCError(Status.DEADLINE_EXCEEDED, f"deadline exceeded waiting for {self.path}") from None
        except (OSError, StreamTerminatedError, h2.exceptions.ProtocolError) as err:
            self.reachable, self.last_error = False, str(err) or type(err).__name__
            log.event(
                LOGGER,
                "backend_unavailable",
                level=logging.WARNING,
                backend=self.path,
                method=path,
                error=err,
            )
            raise GRPCError(
                Status.UNAVAILABLE, f"backend runtime {self.path} is unavailable: {err}"
            ) from None


class Forwarder:
    """grpclib handler that forwards every CRI method (and unknown ones) to the backends.

    Args:
        runtime: the backend for RuntimeService and for unknown method paths.
        image: the backend for ImageService (often the same socket as ``runtime``).
        interceptors: unary method paths whose calls go through an :data:`Interceptor`.
        observers: told about every finished call (:class:`krproxy.calls.CallRecord`).
    """

    def __init__(
        self,
        runtime: Backend,
        image: Backend,
        interceptors: Mapping[str, Interceptor] | None = None,
        observers: Sequence[calls.Observer] = (),
    ) -> None:
        self.runtime = runtime
        self.image = image
        self.interceptors: dict[str, Interceptor] = dict(interceptors or {})
        self.observers: list[calls.Observer] = list(observers)
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    # -- routing ---------------------------------------------------------------------

    def __mapping__(self) -> dict[str, Handler]:
        handlers = {
            Cardinality.UNARY_UNARY: self._unary,
            Cardinality.UNARY_STREAM: self._server_stream,
        }
        return {
            path: Handler(functools.partial(handlers[card], path), card, Raw, Raw)
            for path, card in known_routes().items()
        }

    def fallback(self, path: str) -> Handler:
        """Handler for a path our protos lack: relayed as a bidirectional stream."""
        return Handler(functools.partial(self._any_stream, path), Cardinality.STREAM_STREAM, Raw, Raw)

    def backend_for(self, path: str) -> Backend:
        # Matches runtime.v1 and older API versions (runtime.v1alpha2.ImageService) alike.
        return self.image if ".ImageService/" in path else self.runtime

    # -- bookkeeping for graceful shutdown ---------------------------------------------

    @contextlib.contextmanager
    def _track(self, path: str) -> Iterator[calls.CallContext]:
        """Count the call as in flight, make its :class:`CallContext` current, report it at the end."""
        if self.draining:
            raise GRPCError(Status.UNAVAILABLE, "krproxy is shutting down")
        ctx = calls.CallContext(path)
        calls.CURRENT.set(ctx)  # this task's own context: grpclib runs one task per call
        self.in_flight += 1  # nothing may fail between here and the try: the finally undoes it
        self._idle.clear()
        try:
            yield ctx
        except GRPCError as err:
            ctx.fail(err.status, err.message)
            raise
        except Exception as err:  # a bug of ours: grpclib answers UNKNOWN and logs it
            ctx.fail(Status.UNKNOWN, f"{type(err).__name__}: {err}")
            raise
        except BaseException:
            ctx.fail(Status.CANCELLED, "the call ended before an answer was sent")
            raise
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
            if self.observers:
                self._report(ctx.finish())

    def _report(self, record: calls.CallRecord) -> None:
        for observer in self.observers:
            try:
                observer(record)
            except Exception:  # an observer must never break a call
                LOGGER.exception("observer %r failed", observer)

    async def wait_idle(self) -> None:
        """Return once no call is in flight (checked after :attr:`draining` is set)."""
        await self._idle.wait()

    # -- handlers ----------------------------------------------------------------------

    async def _unary(self, path: str, stream: ServerStream) -> None:
        with self._track(path) as ctx:
            request = await stream.recv_message()
            assert request is not None  # grpclib guarantees one message for unary requests
            ctx.request = request
            forward = functools.partial(self._forward_unary, path, stream)
            interceptor = self.interceptors.get(path)
            try:
                reply = await (interceptor(path, request, forward) if interceptor else forward(request))
            except BackendError as err:
                await _relay_error(stream, err, ctx)
                return
            await stream.send_initial_metadata(metadata=reply.initial_metadata)
            await stream.send_message(reply.message)
            await stream.send_trailing_metadata(metadata=reply.trailing_metadata)
            ctx.reply, ctx.replies = reply.message, 1

    async def _forward_unary(self, path: str, stream: ServerStream, request: bytes) -> Reply:
        backend = self.backend_for(path)
        ctx = calls.CURRENT.get()
        if ctx is None:
            return await self._call_backend(backend, path, stream, request)
        if request is not ctx.request:
            ctx.forwarded = request  # an interceptor changed it
        started = time.perf_counter()
        try:
            return await self._call_backend(backend, path, stream, request)
        finally:
            ctx.backend_seconds += time.perf_counter() - started

    async def _call_backend(self, backend: Backend, path: str, stream: ServerStream, request: bytes) -> Reply:
        async with backend.call(
            path, Cardinality.UNARY_UNARY, metadata=stream.metadata, deadline=stream.deadline
        ) as upstream:
            await upstream.send_message(request, end=True)
            message = await upstream.recv_message()
            await upstream.recv_trailing_metadata()
            if message is None:
                raise GRPCError(Status.INTERNAL, f"backend {backend.path} answered {path} with no message")
            return Reply(
                message, upstream.initial_metadata or MultiDict(), upstream.trailing_metadata or MultiDict()
            )

    async def _server_stream(self, path: str, stream: ServerStream) -> None:
        with self._track(path) as ctx:
            request = await stream.recv_message()
            assert request is not None  # grpclib guarantees one message for unary requests
            ctx.request = request
            backend = self.backend_for(path)
            try:
                async with backend.call(
                    path, Cardinality.UNARY_STREAM, metadata=stream.metadata, deadline=stream.deadline
                ) as upstream:
                    await upstream.send_message(request, end=True)
                    await _relay_replies(upstream, stream, ctx)
            except BackendError as err:
                await _relay_error(stream, err, ctx)

    async def _any_stream(self, path: str, stream: ServerStream) -> None:
        with self._track(path) as ctx:
            backend = self.backend_for(path)
            try:
                async with backend.call(
                    path, Cardinality.STREAM_STREAM, metadata=stream.metadata, deadline=stream.deadline
                ) as upstream:
                    await upstream.send_request()
                    # Requests are pumped by a task of their own while replies are relayed
                    # here, so the backend's status surfaces as a plain GRPCError (not an
                    # exception group). The pump ends with the call either way.
                    pump = asyncio.ensure_future(_relay_requests(stream, upstream))
                    pump.add_done_callback(_consume_outcome)
                    try:
                        await _relay_replies(upstream, stream, ctx)
                    finally:
                        pump.cancel()
            except BackendError as err:
                await _relay_error(stream, err, ctx)


def _consume_outcome(task: asyncio.Future[None]) -> None:
    """Mark a helper task's outcome as seen; a caller that stopped sending is no error."""
    if not task.cancelled():
        task.exception()


async def _relay_requests(stream: ServerStream, upstream: grpclib.client.Stream[bytes, bytes]) -> None:
    async for message in stream:
        await upstream.send_message(message)
    await upstream.end()


async def _relay_replies(
    upstream: grpclib.client.Stream[bytes, bytes], stream: ServerStream, ctx: calls.CallContext
) -> None:
    await upstream.recv_initial_metadata()
    await stream.send_initial_metadata(metadata=upstream.initial_metadata)
    async for message in upstream:
        await stream.send_message(message)
        ctx.replies += 1
    await upstream.recv_trailing_metadata()
    await stream.send_trailing_metadata(metadata=upstream.trailing_metadata)


async def _relay_error(stream: ServerStream, err: BackendError, ctx: calls.CallContext) -> None:
    ctx.fail(err.status, err.message)
    await stream.send_trailing_metadata(
        status=err.status,
        status_message=err.message,
        status_details=err.details,
        metadata=err.trailing_metadata,
    )
