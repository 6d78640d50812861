"""The fake containerd on the wire: :class:`~krproxy.fakes.containerd.state.RuntimeState` served by krproxy's gRPC server.

Each CRI method path (:func:`krproxy.methods.cri_methods`) gets a handler that receives the request
as raw bytes (so the exact bytes a proxy forwarded can be recorded), decodes it, applies any
injected fault, calls the state, and encodes the answer (or sends it as the state encoded it, for
:data:`~krproxy.fakes.containerd.state.RuntimeState.ENCODED_CALLS`).

Which methods work is decided by :data:`~krproxy.fakes.containerd.state.RuntimeState.CRI_CALLS` plus
``GetContainerEvents`` (served here, since it needs a live stream); every other CRI method answers
UNIMPLEMENTED "method X not implemented" (grpc-go's generated answer) after its request was
recorded, and unknown method paths UNIMPLEMENTED from the server itself.

The fake is as strict as containerd's grpc-go (:mod:`krproxy.fakes.strict`, applied by
:func:`krproxy.fakes.grpc_go.header_check`): a request with a malformed ``grpc-timeout`` (more than 8
digits) or without ``:method`` is refused as the chosen grpc-go version does (containerd 1.6's
RST_STREAM PROTOCOL_ERROR by default), a message over 16 MiB either way is RESOURCE_EXHAUSTED with
grpc-go's words (a request's by the server, before it is read), and no SETTINGS_MAX_CONCURRENT_STREAMS is advertised unless asked for. The header
block of every request is logged (:meth:`FakeContainerd.headers`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import betterproto2
import betterproto2.casing
import trio
from google.protobuf.message import DecodeError

from krproxy import rpc
from krproxy.fakes import _armed, strict
from krproxy.fakes.containerd import restore
from krproxy.fakes.containerd.records import CriError
from krproxy.fakes.containerd.state import RuntimeState
from krproxy.fakes.containerd.versions import Imitation, imitation, route
from krproxy.fakes.grpc_go import Metadata, encode_metadata, header_check, metadata_items
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks import wire
from krproxy.methods import cri_methods
from krproxy.proto.runtime import v1 as cri

LOGGER = logging.getLogger("krproxy.fakes.containerd")

#: One subscriber of GetContainerEvents: where its events are sent.
_Subscriber = trio.MemorySendChannel[cri.ContainerEventResponse]


@attrs.frozen
class Fault:
    """Misbehaviour to inject into one CRI method.

    Attributes:
        delay: seconds to wait before answering (trio time: a MockClock drives it).
        status: answer with this gRPC status instead of calling the runtime.
        message: the status message sent with ``status``.
        trailing_metadata: extra trailing metadata sent with ``status`` (a ``-bin`` key's value as bytes).
        drop: abort the client's connection mid-call; the client sees UNAVAILABLE.
        after_call: apply ``status``/``drop`` after the runtime did the work (the reply is lost),
            instead of before (the runtime never saw the call). ``delay`` always comes first.
        times: how many calls the fault affects; ``None`` means every call until cleared.
    """

    delay: float = 0.0
    status: Status | None = None
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


@attrs.define(eq=False)
class FakeContainerd:
    """A stateful fake containerd CRI endpoint with a request log and fault injection.

    Attributes:
        state: the pure runtime state; tests may inspect it or drive it directly (then call
            :meth:`flush_events` so subscribers see the resulting events).
        imitate: the containerd version imitated ("1.6", "1.7", "2.1" or "2.x", "2.3"; see
            :mod:`krproxy.fakes.containerd.versions`): given, it is also the state's; None (the default):
            the state's (1.6 unless the state was built otherwise). It decides how a ``:path`` is routed
            (:func:`~krproxy.fakes.containerd.versions.route`) and the answers where versions differ.
        history: how many requests to remember per method.
        history_bytes: how many bytes of raw requests to remember per method: older ones are forgotten
            beyond it (the newest is always kept), so a run of large requests stays bounded.
        grpc_go: how a request grpc-go refuses is answered; None (the default): as the imitated
            version's grpc-go (1.6: a reset; later: grpc-go's early abort).
        max_concurrent_streams: the SETTINGS_MAX_CONCURRENT_STREAMS to advertise; None (the
            default) advertises none, as containerd.
        enforce_deadlines: False: a caller's ``grpc-timeout`` is checked and logged but not
            enforced (a test that stops trio's clock, or jumps it, decides when a call ends).
    """

    state: RuntimeState = attrs.Factory(RuntimeState)
    imitate: str | Imitation | None = None
    history: int = 100
    history_bytes: int = 32 << 20
    grpc_go: strict.GrpcGo | None = None
    max_concurrent_streams: int | None = None
    enforce_deadlines: bool = True
    #: The last ``history`` requests refused for their headers (:func:`krproxy.fakes.strict.check_request`), with why.
    rejected: list[tuple[strict.Headers, strict.Rejection]] = attrs.field(init=False, factory=list)
    _headers: dict[str, collections.deque[strict.Headers]] = attrs.field(init=False, factory=dict)
    _log: dict[str, collections.deque[RecordedRequest]] = attrs.field(init=False, factory=dict)
    _faults: dict[str, tuple[Fault, int | None]] = attrs.field(init=False, factory=dict)
    _subscribers: set[_Subscriber] = attrs.field(init=False, factory=set)
    _logged_bytes: dict[str, int] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.imitate is not None:
            self.state.settings.imitate = imitation(self.imitate)

    @property
    def imitated(self) -> Imitation:
        """The containerd version this fake imitates (its state's)."""
        return self.state.settings.imitate

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
        self._logged_bytes.clear()
        self._headers.clear()
        self.rejected.clear()

    def footprint(self) -> dict[str, int]:
        """What the fake holds, by table: records, logged requests and their raw bytes, header blocks,
        refusals, queued events, subscribers. A long run must keep each bounded (the memory test)."""
        state = self.state
        return {
            "sandboxes": len(state.sandboxes),
            "containers": len(state.containers),
            "images": len(state.images),
            "reserved_names": len(state.tables.reserved_names),
            "pod_index": len(state.tables.pod_index),
            "events": len(state.tables.events),
            "requests": sum(len(log) for log in self._log.values()),
            "request_bytes": sum(self._logged_bytes.values()),
            "headers": sum(len(blocks) for blocks in self._headers.values()),
            "rejected": len(self.rejected),
            "subscribers": len(self._subscribers),
        }

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
            for subscriber in self._subscribers:
                subscriber.send_nowait(event)

    def server(self) -> rpc.Server:
        """A :class:`krproxy.rpc.Server` serving this fake, as strict as containerd's grpc-go."""
        grpc_go = self.imitated.grpc_go if self.grpc_go is None else self.grpc_go
        handlers = self._handlers()
        return rpc.Server(
            handlers,
            fallback=functools.partial(self._route, handlers),
            check_headers=header_check(grpc_go, accepted=self._accepted, rejected=self._rejected),
            max_request=strict.MAX_MESSAGE,
            max_streams=self.max_concurrent_streams,
            enforce_deadlines=self.enforce_deadlines,
        )

    # -- machinery ----------------------------------------------------------------------------

    def _handlers(self) -> dict[str, rpc.Handler]:
        """A handler for every CRI method; the state's methods where it has them."""
        handlers: dict[str, rpc.Handler] = {}
        for path, method in cri_methods().items():
            name = path.rsplit("/", 1)[1]
            snake = betterproto2.casing.snake_case(name)
            call: Callable[[Any], Any]
            if snake in RuntimeState.ENCODED_CALLS:
                call = getattr(self.state, f"{snake}_encoded")
            elif snake in RuntimeState.CRI_CALLS:
                call = getattr(self.state, snake)
            elif snake == "get_container_events":
                call = self._subscription
            elif snake == "restore_pod":
                call = functools.partial(restore.restore_pod, self.state)
            else:
                call = functools.partial(_unimplemented, name)
            streaming = method.cardinality.server_streaming
            handlers[path] = functools.partial(self._handle, name, method.request, call, streaming)
        return handlers

    def _route(self, handlers: dict[str, rpc.Handler], path: str) -> rpc.Handler:
        """A path the handlers do not name exactly, routed as the imitated grpc-go routes it: the
        method's handler (a slash-less path on 1.6 and 1.7), or one answering grpc-go's refusal."""
        services: dict[str, set[str]] = {}
        for known in handlers:
            service, _, method = known[1:].rpartition("/")
            services.setdefault(service, set()).add(method)
        try:
            service, method = route(path, {k: frozenset(v) for k, v in services.items()}, self.imitated)
        except GRPCError as err:
            return functools.partial(_refuse, err)
        return handlers[f"/{service}/{method}"]

    def _accepted(self, headers: strict.Headers) -> None:
        path = next((value for name, value in headers if name == ":path"), "")
        method = path.rsplit("/", 1)[-1]
        self._headers.setdefault(method, collections.deque(maxlen=self.history)).append(tuple(headers))

    def _rejected(self, headers: strict.Headers, rejection: strict.Rejection) -> None:
        self.rejected.append((tuple(headers), rejection))
        del self.rejected[: -self.history]

    def _record(self, request: RecordedRequest) -> None:
        """Log ``request``, forgetting the oldest beyond :attr:`history` requests or :attr:`history_bytes`."""
        method = request.method
        log = self._log.setdefault(method, collections.deque())
        log.append(request)
        size = self._logged_bytes.get(method, 0) + len(request.raw)
        while len(log) > 1 and (len(log) > self.history or size > self.history_bytes):
            size -= len(log.popleft().raw)
        self._logged_bytes[method] = size

    @contextlib.asynccontextmanager
    async def _subscription(self, request: cri.GetEventsRequest) -> AsyncIterator[AsyncIterator[Any]]:
        """GetContainerEvents: subscribed on entry (before the answer starts, so an event produced
        right after the call arrived is not missed), unsubscribed on exit."""
        send, receive = trio.open_memory_channel[cri.ContainerEventResponse](math.inf)
        self._subscribers.add(send)
        try:
            yield receive
        finally:
            self._subscribers.discard(send)

    @staticmethod
    async def _misbehave(fault: Fault, stream: rpc.Stream) -> bool:
        """Apply a fault's drop or status; True when the call has been answered (or cut off)."""
        if fault.drop:
            stream.close_connection()
            await trio.sleep_forever()  # the connection is gone: the server cancels this call
        if fault.status is not None:
            await stream.send_trailing_metadata(
                fault.status, fault.message or None, metadata=encode_metadata(fault.trailing_metadata)
            )
            return True
        return False

    async def _handle(
        self,
        method: str,
        request_type: type[betterproto2.Message],
        call: Callable[[Any], Any],
        server_streaming: bool,
        stream: rpc.Stream,
    ) -> None:
        raw = await stream.recv_message()
        if raw is None:
            raise GRPCError(Status.INTERNAL, f"{method}: the request ended without a message")
        message = _unmarshal(request_type, raw)
        self._record(RecordedRequest(method, message, raw, metadata_items(stream.metadata)))
        LOGGER.debug("event=request method=%s bytes=%d", method, len(raw))
        fault = _armed.take(self._faults, method)
        if fault is not None:
            if fault.delay:
                await trio.sleep(fault.delay)
            if not fault.after_call and await self._misbehave(fault, stream):
                return
        try:
            if server_streaming:
                async with call(message) as replies:
                    await stream.send_initial_metadata()
                    async for reply in replies:
                        await stream.send_message(_checked(bytes(reply.SerializeToString())))
                return
            try:
                reply = call(message)
            except CriError as err:
                raise GRPCError(Status(err.code.value), err.message) from None
        finally:
            self.flush_events()
        if fault is not None and fault.after_call and await self._misbehave(fault, stream):
            return
        await stream.send_message(
            _checked(reply if isinstance(reply, bytes) else bytes(reply.SerializeToString()))
        )


def _unmarshal(request_type: type[betterproto2.Message], raw: bytes) -> Any:
    """*raw* as containerd's Go decoder reads it: read by upb first, which reads as Go does (a field sent
    with a wire type other than its own is an unknown field, the last of a singular field sent twice
    wins), unknown fields dropped, then into betterproto2's message. betterproto2 alone is lenient
    where Go is not: it kept a varint in a message field's place (the fake then failed on it with a
    Python error) and read a string cut short. Bytes that are no message at all are grpc-go's
    INTERNAL "error unmarshalling request"."""
    try:
        read = wire.message_class(request_type.__name__, writing=True).FromString(raw)
    except DecodeError as err:
        raise GRPCError(Status.INTERNAL, f"grpc: error unmarshalling request: {err}") from None
    read.DiscardUnknownFields()
    return request_type.FromString(read.SerializeToString())


async def _refuse(error: GRPCError, stream: rpc.Stream) -> None:
    """grpc-go's answer to a path it routes nowhere: the status alone, the request unread."""
    raise error


def _unimplemented(method: str, request: Any) -> Any:
    """A CRI method the state does not model: grpc-go's generated ``Unimplemented...Server`` answer."""
    raise GRPCError(Status.UNIMPLEMENTED, f"method {method} not implemented")


def _checked(reply: bytes) -> bytes:
    """``reply``, unless it is over containerd's limit: then RESOURCE_EXHAUSTED, as grpc-go sends."""
    if len(reply) > strict.MAX_MESSAGE:
        raise GRPCError(Status.RESOURCE_EXHAUSTED, strict.too_large(len(reply), sending=True))
    return reply


async def run_fake_containerd(
    path: str,
    fake: FakeContainerd | None = None,
    *,
    task_status: trio.TaskStatus[FakeContainerd] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a fake containerd on the unix socket ``path`` until cancelled.

    Reports the :class:`FakeContainerd` through ``task_status`` once the socket accepts
    connections; on cancellation connections are closed and the socket file is removed.
    """
    fake = FakeContainerd() if fake is None else fake
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.server().serve, path)
        LOGGER.info("event=listening path=%s", path)
        task_status.started(fake)
