"""The rules of a :class:`krproxy.h2.connection.Connection` for the frames that steer it:
SETTINGS, WINDOW_UPDATE, RST_STREAM and GOAWAY, an answer's header blocks, and stream errors.
No I/O."""

from __future__ import annotations

import hpack

from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2._send import Sender
from krproxy.h2.hpackskim import Skimmer
from krproxy.h2.streams import Stream

__all__ = ["MAX_WINDOW_SHIFTS", "Control"]

#: Stream windows a peer's changes of SETTINGS_INITIAL_WINDOW_SIZE may make us adjust over a
#: connection's life (each change adjusts every open stream's); beyond it the connection ends
#: with ENHANCE_YOUR_CALM. A few hundred thousand cost a fraction of a second; grpc-go (kubelet,
#: containerd) changes it only as its BDP estimate grows, a handful of times per connection.
MAX_WINDOW_SHIFTS = 1_000_000


class Control(Sender):
    """SETTINGS, WINDOW_UPDATE, RST_STREAM, GOAWAY and stream errors, received; the state is set
    up by ``Connection.__init__``."""

    peer_settings_seen: bool
    decoder: hpack.Decoder
    _continuation: tuple[int, int, bytearray | Skimmer] | None
    window_shifts: int
    max_window_shifts: int
    peer_table_size: int
    peer_max_header_list: int | None
    goaway_received: bool

    def _ours(self, stream_id: int) -> bool:
        return (stream_id % 2 == 1) != self.server

    def _require_not_idle(self, stream_id: int, kind: str) -> None:
        """RST_STREAM or WINDOW_UPDATE on a stream nobody opened yet is a connection error
        (RFC 9113 §5.1): the peer's stream ids and ours are told apart by parity."""
        if stream_id == 0:
            return
        idle = stream_id >= self.next_id if self._ours(stream_id) else stream_id > self.last_peer_id
        if idle:
            raise f.ProtocolError(f"{kind} on idle stream {stream_id}")

    def _on_settings(self, values: list[tuple[int, int]]) -> None:
        if not self.peer_settings_seen:
            self.peer_settings_seen = True
            self.peer_max_streams = 2**31  # the peer states its limit now, or has none
        for key, value in values:
            if key == f.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise f.ProtocolError("INITIAL_WINDOW_SIZE above 2^31-1", f.FLOW_CONTROL_ERROR)
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                if delta and self.streams:
                    # A peer flipping it back and forth makes us walk every stream each time.
                    self.window_shifts += len(self.streams)
                    if self.window_shifts > self.max_window_shifts:
                        raise f.ProtocolError(
                            "too many SETTINGS_INITIAL_WINDOW_SIZE changes", f.ENHANCE_YOUR_CALM
                        )
                    for stream in self.streams.values():
                        if stream.reset:  # no longer a window we maintain (a WINDOW_UPDATE may have
                            continue  # overflowed it: that was the stream's error, §6.9.1)
                        stream.send_window += delta
                        if stream.send_window > f.MAX_WINDOW:  # RFC 9113 §6.9.2
                            raise f.ProtocolError("a stream window above 2^31-1", f.FLOW_CONTROL_ERROR)
                if delta > 0:
                    self._pump_blocked()
            elif key == f.MAX_FRAME_SIZE:
                if not f.DEFAULT_MAX_FRAME <= value <= 2**24 - 1:
                    raise f.ProtocolError(f"MAX_FRAME_SIZE {value} out of range")
                self.peer_max_frame = value
            elif key == f.MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
            elif key == f.MAX_HEADER_LIST_SIZE:
                self.peer_max_header_list = value
            elif key == f.ENABLE_PUSH and value > 1:
                raise f.ProtocolError("ENABLE_PUSH above 1")
            elif key == f.HEADER_TABLE_SIZE and value < self.peer_table_size:
                # Our blocks never use the dynamic table, but the peer's decoder must be told
                # that its smaller size took effect (RFC 7541 §4.2), in our next header block.
                self.peer_table_size = value
                self.table_update = True
        self.output += f.frame(f.SETTINGS, f.ACK, 0)
        self._events.append(ev.SettingsChanged(tuple(values)))

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
        stream = self.streams.get(stream_id)
        if stream is not None and not stream.reset:
            stream.send_window += increment
            if stream.send_window > f.MAX_WINDOW:  # that stream's error only (RFC 9113 §6.9.1)
                self._stream_error(stream_id, f.FLOW_CONTROL_ERROR)
                return
            if stream.pending or stream.trailers_pending is not None:
                self._report(stream, self._pump(stream))

    def _on_reset(self, stream_id: int, code: int) -> None:
        stream = self.streams.get(stream_id)
        if stream is None or stream.reset:
            return
        stream.reset = True
        self._events.append(ev.StreamReset(stream_id, code, remote=True, unsent=self._drop(stream)))

    def _on_goaway(self, last_stream_id: int, code: int, debug: bytes) -> None:
        self.goaway_received = True
        refused = []
        if not self.server:
            for stream in self.streams.values():
                if stream.id > last_stream_id and not stream.reset:
                    # Not processed, like a refusal: no RST_STREAM. What is queued on it stays
                    # until the driver releases the stream (release_stream reports it).
                    stream.reset = True
                    self.blocked.pop(stream.id, None)
                    refused.append(stream.id)
        self._events.append(ev.GoAwayReceived(last_stream_id, code, debug, tuple(refused)))

    def _on_answer_block(self, stream: Stream | None, headers: ev.Headers, end: bool) -> None:
        """A header block on a stream of ours (client role): the answer's headers, then its
        trailers (END_STREAM). A second block without END_STREAM is malformed (RFC 9113 §8.1),
        that stream's error, not a second answer (no 1xx answers: gRPC sends none)."""
        if stream is None or stream.recv_ended or stream.reset:
            return
        if stream.headers_received and not end:
            self._stream_error(stream.id, f.PROTOCOL_ERROR)
            return
        stream.recv_ended = end
        stream.headers_received = True
        self._events.append(ev.HeadersReceived(stream.id, headers, end))

    def _skim(self, stream_id: int, flags: int, block: bytearray | Skimmer, payload: bytes) -> Skimmer:
        """A header block past what we decode: from now on read for the HPACK state only."""
        if isinstance(block, bytearray):
            skimmer = Skimmer(self.decoder)
            skimmer.feed(bytes(block))
            self._continuation = (stream_id, flags, skimmer)
            block = skimmer
        block.feed(payload)
        return block

    def _on_oversized_block(self, stream_id: int, skimmer: Skimmer) -> None:
        """A header block over what we decode ended (its HPACK state taken in): that stream is
        reset with FRAME_SIZE_ERROR, as grpc-go resets a stream whose header list is over its
        limit; a request's stream is never opened. Stream id rules as for any block."""
        skimmer.finish()
        if self.server and stream_id not in self.streams:
            if self._take_peer_stream_id(stream_id):
                self._send_reset(stream_id, f.FRAME_SIZE_ERROR)
            return
        self._stream_error(stream_id, f.FRAME_SIZE_ERROR)

    def _take_peer_stream_id(self, stream_id: int) -> bool:
        """A caller's header block opens ``stream_id`` (server role): True if it is the next one
        of theirs, False for a stream we reset (frames already on their way are ignored, §5.1);
        a connection error otherwise (odd ids only, never lower nor reused, RFC 9113 §5.1.1)."""
        if stream_id % 2 == 0:
            raise f.ProtocolError(f"caller opened even stream {stream_id}")
        if stream_id <= self.last_peer_id:
            if stream_id in self.reset_ids:
                return False
            raise f.ProtocolError(
                f"HEADERS opening stream {stream_id}, not above stream {self.last_peer_id}"
                " (stream ids are never lower nor reused, RFC 9113 §5.1.1)"
            )
        self.last_peer_id = stream_id
        return True

    def _stream_error(self, stream_id: int, code: int, idle: bool = False) -> None:
        """A stream error (RFC 9113 §5.4.2): RST_STREAM(code) on that stream; the connection and
        its other streams go on. Nothing is sent for an idle stream, unless ``idle``: a PRIORITY
        frame may name one, and its own error is the stream's (§5.3.1 of RFC 7540; grpc-go's and
        hyper's servers reset it too)."""
        stream = self.streams.get(stream_id)
        if stream is not None:
            if stream.done:
                return
            unsent = self.reset_stream(stream_id, code)
            self._events.append(ev.StreamReset(stream_id, code, remote=False, unsent=unsent))
            return
        known = stream_id < self.next_id if self._ours(stream_id) else stream_id <= self.last_peer_id
        if (known or idle) and stream_id not in self.reset_ids:
            self._send_reset(stream_id, code)
