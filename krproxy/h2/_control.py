"""The frames that steer a :class:`krproxy.h2.connection.Connection`, as received: SETTINGS, PING,
WINDOW_UPDATE, RST_STREAM and GOAWAY, and the stream errors (RFC 9113 §5.4.2) every part raises.
A :class:`Control` holds what it alone keeps (the peer's SETTINGS seen, the window shifts they
cost, a GOAWAY received) and writes what the peer's settings say about sending into the
:class:`~krproxy.h2._send.Sender` it is given. No I/O."""

from __future__ import annotations

from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2._send import DRAIN_PING, Sender
from krproxy.h2._state import State

__all__ = ["MAX_WINDOW_SHIFTS", "Control"]

#: Stream windows a peer's changes of SETTINGS_INITIAL_WINDOW_SIZE may make us adjust over a
#: connection's life (each change adjusts every open stream's); beyond it the connection ends
#: with ENHANCE_YOUR_CALM. A few hundred thousand cost a fraction of a second; grpc-go (kubelet,
#: containerd) changes it only as its BDP estimate grows, a handful of times per connection.
MAX_WINDOW_SHIFTS = 1_000_000


class Control:
    """SETTINGS, PING, WINDOW_UPDATE, RST_STREAM and GOAWAY received, and stream errors."""

    def __init__(self, state: State, sender: Sender, *, max_window_shifts: int | None = None) -> None:
        """``max_window_shifts``: None, :data:`MAX_WINDOW_SHIFTS` (read now: tests lower it)."""
        self.state = state
        self.sender = sender
        self.server = state.server
        self.streams = state.streams  # the state's (never replaced)
        self.peer_settings_seen = False
        #: Stream windows the peer's SETTINGS_INITIAL_WINDOW_SIZE changes adjusted so far.
        self.window_shifts = 0
        self.max_window_shifts = MAX_WINDOW_SHIFTS if max_window_shifts is None else max_window_shifts
        self.goaway_received = False

    def ours(self, stream_id: int) -> bool:
        """``stream_id`` is of the kind we open (odd in the client role, even in the server's)."""
        return (stream_id % 2 == 1) != self.server

    def require_not_idle(self, stream_id: int, kind: str) -> None:
        """RST_STREAM or WINDOW_UPDATE on a stream nobody opened yet is a connection error
        (RFC 9113 §5.1): the peer's stream ids and ours are told apart by parity."""
        if stream_id == 0:
            return
        state = self.state
        idle = stream_id >= state.next_id if self.ours(stream_id) else stream_id > state.last_peer_id
        if idle:
            raise f.ProtocolError(f"{kind} on idle stream {stream_id}")

    def on_settings(self, values: list[tuple[int, int]]) -> None:
        sender = self.sender
        if not self.peer_settings_seen:
            self.peer_settings_seen = True
            sender.peer_max_streams = 2**31  # the peer states its limit now, or has none
        for key, value in values:
            if key == f.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise f.ProtocolError("INITIAL_WINDOW_SIZE above 2^31-1", f.FLOW_CONTROL_ERROR)
                delta = value - sender.peer_initial_window
                sender.peer_initial_window = value
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
                    sender.pump_blocked()
            elif key == f.MAX_FRAME_SIZE:
                if not f.DEFAULT_MAX_FRAME <= value <= 2**24 - 1:
                    raise f.ProtocolError(f"MAX_FRAME_SIZE {value} out of range")
                sender.peer_max_frame = value
            elif key == f.MAX_CONCURRENT_STREAMS:
                sender.peer_max_streams = value
            elif key == f.MAX_HEADER_LIST_SIZE:
                sender.peer_max_header_list = value
            elif key == f.ENABLE_PUSH and value > 1:
                raise f.ProtocolError("ENABLE_PUSH above 1")
            elif key == f.HEADER_TABLE_SIZE and value < sender.peer_table_size:
                # Our blocks never use the dynamic table, but the peer's decoder must be told
                # that its smaller size took effect (RFC 7541 §4.2), in our next header block.
                sender.peer_table_size = value
                sender.table_update = True
        self.state.output += f.frame(f.SETTINGS, f.ACK, 0)
        self.state.events.append(ev.SettingsChanged(tuple(values)))

    def on_ping(self, flags: int, payload: bytes) -> None:
        """A PING is answered at once; the answer to our drain PING sends the final GOAWAY."""
        if len(payload) != 8:
            raise f.ProtocolError("PING payload is not 8 bytes", f.FRAME_SIZE_ERROR)
        if not flags & f.ACK:
            self.state.output += f.frame(f.PING, f.ACK, 0, payload)
            self.state.events.append(ev.PingReceived(payload))
        else:
            if payload == DRAIN_PING and self.sender.goaway_state == "announced":
                self.sender.final_goaway()
            self.state.events.append(ev.PingAcked(payload))

    def on_window_update(self, stream_id: int, increment: int) -> None:
        if increment == 0:
            if stream_id == 0:
                raise f.ProtocolError("WINDOW_UPDATE of 0")
            # On a stream it is that stream's error only (RFC 9113 §6.9): reset it, keep the rest.
            self.stream_error(stream_id, f.PROTOCOL_ERROR)
            return
        sender = self.sender
        if stream_id == 0:
            sender.send_window += increment
            if sender.send_window > f.MAX_WINDOW:
                raise f.ProtocolError("connection window above 2^31-1", f.FLOW_CONTROL_ERROR)
            sender.pump_blocked()
            return
        stream = self.streams.get(stream_id)
        if stream is not None and not stream.reset:
            stream.send_window += increment
            if stream.send_window > f.MAX_WINDOW:  # that stream's error only (RFC 9113 §6.9.1)
                self.stream_error(stream_id, f.FLOW_CONTROL_ERROR)
                return
            if stream.pending or stream.trailers_pending is not None:
                sender.report(stream, sender.pump(stream))

    def on_reset(self, stream_id: int, code: int) -> None:
        stream = self.streams.get(stream_id)
        if stream is None or stream.reset:
            return
        stream.reset = True
        unsent = self.sender.drop(stream)
        self.state.events.append(ev.StreamReset(stream_id, code, remote=True, unsent=unsent))

    def on_goaway(self, last_stream_id: int, code: int, debug: bytes) -> None:
        self.goaway_received = True
        refused = []
        if not self.server:
            blocked = self.sender.blocked
            for stream in self.streams.values():
                if stream.id > last_stream_id and not stream.reset:
                    # Not processed, like a refusal: no RST_STREAM. What is queued on it stays
                    # until the driver releases the stream (release_stream reports it).
                    stream.reset = True
                    blocked.pop(stream.id, None)
                    refused.append(stream.id)
        self.state.events.append(ev.GoAwayReceived(last_stream_id, code, debug, tuple(refused)))

    def stream_error(self, stream_id: int, code: int, idle: bool = False) -> None:
        """A stream error (RFC 9113 §5.4.2): RST_STREAM(code) on that stream; the connection and
        its other streams go on. Nothing is sent for an idle stream, unless ``idle``: a PRIORITY
        frame may name one, and its own error is the stream's (§5.3.1 of RFC 7540; grpc-go's and
        hyper's servers reset it too)."""
        stream = self.streams.get(stream_id)
        if stream is not None:
            if stream.done:
                return
            unsent = self.sender.reset_stream(stream_id, code)
            self.state.events.append(ev.StreamReset(stream_id, code, remote=False, unsent=unsent))
            return
        state = self.state
        known = stream_id < state.next_id if self.ours(stream_id) else stream_id <= state.last_peer_id
        if (known or idle) and stream_id not in state.reset_ids:
            self.sender.send_reset(stream_id, code)
