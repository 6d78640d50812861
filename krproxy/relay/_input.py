"""The reading side of an :class:`~krproxy.relay.connection.Endpoint` (:class:`Reader`, which the
endpoint holds): its socket's bytes into the HTTP/2 core, the core's events into the calls'
steps, large header blocks decoded aside.

The core reads *stepwise*: it stops after each frame that made events, so each event is acted
on (a call answered, a stream reset or released) before the next frame meets the core's state.
A transport with ``whole_requests`` (a :class:`krproxy.rpc.Server`'s) has a request's HEADERS
and the DATA frame ending it read in one step: ``open_call`` is given the body, and one it does
not take goes to the stream's half as any DATA (:meth:`Reader._on_body`).
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import trio

from krproxy.h2 import events as ev
from krproxy.h2 import frames as f

if TYPE_CHECKING:
    from krproxy.relay.connection import Endpoint

__all__ = ["DECODE_PER_TURN", "LARGE_BLOCK", "Reader"]

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
_RECV_SIZE = 256 * 1024
#: Reads handled back to back before the reader lets other tasks run.
_READS_PER_CHECKPOINT = 8


class _Closed(Exception):
    """The peer closed the connection."""


class _Terminated(Exception):
    """The HTTP/2 core ended the connection (the peer broke HTTP/2); its GOAWAY is queued."""

    def __init__(self, event: ev.ConnectionTerminated) -> None:
        super().__init__(event.reason)
        self.code = event.error_code


class Reader:
    """The reading side of one endpoint: held by it (``ep.reader``), run by :meth:`Endpoint.run`.

    What stays the same for the connection's life is taken from the endpoint once (its socket,
    core, halves and transport); its state (closed, lingering, GOAWAY) is read on it."""

    __slots__ = ("ep", "h2", "halves", "server_side", "sock", "transport")

    def __init__(self, ep: Endpoint) -> None:
        self.ep = ep
        self.sock = ep.sock
        self.h2 = ep.h2
        self.halves = ep.halves  # (cleared in place when the connection ends, never replaced)
        self.server_side = ep.server_side
        self.transport = ep.transport

    async def read(self) -> None:
        """Read and handle frames until the connection ends (always by raising)."""
        ep = self.ep
        sock = self.sock
        h2 = self.h2
        preface_due = self.server_side
        reads = 0
        while True:
            try:
                data = sock.recv(_RECV_SIZE)
            except BlockingIOError:
                reads = 0
                h2.blocks.decode_budget = DECODE_PER_TURN
                await trio.lowlevel.wait_readable(sock)
                continue
            if not data:
                raise _Closed()
            if ep.lingering:  # what a drained caller still sends (Endpoint.close): not read
                continue
            events = h2.receive_data(data)
            if preface_due and h2.preface_received:  # before the events may start a linger's deadline
                preface_due = False
                ep.reading.deadline = math.inf
            await self._handle(events)
            if len(data) < _RECV_SIZE and sock.fileno() >= 0:
                # The read emptied the socket's buffer: wait until more arrives rather than ask
                # again now only to be told EAGAIN (a system call and an exception per call).
                # (A socket closed meanwhile goes on to recv, whose error ends the loop.)
                reads = 0
                h2.blocks.decode_budget = DECODE_PER_TURN
                await trio.lowlevel.wait_readable(sock)
                continue
            reads += 1
            if reads >= _READS_PER_CHECKPOINT:
                reads = 0
                await trio.lowlevel.checkpoint()

    async def _handle(self, events: list[ev.Event]) -> None:
        """Hand the core's events to the calls, waiting for a worker thread to decode each
        header block beyond what the event loop decodes (:data:`DECODE_PER_TURN`)."""
        h2 = self.h2
        unread = h2.unread
        transport = self.transport
        while events:
            # Calls finished by these events are reported after the flush below (or the one
            # before a block decoded aside, or run()'s on an error): their answers go out first.
            transport.defer_records = True
            try:
                self._dispatch(events)
            finally:
                transport.defer_records = False
            last = events[-1]
            kind = last.__class__
            if kind is ev.HeaderBlockReceived:
                events = await self._decode_block_aside(cast(ev.HeaderBlockReceived, last).block)
            elif kind is ev.ConnectionTerminated:
                self.ep.touch()
                transport.flush()
                raise _Terminated(cast(ev.ConnectionTerminated, last))
            elif len(unread) >= f.HEAD_SIZE:
                # The core stopped after this frame's events (stepwise): on with the rest.
                events = h2.next_events()
            else:
                break
        self.ep.touch()
        transport.flush(last=self.ep)  # what was passed on first, then this peer's acknowledgements

    async def _decode_block_aside(self, block: bytes) -> list[ev.Event]:
        """Decode a header block the core handed out in a worker thread, and go on."""
        self.ep.touch()
        self.transport.flush()
        large = len(block) >= LARGE_BLOCK
        headers = await trio.to_thread.run_sync(
            _decode_aside,
            self.h2.decode_block,
            block,
            limiter=self.transport.large_decodes if large else self.transport.small_decodes,
            abandon_on_cancel=True,  # a relay stopping does not wait for it
        )
        if self.ep.closed:  # closed meanwhile (e.g. it stopped reading our answers)
            if self.ep.lingering:  # drained meanwhile: read on, discarding, as _read_loop does
                return []
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
                body = request.body
                if body is None:
                    self.transport.open_call(
                        self.ep, request.stream_id, request.headers, request.end_stream, None
                    )
                elif not self.transport.open_call(
                    self.ep, request.stream_id, request.headers, False, body.data
                ):
                    self._on_body(body)
                if request.stream_id not in halves:  # refused or answered at once: not ours to keep
                    self.h2.release_stream(request.stream_id)
            elif kind is ev.HeadersReceived:
                reply = event
                half = halves.get(reply.stream_id)
                if half is not None:
                    half.call.on_reply_headers(reply.headers, reply.end_stream)
                    if reply.end_stream:
                        half.state.settle()
            elif kind is ev.DataSent:
                sent = event
                half = halves.get(sent.stream_id)
                if half is not None:
                    if sent.size and half.peer is not None:
                        half.peer.grant(sent.size)
                    if sent.stream_ended:
                        half.state.settle()
            elif kind is ev.TrailersReceived:
                trailers = event
                half = halves.get(trailers.stream_id)
                if half is not None:
                    half.call.on_request_trailers(trailers.headers)
                    half.state.settle()
            elif kind is ev.StreamReset:
                self._on_reset(event)
            elif kind is ev.SettingsChanged:
                self.ep.start_waiting()
            elif kind is ev.PingAcked:
                ep = self.ep
                if ep.goaway == "final" and not halves and not ep.closing:
                    ep.close_when_sent()  # the drain PING came back: the final GOAWAY is out
            elif kind is ev.GoAwayReceived:
                self._on_goaway(event)

    def _on_body(self, body: ev.DataReceived) -> None:
        """A request's body read with its headers (the core's ``whole_requests``) that open_call
        did not take: its stream's, as a DATA frame read after open_call. One open_call reset or
        refused meets what the core does with DATA on a stream it reset: its credit is given back."""
        stream_id = body.stream_id
        half = self.halves.get(stream_id)
        s = self.h2.streams.get(stream_id)
        if half is None or s is None or s.reset:
            self.h2.acknowledge_received_data(stream_id, body.flow_controlled_length)
        else:
            half.call.on_request_data(body.data, True)

    def _on_reset(self, event: ev.StreamReset) -> None:
        half = self.halves.get(event.stream_id)
        if half is None:
            return
        if event.unsent and half.peer is not None:
            half.peer.grant(event.unsent)
        code = event.error_code
        if self.server_side:
            half.state.caller_gone()
        elif event.remote:
            refused = code == f.REFUSED_STREAM  # not processed (RFC 9113 §8.7): safe to send again
            name = f.ERROR_NAMES.get(code, f"HTTP/2 error code {code}")
            half.state.upstream_gone(
                f"{self.ep.describe} reset the stream ({name})", refused, reset_code=code
            )
        elif code == f.FRAME_SIZE_ERROR:  # e.g. its header block over what the core reads: as grpc-go's
            reason = f"{self.ep.describe}: peer header list size exceeded limit (FRAME_SIZE_ERROR)"
            half.state.upstream_gone(reason, reset_code=code)  # client, INTERNAL
        else:
            half.state.upstream_gone(f"{self.ep.describe} broke HTTP/2 on the stream ({f.ERROR_NAMES[code]})")

    def _on_goaway(self, event: ev.GoAwayReceived) -> None:
        if self.server_side:
            return  # the caller will open no more streams; the running ones go on
        ep = self.ep
        ep.retire()
        gone = [self.halves[i] for i in event.refused if i in self.halves] + [w[0] for w in ep.waiting]
        for half in gone:
            half.reset = True  # above the last stream it will process: not processed, like a refusal
            half.state.upstream_gone(
                f"{ep.describe} is going away (GOAWAY, HTTP/2 error code {event.error_code})", True
            )

    # -- the end ---------------------------------------------------------------------


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


def _decode_aside(
    decode: Callable[[bytes], Headers | f.ProtocolError], block: bytes
) -> Headers | f.ProtocolError:
    """``decode(block)`` (the core's ``decode_block``: the fields, or the COMPRESSION_ERROR) in a
    worker thread, the event loop's thread getting the interpreter back more often meanwhile
    (:class:`_Aside`)."""
    _Aside.enter()
    try:
        return decode(block)
    finally:
        _Aside.leave()
