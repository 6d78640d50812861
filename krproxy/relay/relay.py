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
forwards through a unary call of the relay's own (:meth:`Relay.unary`); plugin calls and store
recovery use the same; one where no hook would run goes upstream as it came, watched
(:class:`~krproxy.relay._local.LocalCall`, :data:`krproxy.forward.Watch`). Everything else — the
30-odd other CRI methods, method paths our protos lack, server streams such as GetContainerEvents —
costs one frame copy each way, which is what makes the proxy cheap (docs/performance.md).

Per call the relay adds, on its own account: the caller's deadline (``grpc-timeout``) is
enforced here too, so a runtime that hangs cannot keep a call open past it; a runtime that
cannot be reached, or drops its connection mid-call, ends the call with UNAVAILABLE naming
the socket (the next call reconnects); a caller that goes away resets the upstream stream.
Every finished call is reported to the observers as a :class:`krproxy.calls.CallRecord`.

Modules: :mod:`krproxy.h2.frames` (frames and header blocks, no I/O),
:mod:`~krproxy.relay.connection` (connections, streams, flow control),
:mod:`~krproxy.relay.rpc` (relayed, answered and own calls), and this one (:class:`Relay`:
accepting, routing, deadlines, draining).
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import logging
import math
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import trio

from krproxy import calls, log
from krproxy.forward import Interceptor, Watch
from krproxy.grpcstatus import GRPCError, Status
from krproxy.h2 import frames as f
from krproxy.relay import connection
from krproxy.relay._call import Call, report
from krproxy.relay._exchange import _Exchange
from krproxy.relay._local import LocalCall
from krproxy.relay.connection import _STOPPED, Endpoint, Headers
from krproxy.relay.grpc import (
    MAX_OWN_ANSWER,
    REFUSED_ATTEMPTS,
    REFUSED_PAUSE,
    Answer,
    StreamReset,
    UpstreamError,
    grpc_message,
    grpc_timeout,
    own_call_headers,
)
from krproxy.relay.half import Half
from krproxy.relay.route import Route, connect_unix
from krproxy.routing import Routing

LOGGER = logging.getLogger("krproxy.relay")

#: Caller connections served at once; one more is closed at once (counted in the log), so that
#: a client opening connections in a loop cannot use up the daemon's file descriptors.
MAX_CONNECTIONS = 1000

#: Largest request message accepted (``--max-request-message-size``), as containerd's limit.
MAX_REQUEST = 16 * 1024 * 1024


class Relay:
    """The CRI front end (see the module docstring).

    Args:
        observers: told about every finished call (:class:`krproxy.calls.CallRecord`).

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
        self.observers = observers if observers is not None else []  # kept, not copied
        #: False: a caller's ``grpc-timeout`` is passed on but not enforced here (the fake
        #: plugin uses this to hang the way a real server that ignores deadlines does).
        self.enforce_deadlines = enforce_deadlines
        #: Whether records of relayed calls carry the request and (unary) reply bytes: only the
        #: trace recorder needs them, and keeping an 860 KB list per call costs memory and time.
        #: Records of calls with hook points always carry them.
        self.keep_messages = False
        #: Largest request message: one announcing more gets RESOURCE_EXHAUSTED at once.
        self.max_request = MAX_REQUEST
        #: Streams per caller connection, advertised and kept (None: none advertised, as a
        #: grpc-go server by default; the fake plugin plays one).
        self.caller_max_streams: int | None = connection.CALLER_MAX_STREAMS
        #: Whether request header lists are checked as RFC 9113 §8.2 says before open_call
        #: (off for a relay that plays a server with rules of its own: the fake plugin).
        self.check_request_headers = True
        #: The worker threads header blocks are decoded in when the event loop would spend too
        #: long on them (connection.DECODE_PER_TURN): one for large blocks and one for small
        #: ones, for all connections, so that peers sending many share two threads' worth of
        #: the interpreter and the event loop keeps the rest.
        self.large_decodes = trio.CapacityLimiter(1)
        self.small_decodes = trio.CapacityLimiter(1)
        self.runtime: Route | None = None  # set by configure()
        self.image: Route | None = None
        self.interceptors: dict[str, Interceptor] = {}
        self.watches: dict[str, Watch] = {}
        self.routing = Routing()
        self._routes: dict[str, Route] = {}  # to plugins and other sockets, by path
        self._unary_paths: frozenset[str] = frozenset()
        self.nursery: trio.Nursery = None  # type: ignore[assignment]  # set by serve()
        self.dirty: list[Endpoint] = []
        #: True while a reader hands a frame's events to the calls (synchronous): a call finished
        #: then is reported to the observers after the next :meth:`flush` (the reader's, on every
        #: way out), so its record and metrics are off the answer's path.
        self.defer_records = False
        self._unrecorded: list[Call] = []
        self.in_flight = 0
        self.draining = False
        self._idle_waiters: list[trio.Event] = []
        self._accepting: trio.CancelScope | None = None
        self._clients: set[Endpoint] = set()
        self._turned_away = 0  # connections closed at once: MAX_CONNECTIONS were open
        self._deadlines: list[list[Any]] = []  # heap of [deadline, seq, call; None once finished]
        self._dead_timers = 0
        self._seq = itertools.count()
        self._timer: trio.CancelScope | None = None

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

    # -- serving -----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the relay's tasks (without accepting callers) until cancelled.

        Enough for calls of our own (:meth:`call`, :meth:`unary`). On cancellation every
        connection is closed; calls still running end (the upstream streams are reset).
        """
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                nursery.start_soon(self._expire_deadlines)
                task_status.started()
                await trio.sleep_forever()
        finally:
            for ep in list(self._clients):
                ep.close(_STOPPED)
            for route in {self.runtime, self.image, *self._routes.values()}:
                if route is not None and route.ep is not None:
                    route.ep.close(_STOPPED)
            self.flush()

    async def serve(
        self, listener: socket.socket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """:meth:`run`, accepting callers on ``listener`` (bound and listening) until cancelled
        or :meth:`stop_accepting`. The listener is left to the caller."""
        listener.setblocking(False)
        async with trio.open_nursery() as outer:
            await outer.start(self.run)
            with trio.CancelScope() as self._accepting:
                task_status.started()
                await self._accept(listener)

    async def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                await trio.lowlevel.wait_readable(listener)
                continue
            except OSError as err:  # e.g. EMFILE: keep serving the connections we have
                log.error(LOGGER, "accept_failed", error=err)
                await trio.sleep(0.1)
                continue
            if len(self._clients) >= MAX_CONNECTIONS:
                sock.close()
                self._turned_away += 1
                if self._turned_away in (1, 10, 100) or self._turned_away % 1000 == 0:
                    log.warning(
                        LOGGER,
                        "connection_limit",
                        connections=len(self._clients),
                        turned_away=self._turned_away,
                    )
                continue
            ep = Endpoint(self, sock, server_side=True)
            self._clients.add(ep)
            self.nursery.start_soon(self._serve_client, ep)  # the accept loop is in no call
            self.flush()

    async def _serve_client(self, ep: Endpoint) -> None:
        try:
            await ep.run()
        finally:
            self._clients.discard(ep)

    def stop_accepting(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()

    def spawn(self, fn: Callable[[], Awaitable[object]]) -> None:
        """Start a long-lived task (a connection's reader or writer) outside any call's context:
        a task inherits the context it was started in, and one started while a call with hook
        points ran would keep that call (``calls.CURRENT``, with its request) alive."""
        context = contextvars.copy_context()
        context.run(calls.CURRENT.set, None)
        context.run(self.nursery.start_soon, fn)

    def flush(self, last: Endpoint | None = None) -> None:
        """Write out every connection something was queued on, then report the calls that
        finished meanwhile (:attr:`defer_records`). ``last`` goes out after the others: a reader's
        own connection, with its acknowledgements to its peer, after what it passed on
        (containerd sends a PING with an answer's DATA: acknowledged first, the answer waited
        for one more send and containerd's wake-up)."""
        dirty = self.dirty
        if last is not None and last.dirty and len(dirty) > 1:
            dirty.remove(last)
            dirty.insert(0, last)  # taken from the end: this one goes out last
        while dirty:
            dirty.pop().try_send()
        if self._unrecorded:
            finished, self._unrecorded = self._unrecorded, []
            for call in finished:
                report(call, self.observers)

    # -- calls -------------------------------------------------------------------------

    def open_call(self, ep: Endpoint, stream_id: int, headers: Headers, end: bool) -> None:
        path = timeout = None
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"grpc-timeout":
                timeout = grpc_timeout(value)
        if path is None:  # (request_header_problem checked it is there)
            ep.reset_stream(stream_id, f.PROTOCOL_ERROR)
            return
        text = path.decode("utf-8", "replace")
        route = self.image if b".ImageService/" in path else self.runtime
        interceptor = self.interceptors.get(text)
        call = (
            Call(self, text, route)
            if interceptor is None
            else LocalCall(self, text, route, interceptor, headers, self.watches.get(text))
        )
        client = call.client = Half(ep, stream_id, call)
        ep.halves[stream_id] = client
        self.in_flight += 1
        if timeout is not None and self.enforce_deadlines:
            self._add_deadline(call, trio.current_time() + timeout)
        if interceptor is not None:
            if end:
                call.on_request_data(b"", True)
            return
        refusal = self.routing.refusal(text, path)  # which method: the runtime's reading of :path
        if refusal is not None:
            call.fail(refusal.status, refusal.message)
            return
        if route is None:  # a relay that only answers calls itself
            call.fail(Status.UNIMPLEMENTED, f"unknown method {text}")
            return
        try:
            upstream_ep = route.endpoint()
        except OSError as err:
            call.fail(Status.UNAVAILABLE, f"{route.describe} is unavailable: {err}")
            return
        upstream = call.upstream = Half(upstream_ep, 0, call)
        upstream.peer, client.peer = client, upstream
        upstream_ep.open_stream(upstream, f.encode_headers(headers), end)

    def call_finished(self, call: Call) -> None:
        self.in_flight -= 1
        if call.timer is not None:
            # The entry stays in the heap until due (kubelet's deadlines are minutes long), but
            # not the finished call, with its request and reply.
            call.timer[2] = None
            call.timer = None
            self._dead_timers += 1
        if self.in_flight == 0 and self._idle_waiters:
            for event in self._idle_waiters:
                event.set()
            self._idle_waiters.clear()
        if self.observers or call.watcher is not None:
            if self.defer_records:
                self._unrecorded.append(call)
            else:
                report(call, self.observers)

    async def wait_idle(self) -> None:
        """Return once no call is in flight."""
        while self.in_flight:
            event = trio.Event()
            self._idle_waiters.append(event)
            await event.wait()

    # -- calls of our own --------------------------------------------------------------

    async def unary(
        self,
        route: Route,
        path: str,
        message: bytes,
        metadata: Iterable[tuple[bytes, bytes]] = (),
        deadline: float = math.inf,
        max_answer: int = MAX_OWN_ANSWER,
        *,
        watched: bool = False,
    ) -> Answer:
        """Call ``path`` on ``route`` with ``message``, within ``deadline`` (trio clock).

        ``watched``: ``deadline`` is that of a call the relay ends at it anyway (a
        :class:`~krproxy.relay._local.LocalCall`'s timer answers DEADLINE_EXCEEDED and cancels the
        handler, which resets this stream): sent upstream as ``grpc-timeout``, with no cancel
        scope of its own here (about 25 Python calls fewer per intercepted call).

        An answer larger than ``max_answer`` bytes is an :class:`AnswerTooLarge`, a stream the
        upstream reset a :class:`StreamReset`, an answer gRPC does not give (OK without one
        plain message, no trailers) a :class:`BadAnswer` (all are :class:`UpstreamError`).

        Returns the answer whatever its status. Raises OSError if the upstream cannot be
        reached, :class:`UpstreamError` if it went away or answered something that is not
        gRPC, and TimeoutError when the deadline passed first (the stream is reset then). A call
        the upstream refused unprocessed (REFUSED_STREAM, GOAWAY) is sent again, as gRPC's
        transparent retry does: servers may count a finished stream a little longer than we do.
        """
        # A caller cancelled while it did work without a checkpoint (e.g. an OCI hook in a thread)
        # must not get its request sent: everything up to the first wait below is synchronous.
        await trio.lowlevel.checkpoint_if_cancelled()
        framed = grpc_message(message)
        extra = list(metadata)
        for attempt in itertools.count(1):
            exchange = await self._exchange(route, path, framed, extra, deadline, max_answer, watched)
            if not exchange.refused:
                break
            if attempt >= REFUSED_ATTEMPTS:  # even without a deadline, not forever
                raise UpstreamError(f"{route.describe} refused the call {attempt} times: {exchange.error}")
            with trio.move_on_at(deadline):
                await trio.sleep(REFUSED_PAUSE)
            if trio.current_time() >= deadline:
                raise TimeoutError()
        if exchange.error is not None:
            if exchange.reset_code is not None:
                raise StreamReset(exchange.error, exchange.reset_code)
            raise exchange.error_type(exchange.error)
        route.mark_reachable()  # our own calls (store recovery's) count, as their failures do
        return exchange.answer()

    async def _exchange(
        self,
        route: Route,
        path: str,
        framed: bytes,
        metadata: Headers,
        deadline: float,
        max_answer: int,
        watched: bool,
    ) -> _Exchange:
        exchange = _Exchange(max_answer)
        ep = route.endpoint()
        upstream = exchange.upstream = Half(ep, 0, exchange)  # type: ignore[arg-type]
        ep.open_stream(upstream, f.encode_headers(own_call_headers(path, deadline, metadata)), False)
        upstream.send_data(framed, True)
        self.flush()
        try:
            if watched or deadline == math.inf:
                await exchange.done.wait()
            else:
                with trio.move_on_at(deadline):
                    await exchange.done.wait()
        finally:
            if not exchange.done.is_set():  # the deadline passed, or our caller was cancelled
                upstream.abort(f.CANCEL)
                exchange.settle()
                self.flush()
        if not exchange.done.is_set():
            raise TimeoutError()
        return exchange

    async def call(
        self, route: Route, path: str, message: bytes, within: float, max_answer: int = MAX_OWN_ANSWER
    ) -> bytes:
        """:meth:`unary` for callers that want the reply message or an exception.

        Raises :class:`GRPCError` for an error status, and what :meth:`unary` raises.
        """
        answer = await self.unary(
            route, path, message, deadline=trio.current_time() + within, max_answer=max_answer
        )
        if answer.status is not Status.OK:
            raise GRPCError(answer.status, answer.message, answer.details)
        return answer.body

    def route_to(self, endpoint: str, describe: str) -> Route:
        """The route to the socket at ``endpoint``: one per path, kept until :meth:`drop_route`."""
        route = self._routes.get(endpoint)
        if route is None:
            route = self._routes[endpoint] = Route(self, describe, connect_unix(endpoint))
        return route

    def drop_route(self, endpoint: str) -> None:
        """Forget the route to ``endpoint``; its connection closes once its calls are over."""
        route = self._routes.pop(endpoint, None)
        if route is not None and route.ep is not None:
            route.ep.retire()

    # -- deadlines ---------------------------------------------------------------------

    def _add_deadline(self, call: Call, deadline: float) -> None:
        call.deadline = deadline
        call.timer = [deadline, next(self._seq), call]
        heapq.heappush(self._deadlines, call.timer)
        if self._timer is not None and deadline < self._timer.deadline:
            self._timer.deadline = deadline
        # Entries of finished calls stay until due: rebuild the heap without them once they are
        # the majority, so they do not pile up.
        if self._dead_timers > 100 and self._dead_timers * 2 > len(self._deadlines):
            self._deadlines = [entry for entry in self._deadlines if entry[2] is not None]
            heapq.heapify(self._deadlines)
            self._dead_timers = 0

    async def _expire_deadlines(self) -> None:
        while True:
            heap = self._deadlines
            with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as self._timer:
                await trio.sleep_forever()
            self._timer = None
            now = trio.current_time()
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                call = heapq.heappop(heap)[2]
                if call is None:  # finished before its deadline
                    self._dead_timers -= 1
                else:
                    call.fail(Status.DEADLINE_EXCEEDED, f"deadline exceeded waiting for {call.describe}")
            self.flush()

    # -- shutdown ----------------------------------------------------------------------

    def start_draining(self) -> None:
        """Stop accepting connections and start the two-step GOAWAY on every caller connection
        (RFC 9113 §6.8; :meth:`Endpoint.announce_goaway`): calls already sent are served, calls
        not yet sent go elsewhere (a new connection, to our successor), running calls go on."""
        self.draining = True
        self.stop_accepting()
        for ep in list(self._clients):
            ep.announce_goaway()
        self.flush()

    async def wait_drained(self, round_trip: float = 1.0) -> None:
        """Return once every caller connection has had its final GOAWAY (at its PING's answer,
        or after ``round_trip`` seconds without one), no call is in flight, and every caller
        connection has written out what it had queued and closed."""
        with trio.move_on_after(round_trip):
            while any(ep.goaway == "announced" for ep in self._clients):  # noqa: ASYNC110 - one round trip
                await trio.sleep(0.005)
        for ep in list(self._clients):
            ep.final_goaway()
        self.flush()
        await self.wait_idle()
        # A call is over once its trailers are queued, not written: each connection closes itself
        # when its queue is out (the last answers, the final GOAWAY). Closing before would cut an
        # answer the final GOAWAY called processed, and the caller would not send it again.
        while self._clients:  # noqa: ASYNC110 - bounded by the daemon's grace period
            await trio.sleep(0.005)
