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
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Protocol

import hpack
import hpack.exceptions
import trio

from krproxy import log
from krproxy.h2 import frames as f
from krproxy.h2 import hpackmemo

# The limits and window sizes are the HTTP/2 core's (krproxy.h2.connection), one source for both.
from krproxy.h2.connection import (
    CONNECTION_WINDOW,
    DRAIN_PING,
    HTTP1_PEER,
    MAX_HEADER_BLOCK,
    MAX_HEADER_LIST,
    MAX_WINDOW_SHIFTS,
    RESET_IDS_KEPT,
    STREAM_WINDOW,
)

LOGGER = logging.getLogger("krproxy.relay")

Headers = list[tuple[bytes, bytes]]

#: Granted bytes are sent back in WINDOW_UPDATEs once this much has accumulated.
_STREAM_GRANT_AT = STREAM_WINDOW // 4
_CONNECTION_GRANT_AT = CONNECTION_WINDOW // 4
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

#: A private flag on a header block: its HEADERS frame made the stream depend on itself.
_SELF_DEPENDENT = 0x100

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
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[_Waiting]:
        for queue in list(self._queues.values()):
            yield from list(queue)

    @staticmethod
    def _turn(half: Half) -> object:
        client = getattr(half.call, "client", None)
        return client.ep if client is not None else None

    def append(self, entry: _Waiting) -> None:
        self._queues.setdefault(self._turn(entry[0]), deque()).append(entry)
        self._count += 1

    def popleft(self) -> _Waiting:
        turn = next(iter(self._queues))
        queue = self._queues.pop(turn)
        entry = queue.popleft()
        if queue:
            self._queues[turn] = queue  # back at the end: the next caller's turn comes first
        self._count -= 1
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
        self._count -= 1
        if not queue:
            del self._queues[largest]
        return entry

    def remove(self, half: Half) -> None:
        queue = self._queues.get(self._turn(half))
        if queue is None:
            return
        kept = deque(entry for entry in queue if entry[0] is not half)
        self._count -= len(queue) - len(kept)
        if kept:
            self._queues[self._turn(half)] = kept
        else:
            del self._queues[self._turn(half)]

    def clear(self) -> None:
        self._queues.clear()
        self._count = 0


class _Closed(Exception):
    """The peer closed the connection."""


class Half:
    """One side of a relayed call: a stream on one connection."""

    __slots__ = (
        "call",
        "end_pending",
        "ep",
        "expect",
        "headers_sent",
        "id",
        "opened",
        "peer",
        "pending",
        "recv_ended",
        "recv_window",
        "reset",
        "send_ended",
        "send_window",
        "to_grant",
        "trailers_pending",
    )

    def __init__(self, ep: Endpoint, stream_id: int, call: CallSide) -> None:
        self.ep = ep
        self.id = stream_id
        self.call = call
        self.peer: Credit | None = None
        self.opened = True
        self.send_window = ep.peer_initial_window
        self.recv_window = STREAM_WINDOW
        self.to_grant = 0
        self.pending = bytearray()
        self.end_pending = False
        self.trailers_pending: bytes | None = None
        self.headers_sent = False
        self.recv_ended = False
        self.send_ended = False
        self.reset = False
        #: Request bytes still due by the caller's content-length header (None: it sent none).
        self.expect: int | None = None

    @property
    def done(self) -> bool:
        return self.reset or (self.send_ended and self.recv_ended)

    # -- sending towards this half's peer connection ---------------------------------------

    def send_data(self, data: bytes, end: bool) -> None:
        """Queue ``data`` (from the paired half) and send what the windows allow."""
        if self.reset or self.send_ended:
            if self.peer is not None:
                self.peer.grant(len(data))
            return
        ep = self.ep
        size = len(data)
        if (
            self.opened
            and not self.pending
            and size <= self.send_window
            and size <= ep.send_window
            and size <= ep.peer_max_frame
        ):
            # The common case: the whole chunk fits; no queueing, no copy into `pending`.
            if size or end:
                ep.write(
                    f.HEAD.pack(size >> 16, size & 0xFFFF, f.DATA, f.END_STREAM if end else 0, self.id) + data
                )
            self.send_window -= size
            ep.send_window -= size
            if end:
                self.send_ended = True
            if self.peer is not None and size:
                self.peer.grant(size)
            if end:
                self.call.settle()
            return
        self.pending += data
        ep.held += size
        if ep.server_side and ep.held > MAX_HELD and not ep.dirty:  # try_send closes it, outside this frame
            ep.dirty = True
            ep.relay.dirty.append(ep)
        if end:
            self.end_pending = True
        self.pump()

    def send_trailers(self, block: bytes) -> None:
        """Send a header block ending the stream, after any data still queued."""
        if self.reset or self.send_ended:
            return
        self.trailers_pending = block
        self.pump()

    def send_headers(self, block: bytes, end: bool) -> None:
        """Send response (or request) headers at once; they are not flow controlled."""
        if self.reset or self.send_ended:
            return
        self.headers_sent = True
        self.ep.write(self.ep.header_frames(self.id, block, end))
        if end:
            self.send_ended = True
            self.call.settle()

    def pump(self) -> None:
        """Send queued data within the windows; then the queued end of stream or trailers."""
        if not self.opened or self.reset or self.send_ended:
            return
        ep = self.ep
        pending = self.pending
        sent = 0
        total = len(pending)
        if total:
            view = memoryview(pending)
            while sent < total:
                size = min(total - sent, self.send_window, ep.send_window, ep.peer_max_frame)
                if size <= 0:
                    break
                last = sent + size == total
                flags = f.END_STREAM if last and self.end_pending and self.trailers_pending is None else 0
                ep.write(f.HEAD.pack(size >> 16, size & 0xFFFF, f.DATA, flags, self.id))
                ep.write(view[sent : sent + size])
                sent += size
                self.send_window -= size
                ep.send_window -= size
                if flags:
                    self.send_ended = True
            view.release()
            del pending[:sent]
            ep.held -= sent
            if sent and self.peer is not None:
                self.peer.grant(sent)
        if pending:
            ep.blocked[self.id] = self
            return
        ep.blocked.pop(self.id, None)
        if self.trailers_pending is not None:
            block, self.trailers_pending = self.trailers_pending, None
            ep.write(ep.header_frames(self.id, block, True))
            self.send_ended = True
        elif self.end_pending and not self.send_ended:
            ep.write(f.frame(f.DATA, f.END_STREAM, self.id))
            self.send_ended = True
        if self.send_ended:
            self.call.settle()

    # -- receiving: give flow-control credit back ------------------------------------------

    def grant(self, size: int) -> None:
        """``size`` bytes received on this half were passed on: let its sender send more.

        On a caller's connection that is connection credit too; an upstream connection got
        its credit back when the bytes arrived (see the module docstring)."""
        ep = self.ep
        if ep.server_side:
            ep.grant(size)
        if not self.recv_ended and not self.reset:
            self.to_grant += size
            if self.to_grant >= _STREAM_GRANT_AT:
                ep.write(f.window_update(self.id, self.to_grant))
                self.recv_window += self.to_grant
                self.to_grant = 0

    def grant_stream(self, size: int) -> None:
        """Stream credit only, for a reader of our own that gave the connection's credit back on
        arrival and gives the stream's once its messages are taken (:mod:`krproxy.rpc`)."""
        if not self.recv_ended and not self.reset:
            self.to_grant += size
            if self.to_grant >= _STREAM_GRANT_AT:
                self.ep.write(f.window_update(self.id, self.to_grant))
                self.recv_window += self.to_grant
                self.to_grant = 0

    def drop_pending(self) -> None:
        """Discard the data still queued here, granting it back to its sender (the paired half's
        connection), whose window would otherwise shrink for good."""
        if self.pending:
            if self.peer is not None:
                self.peer.grant(len(self.pending))
            self.ep.held -= len(self.pending)
            self.pending.clear()

    def release(self) -> None:
        """The call is over: drop the references between this half, its call and its peer, so
        that their memory goes at once (reference counting), not at a full garbage collection."""
        self.call = _OVER
        self.peer = None
        self.trailers_pending = None

    def abort(self, code: int) -> None:
        """Reset this stream (RST_STREAM) unless it is over already."""
        if self.done:
            return
        self.reset = True
        self.drop_pending()
        self.ep.blocked.pop(self.id, None)
        if self.opened and not self.ep.closed:
            self.ep.reset_stream(self.id, code)


class Endpoint:
    """One HTTP/2 connection: to a caller (``server_side``) or to an upstream."""

    def __init__(
        self, relay: Relay, sock: socket.socket, *, server_side: bool, route: Route | None = None
    ) -> None:
        sock.setblocking(False)
        self.relay = relay
        self.sock = sock
        self.server_side = server_side
        self.route = route
        self.out = bytearray()
        self.dirty = False
        self.writing = False
        self.closing = False  # close once `out` is written (a drained connection)
        self.closed = False
        self.retiring = False  # takes no new streams (GOAWAY received, or ids used up)
        self.halves: dict[int, Half] = {}
        self.blocked: dict[int, Half] = {}  # halves with data waiting for send window
        self.held = 0  # bytes in the halves' `pending`: received elsewhere, not yet sent here
        # Request bytes collected from this caller by calls with hook points still running (each
        # is taken whole before its hooks run); bounded by MAX_HELD too (krproxy.relay.rpc).
        self.collected = 0
        # Upstream halves waiting for a stream slot (peer's MAX_CONCURRENT_STREAMS), with their headers.
        self.waiting = _FairQueue()
        self.send_window = f.DEFAULT_WINDOW
        self.peer_initial_window = f.DEFAULT_WINDOW
        self.peer_max_frame = f.DEFAULT_MAX_FRAME
        # Until the peer's SETTINGS say otherwise, no more streams than RFC 9113 asks every
        # peer to allow: h2 (grpclib) closes the connection on a stream beyond its limit.
        self.peer_max_streams = 100
        self._peer_settings_seen = False
        self._window_shifts = 0  # stream windows adjusted for the peer's INITIAL_WINDOW_SIZE changes
        self.recv_window = CONNECTION_WINDOW
        self.to_grant = 0
        self.next_id = 1
        self.last_peer_id = 0
        #: Graceful shutdown of a caller's connection (RFC 9113 §6.8): None, "announced" (a
        #: GOAWAY with the largest id and a PING are out), or "final" (GOAWAY with the last id
        #: we process: streams above it are refused, the connection closes once idle).
        self.goaway: str | None = None
        self.peer_table_size = 4096  # SETTINGS_HEADER_TABLE_SIZE, for our encoder (RFC 7541 §4.2)
        self.table_update = False  # a dynamic table size update is owed in the next block
        # Streams we reset lately: frames the peer sent before it saw that are ignored.
        self._reset_ids: set[int] = set()
        self._reset_order: deque[int] = deque()
        self.decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)
        self._continuation: tuple[int, int, bytearray] | None = None
        # A header block left for a worker thread (see DECODE_PER_TURN), with its stream and
        # flags, and the bytes of blocks decoded on the event loop since the socket was waited for.
        self._deferred: tuple[int, int, bytes] | None = None
        self._decoded = 0
        self._handshake = trio.CancelScope()  # run() replaces it: the preface's deadline
        ours = [(f.INITIAL_WINDOW_SIZE, STREAM_WINDOW)]
        if server_side:
            if relay.caller_max_streams is not None:
                ours.append((f.MAX_CONCURRENT_STREAMS, relay.caller_max_streams))
        else:
            self.out += f.PREFACE
            ours.append((f.ENABLE_PUSH, 0))
        self.write(f.settings(ours))
        self.write(f.window_update(0, CONNECTION_WINDOW - f.DEFAULT_WINDOW))

    # -- output ------------------------------------------------------------------------

    def write(self, data: bytes | memoryview) -> None:
        self.out += data
        if not self.dirty:
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
        self.to_grant += size
        if self.to_grant >= _CONNECTION_GRANT_AT:
            self.write(f.window_update(0, self.to_grant))
            self.recv_window += self.to_grant
            self.to_grant = 0

    # -- streams -----------------------------------------------------------------------

    def open_stream(self, half: Half, block: bytes, end: bool) -> None:
        """Start ``half`` as a new stream carrying ``block``, or queue it for a free slot."""
        half.opened = False
        half.trailers_pending = None
        half.headers_sent = False
        if len(self.halves) >= self.peer_max_streams:
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
        if self.next_id > f.MAX_STREAM_ID:  # ids used up while it waited: not sent, so refused
            half.reset = True
            half.call.upstream_gone(f"{self.describe}: stream ids used up on this connection", True)
            return
        half.id = self.next_id
        self.next_id += 2
        if self.next_id > f.MAX_STREAM_ID:
            self.retire()
        half.opened = True
        half.send_window = self.peer_initial_window
        self.halves[half.id] = half
        half.send_headers(block, end)
        half.call.backend_clock = time.perf_counter()
        half.pump()

    def forget(self, half: Half) -> None:
        half.drop_pending()  # a stream reset by its peer, or on a lost connection, left it
        if not half.opened:  # ended while it waited for a slot: it holds no place in the queue
            self.waiting.remove(half)
        if self.halves.get(half.id) is half:
            del self.halves[half.id]
        self.blocked.pop(half.id, None)
        self._start_waiting()
        if self.retiring and not self.halves and not self.waiting:
            self.close(_RETIRED)
        elif self.goaway == "final" and not self.halves:
            self._close_when_sent()

    def announce_goaway(self) -> None:
        """First step of a graceful shutdown (RFC 9113 §6.8): GOAWAY with the largest stream id,
        so the caller opens no new streams but those already on their way are still served, and
        a PING whose answer tells that they have all arrived (then :meth:`final_goaway`)."""
        if self.goaway is not None or self.closed:
            return
        self.goaway = "announced"
        self.write(f.goaway(f.MAX_STREAM_ID, f.NO_ERROR))
        self.write(f.frame(f.PING, 0, 0, DRAIN_PING))

    def final_goaway(self) -> None:
        """Second step: GOAWAY with the last stream id processed; later streams are refused (the
        caller sends them again elsewhere), and the connection closes once its calls are over."""
        if self.goaway == "final" or self.closed:
            return
        self.goaway = "final"
        self.write(f.goaway(self.last_peer_id, f.NO_ERROR))
        if not self.halves:
            self._close_when_sent()

    def _close_when_sent(self) -> None:
        """Close once everything queued (the last answers, the GOAWAY) is written out."""
        self.closing = True
        self.try_send()
        if not self.out and not self.writing:
            self.close(_DRAINED)

    def _start_waiting(self) -> None:
        while self.waiting and len(self.halves) < self.peer_max_streams and not self.closed:
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
        except f.ProtocolError as err:
            reason = f"HTTP/2 protocol error: {err}"
            log.event(LOGGER, "protocol_error", level=logging.WARNING, peer=self.describe, error=err)
            if not self.closed:
                self.write(f.goaway(self.last_peer_id, err.code, str(err).encode()[:200]))
                self.try_send()
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
        buf = bytearray()
        preface = self.server_side
        reads = 0
        while True:
            try:
                data = sock.recv(_RECV_SIZE)
            except BlockingIOError:
                reads = self._decoded = 0
                await trio.lowlevel.wait_readable(sock)
                continue
            if not data:
                raise _Closed()
            buf += data
            if preface:
                if len(buf) < len(f.PREFACE):
                    if not f.PREFACE.startswith(bytes(buf)):
                        raise f.ProtocolError("not an HTTP/2 connection preface")
                    continue
                if not buf.startswith(f.PREFACE):
                    raise f.ProtocolError("not an HTTP/2 connection preface")
                del buf[: len(f.PREFACE)]
                preface = False
                self._handshake.deadline = math.inf
            await self._handle(buf)
            reads += 1
            if reads >= _READS_PER_CHECKPOINT:
                reads = 0
                await trio.lowlevel.checkpoint()

    async def _handle(self, buf: bytearray) -> None:
        """Handle the whole frames in ``buf`` and remove them, waiting for a worker thread to
        decode each header block beyond what the event loop decodes (:data:`DECODE_PER_TURN`)."""
        while True:
            used = self._frames(buf)
            del buf[:used]
            self.relay.flush()
            deferred, self._deferred = self._deferred, None
            if deferred is None:
                return
            stream_id, flags, block = deferred
            large = len(block) >= LARGE_BLOCK
            headers = await trio.to_thread.run_sync(
                _decode_aside,
                self.decoder,
                block,
                limiter=self.relay.large_decodes if large else self.relay.small_decodes,
                abandon_on_cancel=True,  # a relay stopping does not wait for it
            )
            if self.closed:  # closed meanwhile (e.g. it stopped reading our answers)
                raise trio.ClosedResourceError("connection closed")
            self._on_block(stream_id, flags, headers)

    def _frames(self, buf: bytearray) -> int:
        """Handle the whole frames at the start of ``buf``; the bytes used. Stops after a header
        block left for a worker thread (:meth:`_handle` waits for it)."""
        offset, total = 0, len(buf)
        head = f.HEAD
        while total - offset >= f.HEAD_SIZE and self._deferred is None:
            high, low, kind, flags, stream_id = head.unpack_from(buf, offset)
            size = high << 16 | low
            if size > f.DEFAULT_MAX_FRAME:
                if buf.startswith(b"HTTP/1.", offset):  # an HTTP/1 answer, read as a frame header
                    raise f.ProtocolError(HTTP1_PEER, f.PROTOCOL_ERROR)
                raise f.ProtocolError(f"frame of {size} bytes exceeds 16384", f.FRAME_SIZE_ERROR)
            end = offset + f.HEAD_SIZE + size
            if end > total:
                break
            payload = bytes(buf[offset + f.HEAD_SIZE : end])
            offset = end
            self._frame(kind, flags, stream_id & 0x7FFF_FFFF, payload)
        return offset

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuation is not None and kind != f.CONTINUATION:
            raise f.ProtocolError("header block interrupted before END_HEADERS")
        if kind == f.DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == f.HEADERS:
            self._require_stream(stream_id, "HEADERS")
            fragment, depends_on = f.header_fragment(flags, payload)
            if depends_on == stream_id:  # a stream error, once the block is decoded (HPACK state)
                flags |= _SELF_DEPENDENT
            if flags & f.END_HEADERS:
                self._block(stream_id, flags, fragment)
            else:
                self._continuation = (stream_id, flags, bytearray(fragment))
        elif kind == f.CONTINUATION:
            if self._continuation is None or self._continuation[0] != stream_id:
                raise f.ProtocolError("CONTINUATION without a header block to continue")
            _, first_flags, block = self._continuation
            block += payload
            if len(block) > MAX_HEADER_BLOCK:
                raise f.ProtocolError("header block too large")
            if flags & f.END_HEADERS:
                self._continuation = None
                self._block(stream_id, first_flags, bytes(block))
        elif kind == f.SETTINGS:
            self._require_connection(stream_id, "SETTINGS")
            if flags & f.ACK and payload:  # RFC 9113 §6.5
                raise f.ProtocolError("SETTINGS ACK with a payload", f.FRAME_SIZE_ERROR)
            if not flags & f.ACK:
                self._on_settings(f.parse_settings(payload))
                self.write(f.frame(f.SETTINGS, f.ACK, 0))
        elif kind == f.WINDOW_UPDATE:
            self._require_not_idle(stream_id, "WINDOW_UPDATE")
            self._on_window_update(stream_id, f.parse_u32(payload))
        elif kind == f.PING:
            self._require_connection(stream_id, "PING")
            if len(payload) != 8:
                raise f.ProtocolError("PING payload is not 8 bytes", f.FRAME_SIZE_ERROR)
            if not flags & f.ACK:
                self.write(f.frame(f.PING, f.ACK, 0, payload))
            elif payload == DRAIN_PING and self.goaway == "announced":
                self.final_goaway()
        elif kind == f.RST_STREAM:
            self._require_stream(stream_id, "RST_STREAM")
            self._require_not_idle(stream_id, "RST_STREAM")
            self._on_reset(stream_id, f.parse_u32(payload))
        elif kind == f.GOAWAY:
            self._require_connection(stream_id, "GOAWAY")
            self._on_goaway(*f.parse_goaway(payload))
        elif kind == f.PUSH_PROMISE:
            raise f.ProtocolError("PUSH_PROMISE (push is disabled)")
        elif kind == f.PRIORITY:  # the scheme is deprecated (§5.3.2), the frame still checked
            self._require_stream(stream_id, "PRIORITY")
            try:
                if f.parse_priority(payload) == stream_id:
                    raise f.StreamError(f"stream {stream_id} depends on itself")
            except f.StreamError as err:
                self._stream_error(stream_id, err.code, idle=True)
        # Unknown frame types are ignored (RFC 9113 §5.5).

    @staticmethod
    def _require_stream(stream_id: int, kind: str) -> None:
        if stream_id == 0:
            raise f.ProtocolError(f"{kind} on stream 0")

    def _require_not_idle(self, stream_id: int, kind: str) -> None:
        """RST_STREAM or WINDOW_UPDATE on a stream nobody opened yet is a connection error
        (RFC 9113 §5.1): the peer's stream ids and ours are told apart by parity."""
        if stream_id == 0:
            return
        ours = (stream_id % 2 == 1) != self.server_side
        idle = stream_id >= self.next_id if ours else stream_id > self.last_peer_id
        if idle:
            raise f.ProtocolError(f"{kind} on idle stream {stream_id}")

    @staticmethod
    def _require_connection(stream_id: int, kind: str) -> None:
        if stream_id != 0:
            raise f.ProtocolError(f"{kind} on stream {stream_id}")

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._require_stream(stream_id, "DATA")
        size = len(payload)
        self.recv_window -= size
        if self.recv_window < 0:
            raise f.ProtocolError("DATA beyond the connection window", f.FLOW_CONTROL_ERROR)
        if not self.server_side:
            self.grant(size)  # an upstream connection's credit comes back on arrival
        data = f.unpad(flags, payload)
        half = self.halves.get(stream_id)
        if half is None or half.recv_ended or half.reset:
            if self.server_side:
                self.grant(size)  # a stream that is over (or never was): nothing to pass on
            if self.server_side and stream_id > self.last_peer_id:
                raise f.ProtocolError(f"DATA on idle stream {stream_id}")
            if not self.server_side:
                return
            if half is not None and not half.done:  # half-closed (remote): its call ends too
                self._stream_error(stream_id, f.STREAM_CLOSED)
            elif stream_id not in self._reset_ids:
                # Closed: the caller reset it, or both sides ended it (RFC 9113 §6.1: a stream
                # error). Not when we reset it: what was in flight then is ignored (§5.1).
                self.reset_stream(stream_id, f.STREAM_CLOSED)
            return
        half.recv_window -= size
        if half.recv_window < 0:
            raise f.ProtocolError(f"DATA beyond the window of stream {stream_id}", f.FLOW_CONTROL_ERROR)
        if size != len(data):
            half.grant(size - len(data))  # padding is consumed here
        end = bool(flags & f.END_STREAM)
        if half.expect is not None:
            half.expect -= len(data)
            if half.expect < 0 or (end and half.expect):
                # DATA other than the content-length said: malformed (RFC 9113 §8.1.1), not
                # passed on; its connection credit comes back here (the padding's came above).
                if self.server_side:
                    self.grant(len(data))
                self._stream_error(stream_id, f.PROTOCOL_ERROR)
                return
        if end:
            half.recv_ended = True
        if self.server_side:
            half.call.on_request_data(data, end)
        else:
            half.call.on_reply_data(data, end)

    def _block(self, stream_id: int, flags: int, block: bytes) -> None:
        """A whole header block arrived: decode it here, or leave it for a worker thread."""
        self._decoded += len(block)
        if self._decoded > DECODE_PER_TURN:
            self._deferred = (stream_id, flags, block)  # _handle decodes it; _frames stops here
            return
        self._on_block(stream_id, flags, _decode_block(self.decoder, block))

    def _on_block(self, stream_id: int, flags: int, headers: Headers) -> None:
        end = bool(flags & f.END_STREAM)
        half = self.halves.get(stream_id)
        if self.server_side:
            if half is None:
                if stream_id % 2 == 0:
                    raise f.ProtocolError(f"caller opened even stream {stream_id}")
                if stream_id <= self.last_peer_id:
                    if stream_id in self._reset_ids:
                        return  # we reset it: frames already on their way are ignored (§5.1)
                    raise f.ProtocolError(
                        f"HEADERS opening stream {stream_id}, not above stream {self.last_peer_id}"
                        " (stream ids are never lower nor reused, RFC 9113 §5.1.1)"
                    )
                self.last_peer_id = stream_id
                limit = self.relay.caller_max_streams
                if self.goaway == "final" or (limit is not None and len(self.halves) >= limit):
                    # Above the last id of our GOAWAY, or beyond the streams we advertised: not
                    # processed, so the caller may send it again (elsewhere).
                    self.reset_stream(stream_id, f.REFUSED_STREAM)
                    return
                problem = (
                    "it depends on itself"
                    if flags & _SELF_DEPENDENT
                    else f.request_header_problem(headers)
                    if self.relay.check_request_headers
                    else None
                )
                length = None if problem is not None else f.content_length(headers)
                if end and length:
                    problem = f"content-length {length} but no DATA"
                if problem is not None:  # malformed (RFC 9113 §8.1.1): a stream error
                    log.event(
                        LOGGER, "malformed_request", level=logging.DEBUG, stream=stream_id, problem=problem
                    )
                    self.reset_stream(stream_id, f.PROTOCOL_ERROR)
                    return
                self.relay.open_call(self, stream_id, headers, end)
                if length is not None and stream_id in self.halves:
                    self.halves[stream_id].expect = length
                return
            if half.reset:
                return
            if half.recv_ended:  # half-closed (remote): a stream error (RFC 9113 §5.1)
                self._stream_error(half.id, f.STREAM_CLOSED)
                return
            half.recv_ended = end
            if not end:
                raise f.ProtocolError(f"second header block on stream {stream_id} without END_STREAM")
            problem = f.request_header_problem(headers, trailers=True)
            if problem is not None or half.expect:  # malformed, or DATA short of content-length
                self._stream_error(half.id, f.PROTOCOL_ERROR)
                return
            half.call.on_request_trailers(headers)
            half.call.settle()
        elif half is not None and not half.recv_ended and not half.reset:
            if end:
                half.recv_ended = True
            half.call.on_reply_headers(headers, end)
            if end:
                half.call.settle()

    def _on_settings(self, values: Iterable[tuple[int, int]]) -> None:
        if not self._peer_settings_seen:
            self._peer_settings_seen = True
            self.peer_max_streams = 2**31  # the peer states its limit now, or has none
        for key, value in values:
            if key == f.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise f.ProtocolError("INITIAL_WINDOW_SIZE above 2^31-1", f.FLOW_CONTROL_ERROR)
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                if delta and self.halves:
                    # A peer flipping it back and forth makes us walk every stream each time.
                    self._window_shifts += len(self.halves)
                    if self._window_shifts > MAX_WINDOW_SHIFTS:
                        raise f.ProtocolError(
                            "too many SETTINGS_INITIAL_WINDOW_SIZE changes", f.ENHANCE_YOUR_CALM
                        )
                for half in self.halves.values():
                    half.send_window += delta
                    if half.send_window > f.MAX_WINDOW:  # RFC 9113 §6.9.2
                        raise f.ProtocolError("a stream window above 2^31-1", f.FLOW_CONTROL_ERROR)
                if delta > 0:
                    self._pump_blocked()
            elif key == f.MAX_FRAME_SIZE:
                if not f.DEFAULT_MAX_FRAME <= value <= 2**24 - 1:
                    raise f.ProtocolError(f"MAX_FRAME_SIZE {value} out of range")
                self.peer_max_frame = value
            elif key == f.MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
            elif key == f.ENABLE_PUSH and value > 1:
                raise f.ProtocolError("ENABLE_PUSH above 1")
            elif key == f.HEADER_TABLE_SIZE and value < self.peer_table_size:
                # Our blocks never use the dynamic table, but the peer's decoder must be told
                # that its smaller size took effect (RFC 7541 §4.2), in our next header block.
                self.peer_table_size = value
                self.table_update = True
        self._start_waiting()

    def _on_window_update(self, stream_id: int, increment: int) -> None:
        if increment == 0:
            if stream_id == 0:
                raise f.ProtocolError("WINDOW_UPDATE of 0")
            # On a stream it is that stream's error only (RFC 9113 §6.9): reset it, keep the rest.
            self._stream_error(stream_id, f.PROTOCOL_ERROR)
            return
        if stream_id == 0:
            self.send_window += increment
            if self.send_window > f.MAX_WINDOW:
                raise f.ProtocolError("connection window above 2^31-1", f.FLOW_CONTROL_ERROR)
            self._pump_blocked()
            return
        half = self.halves.get(stream_id)
        if half is not None:
            half.send_window += increment
            if half.send_window > f.MAX_WINDOW:  # that stream's error only (RFC 9113 §6.9.1)
                self._stream_error(stream_id, f.FLOW_CONTROL_ERROR)
                return
            if half.pending or half.trailers_pending is not None:
                half.pump()

    def _stream_error(self, stream_id: int, code: int, idle: bool = False) -> None:
        """A stream error (RFC 9113 §5.4.2): RST_STREAM(code) on that stream, its call ended; the
        connection and its other streams go on. Nothing is sent for an idle stream, unless
        ``idle``: a PRIORITY frame may name one, and its own error is the stream's (§5.3.1 of
        RFC 7540; grpc-go's and hyper's servers reset it too)."""
        half = self.halves.get(stream_id)
        if half is not None:
            if half.done or half.reset:
                return
            half.abort(code)
            if self.server_side:
                half.call.caller_gone()
            else:
                half.call.upstream_gone(f"{self.describe} broke HTTP/2 on the stream ({f.ERROR_NAMES[code]})")
            return
        ours = (stream_id % 2 == 1) != self.server_side
        known = stream_id < (self.next_id if ours else self.last_peer_id + 1)
        if (known or idle) and stream_id not in self._reset_ids:
            self.reset_stream(stream_id, code)

    def reset_stream(self, stream_id: int, code: int) -> None:
        """Send RST_STREAM; frames the peer sent before it sees it are ignored (RFC 9113 §5.1)."""
        self.write(f.rst_stream(stream_id, code))
        reset = self._reset_ids
        reset.add(stream_id)
        self._reset_order.append(stream_id)
        if len(self._reset_order) > RESET_IDS_KEPT:
            reset.discard(self._reset_order.popleft())

    def header_frames(self, stream_id: int, block: bytes, end: bool) -> bytes:
        """HEADERS (+ CONTINUATION) frames for ``block``, starting with the dynamic table size
        update the peer is owed after lowering SETTINGS_HEADER_TABLE_SIZE (RFC 7541 §4.2)."""
        if self.table_update:
            self.table_update = False
            block = f.table_size_update(0) + block  # we never use the table: 0 fits every limit
        return f.header_frames(stream_id, block, end, self.peer_max_frame)

    def _pump_blocked(self) -> None:
        for half in list(self.blocked.values()):
            half.pump()
            if self.send_window <= 0:
                break

    def _on_reset(self, stream_id: int, code: int) -> None:
        half = self.halves.get(stream_id)
        if half is None or half.reset:
            return
        half.reset = True
        if self.server_side:
            half.call.caller_gone()
        else:
            refused = code == f.REFUSED_STREAM  # not processed (RFC 9113 §8.7): safe to send again
            name = f.ERROR_NAMES.get(code, f"HTTP/2 error code {code}")
            half.call.upstream_gone(f"{self.describe} reset the stream ({name})", refused, reset_code=code)

    def _on_goaway(self, last_stream_id: int, code: int) -> None:
        if self.server_side:
            return  # the caller will open no more streams; the running ones go on
        self.retire()
        for half in [h for h in self.halves.values() if h.id > last_stream_id] + [w[0] for w in self.waiting]:
            half.reset = True  # above the last stream it will process: not processed, like a refusal
            half.call.upstream_gone(f"{self.describe} is going away (GOAWAY, HTTP/2 error code {code})", True)

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
        self.blocked.clear()


def _decode_block(decoder: hpack.Decoder, block: bytes) -> Headers:
    """A header block decoded with the connection's HPACK state (on the event loop, or in a
    worker thread while the connection's reader waits). Raises a COMPRESSION_ERROR."""
    try:
        return hpackmemo.decode(decoder, block)
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
