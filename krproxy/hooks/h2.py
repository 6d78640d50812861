"""gRPC unary calls over HTTP/2 without a gRPC library: how the proxy calls hook plugins.

Why not grpclib: a hook call through grpclib cost the proxy about 0.75 ms of CPU — an h2
state machine per stream, metadata objects, a deadline wrapper and several task switches —
several times krproxy's own hook work (docs/performance.md). A hook call needs much less: one
request message out, one answer back, on a connection only the proxy uses. Here a call is one
``write`` (HEADERS and DATA frames together), and the answer is parsed in the protocol's
``data_received``, which wakes the waiting task once, with the answer.

What is implemented (RFC 9113; gRPC over HTTP/2):

- h2c with prior knowledge (a unix socket carries no TLS and no upgrade);
- flow control both ways, padding, CONTINUATION, SETTINGS, PING, GOAWAY, RST_STREAM and the
  peer's limit on concurrent streams;
- HPACK: header blocks received are decoded with the ``hpack`` package (peers use the dynamic
  table and Huffman coding), blocks sent are literal fields "without indexing" (or static-table
  matches), so this side keeps no encoder state and the peer's dynamic table is never touched;
- gRPC: ``grpc-timeout``, trailers-only answers, ``grpc-status``/``grpc-message``, a non-200
  ``:status`` mapped as gRPC specifies (http-grpc-status-mapping.md), and a call the peer refused
  unprocessed (REFUSED_STREAM) sent again within its timeout, as gRPC's transparent retry does.

Not implemented, since hook calls need none of it: TLS, compression (none is offered, so a
compressed answer is a protocol error), streaming calls, server push (disabled in SETTINGS).

:class:`H2Peer` is the part both ends share (framing, settings, flow control); the proxy's
client is :class:`ClientConnection` under :class:`PluginChannel`. The fake plugin
(:mod:`fakes.plugin.h2server`) builds its server on :class:`H2Peer` too.

Error handling — what :meth:`PluginChannel.unary` raises:

- ``FileNotFoundError`` / ``ConnectionRefusedError`` (``OSError``): nobody listens on the socket;
- :class:`grpclib.exceptions.GRPCError`: the plugin answered a gRPC error status;
- :class:`grpclib.exceptions.StreamTerminatedError`: the stream or the connection ended before
  the answer ("Connection lost", a reset, a GOAWAY);
- :class:`PluginProtocolError`: the plugin broke HTTP/2, or gRPC's framing of the answer;
- ``TimeoutError``: no answer within the timeout (the stream is then reset).

``GRPCError`` and ``StreamTerminatedError`` are grpclib's types with grpclib's messages, so the
causes in logs, statuses and metrics read as they did when plugins were called with grpclib.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from typing import ClassVar

import hpack
import hpack.exceptions
from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.metadata import decode_grpc_message, encode_timeout

__all__ = [
    "MAX_MESSAGE",
    "ClientConnection",
    "H2Error",
    "H2Peer",
    "PluginChannel",
    "PluginProtocolError",
    "Stream",
    "grpc_message",
    "header_block",
    "unframe",
]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types and flags (RFC 9113 §6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# Error codes (RFC 9113 §7).
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
_ERROR_NAMES = {
    0x0: "NO_ERROR",
    0x1: "PROTOCOL_ERROR",
    0x2: "INTERNAL_ERROR",
    0x3: "FLOW_CONTROL_ERROR",
    0x4: "SETTINGS_TIMEOUT",
    0x5: "STREAM_CLOSED",
    0x6: "FRAME_SIZE_ERROR",
    0x7: "REFUSED_STREAM",
    0x8: "CANCEL",
    0x9: "COMPRESSION_ERROR",
    0xA: "CONNECT_ERROR",
    0xB: "ENHANCE_YOUR_CALM",
    0xC: "INADEQUATE_SECURITY",
    0xD: "HTTP_1_1_REQUIRED",
}

# Settings (RFC 9113 §6.5.2).
ENABLE_PUSH = 0x2
MAX_CONCURRENT_STREAMS = 0x3
INITIAL_WINDOW_SIZE = 0x4
MAX_FRAME_SIZE = 0x5
MAX_HEADER_LIST_SIZE = 0x6

DEFAULT_WINDOW = 65_535
#: The largest frame the peer may send us: HTTP/2's default, which we never raise.
MAX_FRAME = 16_384
MAX_WINDOW = 2**31 - 1
MAX_STREAM_ID = 2**31 - 1

#: Window granted to the peer per stream and for the whole connection (grpclib's is 4 MiB too):
#: an answer of any allowed size arrives without waiting for a WINDOW_UPDATE.
RECV_WINDOW = 1 << 22
#: Largest gRPC message accepted, as grpc-go's and grpcio's default receive limit. A plugin is an
#: untrusted peer; without a limit one could make the proxy buffer any amount.
MAX_MESSAGE = 1 << 22
#: Largest decoded header list accepted (hpack's default); advertised in SETTINGS.
MAX_HEADER_LIST = 1 << 16

#: How long to wait before sending a refused call again when no other call is open (then the
#: peer refused for reasons of its own; the call's timeout still bounds the retries).
_REFUSED_PAUSE = 0.01

_HEAD = struct.Struct(">BHBBL")  # length (24 bits, as 8 + 16), type, flags, stream id
_U32 = struct.Struct(">L")
_SETTING = struct.Struct(">HL")
_GOAWAY = struct.Struct(">LL")

#: gRPC's mapping of HTTP statuses other than 200 (http-grpc-status-mapping.md); others: UNKNOWN.
_HTTP_TO_GRPC = {
    b"400": Status.INTERNAL,
    b"401": Status.UNAUTHENTICATED,
    b"403": Status.PERMISSION_DENIED,
    b"404": Status.UNIMPLEMENTED,
    b"429": Status.UNAVAILABLE,
    b"502": Status.UNAVAILABLE,
    b"503": Status.UNAVAILABLE,
    b"504": Status.UNAVAILABLE,
}


class H2Error(Exception):
    """The peer broke HTTP/2 in a way that ends the whole connection (GOAWAY with ``code``)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class PluginProtocolError(Exception):
    """The peer broke HTTP/2, or gRPC's framing of a unary message."""


class _Refused(StreamTerminatedError):
    """The peer refused the stream (REFUSED_STREAM) without processing it: safe to send again."""


# -- bytes --------------------------------------------------------------------------------------


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    size = len(payload)
    return _HEAD.pack(size >> 16, size & 0xFFFF, kind, flags, stream_id) + payload


def _hpack_int(value: int) -> bytes:
    """An HPACK integer with a 7-bit prefix and the bits above it clear (RFC 7541 §5.1)."""
    if value < 0x7F:
        return bytes((value,))
    out = bytearray((0x7F,))
    value -= 0x7F
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """One header field as an HPACK literal "without indexing", new name, no Huffman coding."""
    return b"\x00" + _hpack_int(len(name)) + name + _hpack_int(len(value)) + value


def header_block(*fields: tuple[bytes, bytes]) -> bytes:
    """A header block that uses neither side's dynamic table."""
    static = {(b":method", b"POST"): b"\x83", (b":scheme", b"http"): b"\x86", (b":status", b"200"): b"\x88"}
    return b"".join(static.get(field) or literal(*field) for field in fields)


def header_frames(stream_id: int, block: bytes, end_stream: bool, max_frame: int) -> bytes:
    """HEADERS (+ CONTINUATION) frames carrying ``block``."""
    flags = END_STREAM if end_stream else 0
    if len(block) <= max_frame:
        return frame(HEADERS, flags | END_HEADERS, stream_id, block)
    chunks = [block[i : i + max_frame] for i in range(0, len(block), max_frame)]
    out = [frame(HEADERS, flags, stream_id, chunks[0])]
    out += [frame(CONTINUATION, 0, stream_id, chunk) for chunk in chunks[1:-1]]
    out.append(frame(CONTINUATION, END_HEADERS, stream_id, chunks[-1]))
    return b"".join(out)


def grpc_message(message: bytes) -> bytes:
    """``message`` with gRPC's 5-byte prefix (not compressed, length)."""
    return b"\0" + len(message).to_bytes(4, "big") + message


def unframe(data: bytes | bytearray, what: str) -> bytes:
    """The one gRPC message in ``data`` (the DATA of a unary request or answer).

    Raises:
        PluginProtocolError: no message, a compressed one, a truncated one, or more than one.
    """
    if len(data) < 5:
        raise PluginProtocolError(f"the {what} carried no message")
    if data[0] != 0:
        raise PluginProtocolError(
            f"the {what} is compressed (flag {data[0]}), but no compression was offered"
        )
    size = int.from_bytes(data[1:5], "big")
    if len(data) != 5 + size:
        raise PluginProtocolError(f"the {what} is not one whole message ({len(data) - 5} bytes for {size})")
    return bytes(data[5:])


def _unpad(flags: int, payload: bytes) -> bytes:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise H2Error(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - payload[0]]


# -- the shared part of both ends ----------------------------------------------------------------


class Stream:
    """What a connection keeps per open stream; :class:`H2Peer` subclasses add their own fields."""

    __slots__ = (
        "id",
        "local_closed",
        "out",
        "out_pos",
        "recv_unacked",
        "remote_closed",
        "send_window",
        "tail",
    )

    def __init__(self, stream_id: int, send_window: int) -> None:
        self.id = stream_id
        self.send_window = send_window
        self.recv_unacked = 0  # DATA received and not yet granted back with a WINDOW_UPDATE
        self.out = b""  # DATA payload still to send
        self.out_pos = 0
        self.tail: bytes | None = None  # frames to send after the DATA (trailers)
        self.local_closed = False  # we sent END_STREAM (or will, once the windows allow)
        self.remote_closed = False  # the peer sent END_STREAM


class H2Peer(asyncio.Protocol):
    """One HTTP/2 connection, either end: framing, SETTINGS, PING, flow control and header blocks.

    Subclasses get complete header blocks (decoded) and DATA through :meth:`on_headers` and
    :meth:`on_data`, and decide what a stream means. Frames written while a read is processed
    go out in one ``write`` at its end.

    Error handling: a frame that breaks the protocol for the whole connection (:class:`H2Error`)
    makes us send GOAWAY and close; :meth:`on_closed` is told once, whatever ended the
    connection. An error confined to one stream resets just that stream (:meth:`reset`).
    """

    #: Whether this end opened the connection (sends the preface, uses odd stream ids).
    client: ClassVar[bool]

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, Stream] = {}
        self.closed = False
        self.peer_max_frame = MAX_FRAME
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_streams = MAX_STREAM_ID
        self.send_window = DEFAULT_WINDOW
        #: The highest stream id the peer opened (servers) or we opened (clients).
        self.last_stream = 0
        self._buffer = bytearray()
        self._batch: list[bytes] | None = None  # frames to write at the end of data_received
        self._decoder = hpack.Decoder(MAX_HEADER_LIST)
        self._block: bytearray | None = None  # a header block awaiting CONTINUATION
        self._block_stream = 0
        self._block_flags = 0
        self._preface_due = not self.client
        self._recv_unacked = 0
        self._blocked: dict[int, Stream] = {}  # streams with DATA waiting for window

    # -- subclass interface ----------------------------------------------------------------------

    def on_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool) -> None:
        raise NotImplementedError

    def on_data(self, stream: Stream, data: bytes, end_stream: bool) -> None:
        raise NotImplementedError

    def on_reset(self, stream: Stream, code: int) -> None:
        """The peer reset ``stream`` (already forgotten)."""

    def on_goaway(self, last_stream: int, code: int, debug: bytes) -> None:
        """The peer will not process streams above ``last_stream``."""

    def on_sent(self, stream: Stream) -> None:
        """Everything of ``stream`` was written (END_STREAM included)."""

    def on_forget(self, stream: Stream) -> None:
        """``stream`` is no longer open (ended, reset, or the connection closed)."""

    def on_closed(self, error: Exception) -> None:
        """The connection ended; ``error`` says why. Called once; ``self.streams`` still holds
        the streams that were open."""

    # -- output ------------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self._batch is not None:
            self._batch.append(data)
        elif self.transport is not None and not self.closed:
            self.transport.write(data)

    def send(self, stream: Stream, head: bytes, data: bytes, tail: bytes | None) -> None:
        """Write ``head`` (frames), then ``data`` in DATA frames as the windows allow, then ``tail``
        (frames that end the stream); with no ``tail`` the last DATA frame carries END_STREAM."""
        stream.out, stream.out_pos, stream.tail = data, 0, tail
        out = [head]
        self._drain(stream, out)
        self.write(b"".join(out))

    def reset(self, stream: Stream, code: int = CANCEL) -> None:
        """Reset ``stream`` (RST_STREAM) and forget it."""
        if self.streams.get(stream.id) is stream:
            self.write(frame(RST_STREAM, 0, stream.id, _U32.pack(code)))
            self.forget(stream)

    def forget(self, stream: Stream) -> None:
        if self.streams.pop(stream.id, None) is not None:
            self._blocked.pop(stream.id, None)
            self.on_forget(stream)

    def goaway(self, code: int = NO_ERROR, message: str = "") -> None:
        """Send GOAWAY and close the connection."""
        if self.closed or self.transport is None:
            return
        last = 0 if self.client else self.last_stream
        self.write(frame(GOAWAY, 0, 0, _GOAWAY.pack(last, code) + message.encode()[:256]))
        self._flush()
        self.transport.close()

    def _drain(self, stream: Stream, out: list[bytes]) -> None:
        if stream.local_closed:
            return
        data, pos, total = stream.out, stream.out_pos, len(stream.out)
        while pos < total:
            size = min(total - pos, self.send_window, stream.send_window, self.peer_max_frame)
            if size <= 0:
                stream.out_pos = pos
                self._blocked[stream.id] = stream
                return
            pos += size
            last = pos == total and stream.tail is None
            out.append(frame(DATA, END_STREAM if last else 0, stream.id, data[pos - size : pos]))
            self.send_window -= size
            stream.send_window -= size
        self._blocked.pop(stream.id, None)
        if stream.tail is not None:
            out.append(stream.tail)
        elif not total:
            out.append(frame(DATA, END_STREAM, stream.id))
        stream.out, stream.out_pos, stream.local_closed = b"", 0, True
        self.on_sent(stream)

    def _drain_blocked(self) -> None:
        out: list[bytes] = []
        for stream in list(self._blocked.values()):
            if self.send_window <= 0:
                break
            self._drain(stream, out)
        if out:
            self.write(b"".join(out))

    def _flush(self) -> None:
        batch, self._batch = self._batch, None
        if batch and self.transport is not None:
            self.transport.write(b"".join(batch))

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        settings = b"".join(
            _SETTING.pack(key, value)
            for key, value in (
                (ENABLE_PUSH, 0),
                (INITIAL_WINDOW_SIZE, RECV_WINDOW),
                (MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST),
            )
        )
        opening = frame(SETTINGS, 0, 0, settings) + frame(
            WINDOW_UPDATE, 0, 0, _U32.pack(RECV_WINDOW - DEFAULT_WINDOW)
        )
        transport.write(PREFACE + opening if self.client else opening)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._batch = []
        try:
            self._process()
        except H2Error as err:
            self._fail(err)
        finally:
            self._flush()

    def eof_received(self) -> bool:
        return False  # close the transport: a half-closed HTTP/2 connection is of no use

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self.on_closed(StreamTerminatedError("Connection lost"))
        self.streams.clear()
        self._blocked.clear()

    def _fail(self, err: H2Error) -> None:
        """A connection error: GOAWAY, close, and tell the subclass why."""
        self.goaway(err.code, str(err))
        if not self.closed:
            self.closed = True
            self.on_closed(PluginProtocolError(f"HTTP/2 {_ERROR_NAMES.get(err.code, err.code)}: {err}"))

    # -- input -------------------------------------------------------------------------------------

    def _process(self) -> None:
        buf = self._buffer
        pos = 0
        if self._preface_due:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(bytes(buf)):
                    raise H2Error(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return
            if buf[: len(PREFACE)] != PREFACE:
                raise H2Error(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            pos = len(PREFACE)
            self._preface_due = False
        end = len(buf)
        try:
            while end - pos >= 9 and not self.closed:
                high, low, kind, flags, stream_id = _HEAD.unpack_from(buf, pos)
                size = high << 16 | low
                if size > MAX_FRAME:
                    raise H2Error(FRAME_SIZE_ERROR, f"a frame of {size} bytes (at most {MAX_FRAME})")
                if end - pos - 9 < size:
                    break
                payload = bytes(buf[pos + 9 : pos + 9 + size])
                pos += 9 + size
                self._frame(kind, flags, stream_id & MAX_STREAM_ID, payload)
        finally:
            del buf[:pos]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is not None and kind != CONTINUATION:
            raise H2Error(PROTOCOL_ERROR, "a header block was not continued")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == PING:
            if stream_id or len(payload) != 8:
                raise H2Error(PROTOCOL_ERROR if stream_id else FRAME_SIZE_ERROR, "malformed PING")
            if not flags & ACK:
                self.write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if not stream_id or len(payload) != 4:
                raise H2Error(PROTOCOL_ERROR if not stream_id else FRAME_SIZE_ERROR, "malformed RST_STREAM")
            stream = self.streams.get(stream_id)
            if stream is not None:
                self.forget(stream)
                self.on_reset(stream, _U32.unpack(payload)[0])
        elif kind == GOAWAY:
            if stream_id or len(payload) < 8:
                raise H2Error(PROTOCOL_ERROR if stream_id else FRAME_SIZE_ERROR, "malformed GOAWAY")
            last, code = _GOAWAY.unpack_from(payload)
            self.on_goaway(last & MAX_STREAM_ID, code, payload[8:])
        elif kind == PUSH_PROMISE:
            raise H2Error(PROTOCOL_ERROR, "PUSH_PROMISE, though push is disabled")
        # PRIORITY and unknown frame types are ignored (RFC 9113 §5.5).

    def _idle(self, stream_id: int) -> bool:
        """Whether ``stream_id`` names a stream that was never opened."""
        return stream_id > self.last_stream

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise H2Error(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        self._recv_unacked += size
        if self._recv_unacked > RECV_WINDOW:
            raise H2Error(FLOW_CONTROL_ERROR, "DATA beyond the connection's window")
        if self._recv_unacked >= RECV_WINDOW // 2:
            self.write(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._recv_unacked)))
            self._recv_unacked = 0
        stream = self.streams.get(stream_id)
        if stream is None:
            if self._idle(stream_id):
                raise H2Error(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            return  # a stream we reset or finished: late frames are normal
        if stream.remote_closed:
            self.reset(stream, STREAM_CLOSED)
            return
        stream.recv_unacked += size
        if stream.recv_unacked > RECV_WINDOW:
            self.reset(stream, FLOW_CONTROL_ERROR)
            return
        end_stream = bool(flags & END_STREAM)
        if end_stream:
            stream.remote_closed = True
        elif stream.recv_unacked >= RECV_WINDOW // 2:
            self.write(frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(stream.recv_unacked)))
            stream.recv_unacked = 0
        self.on_data(stream, _unpad(flags, payload), end_stream)

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise H2Error(PROTOCOL_ERROR, "HEADERS on stream 0")
        fragment = _unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(fragment) < 5:
                raise H2Error(FRAME_SIZE_ERROR, "HEADERS with priority shorter than 5 bytes")
            fragment = fragment[5:]
        if flags & END_HEADERS:
            self._header_block(stream_id, flags, fragment)
        else:
            self._block, self._block_stream, self._block_flags = bytearray(fragment), stream_id, flags

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is None or stream_id != self._block_stream:
            raise H2Error(PROTOCOL_ERROR, "CONTINUATION without a header block to continue")
        self._block += payload
        if len(self._block) > MAX_HEADER_LIST:
            raise H2Error(PROTOCOL_ERROR, f"a header block of more than {MAX_HEADER_LIST} bytes")
        if flags & END_HEADERS:
            block, self._block = bytes(self._block), None
            self._header_block(stream_id, self._block_flags, block)

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        try:
            headers = self._decoder.decode(block, raw=True)
        except (hpack.exceptions.HPACKError, IndexError, ValueError) as err:
            raise H2Error(COMPRESSION_ERROR, f"undecodable header block: {err}") from None
        self.on_headers(stream_id, headers, bool(flags & END_STREAM))  # type: ignore[arg-type]

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise H2Error(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise H2Error(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise H2Error(FRAME_SIZE_ERROR, "SETTINGS payload is not a multiple of 6 bytes")
        for offset in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, offset)
            if key == ENABLE_PUSH and value > 1:
                raise H2Error(PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH={value}")
            if key == MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
            elif key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2Error(FLOW_CONTROL_ERROR, f"SETTINGS_INITIAL_WINDOW_SIZE={value}")
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == MAX_FRAME_SIZE:
                if not MAX_FRAME <= value <= 2**24 - 1:
                    raise H2Error(PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE={value}")
                self.peer_max_frame = value
            # HEADER_TABLE_SIZE concerns an encoder's dynamic table, and ours uses none.
        self.write(frame(SETTINGS, ACK, 0))
        self._drain_blocked()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2Error(FRAME_SIZE_ERROR, "WINDOW_UPDATE payload is not 4 bytes")
        increment = _U32.unpack(payload)[0] & MAX_WINDOW
        if not stream_id:
            if not increment:
                raise H2Error(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise H2Error(FLOW_CONTROL_ERROR, "connection window beyond 2^31-1")
            self._drain_blocked()
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        stream.send_window += increment
        if not increment or stream.send_window > MAX_WINDOW:
            self.reset(stream, PROTOCOL_ERROR if not increment else FLOW_CONTROL_ERROR)
        elif stream.id in self._blocked:
            out: list[bytes] = []
            self._drain(stream, out)
            self.write(b"".join(out))


# -- the client --------------------------------------------------------------------------------


class _Call(Stream):
    __slots__ = ("answered", "data", "future")

    def __init__(self, stream_id: int, send_window: int, future: asyncio.Future[bytes]) -> None:
        super().__init__(stream_id, send_window)
        self.future = future
        self.data = bytearray()
        self.answered = False  # the response headers arrived


def _status_error(headers: list[tuple[bytes, bytes]]) -> Exception | None:
    """The error a gRPC status in ``headers`` (trailers) stands for; None for OK."""
    status = message = None
    for name, value in headers:
        if name == b"grpc-status":
            status = value
        elif name == b"grpc-message":
            message = value
    if status is None:
        return GRPCError(Status.UNKNOWN, "Missing grpc-status header")
    try:
        code = Status(int(status))
    except ValueError:
        return GRPCError(Status.UNKNOWN, f"Invalid grpc-status: {status.decode('ascii', 'replace')!r}")
    if code is Status.OK:
        return None
    return GRPCError(code, decode_grpc_message(message.decode("ascii", "replace")) if message else None)


class ClientConnection(H2Peer):
    """The proxy's end of one connection to a plugin: unary calls, any number at a time."""

    client = True

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        #: No new calls: the peer sent GOAWAY, or the stream ids ran out.
        self.draining = False
        self._next_id = 1
        self._room: deque[asyncio.Future[None]] = deque()

    @property
    def usable(self) -> bool:
        return not self.closed and not self.draining

    def has_room(self) -> bool:
        return len(self.streams) < self.peer_max_streams

    async def wait_room(self) -> None:
        """Wait until a stream ends or the connection becomes unusable (the caller checks again)."""
        waiter = self.loop.create_future()
        self._room.append(waiter)
        try:
            await waiter
        finally:
            if not waiter.done():
                waiter.cancel()

    def start(self, head_block: bytes, message: bytes) -> _Call:
        """Send one call: ``head_block`` is its header block, ``message`` the serialized request."""
        stream_id = self._next_id
        self._next_id += 2
        if self._next_id > MAX_STREAM_ID:
            self.draining = True
        self.last_stream = stream_id
        call = _Call(stream_id, self.peer_initial_window, self.loop.create_future())
        self.streams[stream_id] = call
        head = header_frames(stream_id, head_block, False, self.peer_max_frame)
        self.send(call, head, grpc_message(message), None)
        return call

    def cancel(self, call: _Call) -> None:
        """The caller stopped waiting (timeout, cancellation): reset the stream if still open."""
        if self.streams.get(call.id) is call:
            self.reset(call)
            self._closed_if_done()

    def close(self) -> None:
        """Close the connection; calls in flight fail ("Connection lost")."""
        if self.transport is not None and not self.closed:
            self.goaway()

    def _end(self, call: _Call, result: bytes | Exception, code: int = CANCEL) -> None:
        if not call.remote_closed:
            self.reset(call, code)  # tell the plugin we are done with the stream
        else:
            self.forget(call)
        future = call.future
        if not future.done():
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
        self._closed_if_done()

    def _closed_if_done(self) -> None:
        if self.draining and not self.streams and not self.closed and self.transport is not None:
            self._flush()
            self.transport.close()

    def on_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool) -> None:
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id % 2 == 0 or self._idle(stream_id):
                raise H2Error(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}, which we did not open")
            return  # a call we gave up on
        assert isinstance(stream, _Call)
        if stream.remote_closed:
            self.reset(stream, STREAM_CLOSED)
            return
        stream.remote_closed = end_stream
        if stream.answered:  # trailers
            if not end_stream:
                self._end(stream, PluginProtocolError("trailers that do not end the stream"), PROTOCOL_ERROR)
            else:
                self._end(stream, _status_error(headers) or self._answer(stream))
            return
        stream.answered = True
        status = content_type = None
        for name, value in headers:
            if name == b":status":
                status = value
            elif name == b"content-type":
                content_type = value
        if status != b"200":
            shown = status.decode("ascii", "replace") if status is not None else None
            error = GRPCError(
                _HTTP_TO_GRPC.get(status or b"", Status.UNKNOWN), f"Received :status = {shown!r}"
            )
            self._end(stream, error)
        elif end_stream:  # trailers-only: a status without a message
            self._end(stream, _status_error(headers) or PluginProtocolError("the answer carried no message"))
        elif content_type is None:
            self._end(stream, GRPCError(Status.UNKNOWN, "Missing content-type header"))
        elif not content_type.startswith(b"application/grpc"):
            shown = content_type.decode("ascii", "replace")
            self._end(stream, GRPCError(Status.UNKNOWN, f"Invalid content-type: {shown!r}"))

    def _answer(self, call: _Call) -> bytes | Exception:
        try:
            return unframe(call.data, "answer")
        except PluginProtocolError as err:
            return err

    def on_data(self, stream: Stream, data: bytes, end_stream: bool) -> None:
        assert isinstance(stream, _Call)
        if not stream.answered:
            self._end(stream, PluginProtocolError("DATA before the response headers"), PROTOCOL_ERROR)
            return
        stream.data += data
        if len(stream.data) > MAX_MESSAGE + 5:
            self._end(stream, PluginProtocolError(f"an answer larger than {MAX_MESSAGE} bytes"))
        elif end_stream:
            self._end(stream, PluginProtocolError("the answer ended without trailers (no grpc-status)"))

    def on_reset(self, stream: Stream, code: int) -> None:
        assert isinstance(stream, _Call)
        name = _ERROR_NAMES.get(code, str(code))
        kind = _Refused if code == REFUSED_STREAM else StreamTerminatedError
        self._end(stream, kind(f"Stream reset by remote party, error_code: {name}"))

    def on_goaway(self, last_stream: int, code: int, debug: bytes) -> None:
        self.draining = True
        reason = _ERROR_NAMES.get(code, str(code)) + (f" {debug.decode('utf-8', 'replace')}" if debug else "")
        for call in [s for s in self.streams.values() if s.id > last_stream]:
            assert isinstance(call, _Call)
            call.remote_closed = True  # never processed: no reset needed
            self._end(call, StreamTerminatedError(f"Connection closed by the peer (GOAWAY {reason})"))
        self._wake_all()
        self._closed_if_done()

    def on_forget(self, stream: Stream) -> None:
        while self._room:
            waiter = self._room.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    def on_closed(self, error: Exception) -> None:
        for call in list(self.streams.values()):
            assert isinstance(call, _Call)
            if not call.future.done():
                call.future.set_exception(type(error)(*error.args))  # one instance per waiting task
        self.streams.clear()
        self._wake_all()

    def _wake_all(self) -> None:
        while self._room:
            waiter = self._room.popleft()
            if not waiter.done():
                waiter.set_result(None)


class PluginChannel:
    """Unary calls to the plugin at one unix socket, on one HTTP/2 connection.

    The connection is opened by the first call and again by the first call after it ended
    (the plugin restarted, closed it, or sent GOAWAY), so a channel lives as long as the
    plugin's registration. Create and use inside a running asyncio loop.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._connection: ClientConnection | None = None
        self._connecting: asyncio.Future[ClientConnection] | None = None
        self._closed = False
        self._heads: dict[str, bytes] = {}

    async def unary(self, method: str, message: bytes, seconds: float) -> bytes:
        """Call ``method`` (``/package.Service/Method``) with the serialized ``message``; the
        serialized answer. ``seconds`` bounds the whole call, connecting included, and goes to the
        plugin as ``grpc-timeout``. Raises as the module says."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        async with asyncio.timeout_at(deadline):
            while True:
                connection = self._connection
                if connection is None or not connection.usable or not connection.has_room():
                    connection = await self._ready()
                call = connection.start(self._head(method, deadline - loop.time()), message)
                try:
                    return await call.future
                except _Refused:
                    # Not processed (RFC 9113 §8.7), so sent again, as gRPC's transparent retry does:
                    # once one of our other calls ended (the peer counted them all as busy), or after
                    # a pause if none is open.
                    if connection.streams:
                        await connection.wait_room()
                    else:
                        await asyncio.sleep(_REFUSED_PAUSE)
                finally:
                    connection.cancel(call)

    def close(self) -> None:
        """Close the connection; calls in flight fail. The channel cannot be used again."""
        self._closed = True  # a connection still being opened is closed when it opens
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _head(self, method: str, timeout: float) -> bytes:
        head = self._heads.get(method)
        if head is None:
            head = self._heads[method] = header_block(
                (b":method", b"POST"),
                (b":scheme", b"http"),
                (b":path", method.encode()),
                (b":authority", b"localhost"),
                (b"te", b"trailers"),
                (b"content-type", b"application/grpc+proto"),
                (b"user-agent", b"krproxy"),
            )
        return head + literal(b"grpc-timeout", encode_timeout(max(timeout, 0.0)).encode())

    async def _ready(self) -> ClientConnection:
        """A usable connection with room for one more call (connecting, or waiting, if need be)."""
        while True:
            connection = self._connection
            if connection is None or not connection.usable:
                connection = await self._connect()
                if not connection.usable:  # closed by the plugin as soon as it was opened
                    raise StreamTerminatedError("Connection lost")
            if connection.has_room():
                return connection
            await connection.wait_room()

    async def _connect(self) -> ClientConnection:
        if self._closed:
            raise StreamTerminatedError("Channel closed")
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            # Retrieved even if every caller gave up waiting, so it is never logged as lost.
            self._connecting.add_done_callback(lambda task: task.cancelled() or task.exception())
        # Shielded: one caller's timeout must not cancel the connection the others wait for.
        return await asyncio.shield(self._connecting)

    async def _open(self) -> ClientConnection:
        try:
            loop = asyncio.get_running_loop()
            _, connection = await loop.create_unix_connection(lambda: ClientConnection(loop), self.path)
            if self._closed:
                connection.close()
                raise StreamTerminatedError("Channel closed")
            self._connection = connection
            return connection
        finally:
            self._connecting = None
