"""The CRI front end: an HTTP/2 relay between kubelet and the runtime, on trio.

kubelet's connections end here; each of its streams (one gRPC call) is paired with a stream on
an *upstream* connection and the two are relayed frame by frame::

    kubelet ─HTTP/2─┐                   ┌─ runtime socket (RuntimeService, unknown paths)
    kubelet ─HTTP/2─┤ Relay ────────────┼─ image socket (ImageService, if it is another socket)
                    │ (this module)     └─ plugin sockets (the relay's own calls, for the hooks)
                    └ interceptors: the calls with hook points, answered here

Messages are never parsed: DATA payloads are copied from one connection to the other, header
blocks are decoded (HPACK state is per connection) and re-encoded. A call with hook points is
answered by the relay itself: it collects the request and runs the path's interceptor, which
forwards through a unary call of the transport's own (:meth:`Transport.unary`); plugin calls and store
recovery use the same; one where no hook would run goes upstream as it came, watched
(:class:`~krproxy.relay.intercepted.LocalCall`, :data:`krproxy.forward.Watch`). Everything else — the
30-odd other CRI methods, method paths our protos lack, server streams such as GetContainerEvents —
costs one frame copy each way, which is what makes the proxy cheap (docs/performance.md).

Per call the relay adds, on its own account: the caller's deadline (``grpc-timeout``) is
enforced here too, so a runtime that hangs cannot keep a call open past it; a runtime that
cannot be reached, or drops its connection mid-call, ends the call with UNAVAILABLE naming
the socket (the next call reconnects); a caller that goes away resets the upstream stream.
Every finished call is reported to the observers as a :class:`krproxy.calls.CallRecord`.

Modules: :mod:`krproxy.h2.frames` (frames and header blocks, no I/O),
:mod:`~krproxy.relay.connection` (connections, streams, flow control),
:mod:`~krproxy.relay.transport` (accepting, deadlines, draining, calls of our own), the call kinds
(:mod:`~krproxy.relay.call`, :mod:`~krproxy.relay.intercepted`), and this one (:class:`Relay`:
a transport's face that routes by path; docs/architecture.md draws who holds whom).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping

import trio

from krproxy import calls
from krproxy.forward import Interceptor, Watch
from krproxy.grpcstatus import Status
from krproxy.h2 import frames as f
from krproxy.relay.call import Call
from krproxy.relay.connection import Endpoint, Headers
from krproxy.relay.grpc import grpc_timeout
from krproxy.relay.half import Half
from krproxy.relay.intercepted import LocalCall
from krproxy.relay.route import Route, connect_unix
from krproxy.relay.transport import MAX_CONNECTIONS, MAX_REQUEST, Transport
from krproxy.routing import Routing

__all__ = ["MAX_CONNECTIONS", "MAX_REQUEST", "Relay"]


class Relay:
    """The CRI front end (see the module docstring): a :class:`~krproxy.relay.transport.Transport`
    (:attr:`transport`) whose callers' streams it routes by path.

    Args:
        observers: told about every finished call (:class:`krproxy.calls.CallRecord`).
        enforce_deadlines: False: a caller's ``grpc-timeout`` is passed on but not enforced here.

    :meth:`configure` sets the routes (runtime; image, which may be the runtime's; None for a
    relay that only answers calls itself: other paths get UNIMPLEMENTED), the interceptors by
    method path, and the unary method paths (whose replies records carry); ``watches`` (by
    method path, of intercepted paths) may let a call go upstream as the caller sent it
    (:data:`krproxy.forward.Watch`); ``routing`` says which calls are answered here instead of
    forwarded (:class:`krproxy.routing.Routing`: by default a ``:path`` without its leading slash).
    """

    def __init__(
        self, observers: list[calls.Observer] | None = None, *, enforce_deadlines: bool = True
    ) -> None:
        self.transport = Transport(self.open_call, observers, enforce_deadlines=enforce_deadlines)
        self.runtime: Route | None = None  # set by configure()
        self.image: Route | None = None
        self.interceptors: dict[str, Interceptor] = {}
        self.watches: dict[str, Watch] = {}
        self.routing = Routing()
        self._routes: dict[str, Route] = {}  # to plugins and other sockets, by path
        self._unary_paths: frozenset[str] = frozenset()

    def configure(
        self,
        runtime: Route | None,
        image: Route | None,
        interceptors: Mapping[str, Interceptor],
        unary_paths: Iterable[str],
        watches: Mapping[str, Watch] | None = None,
        routing: Routing | None = None,
    ) -> None:
        self.runtime, self.image = runtime, image
        if routing is not None:
            self.routing = routing
        self.interceptors = dict(interceptors)
        self.watches = dict(watches or {})
        self._unary_paths = frozenset(unary_paths)

    def is_unary(self, path: str) -> bool:
        return path in self._unary_paths

    # -- its life: a face is what the daemon runs (as rpc.Server.serve) ------------------
    # Everything else of the transport's (settings, draining, in flight, flush, calls of our
    # own) is read on :attr:`transport`: the face adds routing only.

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """:meth:`Transport.run`: the relay's tasks without a listener (calls of our own)."""
        await self.transport.run(task_status=task_status)

    async def serve(
        self, listener: socket.socket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """:meth:`Transport.serve`: accept callers on ``listener`` until cancelled."""
        await self.transport.serve(listener, task_status=task_status)

    # -- routing -----------------------------------------------------------------------

    def open_call(
        self, ep: Endpoint, stream_id: int, headers: Headers, end: bool, body: bytes | None
    ) -> bool:
        """A caller's new stream (the transport's ``open_call``): a relayed call on the route
        of its path, or an intercepted one; refused as the runtime would refuse it. The relay's
        transport reads no whole requests: ``body`` is None (and never taken)."""
        path = timeout = None
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"grpc-timeout":
                timeout = grpc_timeout(value)
        if path is None:  # (request_header_problem checked it is there)
            ep.reset_stream(stream_id, f.PROTOCOL_ERROR)
            return False
        text = path.decode("utf-8", "replace")
        route = self.image if b".ImageService/" in path else self.runtime
        interceptor = self.interceptors.get(text)
        transport = self.transport
        unary = text in self._unary_paths
        call = (
            Call(transport, text, route, unary)
            if interceptor is None
            else LocalCall(transport, text, route, unary, interceptor, headers, self.watches.get(text))
        )
        state = call.state
        client = state.client = Half(ep, stream_id, call, state)
        ep.halves[stream_id] = client
        transport.call_started(state, None if timeout is None else trio.current_time() + timeout)
        if interceptor is not None:
            if end:
                call.on_request_data(b"", True)
            return False
        refusal = self.routing.refusal(text, path)  # which method: the runtime's reading of :path
        if refusal is not None:
            state.fail(refusal.status, refusal.message)
            return False
        if route is None:  # a relay that only answers calls itself
            state.fail(Status.UNIMPLEMENTED, f"unknown method {text}")
            return False
        try:
            upstream_ep = route.endpoint()
        except OSError as err:
            state.fail(Status.UNAVAILABLE, f"{route.describe} is unavailable: {err}")
            return False
        upstream = state.upstream = Half(upstream_ep, 0, call, state)
        upstream.peer, client.peer = client, upstream
        upstream_ep.open_stream(upstream, f.encode_headers(headers), end)
        return False

    def route_to(self, endpoint: str, describe: str) -> Route:
        """The route to the socket at ``endpoint``: one per path, kept until :meth:`drop_route`."""
        route = self._routes.get(endpoint)
        if route is None:
            route = self._routes[endpoint] = Route(self.transport, describe, connect_unix(endpoint))
        return route

    def drop_route(self, endpoint: str) -> None:
        """Forget the route to ``endpoint``; its connection closes once its calls are over."""
        route = self._routes.pop(endpoint, None)
        if route is not None and route.ep is not None:
            route.ep.retire()
