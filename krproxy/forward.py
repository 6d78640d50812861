"""What intercepted calls are made of: replies, backend errors, interceptors, backends.

Every CRI call reaches the runtime through the relay (:mod:`krproxy.relay`). Most are relayed
frame by frame and never decoded. The few methods that carry hook points are handed to an
:data:`Interceptor` with the request message as bytes and a :data:`Forward` function; the
interceptor may decode and change the request, forwards it (or refuses the call with a
:class:`GRPCError`), and returns the runtime's :class:`Reply`, which the relay sends back.

What an interceptor does not touch passes through unchanged: the request's metadata, the
reply's initial and trailing metadata (kept as raw header fields), and a runtime's error
status with its message, details and trailers (:class:`BackendError`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import attrs

from krproxy.grpcstatus import Cardinality, GRPCError, Status
from krproxy.methods import cri_methods

#: Header fields as they travel: (name, value) bytes pairs, pseudo-headers included.
Headers = list[tuple[bytes, bytes]]


@attrs.frozen
class Reply:
    """A successful unary answer from the runtime, ready to relay.

    ``headers`` and ``trailers`` are the runtime's header blocks; empty ones are filled in
    with a plain gRPC answer (``:status 200``, ``grpc-status 0``) when sent.
    """

    message: bytes
    headers: Headers = attrs.field(factory=list)
    trailers: Headers = attrs.field(factory=list)


class BackendError(GRPCError):
    """The runtime answered with an error status; relayed to the caller unchanged.

    ``headers`` is the runtime's initial header block (None for a trailers-only answer) and
    ``trailers`` the block with its status.
    """

    def __init__(
        self,
        status: Status,
        message: str | None = None,
        details: bytes | None = None,
        *,
        headers: Headers | None = None,
        trailers: Headers | None = None,
    ) -> None:
        super().__init__(status, message, details)
        self.headers = headers
        self.trailers: Headers = trailers if trailers is not None else []


#: Sends a (possibly changed) request to the runtime and returns its reply. The relay gives an
#: interceptor a :class:`CallForward`, which can also hand the forward over; a wrapping interceptor
#: (``ocihooks.proxy.compose``) gives the one inside it a plain function: its own work follows the forward.
Forward = Callable[[bytes], Awaitable[Reply]]


class CallForward:
    """The :data:`Forward` of an intercepted call (:class:`krproxy.relay.intercepted.LocalCall`'s): awaited,
    it forwards; :attr:`hand_over` is the call's own ``hand_over(request, watcher) -> Reply``, for an
    interceptor with nothing left to do but forward and tell the store. It returns what ``hand_over``
    returned; once it has, the call sends *request* upstream, relays the runtime's answer as a watched
    call's and tells *watcher* its end. Only the call kind offers it: a forward of another kind is a
    plain :data:`Forward`, and an interceptor tells the two apart by this type."""

    __slots__ = ("forward", "hand_over")

    def __init__(self, forward: Forward, hand_over: Callable[[bytes, Watcher], Reply]) -> None:
        self.forward = forward
        self.hand_over = hand_over

    def __call__(self, data: bytes) -> Awaitable[Reply]:
        return self.forward(data)


#: Handles one intercepted unary call: ``interceptor(path, request, forward) -> Reply``.
#: It may raise :class:`GRPCError` to refuse the call without forwarding it.
Interceptor = Callable[[str, bytes, Forward], Awaitable[Reply]]

#: Handles one intercepted call of a known method: ``handler(request, forward) -> Reply``.
Handler = Callable[[bytes, Forward], Awaitable[Reply]]

#: Told how a watched call ended, once its answer is out: ``watcher(status, reply)``, *reply* the
#: runtime's answer message when the status is OK (else None). It must be quick and must not raise.
Watcher = Callable[[Status, bytes | None], None]

#: Looks at an intercepted call's whole request (the message's bytes) before anything else happens to
#: it: a :data:`Watcher` lets the call go upstream as the caller sent it, frame by frame like a
#: passthrough call, and is told its end; None hands it to the path's :data:`Interceptor` as usual.
#: Synchronous, on the reader's turn: it must be quick, must not raise, and must say None whenever
#: the interceptor would do anything but forward the caller's request unchanged (a hook to run, a
#: required server to check, a request to refuse, a store to wait for).
Watch = Callable[[bytes], Watcher | None]

#: The path prefix of the CRI RuntimeService's methods.
RUNTIME_PREFIX = "/runtime.v1.RuntimeService/"


class Gate(Protocol):
    """What intercepted calls wait on (a ``trio.Event``, or the hook store's start-up gate)."""

    def is_set(self) -> bool: ...

    async def wait(self) -> None: ...


def runtime_interceptors(
    handlers: Mapping[str, Handler], *, gate: Gate | None = None
) -> dict[str, Interceptor]:
    """The interceptor table of RuntimeService *handlers* (by method name, e.g. ``"StartContainer"``);
    each call waits for *gate* (if given) to be set before its handler runs.

    Once the gate is set a call goes straight on, without the checkpoint ``Event.wait`` makes even
    then: each checkpoint is a pass of trio's scheduler (an ``epoll_wait`` and the run loop's
    bookkeeping) on every intercepted call. The handler's first wait is its checkpoint.
    """

    def bind(handler: Handler) -> Interceptor:
        async def intercept(path: str, request: bytes, forward: Forward) -> Reply:
            if gate is not None and not gate.is_set():
                await gate.wait()
            return await handler(request, forward)

        return intercept

    return {RUNTIME_PREFIX + name: bind(handler) for name, handler in handlers.items()}


def known_routes() -> dict[str, Cardinality]:
    """Every RuntimeService and ImageService method path of our protos, with its cardinality."""
    return {path: method.cardinality for path, method in cri_methods().items()}


@attrs.define(eq=False)
class Backend:
    """A runtime socket and what the last call learned about it (for /status and metrics).

    ``reachable`` is True once the runtime answered (any status), False after it could not be
    reached, None before the first call; ``last_error`` says why it was last unreachable.
    """

    path: str
    reachable: bool | None = None
    last_error: str = ""

    def set_state(self, reachable: bool, error: str) -> None:
        self.reachable = reachable
        if error:
            self.last_error = error
