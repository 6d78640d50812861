"""HTTP/2 connections of the relay (RFC 9113).

An :class:`Endpoint` is one connection, to a caller (kubelet) or to an upstream (the runtime, a
plugin). A :class:`~krproxy.relay.half.Half` is one stream on it; the relay pairs two halves
into a call (:mod:`krproxy.relay.rpc`), and the endpoint hands each frame of a stream to that
call. A :class:`~krproxy.relay.route.Route` holds the connection to one upstream socket.

Protocol state is the HTTP/2 core's (:class:`krproxy.h2.connection.Connection`, one per
endpoint): the endpoint drives it. Its reading side (:mod:`krproxy.relay._input`) feeds the core
what it reads and turns its events into the calls' steps; this module holds the rest: writing,
streams, graceful shutdown, and the limits. What one caller connection may have buffered is
bounded (:data:`MAX_HELD`), as is what calls with hook points have collected of its requests
(they are taken whole before the hooks run), and its streams (:data:`CALLER_MAX_STREAMS`) and
the calls waiting for an upstream stream slot (:data:`MAX_WAITING`), which take turns by caller
connection (flow control: :mod:`krproxy.relay.half`).

I/O: non-blocking sockets in one trio thread. A reader task per connection parses what
arrived and hands it on; whatever that queued on any connection is then written with a plain
``send`` (:meth:`Transport.flush <krproxy.relay.transport.Transport.flush>`); a writer task waits only when a socket's buffer is full.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import time
from typing import TYPE_CHECKING

import trio

from krproxy import log
from krproxy.h2 import frames as f

# The limits and window sizes are the HTTP/2 core's (krproxy.h2.connection), one source for both.
from krproxy.h2.connection import (
    CONNECTION_WINDOW,
    MAX_HEADER_BLOCK,
    MAX_HEADER_LIST,
    MAX_WINDOW_SHIFTS,
    STREAM_WINDOW,
    Connection,
    Role,
)
from krproxy.relay._input import DECODE_PER_TURN, LARGE_BLOCK, Reader, _Closed, _Terminated
from krproxy.relay._queue import FairQueue

if TYPE_CHECKING:
    from krproxy.relay.half import Half
    from krproxy.relay.route import Route
    from krproxy.relay.transport import Transport

__all__ = [
    "CALLER_MAX_STREAMS",
    "CONNECTION_WINDOW",
    "DECODE_PER_TURN",
    "HANDSHAKE_TIMEOUT",
    "LARGE_BLOCK",
    "MAX_HEADER_BLOCK",
    "MAX_HEADER_LIST",
    "MAX_HELD",
    "MAX_UNSENT",
    "MAX_WAITING",
    "MAX_WINDOW_SHIFTS",
    "STREAM_WINDOW",
    "Endpoint",
    "Headers",
]

LOGGER = logging.getLogger("krproxy.relay")
#: The message :meth:`Endpoint.run` logs a bug of ours with (the tests fail on it: tests/conftest.py).
BUG_MESSAGE = "krproxy failed on its connection to the %s"

Headers = list[tuple[bytes, bytes]]

#: Bytes queued for a peer beyond which the connection is closed (see Endpoint.try_send).
MAX_UNSENT = 64 * 1024 * 1024
#: Bytes of answers held for one caller connection (relayed but not yet within its windows)
#: beyond which that connection is closed: a caller that stops reading ends its own calls.
#: Each stream holds at most one stream window (:data:`STREAM_WINDOW`). Also the most request
#: bytes calls with hook points may have collected from one connection at once: a call that
#: would pass it is RESOURCE_EXHAUSTED.
MAX_HELD = 256 * 1024 * 1024
#: Streams one caller connection may have open (the SETTINGS_MAX_CONCURRENT_STREAMS we
#: advertise); one beyond it is refused (RST_STREAM REFUSED_STREAM, RFC 9113 §5.1.2).
CALLER_MAX_STREAMS = 1000
#: Seconds a caller has to send the HTTP/2 connection preface before its connection is closed
#: (grpc-go servers, containerd among them, give 120 s; kubelet sends it at once).
HANDSHAKE_TIMEOUT = 20.0
#: Seconds a drained caller connection is read on after its final GOAWAY is out and its write side
#: shut, until the caller closes it (a lingering close): a caller that opened a stream, or answered
#: a PING, just before it read the GOAWAY must be able to write that, then read the GOAWAY that
#: says its stream was not processed and send it again elsewhere. A close at once fails its write
#: (EPIPE), and grpcio then fails the call UNAVAILABLE instead of retrying it.
LINGER = 2.0
#: How long a connection whose peer stopped taking our writes (EPIPE, ECONNRESET) is read on for what
#: the peer sent before it went: a runtime restarting says in a GOAWAY which streams it never
#: processed, so that their calls are sent again. A peer that closed is read to its end at once; one
#: that only stopped reading (``shutdown(SHUT_RD)``) is closed after this.
READ_AFTER_SEND_FAILED = 1.0
#: Calls waiting for a stream slot on one upstream connection (its peer's
#: MAX_CONCURRENT_STREAMS); beyond it a call fails at once instead of queueing: the latest of
#: the caller with the most calls waiting (which may be the new call).
MAX_WAITING = 10_000

RETIRED = "retired"
STOPPED = "krproxy stopped"
DRAINED = "drained"

#: What a socket error says happened to the connection, in words instead of an errno string.
_PEER_ENDED = {
    errno.ECONNRESET: "connection reset by peer",  # it closed with our bytes unread, e.g. it crashed
    errno.EPIPE: "connection closed by peer",  # it closed, or stopped reading, before our write
}


def _socket_trouble(err: OSError | trio.ClosedResourceError) -> str:
    """Why a read or write failed: the peer's doing in words (:data:`_PEER_ENDED`), else the error."""
    if isinstance(err, OSError) and err.errno in _PEER_ENDED:
        return _PEER_ENDED[err.errno]
    return str(err) or type(err).__name__


class Endpoint:
    """One HTTP/2 connection: to a caller (``server_side``) or to an upstream (``route``'s). The
    driver of a :class:`krproxy.h2.connection.Connection`: socket, deadlines, writing, streams,
    shutdown; its :class:`~krproxy.relay._input.Reader` (``reader``) reads and hands the core's
    events to the calls. It belongs to a :class:`~krproxy.relay.transport.Transport`."""

    def __init__(
        self, transport: Transport, sock: socket.socket, *, server_side: bool, route: Route | None = None
    ) -> None:
        sock.setblocking(False)
        self.transport = transport
        self.sock = sock
        self.server_side = server_side
        self.route = route
        self.h2 = Connection(
            Role.SERVER if server_side else Role.CLIENT,
            max_concurrent_streams=transport.caller_max_streams if server_side else None,
            check_request_headers=transport.check_request_headers,
            max_window_shifts=MAX_WINDOW_SHIFTS,  # read here: tests lower it
            stepwise=True,  # each event is acted on before the core reads on (Reader._handle)
            whole_requests=server_side and transport.whole_requests,
        )
        self.h2.blocks.decode_budget = DECODE_PER_TURN
        self.out = self.h2.output  # written from and trimmed in place
        self.dirty = False
        self.writing = False
        self.closing = False  # close once `out` is written (a drained connection)
        self.closed = False
        self.lingering = False  # closed with its write side shut, read on until the caller closes
        self.send_failed = ""  # why the peer takes no more writes: read on, then closed with it
        self.retiring = False  # takes no new streams (GOAWAY received, or ids used up)
        self.halves: dict[int, Half] = {}
        # Bytes queued on upstream halves still waiting for a stream slot.
        self.waiting_held = 0
        #: MAX_HELD when the connection opened (its halves read it here).
        self.max_held = MAX_HELD
        # Request bytes collected from this caller by calls with hook points still running (each
        # is taken whole before its hooks run); bounded by MAX_HELD too (krproxy.relay.rpc).
        self.collected = 0
        # Upstream halves waiting for a stream slot (peer's MAX_CONCURRENT_STREAMS), with their headers.
        self.waiting = FairQueue()
        self.reading = trio.CancelScope()  # run() replaces it: the preface's deadline, the linger's
        self.reader = Reader(self)
        self.touch()

    @property
    def held(self) -> int:
        """Bytes queued here: received elsewhere, not yet within this connection's windows."""
        return self.h2.sender.buffered + self.waiting_held

    @property
    def recv_window(self) -> int:
        """What the peer may still send on the connection (the core's)."""
        return self.h2.inflow.recv_window

    @property
    def to_grant(self) -> int:
        """Connection credit taken, not yet sent back in a WINDOW_UPDATE (the core's)."""
        return self.h2.inflow.to_grant

    @property
    def goaway(self) -> str | None:
        """Graceful shutdown of a caller's connection (RFC 9113 §6.8): None, "announced" (a
        GOAWAY with the largest id and a PING are out), or "final" (GOAWAY with the last id we
        process: streams above it are refused, the connection closes once idle)."""
        return self.h2.sender.goaway_state

    # -- output ------------------------------------------------------------------------

    def touch(self) -> None:
        """The core may have queued bytes: have the transport write them out (Transport.flush)."""
        if self.out and not self.dirty:
            self.dirty = True
            self.transport.dirty.append(self)

    def mark_dirty(self) -> None:
        """Have the transport's next flush look at this connection (try_send closes one past its limits)."""
        if not self.dirty:
            self.dirty = True
            self.transport.dirty.append(self)

    def try_send(self) -> None:
        """Write out what is buffered, without waiting; a writer task takes over the rest."""
        self.dirty = False
        if self.closed or not self.out:
            return
        if self.send_failed:  # the peer takes no more: what is left to read decides the calls' fate
            self.out.clear()
            return
        if len(self.out) > MAX_UNSENT:
            # Data is flow controlled, so only a peer that sends (pings, resets) without reading
            # gets here; it would fill our memory with our answers to it.
            self.close(f"the peer does not read: {len(self.out)} bytes unsent")
            return
        if self.server_side and self.held > MAX_HELD:
            # A caller's. What waits for an upstream is requests of many callers, each bounded
            # by the windows it has from us: never a reason to close it on every caller.
            self.close(f"the peer does not read: {self.held} bytes of answers held for it")
            return
        if self.writing:
            return
        try:
            sent = self.sock.send(self.out)
        except BlockingIOError:
            sent = 0
        except OSError as err:
            self._send_failed(err)
            return
        if sent == len(self.out):
            self.out.clear()
            return
        del self.out[:sent]
        self.writing = True
        self.transport.spawn(self._write_rest)

    async def _write_rest(self) -> None:
        try:
            while self.out and not self.closed:
                try:
                    await trio.lowlevel.wait_writable(self.sock)
                    sent = self.sock.send(self.out)
                except BlockingIOError:
                    continue
                except (OSError, trio.ClosedResourceError) as err:
                    self._send_failed(err)
                    return
                del self.out[:sent]
        finally:
            self.writing = False
            if self.closing and not self.out:
                self.close(DRAINED)

    def _send_failed(self, err: OSError | trio.ClosedResourceError) -> None:
        """A write failed. Where the peer went away (EPIPE, ECONNRESET), what it sent before it went is
        still in the socket: the reader reads it to its end and closes (a GOAWAY read there says which
        streams the peer never processed, and their calls are sent again on a new connection, as when
        the GOAWAY is read first). Nothing more is written, no new stream comes here, and the reading
        ends within :data:`READ_AFTER_SEND_FAILED`. Any other failure, or one on a connection already
        closed (a write after a drain's close), goes to :meth:`close` as before."""
        reason = f"send failed: {_socket_trouble(err)}"
        if self.closed or not isinstance(err, (BrokenPipeError, ConnectionResetError)):
            self.close(reason)  # (on a closed connection: what close() did before, ending a linger)
            return
        self.send_failed = reason
        self.out.clear()
        if self.route is not None:
            self.route.drop(self)
        self.reading.deadline = min(self.reading.deadline, trio.current_time() + READ_AFTER_SEND_FAILED)

    def grant(self, size: int) -> None:
        """Connection credit for ``size`` received bytes (the streams' comes separately)."""
        self.h2.acknowledge_connection_data(size)
        self.touch()

    # -- streams -----------------------------------------------------------------------

    def open_stream(self, half: Half, block: bytes, end: bool) -> None:
        """Start ``half`` as a new stream carrying ``block``, or queue it for a free slot."""
        half.opened = False
        if len(self.halves) >= self.h2.sender.peer_max_streams:
            if len(self.waiting) >= MAX_WAITING:
                # Refused: the call of the caller with the most calls waiting, which is this one
                # or that caller's latest, so that one caller cannot lock the others out.
                reason = f"{self.describe}: {len(self.waiting)} calls already wait for a stream slot"
                evicted = self.waiting.evict_for(half)
                refused = half if evicted is None else evicted[0]
                refused.reset = True
                refused.state.upstream_gone(reason)
                if evicted is None:
                    return
            self.waiting.append((half, block, end))
            return
        self._start(half, block, end)

    def _start(self, half: Half, block: bytes, end: bool) -> None:
        h2 = self.h2
        if h2.state.next_id > f.MAX_STREAM_ID:  # ids used up while it waited: not sent, so refused
            half.reset = True
            half.state.upstream_gone(f"{self.describe}: stream ids used up on this connection", True)
            return
        limit = h2.over_peer_limit(block)
        if limit is not None:  # not sent: that call fails as grpc-go's client fails it
            half.reset = True
            reason = (
                f"header list size to send violates the maximum size ({limit} bytes) set by {self.describe}"
            )
            half.state.upstream_gone(reason, reset_code=f.INTERNAL_ERROR)
            return
        s = half.s
        queued = len(s.pending)
        self.waiting_held -= queued
        stream_id = h2.start_stream(block, end, stream=s)
        half.opened = True
        self.halves[stream_id] = half
        self.touch()
        if h2.state.next_id > f.MAX_STREAM_ID:
            self.retire()
        half.state.backend_clock = time.perf_counter()
        sent = queued - len(s.pending)
        if sent and half.peer is not None:
            half.peer.grant(sent)
        if s.send_ended:
            half.state.settle()

    def forget(self, half: Half) -> None:
        s = half.s
        if s.pending or s.end_pending or s.trailers_pending is not None:
            half.drop_pending()  # a stream reset by its peer, or on a lost connection, left it
        waiting = self.waiting
        if not half.opened:  # ended while it waited for a slot: it holds no place in the queue
            waiting.remove(half)
        elif self.halves.get(s.id) is half:
            del self.halves[s.id]
            self.h2.release_stream(s.id)
        if waiting.count:
            self.start_waiting()
        if self.retiring and not self.halves and not waiting.count:
            self.close(RETIRED)
        elif self.h2.sender.goaway_state == "final" and not self.halves:
            self.close_when_sent()

    def reset_stream(self, stream_id: int, code: int) -> None:
        """RST_STREAM on a stream the relay will not serve; frames the peer sent before it sees
        it are ignored (RFC 9113 §5.1)."""
        self.h2.reset_stream(stream_id, code)
        self.touch()

    def announce_goaway(self) -> None:
        """First step of a graceful shutdown (RFC 9113 §6.8): GOAWAY with the largest stream id,
        so the caller opens no new streams but those already on their way are still served, and
        a PING whose answer tells that they have all arrived (then :meth:`final_goaway`)."""
        if self.goaway is not None or self.closed:
            return
        self.h2.announce_goaway()
        self.touch()

    def final_goaway(self) -> None:
        """Second step: GOAWAY with the last stream id processed; later streams are refused (the
        caller sends them again elsewhere), and the connection closes once its calls are over."""
        if self.goaway == "final" or self.closed:
            return
        self.h2.final_goaway()
        self.touch()
        if not self.halves:
            self.close_when_sent()

    def close_when_sent(self) -> None:
        """Close once everything queued (the last answers, the GOAWAY) is written out."""
        self.closing = True
        self.try_send()
        if not self.out and not self.writing:
            self.close(DRAINED)

    def start_waiting(self) -> None:
        """Start what waits for a stream slot, as far as the peer's limit allows."""
        if self.h2.control.goaway_received:  # none after it (RFC 9113 §6.8): Reader._on_goaway refused them
            return
        while self.waiting and len(self.halves) < self.h2.sender.peer_max_streams and not self.closed:
            waiting, block, end = self.waiting.popleft()
            if not waiting.done:
                self._start(waiting, block, end)

    def retire(self) -> None:
        """Take no new streams; close once the running ones are over."""
        self.retiring = True
        if self.route is not None:
            self.route.drop(self)
        if not self.halves and not self.waiting:
            self.close(RETIRED)

    # -- input -------------------------------------------------------------------------

    async def run(self) -> None:
        """Read and handle frames until the connection ends, then end its calls."""
        reason = "connection closed"
        deadline = trio.current_time() + HANDSHAKE_TIMEOUT if self.server_side else math.inf
        deadline = min(deadline, self.reading.deadline)  # a linger begun before this task ran
        try:
            with trio.CancelScope(deadline=deadline) as self.reading:
                await self.reader.read()
            # read() only ever ends by raising: here the deadline cancelled it.
            if self.send_failed:
                reason = self.send_failed
            elif self.lingering:  # (any reason but DRAINED closes the socket: see close())
                reason = f"drained; not closed by the caller within {LINGER:g} s of the final GOAWAY"
            else:
                reason = f"no HTTP/2 connection preface within {HANDSHAKE_TIMEOUT:g} s"
                log.warning(LOGGER, "handshake_timeout", peer=self.describe)
        except _Closed:
            reason = self.send_failed or "connection closed by peer"
        except _Terminated as err:
            reason = f"HTTP/2 protocol error: {err}"
            log.warning(LOGGER, "protocol_error", peer=self.describe, error=err)
            if not self.closed:
                self.try_send()  # the core's GOAWAY
        except (OSError, trio.ClosedResourceError) as err:
            reason = _socket_trouble(err)
        except trio.Cancelled:
            reason = STOPPED
            raise
        except Exception as err:  # a bug of ours: it ends this connection, not the daemon
            reason = f"internal error: {type(err).__name__}: {err}"
            LOGGER.exception(BUG_MESSAGE, self.describe)
        finally:
            self.close(reason)
            self.transport.flush()

    @property
    def describe(self) -> str:
        return self.route.describe if self.route is not None else "caller"

    # -- the end ---------------------------------------------------------------------

    def close(self, reason: str) -> None:
        """Close the socket and end every call on it. A drained caller connection only shuts its
        write side and is read on until the caller closes it, at most :data:`LINGER` seconds."""
        if self.closed:
            if self.lingering and reason is not DRAINED:  # the caller closed, the linger is over, or a stop
                self._close_socket()
            return
        self.closed = True
        if self.route is not None:
            self.route.lost(self, reason)
        if reason is DRAINED and self.server_side:
            self._linger()
        else:
            self._close_socket()
        self.out.clear()
        for half in list(self.halves.values()) + [w[0] for w in self.waiting]:
            if half.state.finished:
                continue
            half.reset = True
            if self.server_side:
                half.state.caller_gone()
            else:
                half.state.upstream_gone(reason)
        self.halves.clear()
        self.waiting.clear()

    def _linger(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)  # the caller reads the final GOAWAY, then the end
        except OSError:  # it is gone already
            self._close_socket()
            return
        self.lingering = True
        self.reading.deadline = min(self.reading.deadline, trio.current_time() + LINGER)

    def _close_socket(self) -> None:
        self.lingering = False
        if self.sock.fileno() >= 0:
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()
