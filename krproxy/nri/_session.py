"""One NRI socket on trio: a ttrpc server on one multiplexed connection, a ttrpc client on the other.

The protocol is in :mod:`krproxy.nri._ttrpc` and :mod:`krproxy.nri._mux` (no I/O); this module is the
only code that touches the socket. A plugin serves on :data:`~krproxy.nri._mux.PLUGIN_SERVICE_CONN` and
calls on :data:`~krproxy.nri._mux.RUNTIME_SERVICE_CONN`; the runtime (krproxy's fake, in the tests) the
other way round.

Resource handling:
    :meth:`Session.run` reads until the peer closes the socket or breaks the protocol, then fails every
    call still waiting with :class:`ConnectionLost`, cancels the handlers still running and closes the
    stream. A handler is called on the reader's task as its request is read: one that answers at once
    (returns the bytes) is answered there, with every other answer to the same read, in one write; one
    that returns an awaitable finishes in its own task, under the caller's deadline (``timeout_nano``):
    one that outlives it is cancelled and the stream answered ``DEADLINE_EXCEEDED`` (the caller has
    given up by then). A handler that answers at once cannot be cancelled anyway (it never yields to
    trio), so the deadline changes nothing for it; the inline answer saves the trip through trio's
    scheduler (a task spawned, woken, and a second write) that made most of a call's time when the
    handler itself is fast.

Error handling:
    A handler's :class:`TtrpcError` becomes the answer's status; any other exception is answered
    ``UNKNOWN`` with its text (what Go's ttrpc does with a plain error) and logged. Garbage from the peer
    at the ttrpc level is answered by the protocol (:mod:`~krproxy.nri._ttrpc`); garbage in NRI's framing
    ends the session (logged; :attr:`Session.reason` says so).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping

import attrs
import trio

from krproxy.grpcstatus import Status
from krproxy.nri import _mux, _ttrpc

__all__ = ["AsyncHandler", "ConnectionLost", "Handler", "Session", "TtrpcError"]

LOGGER = logging.getLogger("krproxy.nri.ttrpc")

#: Bytes asked of the socket per read.
_READ_SIZE = 65536

#: A method's implementation: the request's serialized argument in, the serialized answer out: at once
#: (bytes), or an awaitable of it (an ``async def`` handler) when it must wait for something.
Handler = Callable[[bytes], bytes | Awaitable[bytes]]
#: A handler that always waits (``async def``): what ``krproxy nri``'s are (each calls a hook server).
AsyncHandler = Callable[[bytes], Awaitable[bytes]]


class TtrpcError(Exception):
    """A call answered with a status other than OK (or a handler's way to answer one)."""

    def __init__(self, code: Status, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class ConnectionLost(Exception):
    """The socket closed (or broke the protocol) before the call was answered."""


@attrs.define(eq=False)
class _Waiter:
    done: trio.Event = attrs.field(factory=trio.Event)
    response: _ttrpc.Response | None = None
    error: BaseException | None = None


@attrs.define(eq=False)
class Session:
    """An NRI socket speaking ttrpc both ways.

    Args:
        stream: the connected socket.
        serve_on: the multiplexed connection whose calls ``handlers`` answer.
        call_on: the multiplexed connection :meth:`call` uses.
        handlers: ``{(service, method): handler}``; full service names, e.g. ``nri.pkg.api.v1alpha1.Plugin``.
    """

    _stream: trio.abc.Stream
    serve_on: int
    call_on: int
    _handlers: Mapping[tuple[str, str], Handler]
    _server: _ttrpc.Connection = attrs.field(
        factory=lambda: _ttrpc.Connection(_ttrpc.Role.SERVER), init=False
    )
    _client: _ttrpc.Connection = attrs.field(
        factory=lambda: _ttrpc.Connection(_ttrpc.Role.CLIENT), init=False
    )
    _demux: _mux.Demultiplexer = attrs.field(factory=_mux.Demultiplexer, init=False)
    _send_lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)
    _waiters: dict[int, _Waiter] = attrs.field(factory=dict, init=False)
    _lost: BaseException | None = attrs.field(default=None, init=False)
    #: Set whenever a received request has been answered (or the session ended): :meth:`wait_idle` polls it.
    _answered: trio.Event = attrs.field(factory=trio.Event, init=False)

    @property
    def closed(self) -> bool:
        return self._lost is not None

    @property
    def reason(self) -> str:
        """Why the session ended ("" while it runs)."""
        return str(self._lost) if self._lost is not None else ""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve and dispatch until the socket closes or the peer breaks NRI's framing, then return.

        :attr:`reason` says which.
        """
        try:
            async with trio.open_nursery() as handlers:
                task_status.started()
                try:
                    await self._read(handlers)
                finally:
                    handlers.cancel_scope.cancel()
        finally:
            self._lose(self._lost or ConnectionLost("NRI connection closed"))
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await self._stream.aclose()

    async def _read(self, handlers: trio.Nursery) -> None:
        while True:
            try:
                data = await self._stream.receive_some(_READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                # Closed by this side (aclose: a re-subscription, a failed registration, a stop): keep its
                # reason. trio's "another task closed this fd" says only that the read was cut short.
                if self._lost is None:
                    self._lost = ConnectionLost(f"NRI connection lost: {exc}")
                return
            if not data:
                self._lost = ConnectionLost("NRI connection closed by the peer")
                return
            try:
                self._demux.receive_data(bytes(data))
            except _mux.MuxError as exc:
                LOGGER.error("%s", exc)
                self._lost = ConnectionLost(str(exc))
                return
            while (frame := self._demux.next_frame()) is not None:
                conn_id, payload = frame
                if conn_id == self.serve_on:
                    self._server.receive_data(payload)
                elif conn_id == self.call_on:
                    self._client.receive_data(payload)
                else:  # as NRI's multiplexer does with a connection nobody opened
                    LOGGER.debug("dropped %d bytes for NRI connection %d", len(payload), conn_id)
            if self._dispatch(handlers):
                await self._flush()
                self._answered.set()  # only now: the answers are on the wire
            else:
                await self._flush()  # what the protocol answered by itself (bad stream ids, ...)

    def _dispatch(self, handlers: trio.Nursery) -> bool:
        """Hand the events read so far on; whether a request was answered at once (to be flushed)."""
        answered = False
        while (event := self._server.next_event()) is not None:
            if isinstance(event, _ttrpc.RequestReceived):
                answered |= self._start(handlers, event.stream_id, event.request)
            elif isinstance(event, _ttrpc.Ignored):
                LOGGER.debug("ttrpc server ignored a message on stream %d: %s", event.stream_id, event.reason)
        while (event := self._client.next_event()) is not None:
            if isinstance(event, _ttrpc.ResponseReceived):
                waiter = self._waiters.pop(event.stream_id, None)
                if waiter is not None:
                    waiter.response = event.response
                    waiter.done.set()
            elif isinstance(event, _ttrpc.Ignored):
                LOGGER.debug("ttrpc client ignored a message on stream %d: %s", event.stream_id, event.reason)
        return answered

    def _start(self, handlers: trio.Nursery, stream_id: int, request: _ttrpc.Request) -> bool:
        """Call the request's handler on the reader's task; answer it now if it answered at once (True),
        else finish it in a task of its own (False)."""
        handler = self._handlers.get((request.service, request.method))
        if handler is None:
            known = {service for service, _ in self._handlers}
            what = f"method {request.method}" if request.service in known else f"service {request.service}"
            response = _error(Status.UNIMPLEMENTED, what)
        else:
            try:
                answer = handler(request.payload)
            except Exception as exc:
                response = _failed(request, exc)
            else:
                if not isinstance(answer, bytes):
                    handlers.start_soon(self._finish, stream_id, request, answer)
                    return False
                response = _ttrpc.Response(payload=answer)
        self._server.send_response(stream_id, response)
        return True

    async def _finish(self, stream_id: int, request: _ttrpc.Request, answer: Awaitable[bytes]) -> None:
        """Await a handler's answer under the caller's deadline, and send it."""
        deadline = math.inf
        if request.timeout_nano > 0:
            deadline = trio.current_time() + request.timeout_nano / 1e9
        response = _error(Status.DEADLINE_EXCEEDED, "context deadline exceeded")
        with trio.move_on_at(deadline):
            try:
                response = _ttrpc.Response(payload=await answer)
            except Exception as exc:
                response = _failed(request, exc)
        if self.closed:
            return
        self._server.send_response(stream_id, response)
        await self._flush()
        self._answered.set()  # only now: the answer is on the wire

    async def wait_idle(self) -> None:
        """Return once every request received so far has been answered, or the session ended.

        For closing the connection without failing the calls in flight (the peer takes a call cut off by
        a close as the plugin's failure).
        """
        while self._server.pending and self._lost is None:
            self._answered = trio.Event()
            await self._answered.wait()

    async def call(self, service: str, method: str, payload: bytes) -> bytes:
        """Call ``service/method`` on the peer; the answer's payload, or :class:`TtrpcError`.

        The caller's deadline (its enclosing cancel scopes, e.g. ``trio.fail_after``) is sent to the peer as
        the call's ``timeout_nano``, as Go's client sends its context's. Cancelled, the call is forgotten
        (ttrpc has no cancel message; a late answer is dropped). Raises :class:`ConnectionLost` when the
        socket goes first; a request over ttrpc's 4 MiB is not sent and fails RESOURCE_EXHAUSTED.
        """
        if self._lost is not None:
            raise ConnectionLost(str(self._lost))
        deadline = trio.current_effective_deadline()
        timeout_nano = 0 if math.isinf(deadline) else max(1, int((deadline - trio.current_time()) * 1e9))
        request = _ttrpc.Request(service, method, payload, timeout_nano)
        waiter = _Waiter()
        async with self._send_lock:  # stream ids must reach the wire in increasing order
            if self._lost is not None:  # lost while this call waited for the lock: nothing will answer
                raise ConnectionLost(str(self._lost))
            try:
                stream_id = self._client.send_request(request)
            except _ttrpc.OversizedMessage as exc:  # unsent: this call fails alone, as Go's client fails it
                raise TtrpcError(Status.RESOURCE_EXHAUSTED, exc.message) from None
            self._waiters[stream_id] = waiter
            await self._flush_locked()
        try:
            await waiter.done.wait()
        finally:
            if not waiter.done.is_set():
                self._client.cancel(stream_id)
                self._waiters.pop(stream_id, None)
        if waiter.error is not None:
            raise ConnectionLost(str(waiter.error))
        assert waiter.response is not None
        status = waiter.response.status
        if not status.ok:
            raise TtrpcError(status.code, status.message)
        return waiter.response.payload

    async def aclose(self, reason: str = "NRI connection closed by krproxy") -> None:
        """Close the socket; :meth:`run` then returns, with ``reason`` as its :attr:`reason`."""
        self._lose(ConnectionLost(reason))
        await self._stream.aclose()

    async def _flush(self) -> None:
        """Write what both connections have queued, if anything (nothing queued: no checkpoint)."""
        if not (self._server.has_outbound or self._client.has_outbound):
            return
        if self._send_lock.locked():
            await self._send_lock.acquire()
        else:
            self._send_lock.acquire_nowait()  # free: no trip through the scheduler for it
        try:
            await self._flush_locked()
        finally:
            self._send_lock.release()

    async def _flush_locked(self) -> None:
        out = b"".join(_mux.frames(self.serve_on, m) for m in self._server.messages_to_send())
        out += b"".join(_mux.frames(self.call_on, m) for m in self._client.messages_to_send())
        if not out or self._lost is not None:
            return
        try:
            await self._stream.send_all(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._lose(ConnectionLost(f"NRI connection lost: {exc}"))

    def _lose(self, error: BaseException) -> None:
        if self._lost is None:
            self._lost = error
        self._answered.set()
        for waiter in self._waiters.values():
            waiter.error = self._lost
            waiter.done.set()
        self._waiters.clear()


def _error(code: Status, message: str) -> _ttrpc.Response:
    return _ttrpc.Response(_ttrpc.RpcStatus(code, message))


def _failed(request: _ttrpc.Request, exc: Exception) -> _ttrpc.Response:
    """A handler's exception as its answer: a TtrpcError's status, else UNKNOWN with its text (logged)."""
    if isinstance(exc, TtrpcError):
        return _error(exc.code, exc.message)
    LOGGER.error("NRI %s/%s failed", request.service, request.method, exc_info=exc)
    return _error(Status.UNKNOWN, str(exc) or type(exc).__name__)
