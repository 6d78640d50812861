"""The transport: what every HTTP/2 connection, stream and call of krproxy's runs in.

A :class:`Transport` owns the connections (:class:`~krproxy.relay.connection.Endpoint`: callers
accepted on a listener, upstreams opened by a :class:`~krproxy.relay.route.Route`), the task
group their readers, writers and handlers run in, the write-out of what a pass of the readers
queued (:meth:`Transport.flush`), the callers' deadlines, the records of finished calls, graceful
draining, and the unary calls of our own (:meth:`Transport.unary`). What a new stream from a
caller becomes is not its business: it is *given* ``open_call`` by the face that holds it, as
hypercorn's protocol objects are given ``send`` and a task group:

- :class:`krproxy.relay.Relay` routes each stream by path (relayed, intercepted, refused);
- :class:`krproxy.rpc.Server` answers each with a handler (:mod:`krproxy.relay.served`);
- :class:`krproxy.rpc.Channel` accepts none (it only makes calls: ``open_call`` is never asked).

No face subclasses another or the transport.
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import logging
import math
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import trio

from krproxy import calls, log
from krproxy.grpcstatus import GRPCError, Status
from krproxy.h2 import frames as f
from krproxy.relay import connection
from krproxy.relay._handlers import HandlerTasks
from krproxy.relay.call import report
from krproxy.relay.connection import STOPPED, Endpoint, Headers
from krproxy.relay.exchange import Exchange
from krproxy.relay.grpc import (
    MAX_OWN_ANSWER,
    REFUSED_ATTEMPTS,
    REFUSED_PAUSE,
    Answer,
    StreamReset,
    UpstreamError,
    grpc_message,
    own_call_headers,
)
from krproxy.relay.half import Half

if TYPE_CHECKING:
    from krproxy.relay.call import Call
    from krproxy.relay.intercepted import LocalCall
    from krproxy.relay.route import Route
    from krproxy.relay.served import Served
    from krproxy.relay.state import CallState

__all__ = ["MAX_CONNECTIONS", "MAX_REQUEST", "OpenCall", "Transport"]

LOGGER = logging.getLogger("krproxy.relay")

#: Caller connections served at once; one more is closed at once (counted in the log), so that
#: a client opening connections in a loop cannot use up the daemon's file descriptors.
MAX_CONNECTIONS = 1000

#: Largest request message accepted (``--max-request-message-size``), as containerd's limit.
MAX_REQUEST = 16 * 1024 * 1024

#: What a face does with a stream a caller opened: ``open_call(ep, stream_id, headers, end,
#: body)``. It makes a call of the stream (and puts its half in ``ep.halves``), answers it at
#: once, or resets it. ``body``: the request's whole body, read with its headers (the DATA frame
#: ending the stream, on a transport with :attr:`Transport.whole_requests`), else None. It
#: returns whether it took the body (its connection credit included); if not, the body goes to
#: the stream's half as any DATA would, after open_call.
OpenCall = Callable[[Endpoint, int, Headers, bool, "bytes | None"], bool]


def _refuse_every_stream(
    ep: Endpoint, stream_id: int, headers: Headers, end: bool, body: bytes | None
) -> bool:
    """The ``open_call`` of a transport that serves no caller (a :class:`krproxy.rpc.Channel`'s)."""
    ep.reset_stream(stream_id, f.REFUSED_STREAM)
    return False


class Transport:
    """Connections, their tasks and the calls on them (see the module docstring).

    Args:
        open_call: what a stream a caller opened becomes (:data:`OpenCall`); by default it is
            refused (a transport that only makes calls).
        observers: told about every finished call (:class:`krproxy.calls.CallRecord`).
        enforce_deadlines: False: a caller's ``grpc-timeout`` is passed on but not enforced here
            (the fake plugin uses this to hang the way a real server that ignores deadlines does).
    """

    def __init__(
        self,
        open_call: OpenCall = _refuse_every_stream,
        observers: list[calls.Observer] | None = None,
        *,
        enforce_deadlines: bool = True,
    ) -> None:
        self.open_call = open_call
        self.observers = observers if observers is not None else []  # kept, not copied
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
        #: (off for a server that plays one with rules of its own: the fakes).
        self.check_request_headers = True
        #: Whether a caller's request whose HEADERS and DATA frame ending it are read together
        #: comes to ``open_call`` with its body (the core's ``whole_requests``): for a face that
        #: never resets a stream on its headers alone (a :class:`krproxy.rpc.Server` without
        #: ``check_headers``). Read as each connection opens.
        self.whole_requests = False
        #: The worker threads header blocks are decoded in when the event loop would spend too
        #: long on them (connection.DECODE_PER_TURN): one for large blocks and one for small
        #: ones, for all connections, so that peers sending many share two threads' worth of
        #: the interpreter and the event loop keeps the rest.
        self.large_decodes = trio.CapacityLimiter(1)
        self.small_decodes = trio.CapacityLimiter(1)
        self.nursery: trio.Nursery = None  # type: ignore[assignment]  # set by run()
        self.dirty: list[Endpoint] = []
        #: True while a reader hands a frame's events to the calls (synchronous): a call finished
        #: then is reported to the observers after the next :meth:`flush` (the reader's, on every
        #: way out), so its record and metrics are off the answer's path.
        self.defer_records = False
        self._unrecorded: list[Call | LocalCall | Served] = []
        self.in_flight = 0
        self.draining = False
        self._idle_waiters: list[trio.Event] = []
        self._accepting: trio.CancelScope | None = None
        self._clients: set[Endpoint] = set()
        self._upstreams: set[Endpoint] = set()
        self._turned_away = 0  # connections closed at once: MAX_CONNECTIONS were open
        self._deadlines: list[list[Any]] = []  # heap of [deadline, seq, call; None once finished]
        self._dead_timers = 0
        self._seq = itertools.count()
        self._timer: trio.CancelScope | None = None
        #: The tasks calls' handlers run in (:class:`krproxy.relay._handlers.HandlerTasks`).
        self.handlers = HandlerTasks()

    # -- running -----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the transport's tasks (without accepting callers) until cancelled.

        Enough for calls of our own (:meth:`unary`). On cancellation every connection is
        closed; calls still running end (the upstream streams are reset).
        """
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = self.handlers.nursery = nursery
                nursery.start_soon(self._expire_deadlines)
                task_status.started()
                await trio.sleep_forever()
        finally:
            for ep in [*self._clients, *self._upstreams]:
                ep.close(STOPPED)
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
            self.nursery.start_soon(self._serve, ep, self._clients)  # the accept loop is in no call
            self.flush()

    def open_upstream(self, sock: socket.socket, route: Route) -> Endpoint:
        """A connection to an upstream on ``sock`` (connected), read from now on."""
        ep = Endpoint(self, sock, server_side=False, route=route)
        self._upstreams.add(ep)
        self.spawn(lambda: self._serve(ep, self._upstreams))
        return ep

    @staticmethod
    async def _serve(ep: Endpoint, held: set[Endpoint]) -> None:
        try:
            await ep.run()
        finally:
            held.discard(ep)

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

    def call_started(self, call: CallState, deadline: float | None) -> None:
        """A call of a caller's began: counted in flight, and ended at its ``deadline`` (trio's
        clock; None: none) if deadlines are enforced."""
        self.in_flight += 1
        if deadline is not None and self.enforce_deadlines:
            self._add_deadline(call, deadline)

    def call_finished(self, call: CallState, kind: Call | LocalCall | Served) -> None:
        """A call of a caller's is over: its deadline entry dropped, its ``kind`` reported (now,
        or at the next :meth:`flush` while :attr:`defer_records`)."""
        self.in_flight -= 1
        if call.timer is not None:  # (not the finished call, with its request and reply)
            self._drop_timer(call.timer)
            call.timer = None
        if self.in_flight == 0 and self._idle_waiters:
            for event in self._idle_waiters:
                event.set()
            self._idle_waiters.clear()
        if self.observers or kind.watcher is not None:
            if self.defer_records:
                self._unrecorded.append(kind)
            else:
                report(kind, self.observers)

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

        ``watched``: ``deadline`` is that of a call the transport ends at it anyway (an
        :class:`~krproxy.relay.intercepted.LocalCall`'s timer answers DEADLINE_EXCEEDED and cancels
        the handler, which resets this stream): sent upstream as ``grpc-timeout``, with no cancel
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
    ) -> Exchange:
        exchange = Exchange(max_answer)
        ep = route.endpoint()
        upstream = exchange.upstream = Half(ep, 0, exchange, exchange)
        ep.open_stream(upstream, f.encode_headers(own_call_headers(path, deadline, metadata)), False)
        upstream.send_data(framed, True)
        self.flush()
        # The deadline is the transport's timer's (as a caller's call's), not a cancel scope of this
        # task's: entering and leaving one cost each plugin call ~50 Python calls.
        timer = None if watched or deadline == math.inf else self._add_timer(exchange, deadline)
        try:
            await exchange.done.wait()
        finally:
            if timer is not None:
                self._drop_timer(timer)
            if (
                exchange.timed_out or not exchange.done.is_set()
            ):  # the deadline passed, or our caller was cancelled
                upstream.abort(f.CANCEL)
                exchange.settle()
                self.flush()
        if exchange.timed_out:
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

    # -- deadlines ---------------------------------------------------------------------

    def _add_deadline(self, call: CallState, deadline: float) -> None:
        call.deadline = deadline
        call.timer = self._add_timer(call, deadline)

    def _add_timer(self, due: CallState | Exchange, deadline: float) -> list[Any]:
        """Have ``due.expire()`` called at ``deadline`` (trio time) unless the entry returned is
        dropped first (:meth:`_drop_timer`)."""
        entry = [deadline, next(self._seq), due]
        heapq.heappush(self._deadlines, entry)
        if self._timer is not None and deadline < self._timer.deadline:
            self._timer.deadline = deadline
        # Entries of finished calls stay until due: rebuild the heap without them once they are
        # the majority, so they do not pile up.
        if self._dead_timers > 100 and self._dead_timers * 2 > len(self._deadlines):
            self._deadlines = [entry for entry in self._deadlines if entry[2] is not None]
            heapq.heapify(self._deadlines)
            self._dead_timers = 0
        return entry

    def _drop_timer(self, entry: list[Any]) -> None:
        """Forget a timer of :meth:`_add_timer`'s: its entry stays in the heap until due (kubelet's
        deadlines are minutes long), but not what it would have expired. An entry the timer expired is
        out of the heap already: not counted again."""
        if entry[2] is not None:
            entry[2] = None
            self._dead_timers += 1

    async def _expire_deadlines(self) -> None:
        while True:
            heap = self._deadlines
            with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as self._timer:
                await trio.sleep_forever()
            self._timer = None
            now = trio.current_time()
            heap = self._deadlines
            while heap and (heap[0][0] <= now or heap[0][2] is None):  # due, or dropped: not waited for
                entry = heapq.heappop(heap)
                due = entry[2]
                if due is None:  # finished before its deadline
                    self._dead_timers -= 1
                else:
                    entry[2] = None  # (out of the heap: the call's end drops it without counting it)
                    due.expire()
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
