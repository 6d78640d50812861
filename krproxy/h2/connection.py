"""One HTTP/2 connection's protocol state, without I/O (RFC 9113, RFC 7541).

A :class:`Connection` owns no socket, clock or task: bytes go in with :meth:`~Connection.receive_data`,
which returns what happened as events (:mod:`krproxy.h2.events`); the send methods queue frames,
taken with :meth:`~Connection.data_to_send`. Stream states, both sides' windows, both sides'
settings and the HPACK decoder are inside it; the driver (the relay's ``Endpoint``) adds sockets,
deadlines, and the scheduling of large header blocks off the event loop.

It is a plain class that holds its parts, each a class of its own module with its own state (who
holds whom: docs/architecture.md, "The HTTP/2 core: who holds whom"): the shared
:class:`~krproxy.h2._state.State`; the :class:`~krproxy.h2._send.Sender`; the
:class:`~krproxy.h2._control.Control` of SETTINGS, PING, WINDOW_UPDATE, RST_STREAM, GOAWAY and
stream errors; the :class:`~krproxy.h2._inflow.Inflow` of DATA and its credit; the
:class:`~krproxy.h2._blocks.Blocks` of header blocks. This module reads the input (the preface,
frames, where each kind may be sent) and hands each frame to its part.

Rules (each has an in-memory test in ``tests/unit/test_h2state*.py``):

* A *connection* error — a frame the peer may never send, a window past 2^31-1 on the connection, an
  undecodable block, a block past the skimmer's bounds — queues GOAWAY(code) and ends the connection
  (:class:`~krproxy.h2.events.ConnectionTerminated`). A block past :data:`MAX_HEADER_BLOCK` is read
  for the HPACK state only (:mod:`krproxy.h2.hpackskim`) and resets its stream (FRAME_SIZE_ERROR).
* A *stream* error (RFC 9113 §5.4.2) — a malformed request, an answer starting with DATA or with a
  second header block without END_STREAM, DATA on a half-closed stream, a stream window past
  2^31-1, WINDOW_UPDATE of 0 on a stream, PRIORITY on itself or of the wrong length — resets that
  stream only (:class:`~krproxy.h2.events.StreamReset`); frames the peer sent before it saw the reset
  are ignored (§5.1).
* Flow control: received data is credited back only when the consumer calls
  :meth:`~Connection.acknowledge_received_data` (the connection's share on arrival instead, with
  ``connection_credit_on_arrival``, a client's choice: the connection is shared by every caller of a
  relay, its streams are not); data to send waits for the peer's windows inside the connection.
* Streams count against the limits until the driver releases them (:mod:`krproxy.h2.streams`).
* Stepwise reading (``stepwise``) stops after each frame that made events. With
  ``whole_requests``, a request's HEADERS and the DATA frame ending its stream right after,
  whole and unpadded, are one step: the DATA's event rides in the
  :class:`~krproxy.h2.events.RequestReceived` (``body``), held to every rule as if read alone.
* Header blocks are decoded here while the driver's budget lasts
  (:attr:`~krproxy.h2._blocks.Blocks.decode_budget`, set as ``conn.blocks.decode_budget``); beyond
  it, a block is handed out whole (:class:`~krproxy.h2.events.HeaderBlockReceived`) and input waits
  until the driver feeds the decoded fields back with :meth:`~Connection.receive_headers`.
"""

from __future__ import annotations

import enum

from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2._blocks import (
    ADVERTISED_HEADER_LIST,
    MAX_HEADER_BLOCK,
    MAX_HEADER_LIST,
    SELF_DEPENDENT,
    Blocks,
)
from krproxy.h2._control import MAX_WINDOW_SHIFTS, Control
from krproxy.h2._inflow import Inflow
from krproxy.h2._send import DRAIN_PING, RESET_IDS_KEPT, LocalProtocolError, Sender
from krproxy.h2._state import State

__all__ = [
    "ADVERTISED_HEADER_LIST",
    "CONNECTION_WINDOW",
    "DRAIN_PING",
    "HTTP1_PEER",
    "MAX_HEADER_BLOCK",
    "MAX_HEADER_LIST",
    "MAX_WINDOW_SHIFTS",
    "RESET_IDS_KEPT",
    "STREAM_WINDOW",
    "Connection",
    "LocalProtocolError",
    "Role",
]

Headers = ev.Headers

#: Window we grant each stream (SETTINGS_INITIAL_WINDOW_SIZE), and the connection as a whole.
#: An 860 KB ListContainers answer fits in one stream window, so it never waits for a grant.
STREAM_WINDOW = 4 * 1024 * 1024
CONNECTION_WINDOW = 16 * 1024 * 1024

#: Said when the peer answers in HTTP/1 (dockerd does, to an HTTP/2 preface).
HTTP1_PEER = (
    "the peer speaks HTTP/1, not gRPC over HTTP/2; if it is dockerd, run krproxy with "
    "--backend-runtime-mode=Docker"
)


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class Connection:
    """One HTTP/2 connection, server or client role (see the module docstring). It holds its
    parts and reads the input, handing each frame to the part it concerns:

    * :attr:`state` (:class:`~krproxy.h2._state.State`): role, streams, stream ids, resets sent,
      the output buffer and the events of the input being read;
    * :attr:`sender` (:class:`~krproxy.h2._send.Sender`): the send side — streams opened,
      headers, data within the peer's windows, trailers, resets, GOAWAY, PING;
    * :attr:`control` (:class:`~krproxy.h2._control.Control`): SETTINGS, PING, WINDOW_UPDATE,
      RST_STREAM and GOAWAY received, stream errors;
    * :attr:`inflow` (:class:`~krproxy.h2._inflow.Inflow`): DATA received, our windows and the
      credit given back;
    * :attr:`blocks` (:class:`~krproxy.h2._blocks.Blocks`): header blocks received, HPACK decoding,
      :attr:`~krproxy.h2._blocks.Blocks.decode_budget`.

    The parts' methods a driver calls are this connection's too (``conn.send_data`` is
    ``conn.sender.send_data``, bound here: no call added per call); their state is read on the
    part that keeps it (``conn.sender.buffered``, ``conn.inflow.recv_window``).
    """

    def __init__(
        self,
        role: Role,
        *,
        max_concurrent_streams: int | None = None,
        check_request_headers: bool = True,
        connection_credit_on_arrival: bool | None = None,
        stream_window: int = STREAM_WINDOW,
        connection_window: int = CONNECTION_WINDOW,
        max_window_shifts: int | None = None,
        stepwise: bool = False,
        whole_requests: bool = False,
    ) -> None:
        """Args:
        max_concurrent_streams: the limit we advertise (server role); streams beyond it
            are refused with REFUSED_STREAM. None: none advertised, none enforced.
        check_request_headers: refuse malformed requests (RFC 9113 §8.1.1); off for a fake
            that must see them.
        connection_credit_on_arrival: give the connection's flow-control credit back as
            data arrives rather than when it is acknowledged (default: in the client role).
        max_window_shifts: stream windows the peer's SETTINGS_INITIAL_WINDOW_SIZE changes
            may adjust (default :data:`MAX_WINDOW_SHIFTS`).
        stepwise: :meth:`receive_data` returns after each frame that made events, and keeps
            the rest of the input for the next call (``receive_data(b"")`` goes on). A driver
            that acts on an event (answers, resets, releases a stream) then does so before the
            connection's state moves past it: the next frames meet the state it left.
        whole_requests: (stepwise, server role) a request's HEADERS and the DATA frame ending
            its stream right after it, whole and unpadded in the input, are read in one step:
            the DATA's event rides in :attr:`RequestReceived.body
            <krproxy.h2.events.RequestReceived.body>`. For a driver whose answer to a request
            does not change what its DATA meets (no reset on the HEADERS alone): the DATA is
            read before the driver has seen the HEADERS.
        """
        server = role is Role.SERVER
        self.role = role
        self.stepwise = stepwise
        self.whole_requests = whole_requests and stepwise and server
        self.state = state = State(server=server, stream_window=stream_window)
        self.sender = sender = Sender(state)
        self.control = control = Control(state, sender, max_window_shifts=max_window_shifts)
        on_arrival = connection_credit_on_arrival
        self.inflow = inflow = Inflow(
            state,
            sender,
            control,
            connection_window=connection_window,
            credit_on_arrival=(not server) if on_arrival is None else on_arrival,
        )
        self.blocks = blocks = Blocks(
            state,
            sender,
            control,
            check_request_headers=check_request_headers,
            max_concurrent_streams=max_concurrent_streams,
        )
        #: The streams not yet released, by id (the state's table, read only).
        self.streams = state.streams
        #: The bytes queued for the peer (the state's buffer): :meth:`data_to_send` takes them,
        #: or a driver writes from this buffer and trims it in place (one copy less per write).
        self.output = state.output
        #: Input kept for the next call: a partial frame, or the frames after a stepwise stop.
        self.unread = bytearray()
        self.terminated: ev.ConnectionTerminated | None = None
        self._preface_due = server

        # The parts' methods, bound once here: a driver's call (or a frame's) is one call.
        self.can_start_stream = sender.can_start_stream
        self.start_stream = sender.start_stream
        self.release_stream = sender.release_stream
        self.stream = sender.stream
        self.send_headers = sender.send_headers
        self.send_data = sender.send_data
        self.send_answer = sender.send_answer
        self.send_trailers = sender.send_trailers
        self.over_peer_limit = sender.over_peer_limit
        self.abandon_output = sender.abandon_output
        self.reset_stream = sender.reset_stream
        self.send_ping = sender.send_ping
        self.goaway = sender.goaway
        self.announce_goaway = sender.announce_goaway
        self.final_goaway = sender.final_goaway
        self.acknowledge_received_data = inflow.acknowledge_received_data
        self.acknowledge_stream_data = inflow.acknowledge_stream_data
        self.acknowledge_connection_data = inflow.acknowledge_connection_data
        self.decode_block = blocks.decode_block
        self._on_data = inflow.on_data
        self._block = blocks.block

        ours = [(f.INITIAL_WINDOW_SIZE, stream_window), (f.MAX_HEADER_LIST_SIZE, ADVERTISED_HEADER_LIST)]
        if server:
            if max_concurrent_streams is not None:
                ours.append((f.MAX_CONCURRENT_STREAMS, max_concurrent_streams))
        else:
            self.output += f.PREFACE
            ours.append((f.ENABLE_PUSH, 0))
        self.output += f.settings(ours)
        if connection_window > f.DEFAULT_WINDOW:
            self.output += f.window_update(0, connection_window - f.DEFAULT_WINDOW)

    # -- output --------------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        """The bytes queued for the peer since the last call (no I/O: the driver writes them)."""
        out = bytes(self.output)
        self.output.clear()
        return out

    @property
    def input_left(self) -> bool:
        """Input is kept that may hold a whole frame (stepwise reading stopped before it):
        ``receive_data(b"")`` goes on with it."""
        return len(self.unread) >= f.HEAD_SIZE

    @property
    def preface_received(self) -> bool:
        """The client's connection preface arrived (always true in the client role)."""
        return not self._preface_due

    # -- input ---------------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[ev.Event]:
        """Take bytes from the peer; returns what they did, in order. Frames split across calls
        are kept until whole. After :class:`~krproxy.h2.events.ConnectionTerminated`, input is
        ignored. Raises :class:`LocalProtocolError` while a header block awaits
        :meth:`receive_headers`."""
        if self.blocks.deferred is not None:
            raise LocalProtocolError("a header block awaits receive_headers()")
        if self.terminated is not None:
            return []
        if data:
            self.unread += data
        if self._preface_due:
            try:
                if not f.take_preface(self.unread):
                    return []
                self._preface_due = False
            except f.ProtocolError as err:
                self._terminate(err.code, str(err))
                return self._take_events()
        return self.next_events()

    def receive_headers(self, headers: Headers | f.ProtocolError) -> list[ev.Event]:
        """What :meth:`decode_block` made of the handed-out block; goes on with the input."""
        blocks = self.blocks
        if blocks.deferred is None:
            raise LocalProtocolError("no header block awaits decoding")
        stream_id, flags = blocks.deferred
        blocks.deferred = None
        if self.terminated is not None:
            return []
        try:
            if isinstance(headers, f.ProtocolError):
                raise headers
            blocks.on_block(stream_id, flags, headers)
        except f.ProtocolError as err:
            self._terminate(err.code, str(err))
            return self._take_events()
        return self.next_events()

    def _take_events(self) -> list[ev.Event]:
        state = self.state
        events, state.events = state.events, []
        return events

    def next_events(self) -> list[ev.Event]:
        """Handle the whole frames kept in :attr:`unread`; returns their events. In stepwise mode,
        a driver calls it for the rest of the input when the previous events are acted on and
        :attr:`unread` holds a frame header or more: ``receive_data(b"")`` without its checks
        (one call per frame that made events, on every driver's hot path)."""
        buf = self.unread
        offset, total = 0, len(buf)
        head = f.HEAD
        state = self.state
        blocks = self.blocks
        events = state.events
        stepwise = self.stepwise
        try:
            while total - offset >= f.HEAD_SIZE and blocks.deferred is None and self.terminated is None:
                if stepwise and events:
                    if self.whole_requests and len(events) == 1:
                        offset = self._body(events, buf, offset, total)
                    break
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
        except f.ProtocolError as err:
            self._terminate(err.code, str(err))
        finally:
            del buf[:offset]
        state.events = []
        return events

    def _body(self, events: list[ev.Event], buf: bytearray, offset: int, total: int) -> int:
        """``whole_requests``: the DATA frame at ``offset`` read with the request just opened
        (``events``' one event) if it is that stream's, ends it, and is whole and unpadded; its
        event then rides in the request's. Returns the offset the input is read up to."""
        request = events[0]
        if not isinstance(request, ev.RequestReceived) or request.end_stream:
            return offset
        high, low, kind, flags, stream_id = f.HEAD.unpack_from(buf, offset)
        size: int = high << 16 | low
        end: int = offset + f.HEAD_SIZE + size
        if (
            kind != f.DATA
            or flags & (f.END_STREAM | f.PADDED) != f.END_STREAM
            or stream_id & 0x7FFF_FFFF != request.stream_id
            or size > f.DEFAULT_MAX_FRAME
            or end > total
        ):
            return offset
        try:
            self._on_data(flags, request.stream_id, bytes(buf[offset + f.HEAD_SIZE : end]))
        except f.ProtocolError as err:
            self._terminate(err.code, str(err))
            return end
        if len(events) == 2:
            data = events[1]
            if isinstance(data, ev.DataReceived):
                events[:] = [ev.RequestReceived(request.stream_id, request.headers, False, data)]
        return end

    def _terminate(self, code: int, reason: str) -> None:
        if self.terminated is not None:
            return
        self.output += f.goaway(self.state.last_peer_id, code, reason.encode()[:200])
        self.terminated = ev.ConnectionTerminated(code, reason)
        self.state.events.append(self.terminated)

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        """One frame, checked for where it may be sent, handed to the part it concerns."""
        if self.blocks.continuation is not None and kind != f.CONTINUATION:
            raise f.ProtocolError("header block interrupted before END_HEADERS")
        if kind == f.DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == f.HEADERS:
            if stream_id == 0:
                raise f.ProtocolError("HEADERS on stream 0")
            if flags & (f.PADDED | f.PRIORITY_FLAG):  # gRPC peers send neither: the block is the payload
                payload, depends_on = f.header_fragment(flags, payload)
                if depends_on == stream_id:  # a stream error, once the block is decoded (HPACK state)
                    flags |= SELF_DEPENDENT
            if flags & f.END_HEADERS:
                self._block(stream_id, flags, payload)
            else:
                self.blocks.continuation = (stream_id, flags, bytearray(payload))
        elif kind == f.CONTINUATION:
            self.blocks.on_continuation(stream_id, flags, payload)
        elif kind == f.SETTINGS:
            _require_connection(stream_id, "SETTINGS")
            if flags & f.ACK:
                if payload:  # RFC 9113 §6.5
                    raise f.ProtocolError("SETTINGS ACK with a payload", f.FRAME_SIZE_ERROR)
                self.state.events.append(ev.SettingsAcked())
            else:
                self.control.on_settings(f.parse_settings(payload))
        elif kind == f.WINDOW_UPDATE:
            self.control.require_not_idle(stream_id, "WINDOW_UPDATE")
            self.control.on_window_update(stream_id, f.parse_u32(payload))
        elif kind == f.PING:
            _require_connection(stream_id, "PING")
            self.control.on_ping(flags, payload)
        elif kind == f.RST_STREAM:
            _require_stream(stream_id, "RST_STREAM")
            self.control.require_not_idle(stream_id, "RST_STREAM")
            self.control.on_reset(stream_id, f.parse_u32(payload))
        elif kind == f.GOAWAY:
            _require_connection(stream_id, "GOAWAY")
            last, code = f.parse_goaway(payload)
            self.control.on_goaway(last, code, payload[8:])
        elif kind == f.PUSH_PROMISE:
            raise f.ProtocolError("PUSH_PROMISE (push is disabled)")
        elif kind == f.PRIORITY:  # the scheme is deprecated (§5.3.2), the frame still checked
            _require_stream(stream_id, "PRIORITY")
            try:
                if f.parse_priority(payload) == stream_id:
                    raise f.StreamError(f"stream {stream_id} depends on itself")
            except f.StreamError as err:
                self.control.stream_error(stream_id, err.code, idle=True)
        # Unknown frame types are ignored (RFC 9113 §5.5).


def _require_stream(stream_id: int, kind: str) -> None:
    if stream_id == 0:
        raise f.ProtocolError(f"{kind} on stream 0")


def _require_connection(stream_id: int, kind: str) -> None:
    if stream_id != 0:
        raise f.ProtocolError(f"{kind} on stream {stream_id}")
