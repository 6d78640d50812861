"""The send side of a :class:`krproxy.h2.connection.Connection`: headers, data within the peer's
windows, trailers, resets, GOAWAY and PING, and what the peer's SETTINGS say about sending. A
:class:`Sender` holds the send windows, the data queued beyond them and the peer's limits; the
bytes go to the connection's output buffer (:attr:`krproxy.h2._state.State.output`, taken with
``Connection.data_to_send``); nothing here does I/O.

Sends on a stream that is over (reset, ended, released, or never opened by a peer that reset it
since) are no-ops, not errors: a relay forwarding one side of a call to the other races the
peer's resets all the time. What a driver can only get wrong by a bug raises
:class:`LocalProtocolError`.
"""

from __future__ import annotations

import hpack
import hpack.exceptions

from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2._state import State
from krproxy.h2.streams import Stream

__all__ = ["DRAIN_PING", "RESET_IDS_KEPT", "LocalProtocolError", "Sender"]

#: Streams reset by us whose late frames are ignored, per connection (older ones: errors).
RESET_IDS_KEPT = 1024
#: The PING payload that marks the round trip of a graceful shutdown's first GOAWAY.
DRAIN_PING = b"krdrain\x00"


class LocalProtocolError(Exception):
    """Our own side misused the connection (a bug of the driver, not the peer's doing)."""


class Sender:
    """The send side of one connection: its streams opened, their frames sent within the peer's
    windows, frame size and header list limit, the rest queued until WINDOW_UPDATEs let it go.
    The connection binds the public methods onto itself (``conn.send_data`` is this one's)."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.server = state.server
        self.streams = state.streams  # the state's (never replaced): one look-up less per send
        self.output = state.output
        #: What the peer lets us send on the connection (its WINDOW_UPDATEs on stream 0).
        self.send_window = f.DEFAULT_WINDOW
        #: Streams with data waiting for send window.
        self.blocked: dict[int, Stream] = {}
        #: Bytes queued in the streams beyond the peer's windows.
        self.buffered = 0
        # The peer's SETTINGS (krproxy.h2._control sets them), as they steer what we send.
        self.peer_initial_window = f.DEFAULT_WINDOW
        self.peer_max_frame = f.DEFAULT_MAX_FRAME
        # Until the peer's SETTINGS say otherwise, no more streams than RFC 9113 asks every
        # peer to allow: h2 (grpclib) closes the connection on a stream beyond its limit.
        self.peer_max_streams = 100
        self.peer_max_header_list: int | None = None  # the peer's limit; None: none said
        self.peer_table_size = 4096  # SETTINGS_HEADER_TABLE_SIZE, for our encoder (RFC 7541 §4.2)
        self.table_update = False  # a dynamic table size update is owed in the next block
        #: Graceful shutdown (RFC 9113 §6.8): None, "announced" (a GOAWAY with the largest id and
        #: a PING are out) or "final" (GOAWAY with the last id we process; later streams refused).
        self.goaway_state: str | None = None

    # -- streams -------------------------------------------------------------------------

    def can_start_stream(self) -> bool:
        """A stream may be opened now (client role): below the peer's limit, ids left."""
        return len(self.streams) < self.peer_max_streams and self.state.next_id <= f.MAX_STREAM_ID

    def start_stream(
        self, headers: ev.Headers | bytes, end_stream: bool = False, stream: Stream | None = None
    ) -> int:
        """Open the next stream of ours with a request's ``headers`` (or an encoded block);
        returns its id. ``stream``: state the driver kept while the stream waited for a slot
        (data, its end, trailers queued on it go out now, as the windows allow). Raises
        :class:`LocalProtocolError` unless :meth:`can_start_stream`. The peer's header list
        limit is the driver's to check first (:meth:`over_peer_limit`)."""
        if self.server:
            raise LocalProtocolError("a server opens no streams (push is not supported)")
        state = self.state
        stream_id = state.next_id
        if len(self.streams) >= self.peer_max_streams or stream_id > f.MAX_STREAM_ID:  # can_start_stream()
            raise LocalProtocolError("no stream can be opened now (peer's limit or ids used up)")
        state.next_id = stream_id + 2
        if stream is None:
            stream = Stream(stream_id, self.peer_initial_window, state.stream_window)
        else:
            stream.id = stream_id
            stream.send_window = self.peer_initial_window
            stream.recv_window = state.stream_window
        self.streams[stream_id] = stream
        block = headers if isinstance(headers, bytes) else f.encode_headers(headers)
        stream.headers_sent = True
        self.output += self._header_frames(stream_id, block, end_stream)
        if end_stream:
            stream.send_ended = True
        elif stream.pending or stream.end_pending or stream.trailers_pending is not None:
            self.buffered += len(stream.pending)
            self.pump(stream)
        return stream_id

    def release_stream(self, stream_id: int) -> int:
        """Forget a stream (the driver is done with it): its slot is free again. Returns the
        bytes still queued for it, dropped. Sends nothing: reset it first if it is not over."""
        stream = self.streams.pop(stream_id, None)
        if stream is None or not stream.pending:
            # The common end of a call: nothing queued (trailers wait only behind queued data).
            return 0
        return self.drop(stream)

    def stream(self, stream_id: int) -> Stream | None:
        """The state of a stream not yet released (read only)."""
        return self.streams.get(stream_id)

    # -- headers, data, trailers ---------------------------------------------------------

    def send_headers(self, stream_id: int, headers: ev.Headers | bytes, end_stream: bool = False) -> None:
        """Send a header block (not flow controlled) at once; a no-op on a stream that is over."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.reset or stream.send_ended:
            return
        if stream.pending or stream.end_pending:
            raise LocalProtocolError(f"headers after data on stream {stream_id}: use send_trailers")
        block = headers if isinstance(headers, bytes) else f.encode_headers(headers)
        if self._over_peer_limit(stream_id, block):
            return
        stream.headers_sent = True
        self.output += self._header_frames(stream_id, block, end_stream)
        if end_stream:
            stream.send_ended = True

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> int:
        """Send ``data`` within the peer's windows and frame size; the rest waits in the stream
        until WINDOW_UPDATEs let it go (:class:`~krproxy.h2.events.DataSent`). Returns the bytes
        taken now: framed, or dropped on a stream that is over."""
        stream = self.streams.get(stream_id)
        size = len(data)
        if stream is None or stream.reset or stream.send_ended:
            return size
        if not stream.headers_sent:
            raise LocalProtocolError(f"data before headers on stream {stream_id}")
        if (
            not stream.pending
            and size <= stream.send_window
            and size <= self.send_window
            and size <= self.peer_max_frame
        ):
            # The common case: the whole chunk fits; no queueing, no copy into `pending`.
            if size or end_stream:
                self.output += f.HEAD.pack(
                    size >> 16, size & 0xFFFF, f.DATA, f.END_STREAM if end_stream else 0, stream_id
                )
                self.output += data
            stream.send_window -= size
            self.send_window -= size
            if end_stream:
                stream.send_ended = True
            return size
        stream.pending += data
        self.buffered += size
        if end_stream:
            stream.end_pending = True
        return self.pump(stream)

    def send_answer(self, stream_id: int, headers: bytes | None, data: bytes, trailers: bytes) -> bool:
        """A whole answer in one step where it goes out at once: ``headers`` (None: sent already),
        ``data`` in one DATA frame, then ``trailers`` ending the stream; what :meth:`send_headers`,
        :meth:`send_data` and :meth:`send_trailers` in turn would send. False, having sent nothing,
        where one of them would queue, reset or refuse (the windows or the frame size too small for
        ``data``, data queued before it, a block over the peer's header list limit, a stream that is
        over): the driver then sends the three in turn, as before."""
        stream = self.streams.get(stream_id)
        size = len(data)
        if (
            stream is None
            or stream.reset
            or stream.send_ended
            or stream.pending
            or stream.end_pending
            or stream.headers_sent is (headers is not None)
            or size > stream.send_window
            or size > self.send_window
            or size > self.peer_max_frame
        ):
            return False
        limit = self.peer_max_header_list
        if limit is not None and (  # over_peer_limit's first test inline: our blocks are small
            (headers is not None and len(headers) * 64 > limit and self.over_peer_limit(headers) is not None)
            or (len(trailers) * 64 > limit and self.over_peer_limit(trailers) is not None)
        ):
            return False
        output = self.output
        if headers is not None:
            stream.headers_sent = True
            output += self._header_frames(stream_id, headers, False)
        if size:
            output += f.HEAD.pack(size >> 16, size & 0xFFFF, f.DATA, 0, stream_id)
            output += data
        output += self._header_frames(stream_id, trailers, True)
        stream.send_window -= size
        self.send_window -= size
        stream.send_ended = True
        return True

    def send_trailers(self, stream_id: int, headers: ev.Headers | bytes) -> int:
        """End the stream with a header block, after any data still queued. Returns the queued
        bytes framed now (that waited for the windows)."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.reset or stream.send_ended:
            return 0
        block = headers if isinstance(headers, bytes) else f.encode_headers(headers)
        if self._over_peer_limit(stream_id, block):
            return 0
        if not stream.pending:  # nothing queued before them, as after most answers: out now
            self.output += self._header_frames(stream_id, block, True)
            stream.send_ended = True
            return 0
        stream.trailers_pending = block
        return self.pump(stream)

    def over_peer_limit(self, block: bytes) -> int | None:
        """The peer's SETTINGS_MAX_HEADER_LIST_SIZE if the header list of ``block`` (one of
        ours: it never uses the dynamic table, so a fresh decoder reads its size) exceeds it;
        None if it fits or the peer stated no limit. A driver asks before :meth:`start_stream`
        and fails that call instead of sending it, as grpc-go's client does ("header list size
        to send violates the maximum size"); headers and trailers are checked here."""
        limit = self.peer_max_header_list
        if limit is None or len(block) * 64 <= limit:  # no field of ours is under 1 byte a 64
            return None
        try:
            fields = hpack.Decoder(max_header_list_size=1 << 62).decode(block, raw=True)
        except (hpack.exceptions.HPACKError, IndexError, ValueError):
            return None  # not ours to judge: the peer decides
        if sum(32 + len(name) + len(value) for name, value in fields) <= limit:
            return None
        return limit

    def _over_peer_limit(self, stream_id: int, block: bytes) -> bool:
        """A block whose header list exceeds the peer's SETTINGS_MAX_HEADER_LIST_SIZE is not
        sent: the stream is reset with INTERNAL_ERROR instead, as grpc-go's server does
        (``checkForHeaderListSize``), and only that stream ends."""
        if self.over_peer_limit(block) is None:
            return False
        unsent = self.reset_stream(stream_id, f.INTERNAL_ERROR)
        self.state.events.append(ev.StreamReset(stream_id, f.INTERNAL_ERROR, remote=False, unsent=unsent))
        return True

    def abandon_output(self, stream_id: int) -> int:
        """Drop what is queued on a stream (data, its end, trailers) so that the driver may end
        it otherwise (e.g. with a status of its own); returns the data bytes dropped."""
        stream = self.streams.get(stream_id)
        if stream is None:
            return 0
        stream.end_pending = False
        return self.drop(stream)

    def pump(self, stream: Stream) -> int:
        """Frame queued data within the windows, then the queued end or trailers; the bytes framed."""
        if stream.reset or stream.send_ended:
            return 0
        pending = stream.pending
        sent = 0
        total = len(pending)
        if total:
            view = memoryview(pending)
            out = self.output
            while sent < total:
                size = min(total - sent, stream.send_window, self.send_window, self.peer_max_frame)
                if size <= 0:
                    break
                last = sent + size == total
                flags = f.END_STREAM if last and stream.end_pending and stream.trailers_pending is None else 0
                out += f.HEAD.pack(size >> 16, size & 0xFFFF, f.DATA, flags, stream.id)
                out += view[sent : sent + size]
                sent += size
                stream.send_window -= size
                self.send_window -= size
                if flags:
                    stream.send_ended = True
            view.release()
            del pending[:sent]
            self.buffered -= sent
        if pending:
            self.blocked[stream.id] = stream
            return sent
        self.blocked.pop(stream.id, None)
        if stream.trailers_pending is not None:
            block, stream.trailers_pending = stream.trailers_pending, None
            self.output += self._header_frames(stream.id, block, True)
            stream.send_ended = True
        elif stream.end_pending and not stream.send_ended:
            self.output += f.frame(f.DATA, f.END_STREAM, stream.id)
            stream.send_ended = True
        return sent

    def report(self, stream: Stream, sent: int) -> None:
        """Tell the driver what a window's opening let go on ``stream`` (:class:`~krproxy.h2.events.DataSent`)."""
        if sent or stream.send_ended:
            self.state.events.append(ev.DataSent(stream.id, sent, stream.send_ended))

    def pump_blocked(self) -> None:
        """The connection's window opened: send what waits on each blocked stream, in turn."""
        for stream in list(self.blocked.values()):
            ended = stream.send_ended
            sent = self.pump(stream)
            if sent or stream.send_ended != ended:
                self.report(stream, sent)
            if self.send_window <= 0:
                break

    def _header_frames(self, stream_id: int, block: bytes, end: bool) -> bytes:
        """HEADERS (+ CONTINUATION) frames for ``block``, starting with the dynamic table size
        update the peer is owed after lowering SETTINGS_HEADER_TABLE_SIZE (RFC 7541 §4.2)."""
        if self.table_update:
            self.table_update = False
            block = f.table_size_update(0) + block  # we never use the table: 0 fits every limit
        size = len(block)
        if size <= self.peer_max_frame:  # one HEADERS frame, as nearly every block: packed here
            flags = f.END_HEADERS | f.END_STREAM if end else f.END_HEADERS
            return f.HEAD.pack(size >> 16, size & 0xFFFF, f.HEADERS, flags, stream_id) + block
        return f.header_frames(stream_id, block, end, self.peer_max_frame)

    # -- resets --------------------------------------------------------------------------

    def reset_stream(self, stream_id: int, error_code: int = f.CANCEL) -> int:
        """RST_STREAM on a stream unless it is over; frames the peer sent before it sees it are
        ignored (RFC 9113 §5.1). Returns the queued bytes dropped."""
        stream = self.streams.get(stream_id)
        if stream is None:
            return 0
        if stream.done:
            return 0
        stream.reset = True
        unsent = self.drop(stream)
        self.send_reset(stream_id, error_code)
        return unsent

    def drop(self, stream: Stream) -> int:
        """Forget what is queued on ``stream`` (data, trailers); returns the data bytes dropped."""
        unsent = len(stream.pending)
        if unsent:
            self.buffered -= unsent
            stream.pending.clear()
        stream.trailers_pending = None
        self.blocked.pop(stream.id, None)
        return unsent

    def send_reset(self, stream_id: int, code: int) -> None:
        """RST_STREAM(code), whatever the stream's state; its late frames are ignored (§5.1)."""
        self.output += f.rst_stream(stream_id, code)
        state = self.state
        state.reset_ids.add(stream_id)
        state.reset_order.append(stream_id)
        if len(state.reset_order) > RESET_IDS_KEPT:
            state.reset_ids.discard(state.reset_order.popleft())

    # -- the connection --------------------------------------------------------------------

    def send_ping(self, payload: bytes) -> None:
        if len(payload) != 8:
            raise LocalProtocolError("a PING carries 8 bytes")
        self.output += f.frame(f.PING, 0, 0, payload)

    def goaway(self, error_code: int = f.NO_ERROR, debug: bytes = b"") -> None:
        """GOAWAY naming the last stream the peer opened: no more streams (streams above it
        are refused)."""
        self.goaway_state = "final"
        self.output += f.goaway(self.state.last_peer_id, error_code, debug)

    def announce_goaway(self) -> None:
        """First step of a graceful shutdown (RFC 9113 §6.8): GOAWAY with the largest stream id,
        so the peer opens no new streams but those already on their way are still served, and
        a PING whose answer tells that they have all arrived; that answer sends the final
        GOAWAY (:meth:`final_goaway`)."""
        if self.goaway_state is not None:
            return
        self.goaway_state = "announced"
        self.output += f.goaway(f.MAX_STREAM_ID, f.NO_ERROR)
        self.output += f.frame(f.PING, 0, 0, DRAIN_PING)

    def final_goaway(self) -> None:
        """Second step: GOAWAY with the last stream id processed; later streams are refused."""
        if self.goaway_state == "final":
            return
        self.goaway(f.NO_ERROR)
