"""One HTTP/2 connection's protocol state, without I/O (RFC 9113, RFC 7541).

A :class:`Connection` owns no socket, clock or task: bytes go in with :meth:`~Connection.receive_data`,
which returns what happened as events (:mod:`krproxy.h2.events`); the send methods queue frames,
taken with :meth:`~Connection.data_to_send`. Stream states, both sides' windows, both sides'
settings and the HPACK decoder are inside it; the driver (the relay's ``Endpoint``) adds sockets,
deadlines, and the scheduling of large header blocks off the event loop.

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
* Header blocks are decoded here while :attr:`~Connection.decode_budget` lasts; beyond it, a block is
  handed out whole (:class:`~krproxy.h2.events.HeaderBlockReceived`) and input waits until the driver
  feeds the decoded fields back with :meth:`~Connection.receive_headers`.
"""

from __future__ import annotations

import enum
from collections import deque

import hpack
import hpack.exceptions

from krproxy.h2 import _control, hpackmemo
from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2._control import MAX_WINDOW_SHIFTS, Control
from krproxy.h2._send import DRAIN_PING, RESET_IDS_KEPT, LocalProtocolError
from krproxy.h2.hpackskim import Skimmer
from krproxy.h2.streams import Stream

__all__ = [
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
#: Largest header block (with CONTINUATIONs) decoded from a peer; one beyond resets its stream.
MAX_HEADER_BLOCK = 1024 * 1024
#: SETTINGS_MAX_HEADER_LIST_SIZE we advertise: a block within it fits MAX_HEADER_BLOCK, and grpc-go
#: resets a stream over it rather than send it (docs/security.md, "Header list limits, per side").
ADVERTISED_HEADER_LIST = MAX_HEADER_BLOCK - 16_384
#: Largest decoded header list (grpc-go's server default); beyond: COMPRESSION_ERROR, hpack stops.
MAX_HEADER_LIST = 16 * 1024 * 1024
#: A private flag on a header block: its HEADERS frame made the stream depend on itself.
_SELF_DEPENDENT = 0x100

#: Said when the peer answers in HTTP/1 (dockerd does, to an HTTP/2 preface).
HTTP1_PEER = (
    "the peer speaks HTTP/1, not gRPC over HTTP/2; if it is dockerd, run krproxy with "
    "--backend-runtime-mode=Docker"
)


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class Connection(Control):
    """One HTTP/2 connection, server or client role. See the module docstring; the send
    methods are in :class:`krproxy.h2._send.Sender`, the control frames' rules in
    :class:`krproxy.h2._control.Control`."""

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
        """
        self.role = role
        self.server = role is Role.SERVER
        self.max_concurrent_streams = max_concurrent_streams
        self.check_request_headers = check_request_headers
        self.stepwise = stepwise
        self.credit_on_arrival = (
            (not self.server) if connection_credit_on_arrival is None else connection_credit_on_arrival
        )
        self.stream_window = stream_window
        self.streams: dict[int, Stream] = {}
        #: Streams with data waiting for send window.
        self.blocked: dict[int, Stream] = {}
        #: Bytes queued in the streams beyond the peer's windows.
        self.buffered = 0
        #: Bytes of header blocks decoded here before one is handed out
        #: (:class:`~krproxy.h2.events.HeaderBlockReceived`); None: no limit. The driver sets it.
        self.decode_budget: int | None = None
        self.send_window = f.DEFAULT_WINDOW
        self.recv_window = connection_window
        self.to_grant = 0
        self.peer_initial_window = f.DEFAULT_WINDOW
        self.peer_max_frame = f.DEFAULT_MAX_FRAME
        # Until the peer's SETTINGS say otherwise, no more streams than RFC 9113 asks every
        # peer to allow: h2 (grpclib) closes the connection on a stream beyond its limit.
        self.peer_max_streams = 100
        self.peer_settings_seen = False
        self.window_shifts = 0
        self.max_window_shifts = (
            _control.MAX_WINDOW_SHIFTS if max_window_shifts is None else max_window_shifts
        )
        self.next_id = 1 if not self.server else 2
        self.last_peer_id = 0
        #: Graceful shutdown (RFC 9113 §6.8): None, "announced" (a GOAWAY with the largest id and
        #: a PING are out) or "final" (GOAWAY with the last id we process; later streams refused).
        self.goaway_state: str | None = None
        self.goaway_received = False
        self.peer_table_size = 4096  # SETTINGS_HEADER_TABLE_SIZE, for our encoder (RFC 7541 §4.2)
        self.table_update = False  # a dynamic table size update is owed in the next block
        self.reset_ids: set[int] = set()
        self._reset_order: deque[int] = deque()
        self.decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)  # through hpackmemo.decode
        self.terminated: ev.ConnectionTerminated | None = None
        #: Input kept for the next call: a partial frame, or the frames after a stepwise stop.
        self.unread = bytearray()
        #: The bytes queued for the peer: :meth:`data_to_send` takes them, or a driver writes
        #: from this buffer and trims it in place (one copy less per write).
        self.output = bytearray()
        self._events: list[ev.Event] = []
        self._preface_due = self.server
        self._continuation: tuple[int, int, bytearray | Skimmer] | None = None
        self._deferred: tuple[int, int] | None = None
        self._grant_stream_at = stream_window // 4
        self._grant_connection_at = connection_window // 4
        self.peer_max_header_list: int | None = None  # the peer's limit; None: none said
        ours = [(f.INITIAL_WINDOW_SIZE, stream_window), (f.MAX_HEADER_LIST_SIZE, ADVERTISED_HEADER_LIST)]
        if self.server:
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
        if self._deferred is not None:
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

    def decode_block(self, block: bytes) -> Headers | f.ProtocolError:
        """The fields of a block handed out by :class:`~krproxy.h2.events.HeaderBlockReceived`,
        decoded with the connection's HPACK state, or the COMPRESSION_ERROR it is. Safe in a
        worker thread while nothing else touches the connection."""
        try:
            return hpackmemo.decode(self.decoder, block)
        except (hpack.exceptions.HPACKError, IndexError, ValueError) as err:
            return f.ProtocolError(f"undecodable header block: {err}", f.COMPRESSION_ERROR)

    def receive_headers(self, headers: Headers | f.ProtocolError) -> list[ev.Event]:
        """What :meth:`decode_block` made of the handed-out block; goes on with the input."""
        if self._deferred is None:
            raise LocalProtocolError("no header block awaits decoding")
        stream_id, flags = self._deferred
        self._deferred = None
        if self.terminated is not None:
            return []
        try:
            if isinstance(headers, f.ProtocolError):
                raise headers
            self._on_block(stream_id, flags, headers)
        except f.ProtocolError as err:
            self._terminate(err.code, str(err))
            return self._take_events()
        return self.next_events()

    def _take_events(self) -> list[ev.Event]:
        events, self._events = self._events, []
        return events

    def next_events(self) -> list[ev.Event]:
        """Handle the whole frames kept in :attr:`unread`; returns their events. In stepwise mode,
        a driver calls it for the rest of the input when the previous events are acted on and
        :attr:`unread` holds a frame header or more: ``receive_data(b"")`` without its checks
        (one call per frame that made events, on every driver's hot path)."""
        buf = self.unread
        offset, total = 0, len(buf)
        head = f.HEAD
        events = self._events
        stepwise = self.stepwise
        try:
            while total - offset >= f.HEAD_SIZE and self._deferred is None and self.terminated is None:
                if stepwise and events:
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
        self._events = []
        return events

    def _terminate(self, code: int, reason: str) -> None:
        if self.terminated is not None:
            return
        self.output += f.goaway(self.last_peer_id, code, reason.encode()[:200])
        self.terminated = ev.ConnectionTerminated(code, reason)
        self._events.append(self.terminated)

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuation is not None and kind != f.CONTINUATION:
            raise f.ProtocolError("header block interrupted before END_HEADERS")
        if kind == f.DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == f.HEADERS:
            if stream_id == 0:
                raise f.ProtocolError("HEADERS on stream 0")
            if flags & (f.PADDED | f.PRIORITY_FLAG):  # gRPC peers send neither: the block is the payload
                payload, depends_on = f.header_fragment(flags, payload)
                if depends_on == stream_id:  # a stream error, once the block is decoded (HPACK state)
                    flags |= _SELF_DEPENDENT
            if flags & f.END_HEADERS:
                self._block(stream_id, flags, payload)
            else:
                self._continuation = (stream_id, flags, bytearray(payload))
        elif kind == f.CONTINUATION:
            if self._continuation is None or self._continuation[0] != stream_id:
                raise f.ProtocolError("CONTINUATION without a header block to continue")
            _, first_flags, block = self._continuation
            if isinstance(block, bytearray) and len(block) + len(payload) <= MAX_HEADER_BLOCK:
                block += payload
            else:  # over MAX_HEADER_BLOCK: read for the HPACK state only (krproxy.h2.hpackskim)
                block = self._skim(stream_id, first_flags, block, payload)
            if flags & f.END_HEADERS:
                self._continuation = None
                if isinstance(block, Skimmer):
                    self._on_oversized_block(stream_id, block)
                else:
                    self._block(stream_id, first_flags, bytes(block))
        elif kind == f.SETTINGS:
            _require_connection(stream_id, "SETTINGS")
            if flags & f.ACK:
                if payload:  # RFC 9113 §6.5
                    raise f.ProtocolError("SETTINGS ACK with a payload", f.FRAME_SIZE_ERROR)
                self._events.append(ev.SettingsAcked())
            else:
                self._on_settings(f.parse_settings(payload))
        elif kind == f.WINDOW_UPDATE:
            self._require_not_idle(stream_id, "WINDOW_UPDATE")
            self._on_window_update(stream_id, f.parse_u32(payload))
        elif kind == f.PING:
            _require_connection(stream_id, "PING")
            if len(payload) != 8:
                raise f.ProtocolError("PING payload is not 8 bytes", f.FRAME_SIZE_ERROR)
            if not flags & f.ACK:
                self.output += f.frame(f.PING, f.ACK, 0, payload)
                self._events.append(ev.PingReceived(payload))
            else:
                if payload == DRAIN_PING and self.goaway_state == "announced":
                    self.final_goaway()
                self._events.append(ev.PingAcked(payload))
        elif kind == f.RST_STREAM:
            _require_stream(stream_id, "RST_STREAM")
            self._require_not_idle(stream_id, "RST_STREAM")
            self._on_reset(stream_id, f.parse_u32(payload))
        elif kind == f.GOAWAY:
            _require_connection(stream_id, "GOAWAY")
            last, code = f.parse_goaway(payload)
            self._on_goaway(last, code, payload[8:])
        elif kind == f.PUSH_PROMISE:
            raise f.ProtocolError("PUSH_PROMISE (push is disabled)")
        elif kind == f.PRIORITY:  # the scheme is deprecated (§5.3.2), the frame still checked
            _require_stream(stream_id, "PRIORITY")
            try:
                if f.parse_priority(payload) == stream_id:
                    raise f.StreamError(f"stream {stream_id} depends on itself")
            except f.StreamError as err:
                self._stream_error(stream_id, err.code, idle=True)
        # Unknown frame types are ignored (RFC 9113 §5.5).

    # -- DATA ----------------------------------------------------------------------------

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise f.ProtocolError("DATA on stream 0")
        size = len(payload)
        self.recv_window -= size
        if self.recv_window < 0:
            raise f.ProtocolError("DATA beyond the connection window", f.FLOW_CONTROL_ERROR)
        if self.credit_on_arrival:  # _grant_connection(size), its test inline: once per DATA frame
            self.to_grant += size
            if self.to_grant >= self._grant_connection_at:
                self._grant_connection(0)  # adds nothing: sends the WINDOW_UPDATE now due
        data = f.unpad(flags, payload) if flags & f.PADDED else payload
        stream = self.streams.get(stream_id)
        if stream is None or stream.recv_ended or stream.reset:
            if not self.credit_on_arrival:
                self._grant_connection(size)  # a stream that is over (or never was): nothing to pass on
            if not self.server:
                return
            if stream_id > self.last_peer_id:
                raise f.ProtocolError(f"DATA on idle stream {stream_id}")
            if stream is not None and not stream.done:  # half-closed (remote): a stream error
                self._stream_error(stream_id, f.STREAM_CLOSED)
            elif stream_id not in self.reset_ids:
                # Closed: the peer reset it, or both sides ended it (RFC 9113 §6.1: a stream
                # error). Not when we reset it: what was in flight then is ignored (§5.1).
                self._send_reset(stream_id, f.STREAM_CLOSED)
            return
        if not stream.headers_received:  # an answer starts with headers (RFC 9113 §8.1): malformed
            if not self.credit_on_arrival:
                self._grant_connection(size)
            self._stream_error(stream_id, f.PROTOCOL_ERROR)
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
                    self._grant_connection(len(data))
                self._stream_error(stream_id, f.PROTOCOL_ERROR)
                return
        if end:
            stream.recv_ended = True
        self._events.append(ev.DataReceived(stream_id, data, size, end))

    # -- header blocks -------------------------------------------------------------------

    def _block(self, stream_id: int, flags: int, block: bytes) -> None:
        """A whole header block arrived: decode it here, or hand it out (decode_budget)."""
        if self.decode_budget is not None:
            self.decode_budget -= len(block)
            if self.decode_budget < 0:
                self._deferred = (stream_id, flags)
                self._events.append(ev.HeaderBlockReceived(stream_id, block))
                return
        try:  # decode_block's work, without its result's isinstance test (once per block)
            headers = hpackmemo.decode(self.decoder, block)
        except (hpack.exceptions.HPACKError, IndexError, ValueError) as err:
            raise f.ProtocolError(f"undecodable header block: {err}", f.COMPRESSION_ERROR) from None
        if self.server:
            self._on_block(stream_id, flags, headers)
        else:
            self._on_answer_block(self.streams.get(stream_id), headers, bool(flags & f.END_STREAM))

    def _on_block(self, stream_id: int, flags: int, headers: Headers) -> None:
        end = bool(flags & f.END_STREAM)
        stream = self.streams.get(stream_id)
        if not self.server:
            self._on_answer_block(stream, headers, end)
            return
        if stream is None:
            self._open_peer_stream(stream_id, flags, headers, end)
            return
        if stream.reset:
            return
        if stream.recv_ended:  # half-closed (remote): a stream error (RFC 9113 §5.1)
            self._stream_error(stream_id, f.STREAM_CLOSED)
            return
        stream.recv_ended = end
        if not end:
            raise f.ProtocolError(f"second header block on stream {stream_id} without END_STREAM")
        problem = f.request_header_problem(headers, trailers=True) if self.check_request_headers else None
        if problem is not None or stream.expect:  # malformed, or DATA short of content-length
            self._stream_error(stream_id, f.PROTOCOL_ERROR)
            return
        self._events.append(ev.TrailersReceived(stream_id, headers))

    def _open_peer_stream(self, stream_id: int, flags: int, headers: Headers, end: bool) -> None:
        if not self._take_peer_stream_id(stream_id):
            return  # we reset it: frames already on their way are ignored (§5.1)
        limit = self.max_concurrent_streams
        if self.goaway_state == "final" or (limit is not None and len(self.streams) >= limit):
            # Above the last id of our GOAWAY, or beyond the streams we advertised: not
            # processed, so the caller may send it again (elsewhere).
            self._send_reset(stream_id, f.REFUSED_STREAM)
            return
        if flags & _SELF_DEPENDENT:
            problem: str | None = "it depends on itself"
        elif self.check_request_headers:
            problem = f.request_header_problem(headers)
        else:
            problem = None
        length = None if problem is not None else f.content_length(headers)
        if end and length:
            problem = f"content-length {length} but no DATA"
        if problem is not None:  # malformed (RFC 9113 §8.1.1): a stream error
            self._send_reset(stream_id, f.PROTOCOL_ERROR)
            return
        stream = Stream(stream_id, self.peer_initial_window, self.stream_window)
        stream.headers_received = True
        stream.recv_ended = end
        stream.expect = length
        self.streams[stream_id] = stream
        self._events.append(ev.RequestReceived(stream_id, headers, end))


def _require_stream(stream_id: int, kind: str) -> None:
    if stream_id == 0:
        raise f.ProtocolError(f"{kind} on stream 0")


def _require_connection(stream_id: int, kind: str) -> None:
    if stream_id != 0:
        raise f.ProtocolError(f"{kind} on stream {stream_id}")
