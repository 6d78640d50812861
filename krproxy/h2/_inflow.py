"""DATA received by a :class:`krproxy.h2.connection.Connection`, and the flow-control credit given
back for it (RFC 9113 §6.9). An :class:`Inflow` holds our windows: what the peer may still send on
the connection (each stream's is in its :class:`~krproxy.h2.streams.Stream`) and the credit taken
but not yet sent back. No I/O.

Received data is credited back only when the consumer calls :meth:`Inflow.acknowledge_received_data`
(the connection's share on arrival instead, with ``credit_on_arrival``, a client's choice: the
connection is shared by every caller of a relay, its streams are not); a WINDOW_UPDATE goes out
once a quarter of a window has accumulated.
"""

from __future__ import annotations

from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2._control import Control
from krproxy.h2._send import Sender
from krproxy.h2._state import State

__all__ = ["Inflow"]


class Inflow:
    """DATA in, and our receive windows with the credit that reopens them."""

    def __init__(
        self,
        state: State,
        sender: Sender,
        control: Control,
        *,
        connection_window: int,
        credit_on_arrival: bool,
    ) -> None:
        self.state = state
        self.sender = sender
        self.control = control
        self.server = state.server
        self.streams = state.streams  # the state's (never replaced)
        self.output = state.output
        #: Give the connection's credit back as data arrives, not when it is acknowledged.
        self.credit_on_arrival = credit_on_arrival
        #: What the peer may still send on the connection; below zero is its FLOW_CONTROL_ERROR.
        self.recv_window = connection_window
        #: Connection credit taken, not yet sent back in a WINDOW_UPDATE.
        self.to_grant = 0
        self._grant_stream_at = state.stream_window // 4
        self._grant_connection_at = connection_window // 4

    def on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise f.ProtocolError("DATA on stream 0")
        size = len(payload)
        self.recv_window -= size
        if self.recv_window < 0:
            raise f.ProtocolError("DATA beyond the connection window", f.FLOW_CONTROL_ERROR)
        if self.credit_on_arrival:  # _grant_connection(size), its test inline: once per DATA frame
            self.to_grant += size
            if self.to_grant >= self._grant_connection_at:
                self.acknowledge_connection_data(0)  # adds nothing: sends the WINDOW_UPDATE now due
        data = f.unpad(flags, payload) if flags & f.PADDED else payload
        stream = self.streams.get(stream_id)
        if stream is None or stream.recv_ended or stream.reset:
            if not self.credit_on_arrival:
                # A stream that is over (or never was): nothing to pass on.
                self.acknowledge_connection_data(size)
            if not self.server:
                return
            state = self.state
            if stream_id > state.last_peer_id:
                raise f.ProtocolError(f"DATA on idle stream {stream_id}")
            if stream is not None and not stream.done:  # half-closed (remote): a stream error
                self.control.stream_error(stream_id, f.STREAM_CLOSED)
            elif stream_id not in state.reset_ids:
                # Closed: the peer reset it, or both sides ended it (RFC 9113 §6.1: a stream
                # error). Not when we reset it: what was in flight then is ignored (§5.1).
                self.sender.send_reset(stream_id, f.STREAM_CLOSED)
            return
        if not stream.headers_received:  # an answer starts with headers (RFC 9113 §8.1): malformed
            if not self.credit_on_arrival:
                self.acknowledge_connection_data(size)
            self.control.stream_error(stream_id, f.PROTOCOL_ERROR)
            return
        stream.recv_window -= size
        if stream.recv_window < 0:
            raise f.ProtocolError(f"DATA beyond the window of stream {stream_id}", f.FLOW_CONTROL_ERROR)
        if size != len(data):
            self.acknowledge_received_data(stream_id, size - len(data))  # padding is consumed here
        end = bool(flags & f.END_STREAM)
        if stream.expect is not None:
            stream.expect -= len(data)
            if stream.expect < 0 or (end and stream.expect):
                # DATA other than the content-length said: malformed (RFC 9113 §8.1.1), not
                # passed on; its connection credit comes back here (the padding's came above).
                if not self.credit_on_arrival:
                    self.acknowledge_connection_data(len(data))
                self.control.stream_error(stream_id, f.PROTOCOL_ERROR)
                return
        if end:
            stream.recv_ended = True
        self.state.events.append(ev.DataReceived(stream_id, data, size, end))

    def acknowledge_received_data(self, stream_id: int, size: int, connection: bool = True) -> None:
        """The consumer took ``size`` received bytes of a stream: let the peer send as much
        more (the connection's share too, unless it came back on arrival or ``connection`` is
        false). WINDOW_UPDATEs go out once a quarter of a window has accumulated."""
        # acknowledge_connection_data inline: this runs once per DATA frame relayed.
        if connection and not self.credit_on_arrival:
            self.to_grant += size
            if self.to_grant >= self._grant_connection_at:
                self.output += f.window_update(0, self.to_grant)
                self.recv_window += self.to_grant
                self.to_grant = 0
        stream = self.streams.get(stream_id)
        if stream is not None and not stream.recv_ended and not stream.reset:
            stream.to_grant += size
            if stream.to_grant >= self._grant_stream_at:
                self.output += f.window_update(stream_id, stream.to_grant)
                stream.recv_window += stream.to_grant
                stream.to_grant = 0

    def acknowledge_stream_data(self, stream_id: int, size: int) -> None:
        """Stream credit only: for a consumer that gave the connection's share back already
        (:meth:`acknowledge_connection_data`) and the stream's as it takes messages."""
        self.acknowledge_received_data(stream_id, size, connection=False)

    def acknowledge_connection_data(self, size: int) -> None:
        """Connection credit only (see :meth:`acknowledge_stream_data`)."""
        self.to_grant += size
        if self.to_grant >= self._grant_connection_at:
            self.output += f.window_update(0, self.to_grant)
            self.recv_window += self.to_grant
            self.to_grant = 0
