"""HTTP/1.1 over trio streams with h11: the only code in Docker mode that touches sockets.

:class:`Peer` pairs a stream with an h11 state machine (bytes in, events out, as h11's
``examples/trio-server.py``); :func:`splice` relays a hijacked connection; :func:`error_reply`
and :func:`raw_head` build what the proxy writes itself.

Error handling: a peer that breaks the protocol raises :class:`h11.RemoteProtocolError` out of
:meth:`Peer.next_event`; a peer that goes away raises :class:`trio.BrokenResourceError` (or
reads as end of stream). Callers decide what the client gets.
"""

from __future__ import annotations

import contextlib
import http
import json
from collections.abc import Iterable, Sequence

import attrs
import h11
import trio

__all__ = [
    "HTTP2_PEER",
    "MAX_HEADER_BYTES",
    "RECEIVE_SIZE",
    "Headers",
    "Peer",
    "Reply",
    "error_reply",
    "header",
    "raw_head",
    "splice",
    "with_body_length",
]

#: Bytes asked for per read: large enough for log and stream chunks, small enough to relay promptly.
RECEIVE_SIZE = 64 * 1024
#: Largest request or response head accepted (h11 answers 431 above it); dockerd's own limit is 1 MiB
#: (Go's DefaultMaxHeaderBytes), kubelet's requests are a few hundred bytes.
MAX_HEADER_BYTES = 64 * 1024

Headers = list[tuple[bytes, bytes]]

#: Said when what should be dockerd answers with an HTTP/2 frame (grpc-go sends its SETTINGS at
#: once): the usual reason is Docker mode left on the default endpoint, containerd's CRI socket.
HTTP2_PEER = (
    "the peer speaks HTTP/2 (gRPC), not the Docker API; if it is containerd's CRI socket, pass "
    "dockerd's (--remote-runtime-service-endpoint=unix:///var/run/docker.sock) or drop "
    "--backend-runtime-mode=Docker"
)


def _is_http2_frame(data: bytes) -> bool:
    """Whether ``data`` starts as a server's first HTTP/2 frame does: SETTINGS (type 4) on stream 0."""
    return len(data) >= 9 and data[3] == 0x04 and data[5:9] == b"\x00\x00\x00\x00"


@attrs.define(eq=False)
class Peer:
    """One end of an HTTP/1.1 connection: a trio socket stream and its h11 state machine."""

    stream: trio.SocketStream
    conn: h11.Connection
    #: The first bytes the peer sent, to tell what it speaks when h11 cannot parse them.
    _first: bytes = attrs.field(default=b"", init=False)

    @classmethod
    def server(cls, stream: trio.SocketStream) -> Peer:
        """The proxy's side of a client connection (it reads requests)."""
        return cls(stream, h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES))

    @classmethod
    def client(cls, stream: trio.SocketStream) -> Peer:
        """The proxy's side of a dockerd connection (it reads responses)."""
        return cls(stream, h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES))

    async def next_event(self) -> h11.Event | type[h11.PAUSED]:
        """The next event, reading from the stream as needed; end of stream is fed to h11 as such.

        Raises:
            h11.RemoteProtocolError: the peer broke HTTP/1.1.
            trio.BrokenResourceError: the connection was reset.
        """
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as err:
                if _is_http2_frame(self._first):
                    raise h11.RemoteProtocolError(f"{err}; {HTTP2_PEER}") from None
                raise
            if event is h11.NEED_DATA:
                data = await self.stream.receive_some(RECEIVE_SIZE)
                if not self._first:
                    self._first = data
                self.conn.receive_data(data)
                continue
            return event  # type: ignore[return-value]

    async def read_body(self, limit: int, what: str = "request body") -> bytes | None:
        """The rest of the current message's body, or None once it exceeds ``limit`` bytes.

        Raises:
            h11.RemoteProtocolError: something other than body data before the end of the message
                (``what`` names the message in the error).
        """
        chunks: list[bytes] = []
        size = 0
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > limit:
                    return None
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:
                raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} in {what}")

    async def send(self, event: h11.Event) -> None:
        """Send one event (h11 does the framing: Content-Length or chunked)."""
        data = self.conn.send(event)
        if data:
            await self.stream.send_all(data)

    async def feed(self) -> bool:
        """Read once from the stream into h11's buffer (no parsing); False at end of stream."""
        data = await self.stream.receive_some(RECEIVE_SIZE)
        self.conn.receive_data(data)
        return bool(data)


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The value of header *name* (lower-case), or None; h11 has already folded repeated framing headers."""
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def with_body_length(headers: Sequence[tuple[bytes, bytes]], length: int) -> Headers:
    """*headers* with their body framing replaced by ``Content-Length: length`` (order otherwise kept)."""
    kept = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"transfer-encoding")]
    return [*kept, (b"Content-Length", str(length).encode())]


@attrs.frozen
class Reply:
    """A whole response, as the hook path handles it (intercepted calls have small JSON bodies)."""

    status: int
    headers: Headers
    body: bytes = b""
    reason: bytes = b""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def error_reply(status: int, message: str, *, close: bool = False) -> Reply:
    """A dockerd-style error: ``{"message": ...}`` as JSON, which Docker clients show to the user."""
    body = json.dumps({"message": message}).encode() + b"\n"
    headers: Headers = [(b"Content-Type", b"application/json"), (b"Content-Length", str(len(body)).encode())]
    if close:
        headers.append((b"Connection", b"close"))
    return Reply(status, headers, body, http.HTTPStatus(status).phrase.encode())


def raw_head(event: h11.Response | h11.InformationalResponse) -> bytes:
    """A response head as dockerd sent it, for hijacked connections that h11 must not frame."""
    version = event.http_version or b"1.1"
    lines = [b"HTTP/%s %d %s" % (version, event.status_code, event.reason)]
    lines += [name + b": " + value for name, value in event.headers.raw_items()]
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        while data := await source.receive_some(RECEIVE_SIZE):
            await sink.send_all(data)


async def splice(client: trio.SocketStream, daemon: trio.SocketStream, *, client_done: bool = False) -> None:
    """Relay bytes both ways until dockerd's side ends (or either connection breaks).

    The client's end of stream is passed on as a half-close (``send_eof``): ``docker exec -i`` closes
    stdin that way and still reads the command's output. dockerd ending its side ends the session.
    ``client_done`` says the client's end of stream was already read.
    """

    async def to_daemon() -> None:
        if not client_done:
            await _pump(client, daemon)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await daemon.send_eof()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(to_daemon)
        await _pump(daemon, client)
        nursery.cancel_scope.cancel()
