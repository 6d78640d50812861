"""HTTP/2 connections of the relay: framing state, flow control, streams (RFC 9113).

An :class:`Endpoint` is one connection, to a caller (kubelet) or to an upstream (the runtime, a
plugin). A :class:`Half` is one stream on it; the relay pairs two halves into a call
(:mod:`krproxy.relay.rpc`), and the endpoint hands each frame of a stream to that call. A
:class:`Route` holds the connection to one upstream socket and opens a new one when needed.

Flow control: a *stream's* credit is granted back to its sender only once its bytes were
written towards the other side, within that side's window, so a slow reader slows down its own
stream's writer and the relay holds at most one stream window of data per stream. The credit of
an *upstream connection* (shared by every caller) is granted back as soon as its bytes are
buffered here: a caller that stops reading holds up its own streams only, never the runtime
connection's window that every other caller needs. A caller's connection credit stays end to
end (its requests wait for the runtime's windows, not our memory). What one caller connection
may have buffered is bounded (:data:`MAX_HELD`), as is what calls with hook points have
collected of its requests (they are taken whole before the hooks run), and its streams (:data:`CALLER_MAX_STREAMS`)
and the calls waiting for an upstream stream slot (:data:`MAX_WAITING`), which take turns by
caller connection.

Protocol state is the HTTP/2 core's (:class:`krproxy.h2.connection.Connection`, one per
endpoint): the endpoint feeds it what it reads and turns its events into the calls' steps. The
core reads *stepwise*: it stops after each frame that made events, so each event is acted on
(a call answered, a stream reset or released) before the next frame meets the core's state.

I/O: non-blocking sockets in one trio thread. A reader task per connection parses what
arrived and hands it on; whatever that queued on any connection is then written with a plain
``send`` (:meth:`Relay.flush`); a writer task waits only when a socket's buffer is full.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol, cast

import hpack
import hpack.exceptions
import trio

from krproxy import log
from krproxy.h2 import events as ev
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
from krproxy.h2.streams import Stream

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
    "CallSide",
    "Credit",
    "Endpoint",
    "Half",
    "Headers",
    "Relay",
    "Route",
    "connect_unix",
]

LOGGER = logging.getLogger("krproxy.relay")

Headers = list[tuple[bytes, bytes]]

#: Bytes of header blocks a connection's reader decodes on the event loop between two waits
#: for its socket; a block that does not fit is decoded in a worker thread while the reader
#: waits (frames after it wait too: HPACK state is the connection's). HPACK decoding in Python
#: costs ~2 µs a field, and a field may take one byte: a 1 MiB block of indexed fields held
#: every other caller up for ~0.6 s, and blocks just small enough to be decoded here one after
#: the other would as well. 4 KiB is ~8 ms at worst, and ten to a hundred of kubelet's blocks.
DECODE_PER_TURN = 4 * 1024
#: Blocks this large and larger take the worker thread of large blocks
#: (``Relay.large_decodes``), others beyond DECODE_PER_TURN that of small ones
#: (``Relay.small_decodes``), so that a caller's few small blocks never wait for a peer's
#: megabyte.
LARGE_BLOCK = 16 * 1024
#: Seconds a decoding worker thread runs before the event loop's thread may take the
#: interpreter (GIL) back: Python's 5 ms made every step of other callers' calls (request,
#: forward, answer) wait up to 5 ms while a block was decoded aside.
_ASIDE_SWITCH_INTERVAL = 0.0001
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
#: Calls waiting for a stream slot on one upstream connection (its peer's
#: MAX_CONCURRENT_STREAMS); beyond it a call fails at once instead of queueing: the latest of
#: the caller with the most calls waiting (which may be the new call).
MAX_WAITING = 10_000
_RECV_SIZE = 256 * 1024
#: Reads handled back to back before the reader lets other tasks run.
_READS_PER_CHECKPOINT = 8

_RETIRED = "retired"
_STOPPED = "krproxy stopped"
_DRAINED = "drained"

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


class Relay(Protocol):
    """What a connection needs of the relay that owns it (:class:`krproxy.relay.relay.Relay`):
    named here so that this module does not import that one (no import cycle, not even for
    the type checker)."""

    dirty: list[Endpoint]
    caller_max_streams: int | None
    check_request_headers: bool
    large_decodes: trio.CapacityLimiter
    small_decodes: trio.CapacityLimiter

    def spawn(self, fn: Callable[[], Awaitable[object]]) -> None: ...
    def flush(self) -> None: ...
    def open_call(self, ep: Endpoint, stream_id: int, headers: Headers, end: bool) -> None: ...


class CallSide(Protocol):
    """What a stream's frames are handed to: a call in the relay (:mod:`krproxy.relay.rpc`)."""

    finished: bool
    backend_clock: float

    def on_request_data(self, data: bytes, end: bool) -> None: ...
    def on_request_trailers(self, headers: Headers) -> None: ...
    def on_reply_headers(self, headers: Headers, end: bool) -> None: ...
    def on_reply_data(self, data: bytes, end: bool) -> None: ...
    def caller_gone(self) -> None: ...
    def upstream_gone(self, reason: str, refused: bool = False, reset_code: int | None = None) -> None: ...
    def settle(self) -> None: ...


class Credit(Protocol):
    """Told of bytes queued on a half once they are written (or dropped): the paired half, whose
    sender gets flow-control credit back, or a local sender waiting for room (:mod:`krproxy.rpc`)."""

    def grant(self, size: int) -> None: ...


class _Over:
    """What a half reports to once its call is over (see :meth:`Half.release`): nothing."""

    finished = True
    backend_clock = 0.0

    def on_request_data(self, data: bytes, end: bool) -> None:
        pass

    def on_request_trailers(self, headers: Headers) -> None:
        pass

    def on_reply_headers(self, headers: Headers, end: bool) -> None:
        pass

    def on_reply_data(self, data: bytes, end: bool) -> None:
        pass

    def caller_gone(self) -> None:
        pass

    def upstream_gone(self, reason: str, refused: bool = False, reset_code: int | None = None) -> None:
        pass

    def settle(self) -> None:
        pass


_OVER = _Over()


_Waiting = tuple["Half", bytes, bool]


class _FairQueue:
    """Calls waiting for a stream slot, taken in turns by caller connection (round robin): a
    caller with hundreds of calls queued does not make another caller's one call wait behind
    them. The relay's own calls (hooked forwards, plugin and recovery calls) share one turn."""

    def __init__(self) -> None:
        self._queues: dict[object, deque[_Waiting]] = {}
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[_Waiting]:
        for queue in list(self._queues.values()):
            yield from list(queue)

    @staticmethod
    def _turn(half: Half) -> object:
        client = getattr(half.call, "client", None)
        return client.ep if client is not None else None

    def append(self, entry: _Waiting) -> None:
        self._queues.setdefault(self._turn(entry[0]), deque()).append(entry)
        self.count += 1

    def popleft(self) -> _Waiting:
        turn = next(iter(self._queues))
        queue = self._queues.pop(turn)
        entry = queue.popleft()
        if queue:
            self._queues[turn] = queue  # back at the end: the next caller's turn comes first
        self.count -= 1
        return entry

    def evict_for(self, half: Half) -> _Waiting | None:
        """The queue is full: the latest entry of the caller with the most calls waiting, taken
        out to make room for ``half``; None if ``half``'s caller would then have the most (it
        is the one to be refused)."""
        largest = max(self._queues, key=lambda turn: len(self._queues[turn]))
        queue = self._queues[largest]
        if len(self._queues.get(self._turn(half), ())) + 1 >= len(queue):
            return None
        entry = queue.pop()
        self.count -= 1
        if not queue:
            del self._queues[largest]
        return entry

    def remove(self, half: Half) -> None:
        queue = self._queues.get(self._turn(half))
        if queue is None:
            return
        kept = deque(entry for entry in queue if entry[0] is not half)
        self.count -= len(queue) - len(kept)
        if kept:
            self._queues[self._turn(half)] = kept
        else:
            del self._queues[self._turn(half)]

    def clear(self) -> None:
        self._queues.clear()
        self.count = 0


class _Closed(Exception):
    """The peer closed the connection."""


class _Terminated(Exception):
    """The HTTP/2 core ended the connection (the peer broke HTTP/2); its GOAWAY is queued."""

    def __init__(self, event: ev.ConnectionTerminated) -> None:
        super().__init__(event.reason)
        self.code = event.error_code


class Half:
    """One side of a relayed call: a stream on one connection.

    Its protocol state (windows, queued data, ends) is the core's :class:`~krproxy.h2.streams.Stream`,
    shared: the connection's own once the stream is open, a stream of its own while an upstream
    half waits for a slot (what is queued on it goes out when it starts)."""

    __slots__ = ("call", "ep", "opened", "peer", "s")

    def __init__(self, ep: Endpoint, stream_id: int, call: CallSide) -> None:
        self.ep = ep
        self.call = call
        self.peer: Credit | None = None
        stream = ep.h2.streams.get(stream_id) if stream_id else None
        self.opened = stream is not None
        self.s = stream if stream is not None else Stream(stream_id, 0, STREAM_WINDOW)

    # The stream's state, as the calls read (and mark) it.

    @property
    def id(self) -> int:
        return self.s.id

    @property
    def reset(self) -> bool:
        return self.s.reset

    @reset.setter
    def reset(self, value: bool) -> None:
        # The call is over without an RST_STREAM of ours (refused, or its connection lost).
        self.s.reset = value

    @property
    def recv_ended(self) -> bool:
        return self.s.recv_ended

    @recv_ended.setter
    def recv_ended(self, value: bool) -> None:
        self.s.recv_ended = value

    @property
    def send_ended(self) -> bool:
        return self.s.send_ended

    @property
    def headers_sent(self) -> bool:
        return self.s.headers_sent

    @property
    def pending(self) -> bytearray:
        return self.s.pending

    @property
    def done(self) -> bool:
        return self.s.done

    # -- sending towards this half's peer connection ---------------------------------------

    def send_data(self, data: bytes, end: bool) -> None:
        """Queue ``data`` (from the paired half) and send what the windows allow."""
        s = self.s
        over = s.reset or s.send_ended  # a variable: the send below may end it (no narrowing)
        if over:
            if self.peer is not None:
                self.peer.grant(len(data))
            return
        ep = self.ep
        if not self.opened:  # waiting for a slot: queued until it starts
            s.pending += data
            ep.waiting_held += len(data)
            if end:
                s.end_pending = True
            return
        taken = ep.h2.send_data(s.id, data, end)
        if not ep.dirty:
            ep.touch()
        if taken and self.peer is not None:
            self.peer.grant(taken)
        if ep.server_side and ep.h2.buffered > MAX_HELD and not ep.dirty:  # try_send closes it
            ep.dirty = True
            ep.relay.dirty.append(ep)
        if s.send_ended:
            self.call.settle()

    def send_trailers(self, block: bytes) -> None:
        """Send a header block ending the stream, after any data still queued."""
        s = self.s
        over = s.reset or s.send_ended  # a variable: the send below may end it (no narrowing)
        if over:
            return
        if not self.opened:
            s.trailers_pending = block
            return
        ep = self.ep
        sent = ep.h2.send_trailers(s.id, block)
        if not ep.dirty:
            ep.touch()
        if sent and self.peer is not None:
            self.peer.grant(sent)
        if s.send_ended:
            self.call.settle()

    def send_headers(self, block: bytes, end: bool) -> None:
        """Send response (or request) headers at once; they are not flow controlled."""
        s = self.s
        if s.reset or s.send_ended:
            return
        ep = self.ep
        ep.h2.send_headers(s.id, block, end)
        if not ep.dirty:
            ep.touch()
        if end:
            self.call.settle()

    # -- receiving: give flow-control credit back ------------------------------------------

    def grant(self, size: int) -> None:
        """``size`` bytes received on this half were passed on: let its sender send more.

        On a caller's connection that is connection credit too; an upstream connection got
        its credit back when the bytes arrived (see the module docstring)."""
        ep = self.ep
        ep.h2.acknowledge_received_data(self.s.id, size)
        if not ep.dirty:
            ep.touch()

    def grant_stream(self, size: int) -> None:
        """Stream credit only, for a reader of our own that gave the connection's credit back on
        arrival and gives the stream's once its messages are taken (:mod:`krproxy.rpc`)."""
        self.ep.h2.acknowledge_stream_data(self.s.id, size)
        self.ep.touch()

    def drop_pending(self) -> None:
        """Discard what is still queued here (data, its end, trailers), granting the data back to
        its sender (the paired half's connection), whose window would otherwise shrink for good."""
        s = self.s
        if self.opened:
            dropped = self.ep.h2.abandon_output(s.id)
        else:
            dropped = len(s.pending)
            self.ep.waiting_held -= dropped
            s.pending.clear()
            s.end_pending = False
            s.trailers_pending = None
        if dropped and self.peer is not None:
            self.peer.grant(dropped)

    def release(self) -> None:
        """The call is over: drop the references between this half, its call and its peer, so
        that their memory goes at once (reference counting), not at a full garbage collection."""
        self.call = _OVER
        self.peer = None
        self.s.trailers_pending = None

    def abort(self, code: int) -> None:
        """Reset this stream (RST_STREAM) unless it is over already."""
        if self.s.done:
            return
        ep = self.ep
        if self.opened and not ep.closed:
            dropped = ep.h2.reset_stream(self.s.id, code)
            ep.touch()
            if dropped and self.peer is not None:
                self.peer.grant(dropped)
            return
        self.drop_pending()
        self.s.reset = True


class Endpoint:
    """One HTTP/2 connection: to a caller (``server_side``) or to an upstream. The driver of a
    :class:`krproxy.h2.connection.Connection`: socket, deadlines, decoding large header blocks
    in a worker thread, flushing; the core's events become calls' steps."""

    def __init__(
        self, relay: Relay, sock: socket.socket, *, server_side: bool, route: Route | None = None
    ) -> None:
        sock.setblocking(False)
        self.relay = relay
        self.sock = sock
        self.server_side = server_side
        self.route = route
        self.h2 = Connection(
            Role.SERVER if server_side else Role.CLIENT,
            max_concurrent_streams=relay.caller_max_streams if server_side else None,
            check_request_headers=relay.check_request_headers,
            max_window_shifts=MAX_WINDOW_SHIFTS,  # read here: tests lower it
            stepwise=True,  # each event is acted on before the core reads on (see _handle)
        )
        self.h2.decode_budget = DECODE_PER_TURN
        self.out = self.h2.output  # written from and trimmed in place
        self.dirty = False
        self.writing = False
        self.closing = False  # close once `out` is written (a drained connection)
        self.closed = False
        self.retiring = False  # takes no new streams (GOAWAY received, or ids used up)
        self.halves: dict[int, Half] = {}
        # Bytes queued on upstream halves still waiting for a stream slot.
        self.waiting_held = 0
        # Request bytes collected from this caller by calls with hook points still running (each
        # is taken whole before its hooks run); bounded by MAX_HELD too (krproxy.relay.rpc).
        self.collected = 0
        # Upstream halves waiting for a stream slot (peer's MAX_CONCURRENT_STREAMS), with their headers.
        self.waiting = _FairQueue()
        self._handshake = trio.CancelScope()  # run() replaces it: the preface's deadline
        self.touch()

    @property
    def held(self) -> int:
        """Bytes queued here: received elsewhere, not yet within this connection's windows."""
        return self.h2.buffered + self.waiting_held

    @property
    def recv_window(self) -> int:
        """What the peer may still send on the connection (the core's)."""
        return self.h2.recv_window

    @property
    def to_grant(self) -> int:
        """Connection credit taken, not yet sent back in a WINDOW_UPDATE (the core's)."""
        return self.h2.to_grant

    @property
    def goaway(self) -> str | None:
        """Graceful shutdown of a caller's connection (RFC 9113 §6.8): None, "announced" (a
        GOAWAY with the largest id and a PING are out), or "final" (GOAWAY with the last id we
        process: streams above it are refused, the connection closes once idle)."""
        return self.h2.goaway_state

    # -- output ------------------------------------------------------------------------

    def touch(self) -> None:
        """The core may have queued bytes: have the relay write them out (Relay.flush)."""
        if self.out and not self.dirty:
            self.dirty = True
            self.relay.dirty.append(self)

    def try_send(self) -> None:
        """Write out what is buffered, without waiting; a writer task takes over the rest."""
        self.dirty = False
        if self.closed or not self.out:
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
            self.close(f"send failed: {_socket_trouble(err)}")
            return
        if sent == len(self.out):
            self.out.clear()
            return
        del self.out[:sent]
        self.writing = True
        self.relay.spawn(self._write_rest)

    async def _write_rest(self) -> None:
        try:
            while self.out and not self.closed:
                try:
                    await trio.lowlevel.wait_writable(self.sock)
                    sent = self.sock.send(self.out)
                except BlockingIOError:
                    continue
                except (OSError, trio.ClosedResourceError) as err:
                    self.close(f"send failed: {_socket_trouble(err)}")
                    return
                del self.out[:sent]
        finally:
            self.writing = False
            if self.closing and not self.out:
                self.close(_DRAINED)

    def grant(self, size: int) -> None:
        """Connection credit for ``size`` received bytes (the streams' comes separately)."""
        self.h2.acknowledge_connection_data(size)
        self.touch()

    # -- streams -----------------------------------------------------------------------

    def open_stream(self, half: Half, block: bytes, end: bool) -> None:
        """Start ``half`` as a new stream carrying ``block``, or queue it for a free slot."""
        half.opened = False
        if len(self.halves) >= self.h2.peer_max_streams:
            if len(self.waiting) >= MAX_WAITING:
                # Refused: the call of the caller with the most calls waiting, which is this one
                # or that caller's latest, so that one caller cannot lock the others out.
                reason = f"{self.describe}: {len(self.waiting)} calls already wait for a stream slot"
                evicted = self.waiting.evict_for(half)
                refused = half if evicted is None else evicted[0]
                refused.reset = True
                refused.call.upstream_gone(reason)
                if evicted is None:
                    return
            self.waiting.append((half, block, end))
            return
        self._start(half, block, end)

    def _start(self, half: Half, block: bytes, end: bool) -> None:
        h2 = self.h2
        if h2.next_id > f.MAX_STREAM_ID:  # ids used up while it waited: not sent, so refused
            half.reset = True
            half.call.upstream_gone(f"{self.describe}: stream ids used up on this connection", True)
            return
        s = half.s
        queued = len(s.pending)
        self.waiting_held -= queued
        stream_id = h2.start_stream(block, end, stream=s)
        half.opened = True
        self.halves[stream_id] = half
        self.touch()
        if h2.next_id > f.MAX_STREAM_ID:
            self.retire()
        half.call.backend_clock = time.perf_counter()
        sent = queued - len(s.pending)
        if sent and half.peer is not None:
            half.peer.grant(sent)
        if s.send_ended:
            half.call.settle()

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
            self._start_waiting()
        if self.retiring and not self.halves and not waiting.count:
            self.close(_RETIRED)
        elif self.h2.goaway_state == "final" and not self.halves:
            self._close_when_sent()

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
            self._close_when_sent()

    def _close_when_sent(self) -> None:
        """Close once everything queued (the last answers, the GOAWAY) is written out."""
        self.closing = True
        self.try_send()
        if not self.out and not self.writing:
            self.close(_DRAINED)

    def _start_waiting(self) -> None:
        while self.waiting and len(self.halves) < self.h2.peer_max_streams and not self.closed:
            waiting, block, end = self.waiting.popleft()
            if not waiting.done:
                self._start(waiting, block, end)

    def retire(self) -> None:
        """Take no new streams; close once the running ones are over."""
        self.retiring = True
        if self.route is not None:
            self.route.drop(self)
        if not self.halves and not self.waiting:
            self.close(_RETIRED)

    # -- input -------------------------------------------------------------------------

    async def run(self) -> None:
        """Read and handle frames until the connection ends, then end its calls."""
        reason = "connection closed"
        deadline = trio.current_time() + HANDSHAKE_TIMEOUT if self.server_side else math.inf
        try:
            with trio.CancelScope(deadline=deadline) as self._handshake:
                await self._read_loop()
            # _read_loop only ever ends by raising: here the deadline cancelled it.
            reason = f"no HTTP/2 connection preface within {HANDSHAKE_TIMEOUT:g} s"
            log.event(LOGGER, "handshake_timeout", level=logging.WARNING, peer=self.describe)
        except _Closed:
            reason = "connection closed by peer"
        except _Terminated as err:
            reason = f"HTTP/2 protocol error: {err}"
            log.event(LOGGER, "protocol_error", level=logging.WARNING, peer=self.describe, error=err)
            if not self.closed:
                self.try_send()  # the core's GOAWAY
        except (OSError, trio.ClosedResourceError) as err:
            reason = _socket_trouble(err)
        except trio.Cancelled:
            reason = _STOPPED
            raise
        finally:
            self.close(reason)
            self.relay.flush()

    @property
    def describe(self) -> str:
        return self.route.describe if self.route is not None else "caller"

    async def _read_loop(self) -> None:
        sock = self.sock
        h2 = self.h2
        preface_due = self.server_side
        reads = 0
        while True:
            try:
                data = sock.recv(_RECV_SIZE)
            except BlockingIOError:
                reads = 0
                h2.decode_budget = DECODE_PER_TURN
                await trio.lowlevel.wait_readable(sock)
                continue
            if not data:
                raise _Closed()
            await self._handle(h2.receive_data(data))
            if preface_due and h2.preface_received:
                preface_due = False
                self._handshake.deadline = math.inf
            reads += 1
            if reads >= _READS_PER_CHECKPOINT:
                reads = 0
                await trio.lowlevel.checkpoint()

    async def _handle(self, events: list[ev.Event]) -> None:
        """Hand the core's events to the calls, waiting for a worker thread to decode each
        header block beyond what the event loop decodes (:data:`DECODE_PER_TURN`)."""
        h2 = self.h2
        unread = h2.unread
        while events:
            self._dispatch(events)
            last = events[-1]
            kind = last.__class__
            if kind is ev.HeaderBlockReceived:
                events = await self._decode_block_aside(cast(ev.HeaderBlockReceived, last).block)
            elif kind is ev.ConnectionTerminated:
                self.touch()
                self.relay.flush()
                raise _Terminated(cast(ev.ConnectionTerminated, last))
            elif len(unread) >= f.HEAD_SIZE:
                # The core stopped after this frame's events (stepwise): on with the rest.
                events = h2.next_events()
            else:
                break
        self.touch()
        self.relay.flush()

    async def _decode_block_aside(self, block: bytes) -> list[ev.Event]:
        """Decode a header block the core handed out in a worker thread, and go on."""
        self.touch()
        self.relay.flush()
        large = len(block) >= LARGE_BLOCK
        try:
            headers: Headers | f.ProtocolError = await trio.to_thread.run_sync(
                _decode_aside,
                self.h2.decoder,
                block,
                limiter=self.relay.large_decodes if large else self.relay.small_decodes,
                abandon_on_cancel=True,  # a relay stopping does not wait for it
            )
        except f.ProtocolError as err:
            headers = err
        if self.closed:  # closed meanwhile (e.g. it stopped reading our answers)
            raise trio.ClosedResourceError("connection closed")
        return self.h2.receive_headers(headers)

    def _dispatch(self, events: list[Any]) -> None:
        # Events are read without cast() (a function call each on the hot path).
        server = self.server_side
        halves = self.halves
        for event in events:
            kind = event.__class__
            if kind is ev.DataReceived:
                data = event
                half = halves.get(data.stream_id)
                if half is None:  # the relay refused it (and the core reset it)
                    self.h2.acknowledge_received_data(data.stream_id, data.flow_controlled_length)
                elif server:
                    half.call.on_request_data(data.data, data.end_stream)
                else:
                    half.call.on_reply_data(data.data, data.end_stream)
            elif kind is ev.RequestReceived:
                request = event
                self.relay.open_call(self, request.stream_id, request.headers, request.end_stream)
                if request.stream_id not in halves:  # refused or answered at once: not ours to keep
                    self.h2.release_stream(request.stream_id)
            elif kind is ev.HeadersReceived:
                reply = event
                half = halves.get(reply.stream_id)
                if half is not None:
                    half.call.on_reply_headers(reply.headers, reply.end_stream)
                    if reply.end_stream:
                        half.call.settle()
            elif kind is ev.DataSent:
                sent = event
                half = halves.get(sent.stream_id)
                if half is not None:
                    if sent.size and half.peer is not None:
                        half.peer.grant(sent.size)
                    if sent.stream_ended:
                        half.call.settle()
            elif kind is ev.TrailersReceived:
                trailers = event
                half = halves.get(trailers.stream_id)
                if half is not None:
                    half.call.on_request_trailers(trailers.headers)
                    half.call.settle()
            elif kind is ev.StreamReset:
                self._on_reset(event)
            elif kind is ev.SettingsChanged:
                self._start_waiting()
            elif kind is ev.PingAcked:
                if self.goaway == "final" and not halves and not self.closing:
                    self._close_when_sent()  # the drain PING came back: the final GOAWAY is out
            elif kind is ev.GoAwayReceived:
                self._on_goaway(event)

    def _on_reset(self, event: ev.StreamReset) -> None:
        half = self.halves.get(event.stream_id)
        if half is None:
            return
        if event.unsent and half.peer is not None:
            half.peer.grant(event.unsent)
        code = event.error_code
        if self.server_side:
            half.call.caller_gone()
        elif event.remote:
            refused = code == f.REFUSED_STREAM  # not processed (RFC 9113 §8.7): safe to send again
            name = f.ERROR_NAMES.get(code, f"HTTP/2 error code {code}")
            half.call.upstream_gone(f"{self.describe} reset the stream ({name})", refused, reset_code=code)
        else:
            half.call.upstream_gone(f"{self.describe} broke HTTP/2 on the stream ({f.ERROR_NAMES[code]})")

    def _on_goaway(self, event: ev.GoAwayReceived) -> None:
        if self.server_side:
            return  # the caller will open no more streams; the running ones go on
        self.retire()
        gone = [self.halves[i] for i in event.refused if i in self.halves] + [w[0] for w in self.waiting]
        for half in gone:
            half.reset = True  # above the last stream it will process: not processed, like a refusal
            half.call.upstream_gone(
                f"{self.describe} is going away (GOAWAY, HTTP/2 error code {event.error_code})", True
            )

    # -- the end ---------------------------------------------------------------------

    def close(self, reason: str) -> None:
        """Close the socket and end every call on it."""
        if self.closed:
            return
        self.closed = True
        if self.route is not None:
            self.route.lost(self, reason)
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()
        self.out.clear()
        for half in list(self.halves.values()) + [w[0] for w in self.waiting]:
            if half.call.finished:
                continue
            half.reset = True
            if self.server_side:
                half.call.caller_gone()
            else:
                half.call.upstream_gone(reason)
        self.halves.clear()
        self.waiting.clear()


def _decode_block(decoder: hpack.Decoder, block: bytes) -> Headers:
    """A header block decoded with the connection's HPACK state (on the event loop, or in a
    worker thread while the connection's reader waits). Raises a COMPRESSION_ERROR."""
    try:
        return cast(Headers, decoder.decode(block, raw=True))
    except (hpack.exceptions.HPACKError, IndexError, ValueError) as err:
        raise f.ProtocolError(f"undecodable header block: {err}", f.COMPRESSION_ERROR) from None


class _Aside:
    """The interpreter's switch interval while blocks are decoded in worker threads
    (:data:`_ASIDE_SWITCH_INTERVAL`): the first thread to start sets it, the last one to end
    puts the previous value back (two may decode at once, one per limiter)."""

    lock = threading.Lock()
    running = 0
    interval = 0.0

    @classmethod
    def enter(cls) -> None:
        with cls.lock:
            if not cls.running:
                cls.interval = sys.getswitchinterval()
                sys.setswitchinterval(min(cls.interval, _ASIDE_SWITCH_INTERVAL))
            cls.running += 1

    @classmethod
    def leave(cls) -> None:
        with cls.lock:
            cls.running -= 1
            if not cls.running:
                sys.setswitchinterval(cls.interval)


def _decode_aside(decoder: hpack.Decoder, block: bytes) -> Headers:
    """:func:`_decode_block` in a worker thread, the event loop's thread getting the interpreter
    back more often meanwhile (:class:`_Aside`)."""
    _Aside.enter()
    try:
        return _decode_block(decoder, block)
    finally:
        _Aside.leave()


class Route:
    """Where one kind of call goes: a runtime socket, or the in-process server.

    Holds one upstream connection at a time, opened on first use and again after it was
    lost, so a restarted runtime is picked up by the next call. ``on_state(reachable, error)``
    is told when the runtime answers after being unreachable, and when it cannot be reached.
    """

    def __init__(
        self,
        relay: Relay,
        describe: str,
        connect: Callable[[], socket.socket],
        *,
        on_state: Callable[[bool, str], None] | None = None,
    ) -> None:
        self.relay = relay
        self.describe = describe
        self.connect = connect
        self.on_state = on_state
        self.reachable: bool | None = None
        self.ep: Endpoint | None = None

    def endpoint(self) -> Endpoint:
        """The connection new calls go on; connects first if there is none. Raises OSError."""
        ep = self.ep
        if ep is None or ep.closed or ep.retiring:
            try:
                sock = self.connect()
            except OSError as err:
                self._unreachable(str(err) or type(err).__name__)
                raise
            ep = self.ep = Endpoint(self.relay, sock, server_side=False, route=self)
            self.relay.spawn(ep.run)
        return ep

    def drop(self, ep: Endpoint) -> None:
        if self.ep is ep:
            self.ep = None

    def lost(self, ep: Endpoint, reason: str) -> None:
        self.drop(ep)
        if reason in (_RETIRED, _STOPPED):
            return
        running = len(ep.halves) + len(ep.waiting)
        if running:
            self._unreachable(reason, calls=running)
        else:  # an idle connection ended: nothing was lost, the next call reconnects
            log.event(LOGGER, "backend_disconnected", backend=self.describe, reason=reason)

    def mark_reachable(self) -> None:
        if self.reachable is not True:
            self.reachable = True
            if self.on_state is not None:
                self.on_state(True, "")

    def _unreachable(self, error: str, calls: int = 0) -> None:
        # A warning once per event: the backend going down, or a connection breaking under calls.
        # While it stays down, each further failed connect (every call, every recovery retry) is
        # a debug line, not a warning per kubelet call.
        news = self.reachable is not False or calls > 0
        self.reachable = False
        if self.on_state is not None:
            self.on_state(False, error)
        log.event(
            LOGGER,
            "backend_unavailable",
            level=logging.WARNING if news else logging.DEBUG,
            backend=self.describe,
            error=error,
            calls=calls,
        )


def connect_unix(path: str) -> Callable[[], socket.socket]:
    """A connect function for :class:`Route`: a non-blocking connection to the socket at ``path``."""

    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
        except BlockingIOError:
            sock.close()  # a unix socket refuses at once when its backlog is full
            raise ConnectionRefusedError(f"{path}: listen backlog full") from None
        except BaseException:
            sock.close()
            raise
        return sock

    return connect
