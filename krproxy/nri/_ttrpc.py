"""ttrpc, containerd's small RPC protocol, without I/O: framing, envelopes and stream bookkeeping.

NRI speaks ttrpc (github.com/containerd/ttrpc), not gRPC, and no Python implementation exists. This
module is the protocol as ttrpc 1.2 (containerd 1.7 and 2.x) puts it on the wire, checked against its Go
source (``channel.go``, ``server.go``, ``client.go``, ``request.proto``):

* Every message is a **10-byte header** — length of the payload (4 bytes, big-endian; the header not
  counted), stream id (4 bytes, big-endian), type (1 byte: request 1, response 2, data 3) and flags
  (1 byte) — followed by the payload. A payload is at most **4 MiB**; the receiver of a longer one skips
  its bytes and answers that stream ``RESOURCE_EXHAUSTED``.
* The client opens a stream per call with the **next odd id** (1, 3, 5, ...), ids always increasing.
  The server refuses even ids and ids not above the last one with ``INVALID_ARGUMENT``.
* A request's payload is a protobuf ``ttrpc.Request{service=1, method=2, payload=3, timeout_nano=4,
  metadata=5 (KeyValue{key=1, value=2})}``; the answer, on the same stream id, a ``ttrpc.Response{status=1
  (google.rpc.Status{code=1, message=2, details=3}), payload=2}``. The server always sets the status
  (code 0 for success); the client treats a missing status as success, as Go's client does.
* Unknown services and methods are answered ``UNIMPLEMENTED`` (``"service X"``, ``"method X"``).

Streaming calls (data messages) exist in ttrpc but neither NRI service uses them: a data message is
answered as Go's server answers one for a stream it does not know. Unknown message types are ignored (as
Go does, "for future compatibility").

:class:`Connection` is one side of one ttrpc connection, client or server (a ttrpc connection has one of
each; NRI runs two connections over one socket, see :mod:`krproxy.nri._mux`). Bytes go in with
:meth:`Connection.receive_data`, events come out of :meth:`Connection.next_event`, and what to write is
taken with :meth:`Connection.messages_to_send`; nothing here blocks or touches a socket.
"""

from __future__ import annotations

import enum
import struct
from collections import deque

import attrs

from krproxy.grpcstatus import Status
from krproxy.protowire import DecodeError, fields, varint

__all__ = [
    "HEADER_LENGTH",
    "MESSAGE_LENGTH_MAX",
    "Connection",
    "DecodeError",
    "Flags",
    "Ignored",
    "MessageType",
    "OversizedMessage",
    "Request",
    "RequestReceived",
    "Response",
    "ResponseReceived",
    "Role",
    "RpcStatus",
    "decode_header",
    "encode_message",
]

#: Bytes in a message header.
HEADER_LENGTH = 10
#: ttrpc's default (and containerd's) largest payload: ``messageLengthMax = 4 << 20`` in channel.go.
MESSAGE_LENGTH_MAX = 4 << 20

_HEADER = struct.Struct(">IIBB")


class MessageType(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2
    DATA = 3


class Flags(enum.IntFlag):
    REMOTE_CLOSED = 0x1
    REMOTE_OPEN = 0x2
    NO_DATA = 0x4


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


def encode_message(stream_id: int, kind: MessageType, payload: bytes, flags: int = 0) -> bytes:
    """One message on the wire: header and payload."""
    if len(payload) > MESSAGE_LENGTH_MAX:
        raise ValueError(
            f"ttrpc message of {len(payload)} bytes exceeds the {MESSAGE_LENGTH_MAX} bytes allowed"
        )
    return _HEADER.pack(len(payload), stream_id, kind, flags) + payload


def _too_long(length: int, limit: int) -> str:
    """Go's words for a message over the limit (``OversizedMessageError``, ``channel.recv``)."""
    return f"message length {length} exceed maximum message size of {limit}"


class OversizedMessage(ValueError):
    """A request too large to send (:meth:`Connection.send_request`): nothing was sent, and the call
    fails alone with RESOURCE_EXHAUSTED and :attr:`message`, as Go's ttrpc client refuses it."""

    def __init__(self, request: Request, message: str) -> None:
        super().__init__(f"{request.service}/{request.method}: {message}")
        self.message = message


def decode_header(header: bytes) -> tuple[int, int, int, int]:
    """``(length, stream_id, type, flags)`` of a 10-byte header."""
    return _HEADER.unpack(header)


# --- the protobuf envelopes (five small messages: written by hand, no generated code) ---


def _field_bytes(number: int, data: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(data)) + data


def _field_text(number: int, text: str) -> bytes:
    """A string field; proto3 writes nothing for the empty string. A character UTF-8 cannot encode
    (a lone surrogate, from a path read with surrogateescape) is written escaped (``\\udcff``)."""
    return _field_bytes(number, text.encode("utf-8", "backslashreplace")) if text else b""


def _field_varint(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def _expect(number: int, wire_type: int, value: int | bytes, want: int) -> int | bytes:
    if wire_type != want:
        raise DecodeError(f"field {number}: wire type {wire_type}, expected {want}")
    return value


def _text(number: int, wire_type: int, value: int | bytes) -> str:
    raw = _expect(number, wire_type, value, 2)
    assert isinstance(raw, bytes)
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise DecodeError(f"field {number}: not UTF-8") from exc


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


@attrs.frozen
class Request:
    """``ttrpc.Request``: which method, its serialized argument, the caller's deadline and metadata."""

    service: str
    method: str
    payload: bytes = b""
    #: Nanoseconds the caller waits; 0 when it set no deadline.
    timeout_nano: int = 0
    metadata: tuple[tuple[str, str], ...] = ()

    def encode(self) -> bytes:
        out = _field_text(1, self.service) + _field_text(2, self.method)
        if self.payload:
            out += _field_bytes(3, self.payload)
        if self.timeout_nano:
            out += _field_varint(4, self.timeout_nano)
        for key, value in self.metadata:
            out += _field_bytes(5, _field_text(1, key) + _field_text(2, value))
        return out

    @classmethod
    def decode(cls, data: bytes) -> Request:
        service = method = ""
        payload = b""
        timeout = 0
        metadata: list[tuple[str, str]] = []
        for number, wire_type, value in fields(data):
            if number == 1:
                service = _text(number, wire_type, value)
            elif number == 2:
                method = _text(number, wire_type, value)
            elif number == 3:
                raw = _expect(number, wire_type, value, 2)
                assert isinstance(raw, bytes)
                payload = raw
            elif number == 4:
                raw_int = _expect(number, wire_type, value, 0)
                assert isinstance(raw_int, int)
                timeout = _int64(raw_int)
            elif number == 5:
                raw = _expect(number, wire_type, value, 2)
                assert isinstance(raw, bytes)
                key = val = ""
                for n, w, v in fields(raw):
                    if n == 1:
                        key = _text(n, w, v)
                    elif n == 2:
                        val = _text(n, w, v)
                metadata.append((key, val))
        return cls(service, method, payload, timeout, tuple(metadata))


@attrs.frozen
class RpcStatus:
    """``google.rpc.Status``: a gRPC code, a message and (kept undecoded) the details."""

    code: Status = Status.OK
    message: str = ""
    #: Each detail's serialized ``google.protobuf.Any``, as received.
    details: tuple[bytes, ...] = ()

    @property
    def ok(self) -> bool:
        return self.code == Status.OK

    def encode(self) -> bytes:
        out = _field_varint(1, self.code) if self.code else b""
        out += _field_text(2, self.message)
        for detail in self.details:
            out += _field_bytes(3, detail)
        return out

    @classmethod
    def decode(cls, data: bytes) -> RpcStatus:
        code = 0
        message = ""
        details: list[bytes] = []
        for number, wire_type, value in fields(data):
            if number == 1:
                raw_int = _expect(number, wire_type, value, 0)
                assert isinstance(raw_int, int)
                code = _int64(raw_int) & 0xFFFFFFFF  # int32 on the wire
                code = code - (1 << 32) if code >= 1 << 31 else code
            elif number == 2:
                message = _text(number, wire_type, value)
            elif number == 3:
                raw = _expect(number, wire_type, value, 2)
                assert isinstance(raw, bytes)
                details.append(raw)
        try:
            status = Status(code)
        except ValueError:
            status = Status.UNKNOWN  # as grpc-go maps a code it does not know
            message = f"unknown status code {code}: {message}"
        return cls(status, message, tuple(details))


@attrs.frozen
class Response:
    """``ttrpc.Response``: the status and, on success, the serialized answer."""

    status: RpcStatus = RpcStatus()
    payload: bytes = b""

    def encode(self) -> bytes:
        out = _field_bytes(1, self.status.encode())  # always present, as Go's server writes it
        if self.payload:
            out += _field_bytes(2, self.payload)
        return out

    @classmethod
    def decode(cls, data: bytes) -> Response:
        status = RpcStatus()
        payload = b""
        for number, wire_type, value in fields(data):
            raw = _expect(number, wire_type, value, 2) if number in (1, 2) else b""
            assert isinstance(raw, bytes)
            if number == 1:
                status = RpcStatus.decode(raw)
            elif number == 2:
                payload = raw
        return cls(status, payload)


# --- events ---


@attrs.frozen
class RequestReceived:
    """A server received a call: answer it with :meth:`Connection.send_response` on ``stream_id``."""

    stream_id: int
    request: Request


@attrs.frozen
class ResponseReceived:
    """A client's call on ``stream_id`` was answered (the status says whether it succeeded)."""

    stream_id: int
    response: Response


@attrs.frozen
class Ignored:
    """A message the connection dropped, and why (the peer is not at fault enough to close for it)."""

    stream_id: int
    kind: int
    reason: str


Event = RequestReceived | ResponseReceived | Ignored


@attrs.define
class Connection:
    """One side of a ttrpc connection.

    A client sends requests (:meth:`send_request`) and receives :class:`ResponseReceived`; a server
    receives :class:`RequestReceived` and answers with :meth:`send_response`. Messages the protocol
    answers by itself (oversized, bad stream ids, undecodable requests on a server) are answered here
    and never become events.

    Args:
        role: :attr:`Role.CLIENT` or :attr:`Role.SERVER`.
        max_message_length: the largest payload accepted and sent (ttrpc's 4 MiB by default).
    """

    role: Role
    max_message_length: int = MESSAGE_LENGTH_MAX
    _buffer: bytearray = attrs.field(factory=bytearray, init=False)
    _skip: int = attrs.field(default=0, init=False)
    _outbound: list[bytes] = attrs.field(factory=list, init=False)
    _events: deque[Event] = attrs.field(factory=deque, init=False)
    _next_stream_id: int = attrs.field(default=1, init=False)
    _last_stream_id: int = attrs.field(default=0, init=False)
    #: Client: streams awaiting an answer. Server: requests not answered yet.
    _open: set[int] = attrs.field(factory=set, init=False)

    # -- sending --

    def send_request(self, request: Request) -> int:
        """Queue a call; returns its stream id (the next odd one)."""
        if self.role is not Role.CLIENT:
            raise RuntimeError("only a ttrpc client sends requests")
        payload = request.encode()
        if len(payload) > self.max_message_length:
            raise OversizedMessage(request, _too_long(len(payload), self.max_message_length))
        stream_id = self._next_stream_id
        if stream_id > 0xFFFFFFFF:
            raise RuntimeError("ttrpc stream ids exhausted: open a new connection")
        self._next_stream_id += 2
        self._open.add(stream_id)
        self._outbound.append(encode_message(stream_id, MessageType.REQUEST, payload))
        return stream_id

    def cancel(self, stream_id: int) -> None:
        """Forget a call the caller gave up on; a late answer is then ignored (ttrpc has no cancel message)."""
        self._open.discard(stream_id)

    def send_response(self, stream_id: int, response: Response) -> None:
        """Answer the request received on ``stream_id``."""
        if self.role is not Role.SERVER:
            raise RuntimeError("only a ttrpc server sends responses")
        if stream_id not in self._open:
            raise ValueError(f"stream {stream_id} has no request waiting for an answer")
        self._open.discard(stream_id)
        payload = response.encode()
        if len(payload) > self.max_message_length:
            # As Go's server does when its answer is too large: the caller gets a status instead.
            payload = Response(
                RpcStatus(Status.RESOURCE_EXHAUSTED, _too_long(len(payload), self.max_message_length))
            ).encode()
        self._outbound.append(encode_message(stream_id, MessageType.RESPONSE, payload))

    def _answer(self, stream_id: int, code: Status, message: str) -> None:
        payload = Response(RpcStatus(code, message)).encode()
        self._outbound.append(encode_message(stream_id, MessageType.RESPONSE, payload))

    def messages_to_send(self) -> list[bytes]:
        """Messages (header and payload each) to write to the peer, in order; forgets them. Does no I/O.

        Kept apart because NRI's multiplexer frames each message on its own (:func:`krproxy.nri._mux.frames`).
        """
        out = self._outbound
        self._outbound = []
        return out

    @property
    def has_outbound(self) -> bool:
        """Whether :meth:`messages_to_send` has anything."""
        return bool(self._outbound)

    @property
    def pending(self) -> frozenset[int]:
        """Client: calls not answered yet. Server: requests not answered yet."""
        return frozenset(self._open)

    # -- receiving --

    def receive_data(self, data: bytes) -> None:
        """Feed bytes read from the peer (any chunking); events become available from :meth:`next_event`."""
        if self._skip:
            skipped = min(self._skip, len(data))
            self._skip -= skipped
            data = data[skipped:]
        self._buffer += data
        while len(self._buffer) >= HEADER_LENGTH:
            length, stream_id, kind, flags = decode_header(bytes(self._buffer[:HEADER_LENGTH]))
            if length > self.max_message_length:
                # Skip it (it may span later chunks) and tell the sender, as Go's channel.recv does.
                del self._buffer[:HEADER_LENGTH]
                skipped = min(length, len(self._buffer))
                del self._buffer[:skipped]
                self._skip = length - skipped
                self._oversized(stream_id, kind, length)
                if self._skip:
                    return
                continue
            if len(self._buffer) < HEADER_LENGTH + length:
                return
            payload = bytes(self._buffer[HEADER_LENGTH : HEADER_LENGTH + length])
            del self._buffer[: HEADER_LENGTH + length]
            self._message(stream_id, kind, flags, payload)

    def next_event(self) -> Event | None:
        """The next event, or None when the bytes received so far hold no more."""
        return self._events.popleft() if self._events else None

    def _oversized(self, stream_id: int, kind: int, length: int) -> None:
        message = _too_long(length, self.max_message_length)
        if self.role is Role.SERVER:
            self._answer(stream_id, Status.RESOURCE_EXHAUSTED, message)
        elif stream_id in self._open:
            self._open.discard(stream_id)
            status = RpcStatus(Status.RESOURCE_EXHAUSTED, message)
            self._events.append(ResponseReceived(stream_id, Response(status)))
        else:
            self._events.append(Ignored(stream_id, kind, message))

    def _message(self, stream_id: int, kind: int, flags: int, payload: bytes) -> None:
        if self.role is Role.SERVER:
            self._server_message(stream_id, kind, payload)
        else:
            self._client_message(stream_id, kind, payload)

    def _server_message(self, stream_id: int, kind: int, payload: bytes) -> None:
        if kind not in (MessageType.REQUEST, MessageType.DATA):
            self._events.append(Ignored(stream_id, kind, f"message type {kind} is not for a server"))
            return
        if stream_id % 2 != 1:
            self._answer(
                stream_id, Status.INVALID_ARGUMENT, "StreamID must be odd for client initiated streams"
            )
            return
        if kind == MessageType.DATA:  # no NRI method streams: every data stream is unknown here
            self._answer(stream_id, Status.INVALID_ARGUMENT, "StreamID is no longer active")
            return
        if stream_id <= self._last_stream_id:
            self._answer(stream_id, Status.INVALID_ARGUMENT, "StreamID cannot be re-used and must increment")
            return
        self._last_stream_id = stream_id
        try:
            request = Request.decode(payload)
        except DecodeError as exc:
            self._answer(stream_id, Status.INVALID_ARGUMENT, f"unmarshal request error: {exc}")
            return
        self._open.add(stream_id)
        self._events.append(RequestReceived(stream_id, request))

    def _client_message(self, stream_id: int, kind: int, payload: bytes) -> None:
        if kind != MessageType.RESPONSE:
            self._events.append(Ignored(stream_id, kind, f"message type {kind} is not for a client"))
            return
        if stream_id not in self._open:
            self._events.append(Ignored(stream_id, kind, "received message on inactive stream"))
            return
        self._open.discard(stream_id)
        try:
            response = Response.decode(payload)
        except DecodeError as exc:
            response = Response(RpcStatus(Status.INTERNAL, f"undecodable ttrpc response: {exc}"))
        self._events.append(ResponseReceived(stream_id, response))
