"""The fake containerd on the wire: grpclib services around :class:`~fakes.containerd.state.RuntimeState`.

This is the only module of the fake that touches grpclib or asyncio. Each CRI method path gets a
handler that receives the request as raw bytes (so the exact bytes a proxy forwarded can be
recorded), decodes it, applies any injected fault, calls the state, and encodes the answer (or
sends it as the state encoded it, for :data:`~fakes.containerd.state.RuntimeState.ENCODED_CALLS`).

Which methods work is decided by :data:`~fakes.containerd.state.RuntimeState.CRI_CALLS` plus
``GetContainerEvents`` (served here, since it needs a live stream); every other method of the
generated service bases answers UNIMPLEMENTED, as do unknown method paths (via
:func:`krproxy._grpc.serve`'s fallback).

The fake is as strict as containerd's grpc-go (:mod:`fakes.strict`): a request with a malformed
``grpc-timeout`` (more than 8 digits) or without ``:method`` is refused as the chosen grpc-go
version does (containerd 1.6's RST_STREAM PROTOCOL_ERROR by default), a message over 16 MiB either
way is RESOURCE_EXHAUSTED, and no SETTINGS_MAX_CONCURRENT_STREAMS is advertised unless asked for.
The header block of every request is logged (:meth:`FakeContainerd.headers`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import attrs
import betterproto2
import grpclib.const
import grpclib.server
import trio
from grpclib.exceptions import GRPCError

from fakes import strict
from fakes.containerd.grpc_go import serve_strictly
from fakes.containerd.state import CriError, RuntimeState
from krproxy._grpc import BytesCodec, Raw, serve
from krproxy.proto.runtime import v1 as cri
from krproxy.proto.runtime.v1 import services as cri_services

LOGGER = logging.getLogger("fakes.containerd")

Metadata = tuple[tuple[str, str | bytes], ...]


@attrs.frozen
class Fault:
    """Misbehaviour to inject into one CRI method.

    Attributes:
        delay: seconds to wait before answering (asyncio time, so trio's MockClock drives it).
        status: answer with this gRPC status instead of calling the runtime.
        message: the status message sent with ``status``.
        trailing_metadata: extra trailing metadata sent with ``status``.
        drop: abort the client's connection mid-call; the client sees UNAVAILABLE.
        after_call: apply ``status``/``drop`` after the runtime did the work (the reply is lost),
            instead of before (the runtime never saw the call). ``delay`` always comes first.
        times: how many calls the fault affects; ``None`` means every call until cleared.
    """

    delay: float = 0.0
    status: grpclib.const.Status | None = None
    message: str = ""
    trailing_metadata: Metadata = ()
    drop: bool = False
    after_call: bool = False
    times: int | None = 1


@attrs.frozen
class RecordedRequest:
    """One request the fake received: decoded, as raw bytes, and the call's metadata."""

    method: str
    message: betterproto2.Message = attrs.field(eq=False)
    raw: bytes
    metadata: Metadata


class _RuntimeService(cri_services.RuntimeServiceBase):
    """The runtime service; every method not served by the state stays UNIMPLEMENTED."""

    def __init__(self, fake: FakeContainerd) -> None:
        self._fake = fake

    def get_container_events(
        self, message: cri.GetEventsRequest
    ) -> AsyncIterator[cri.ContainerEventResponse]:
        # A plain function: the subscription exists as soon as this returns, before the first
        # event is awaited, so an event produced right after the call starts is not missed.
        return self._fake._subscribe()


class _ImageService(cri_services.ImageServiceBase):
    """The image service; every method not served by the state stays UNIMPLEMENTED."""


@attrs.define(eq=False)
class FakeContainerd:
    """A stateful fake containerd CRI endpoint with a request log and fault injection.

    Attributes:
        state: the pure runtime state; tests may inspect it or drive it directly (then call
            :meth:`flush_events` so subscribers see the resulting events).
        history: how many requests to remember per method.
        grpc_go: how a request grpc-go refuses is answered (containerd 1.6's way by default).
        max_concurrent_streams: the SETTINGS_MAX_CONCURRENT_STREAMS to advertise; None (the
            default) advertises none, as containerd.
        enforce_deadlines: False: a caller's ``grpc-timeout`` is checked and logged but not
            enforced (grpclib would enforce it in real time, which a test's stopped trio clock
            does not stop).
    """

    state: RuntimeState = attrs.Factory(RuntimeState)
    history: int = 100
    grpc_go: strict.GrpcGo = strict.GrpcGo.V1_6
    max_concurrent_streams: int | None = None
    enforce_deadlines: bool = True
    #: Every request refused for its headers (:func:`fakes.strict.check_request`), with why.
    rejected: list[tuple[strict.Headers, strict.Rejection]] = attrs.field(init=False, factory=list)
    _headers: dict[str, collections.deque[strict.Headers]] = attrs.field(init=False, factory=dict)
    _log: dict[str, collections.deque[RecordedRequest]] = attrs.field(init=False, factory=dict)
    _faults: dict[str, tuple[Fault, int | None]] = attrs.field(init=False, factory=dict)
    _subscribers: set[asyncio.Queue[cri.ContainerEventResponse]] = attrs.field(init=False, factory=set)

    # -- test-facing API ----------------------------------------------------------------------

    def requests(self, method: str) -> list[RecordedRequest]:
        """The last ``history`` requests of ``method`` (short name, e.g. ``"CreateContainer"``)."""
        return list(self._log.get(method, ()))

    def headers(self, method: str) -> list[strict.Headers]:
        """The header blocks of the last ``history`` requests of ``method`` (short name), pseudo-headers
        and ``grpc-timeout`` included, as received; also of requests that failed later."""
        return list(self._headers.get(method, ()))

    def clear_requests(self) -> None:
        """Forget every recorded request and header block."""
        self._log.clear()
        self._headers.clear()
        self.rejected.clear()

    def inject(self, method: str, fault: Fault) -> None:
        """Make the next ``fault.times`` calls of ``method`` (short name) misbehave as described."""
        self._faults[method] = (fault, fault.times)

    def clear_faults(self) -> None:
        """Remove every injected fault."""
        self._faults.clear()

    def seed(self, pods: int, containers_per_pod: int = 1) -> list[str]:
        """Add many READY pods with RUNNING containers at once; see :meth:`RuntimeState.seed`."""
        return self.state.seed(pods, containers_per_pod)

    def exit_container(self, container_id: str, exit_code: int, reason: str = "") -> None:
        """Simulate a container's process ending by itself, and tell the event subscribers."""
        self.state.exit_container(container_id, exit_code, reason)
        self.flush_events()

    @property
    def event_subscribers(self) -> int:
        """How many GetContainerEvents streams are open."""
        return len(self._subscribers)

    def flush_events(self) -> None:
        """Hand the state's pending lifecycle events to every GetContainerEvents stream."""
        for event in self.state.take_events():
            for queue in self._subscribers:
                queue.put_nowait(event)

    def handlers(self) -> list[Any]:
        """The grpclib handler objects to serve (pass them to :func:`krproxy._grpc.serve` with
        :class:`krproxy._grpc.BytesCodec` and ``configure=``:meth:`configure`)."""
        return [_Routes(self, [_RuntimeService(self), _ImageService()])]

    def configure(self, server: grpclib.server.Server) -> None:
        """Make ``server`` (not started yet) as strict as containerd's grpc-go, logging headers here."""
        serve_strictly(
            server,
            self.grpc_go,
            max_concurrent_streams=self.max_concurrent_streams,
            deadlines=self.enforce_deadlines,
            accepted=self._accepted,
            rejected=self._rejected,
        )

    # -- machinery ----------------------------------------------------------------------------

    def _accepted(self, headers: strict.Headers) -> None:
        path = next((value for name, value in headers if name == ":path"), "")
        method = path.rsplit("/", 1)[-1]
        self._headers.setdefault(method, collections.deque(maxlen=self.history)).append(tuple(headers))

    def _rejected(self, headers: strict.Headers, rejection: strict.Rejection) -> None:
        LOGGER.info("event=request_refused reason=%r", rejection.message)
        self.rejected.append((tuple(headers), rejection))

    async def _subscribe(self) -> AsyncIterator[cri.ContainerEventResponse]:
        queue: asyncio.Queue[cri.ContainerEventResponse] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.discard(queue)

    def _take_fault(self, method: str) -> Fault | None:
        entry = self._faults.get(method)
        if entry is None:
            return None
        fault, left = entry
        if left is not None:
            if left <= 1:
                del self._faults[method]
            else:
                self._faults[method] = (fault, left - 1)
        return fault

    async def _misbehave(self, fault: Fault, stream: grpclib.server.Stream[Any, Any]) -> bool:
        """Apply a fault's status or drop; True when the call has been answered."""
        if fault.drop:
            # grpclib has no public way to cut a connection; its protocol stream holds the
            # asyncio transport. Aborting makes grpclib cancel this handler (connection_lost).
            stream._stream._transport.abort()
            await asyncio.Event().wait()
        if fault.status is not None:
            await stream.send_trailing_metadata(
                status=fault.status,
                status_message=fault.message or None,
                metadata=fault.trailing_metadata or None,
            )
            return True
        return False

    async def _handle(
        self,
        method: str,
        request_type: type[betterproto2.Message],
        call: Callable[[Any], Any],
        server_streaming: bool,
        stream: grpclib.server.Stream[bytes, bytes],
    ) -> None:
        raw = await stream.recv_message()
        assert raw is not None
        if len(raw) > strict.MAX_MESSAGE:
            raise GRPCError(
                grpclib.const.Status.RESOURCE_EXHAUSTED, strict.too_large(len(raw), sending=False)
            )
        message = request_type.FromString(raw)
        log = self._log.setdefault(method, collections.deque(maxlen=self.history))
        log.append(RecordedRequest(method, message, raw, tuple((stream.metadata or {}).items())))
        LOGGER.debug("event=request method=%s bytes=%d", method, len(raw))
        fault = self._take_fault(method)
        if fault is not None:
            if fault.delay:
                await asyncio.sleep(fault.delay)
            if not fault.after_call and await self._misbehave(fault, stream):
                return
        try:
            if server_streaming:
                replies = call(message)
                await stream.send_initial_metadata()
                async for reply in replies:
                    await stream.send_message(_checked(bytes(reply.SerializeToString())))
                return
            try:
                reply = call(message)
                if asyncio.iscoroutine(reply):
                    reply = await reply
            except CriError as err:
                raise GRPCError(grpclib.const.Status(err.code.value), err.message) from None
        finally:
            self.flush_events()
        if fault is not None and fault.after_call and await self._misbehave(fault, stream):
            return
        await stream.send_message(
            _checked(reply if isinstance(reply, bytes) else bytes(reply.SerializeToString()))
        )


def _checked(reply: bytes) -> bytes:
    """``reply``, unless it is over containerd's limit: then RESOURCE_EXHAUSTED, as grpc-go sends."""
    if len(reply) > strict.MAX_MESSAGE:
        raise GRPCError(grpclib.const.Status.RESOURCE_EXHAUSTED, strict.too_large(len(reply), sending=True))
    return reply


class _Routes:
    """A grpclib handler whose route table covers every method of the given generated services.

    Requests and replies cross grpclib as bytes (:data:`krproxy._grpc.Raw`); :meth:`FakeContainerd._handle`
    decodes and encodes them.
    """

    def __init__(self, fake: FakeContainerd, services: Iterable[Any]) -> None:
        self._fake = fake
        self._services = list(services)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        routes: dict[str, grpclib.const.Handler] = {}
        for service in self._services:
            for path, handler in service.__mapping__().items():
                method = path.rsplit("/", 1)[1]
                # The generated handler for method ``Foo`` is the bound ``__rpc_foo``; its
                # public counterpart ``foo`` is what a subclass overrides.
                snake = handler.func.__name__.removeprefix("__rpc_")
                streaming = handler.cardinality.server_streaming
                call = (
                    getattr(self._fake.state, f"{snake}_encoded")
                    if snake in RuntimeState.ENCODED_CALLS
                    else getattr(self._fake.state, snake)
                    if snake in RuntimeState.CRI_CALLS
                    else getattr(service, snake)
                )
                routes[path] = grpclib.const.Handler(
                    functools.partial(self._fake._handle, method, handler.request_type, call, streaming),
                    handler.cardinality,
                    Raw,
                    Raw,
                )
        return routes


async def run_fake_containerd(
    path: str,
    fake: FakeContainerd | None = None,
    *,
    task_status: trio.TaskStatus[FakeContainerd] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a fake containerd on the unix socket ``path`` until cancelled.

    Must run inside ``trio_asyncio.open_loop()``. Reports the :class:`FakeContainerd` through
    ``task_status`` once the socket accepts connections; on cancellation the socket file is
    removed.
    """
    fake = FakeContainerd() if fake is None else fake
    async with trio.open_nursery() as nursery:
        await nursery.start(
            functools.partial(serve, fake.handlers(), path, codec=BytesCodec(), configure=fake.configure)
        )
        LOGGER.info("event=listening path=%s", path)
        task_status.started(fake)
