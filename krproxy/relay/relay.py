"""The CRI front end: an HTTP/2 relay between kubelet and the runtime, on trio.

kubelet's connections end here; each of its streams (one gRPC call) is paired with a stream on
an *upstream* connection and the two are relayed frame by frame::

    kubelet ─HTTP/2─┐                 ┌─ runtime socket (RuntimeService, unknown paths)
    kubelet ─HTTP/2─┤ Relay ──────────┼─ image socket (ImageService, if it is another socket)
                    │  (this module)  └─ in-process grpclib server: the calls with hook points
                    └ deadlines, records   (krproxy.forward.Forwarder + interceptors)

Messages are never parsed: DATA payloads are copied from one connection to the other, header
blocks are decoded (HPACK state is per connection) and re-encoded. Calls with hook points go to
the in-process grpclib server, which runs the interceptors and calls the runtime itself; to
the relay it is just another upstream. Everything else — the 30-odd other CRI methods, method
paths our protos lack, server streams such as GetContainerEvents — costs one frame copy each
way, which is what makes the proxy cheap (docs/performance.md).

Per call the relay adds, on its own account: the caller's deadline (``grpc-timeout``) is
enforced here too, so a runtime that hangs cannot keep a call open past it; a runtime that
cannot be reached, or drops its connection mid-call, ends the call with UNAVAILABLE naming
the socket (the next call reconnects); a caller that goes away resets the upstream stream.
Every finished call is reported to the observers as a :class:`krproxy.calls.CallRecord`.

Flow control is end to end: bytes received on one side are granted back to the sender only
once they were written towards the other side, within that side's window. So a slow reader
slows its writer down, and the relay holds at most one window of data per stream.

The relay runs entirely in one trio thread on non-blocking sockets: a reader task per
connection parses what arrived, hands each frame to the paired stream and then writes out
every connection it touched with a plain ``send`` (a writer task waits only when a socket's
buffer is full).
"""

from __future__ import annotations

import base64
import heapq
import itertools
import logging
import math
import socket
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import attrs
import hpack
import hpack.exceptions
import trio
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from krproxy import calls, log
from krproxy.forward import BackendError, Interceptor, Reply
from krproxy.relay import frames as f

LOGGER = logging.getLogger("krproxy.relay")

Headers = list[tuple[bytes, bytes]]

#: Window we grant each stream (SETTINGS_INITIAL_WINDOW_SIZE), and the connection as a whole.
#: An 860 KB ListContainers answer fits in one stream window, so it never waits for a grant.
STREAM_WINDOW = 4 * 1024 * 1024
CONNECTION_WINDOW = 16 * 1024 * 1024
#: Granted bytes are sent back in WINDOW_UPDATEs once this much has accumulated.
_STREAM_GRANT_AT = STREAM_WINDOW // 4
_CONNECTION_GRANT_AT = CONNECTION_WINDOW // 4
#: Largest header block (with CONTINUATIONs) accepted from a peer.
MAX_HEADER_BLOCK = 1024 * 1024
_RECV_SIZE = 256 * 1024
#: Reads handled back to back before the reader lets other tasks run.
_READS_PER_CHECKPOINT = 8

_GRPC_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_STATUS_BY_CODE = {status.value: status for status in Status}


_RETIRED = "retired"
_STOPPED = "krproxy stopped"


class _Closed(Exception):
    """The peer closed the connection."""


def grpc_timeout(value: bytes) -> float | None:
    """Seconds in a ``grpc-timeout`` header value (``"100m"``), None if malformed."""
    unit = _GRPC_TIMEOUT_UNITS.get(value[-1:])
    if unit is None or not value[:-1].isdigit() or len(value) > 9:
        return None
    return int(value[:-1]) * unit


def _trailers_only(status: Status, message: str, headers_sent: bool) -> Headers:
    fields: Headers = [] if headers_sent else [(b":status", b"200"), (b"content-type", b"application/grpc")]
    fields.append((b"grpc-status", b"%d" % status.value))
    fields.append((b"grpc-message", urllib.parse.quote(message, safe=" ").encode()))
    return fields


class _Tap:
    """Counts the gRPC messages in one direction of a call and keeps the first one's bytes.

    ``keep_all`` keeps every message's bytes instead (for unary replies, as records carry them).
    """

    __slots__ = ("_head", "_keep_all", "_left", "first", "messages")

    def __init__(self, keep_all: bool) -> None:
        self._head = bytearray()
        self._left = 0
        self._keep_all = keep_all
        self.first: bytearray | None = None
        self.messages = 0

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            if self._left:
                take = min(self._left, n - i)
                if self.first is not None and (self.messages == 0 or self._keep_all):
                    self.first += data[i : i + take]
                i += take
                self._left -= take
                if not self._left:
                    self.messages += 1
                continue
            need = 5 - len(self._head)
            self._head += data[i : i + need]
            i += need
            if len(self._head) == 5:
                self._left = int.from_bytes(self._head[1:5], "big")
                self._head.clear()
                if self.first is None:
                    self.first = bytearray()
                if not self._left:
                    self.messages += 1


class Half:
    """One side of a relayed call: a stream on one connection."""

    __slots__ = (
        "call",
        "end_pending",
        "ep",
        "headers_sent",
        "id",
        "opened",
        "peer",
        "pending",
        "recv_ended",
        "recv_window",
        "reset",
        "send_ended",
        "send_window",
        "to_grant",
        "trailers_pending",
    )

    def __init__(self, ep: Endpoint, stream_id: int, call: Call) -> None:
        self.ep = ep
        self.id = stream_id
        self.call = call
        self.peer: Half | None = None
        self.opened = True
        self.send_window = ep.peer_initial_window
        self.recv_window = STREAM_WINDOW
        self.to_grant = 0
        self.pending = bytearray()
        self.end_pending = False
        self.trailers_pending: bytes | None = None
        self.headers_sent = False
        self.recv_ended = False
        self.send_ended = False
        self.reset = False

    @property
    def done(self) -> bool:
        return self.reset or (self.send_ended and self.recv_ended)

    # -- sending towards this half's peer connection ---------------------------------------

    def send_data(self, data: bytes, end: bool) -> None:
        """Queue ``data`` (from the paired half) and send what the windows allow."""
        if self.reset or self.send_ended:
            if self.peer is not None:
                self.peer.grant(len(data))
            return
        ep = self.ep
        size = len(data)
        if (
            self.opened
            and not self.pending
            and size <= self.send_window
            and size <= ep.send_window
            and size <= ep.peer_max_frame
        ):
            # The common case: the whole chunk fits; no queueing, no copy into `pending`.
            if size or end:
                ep.write(
                    f.HEAD.pack(size >> 16, size & 0xFFFF, f.DATA, f.END_STREAM if end else 0, self.id) + data
                )
            self.send_window -= size
            ep.send_window -= size
            if end:
                self.send_ended = True
            if self.peer is not None and size:
                self.peer.grant(size)
            if end:
                self.call.settle()
            return
        self.pending += data
        if end:
            self.end_pending = True
        self.pump()

    def send_trailers(self, block: bytes) -> None:
        """Send a header block ending the stream, after any data still queued."""
        if self.reset or self.send_ended:
            return
        self.trailers_pending = block
        self.pump()

    def send_headers(self, block: bytes, end: bool) -> None:
        """Send response (or request) headers at once; they are not flow controlled."""
        if self.reset or self.send_ended:
            return
        self.headers_sent = True
        self.ep.write(f.header_frames(self.id, block, end, self.ep.peer_max_frame))
        if end:
            self.send_ended = True
            self.call.settle()

    def pump(self) -> None:
        """Send queued data within the windows; then the queued end of stream or trailers."""
        if not self.opened or self.reset or self.send_ended:
            return
        ep = self.ep
        pending = self.pending
        sent = 0
        total = len(pending)
        if total:
            view = memoryview(pending)
            while sent < total:
                size = min(total - sent, self.send_window, ep.send_window, ep.peer_max_frame)
                if size <= 0:
                    break
                last = sent + size == total
                flags = f.END_STREAM if last and self.end_pending and self.trailers_pending is None else 0
                ep.write(f.HEAD.pack(size >> 16, size & 0xFFFF, f.DATA, flags, self.id))
                ep.write(view[sent : sent + size])
                sent += size
                self.send_window -= size
                ep.send_window -= size
                if flags:
                    self.send_ended = True
            view.release()
            del pending[:sent]
            if sent and self.peer is not None:
                self.peer.grant(sent)
        if pending:
            ep.blocked[self.id] = self
            return
        ep.blocked.pop(self.id, None)
        if self.trailers_pending is not None:
            block, self.trailers_pending = self.trailers_pending, None
            ep.write(f.header_frames(self.id, block, True, ep.peer_max_frame))
            self.send_ended = True
        elif self.end_pending and not self.send_ended:
            ep.write(f.frame(f.DATA, f.END_STREAM, self.id))
            self.send_ended = True
        if self.send_ended:
            self.call.settle()

    # -- receiving: give flow-control credit back ------------------------------------------

    def grant(self, size: int) -> None:
        """``size`` bytes received on this half were passed on: let its sender send more."""
        ep = self.ep
        ep.grant(size)
        if not self.recv_ended and not self.reset:
            self.to_grant += size
            if self.to_grant >= _STREAM_GRANT_AT:
                ep.write(f.window_update(self.id, self.to_grant))
                self.recv_window += self.to_grant
                self.to_grant = 0

    def abort(self, code: int) -> None:
        """Reset this stream (RST_STREAM) unless it is over already."""
        if self.done:
            return
        self.reset = True
        self.pending.clear()
        self.ep.blocked.pop(self.id, None)
        if self.opened and not self.ep.closed:
            self.ep.write(f.rst_stream(self.id, code))


class Call:
    """A gRPC call in the relay: the caller's half, the upstream half, and what is known."""

    __slots__ = (
        "answered",
        "backend_clock",
        "backend_seconds",
        "client",
        "clock",
        "deadline",
        "finished",
        "message",
        "path",
        "relay",
        "reply_tap",
        "request_tap",
        "route",
        "started",
        "status",
        "upstream",
    )

    def __init__(self, relay: Relay, path: str, route: Route) -> None:
        self.relay = relay
        self.path = path
        self.route = route
        self.client: Half = None  # type: ignore[assignment]  # set right after construction
        self.upstream: Half | None = None
        self.started = time.time()
        self.clock = time.perf_counter()
        self.backend_clock = 0.0
        self.backend_seconds = 0.0
        self.status = Status.OK
        self.message: str | None = None
        self.answered = False  # the caller got a status (trailers), from upstream or from us
        self.finished = False
        self.deadline = math.inf
        self.request_tap: _Tap | None = _Tap(keep_all=False)
        self.reply_tap: _Tap | None = _Tap(keep_all=relay.is_unary(path))

    def on_request_data(self, data: bytes, end: bool) -> None:
        if self.request_tap is not None and data:
            self.request_tap.feed(data)
        upstream = self.upstream
        if upstream is None or upstream.done:
            self.client.grant(len(data))
            return
        upstream.send_data(data, end)

    def on_reply_data(self, data: bytes, end: bool) -> None:
        if self.reply_tap is not None and data:
            self.reply_tap.feed(data)
        if end:
            self._backend_done()
        self.client.send_data(data, end)

    def on_reply_headers(self, headers: Headers, end: bool) -> None:
        self.route.mark_reachable()
        block = f.encode_headers(headers)
        if end:
            self._backend_done()
            self._take_status(headers)
            if self.client.headers_sent:
                self.client.send_trailers(block)
            else:
                self.client.send_headers(block, True)
        else:
            self.client.send_headers(block, False)

    def on_request_trailers(self, headers: Headers) -> None:
        # gRPC callers end a request with END_STREAM on DATA; a header block is legal though.
        if self.upstream is not None and not self.upstream.done:
            self.upstream.send_trailers(f.encode_headers(headers))

    def _backend_done(self) -> None:
        if self.backend_clock:
            self.backend_seconds = time.perf_counter() - self.backend_clock

    def _take_status(self, headers: Headers) -> None:
        self.answered = True
        code, message = None, None
        for name, value in headers:
            if name == b"grpc-status":
                code = value
            elif name == b"grpc-message":
                message = value
        status = _STATUS_BY_CODE.get(int(code)) if code is not None and code.isdigit() else None
        self.status = status if status is not None else Status.UNKNOWN
        self.message = (
            urllib.parse.unquote(message.decode("utf-8", "replace")) if message is not None else None
        )

    def fail(self, status: Status, message: str) -> None:
        """End the call with ``status`` for the caller and reset the upstream stream."""
        if self.finished:
            return
        client = self.client
        if not client.done and not client.send_ended and not self.answered:
            self.answered = True
            self.status, self.message = status, message
            client.pending.clear()
            client.end_pending = False
            client.ep.blocked.pop(client.id, None)
            block = f.encode_headers(_trailers_only(status, message, client.headers_sent))
            client.trailers_pending = None
            client.send_headers(block, True)
        if self.upstream is not None:
            self.upstream.abort(f.CANCEL)
        self.settle()

    def caller_gone(self) -> None:
        """The caller reset the stream or its connection closed."""
        if not self.answered:
            self.answered = True
            self.status, self.message = Status.CANCELLED, "the call ended before an answer was sent"
        self.client.reset = True
        if self.upstream is not None:
            self.upstream.abort(f.CANCEL)
        self.settle()

    def upstream_gone(self, reason: str) -> None:
        """The upstream stream was reset or its connection lost, before the call ended."""
        upstream = self.upstream
        if upstream is not None:
            upstream.reset = True
        if not self.answered:
            self.fail(Status.UNAVAILABLE, f"{self.route.describe} is unavailable: {reason}")
        else:
            self.settle()

    def settle(self) -> None:
        """Close what is over; once both halves are, the call is finished."""
        if self.finished:
            return
        client, upstream = self.client, self.upstream
        if client.send_ended and not client.recv_ended and not client.reset:
            # We answered before the caller finished sending: close its side (RFC 9113 §8.1).
            client.abort(f.NO_ERROR)
        if upstream is not None and upstream.recv_ended and not upstream.send_ended and not upstream.reset:
            upstream.abort(f.CANCEL)  # the upstream answered; nothing more of the request matters
        if client.done and (upstream is None or upstream.done):
            self.finish()

    def finish(self) -> None:
        self.finished = True
        self.client.ep.forget(self.client)
        if self.upstream is not None:
            self.upstream.ep.forget(self.upstream)
        self.relay.call_finished(self)

    def record(self) -> calls.CallRecord:
        request = self.request_tap.first if self.request_tap is not None else None
        reply_tap = self.reply_tap
        reply = None
        ok = self.status is Status.OK and self.relay.is_unary(self.path)
        if ok and reply_tap is not None and reply_tap.first is not None and reply_tap.messages == 1:
            reply = bytes(reply_tap.first)
        return calls.CallRecord(
            path=self.path,
            started=self.started,
            seconds=time.perf_counter() - self.clock,
            backend_seconds=self.backend_seconds,
            request=bytes(request) if request is not None else b"",
            forwarded=None,
            reply=reply,
            replies=reply_tap.messages if reply_tap is not None else 0,
            status=self.status,
            message=self.message,
            hooks=(),
        )


class Endpoint:
    """One HTTP/2 connection: to a caller (``server_side``) or to an upstream."""

    def __init__(
        self, relay: Relay, sock: socket.socket, *, server_side: bool, route: Route | None = None
    ) -> None:
        sock.setblocking(False)
        self.relay = relay
        self.sock = sock
        self.server_side = server_side
        self.route = route
        self.out = bytearray()
        self.dirty = False
        self.writing = False
        self.closed = False
        self.retiring = False  # takes no new streams (GOAWAY received, or ids used up)
        self.halves: dict[int, Half] = {}
        self.blocked: dict[int, Half] = {}  # halves with data waiting for send window
        # Upstream halves waiting for a stream slot (peer's MAX_CONCURRENT_STREAMS), with their headers.
        self.waiting: deque[tuple[Half, bytes, bool]] = deque()
        self.send_window = f.DEFAULT_WINDOW
        self.peer_initial_window = f.DEFAULT_WINDOW
        self.peer_max_frame = f.DEFAULT_MAX_FRAME
        # Until the peer's SETTINGS say otherwise, no more streams than RFC 9113 asks every
        # peer to allow: h2 (grpclib) closes the connection on a stream beyond its limit.
        self.peer_max_streams = 100
        self._peer_settings_seen = False
        self.recv_window = CONNECTION_WINDOW
        self.to_grant = 0
        self.next_id = 1
        self.last_peer_id = 0
        self.decoder = hpack.Decoder()
        self._continuation: tuple[int, int, bytearray] | None = None
        ours = [(f.INITIAL_WINDOW_SIZE, STREAM_WINDOW)]
        if not server_side:
            self.out += f.PREFACE
            ours.append((f.ENABLE_PUSH, 0))
        self.write(f.settings(ours))
        self.write(f.window_update(0, CONNECTION_WINDOW - f.DEFAULT_WINDOW))

    # -- output ------------------------------------------------------------------------

    def write(self, data: bytes | memoryview) -> None:
        self.out += data
        if not self.dirty:
            self.dirty = True
            self.relay.dirty.append(self)

    def try_send(self) -> None:
        """Write out what is buffered, without waiting; a writer task takes over the rest."""
        self.dirty = False
        if self.writing or self.closed or not self.out:
            return
        try:
            sent = self.sock.send(self.out)
        except BlockingIOError:
            sent = 0
        except OSError as err:
            self.close(f"send failed: {err}")
            return
        if sent == len(self.out):
            self.out.clear()
            return
        del self.out[:sent]
        self.writing = True
        self.relay.nursery.start_soon(self._write_rest)

    async def _write_rest(self) -> None:
        try:
            while self.out and not self.closed:
                try:
                    await trio.lowlevel.wait_writable(self.sock)
                    sent = self.sock.send(self.out)
                except BlockingIOError:
                    continue
                except (OSError, trio.ClosedResourceError) as err:
                    self.close(f"send failed: {err}")
                    return
                del self.out[:sent]
        finally:
            self.writing = False

    def grant(self, size: int) -> None:
        self.to_grant += size
        if self.to_grant >= _CONNECTION_GRANT_AT:
            self.write(f.window_update(0, self.to_grant))
            self.recv_window += self.to_grant
            self.to_grant = 0

    # -- streams -----------------------------------------------------------------------

    def open_stream(self, half: Half, block: bytes, end: bool) -> None:
        """Start ``half`` as a new stream carrying ``block``, or queue it for a free slot."""
        half.opened = False
        half.trailers_pending = None
        half.headers_sent = False
        if len(self.halves) >= self.peer_max_streams:
            self.waiting.append((half, block, end))
            return
        self._start(half, block, end)

    def _start(self, half: Half, block: bytes, end: bool) -> None:
        half.id = self.next_id
        self.next_id += 2
        if self.next_id > f.MAX_STREAM_ID:
            self.retire()
        half.opened = True
        half.send_window = self.peer_initial_window
        self.halves[half.id] = half
        half.send_headers(block, end)
        half.call.backend_clock = time.perf_counter()
        half.pump()

    def forget(self, half: Half) -> None:
        if self.halves.get(half.id) is half:
            del self.halves[half.id]
        self.blocked.pop(half.id, None)
        self._start_waiting()
        if self.retiring and not self.halves and not self.waiting:
            self.close(_RETIRED)

    def _start_waiting(self) -> None:
        while self.waiting and len(self.halves) < self.peer_max_streams and not self.closed:
            waiting, block, end = self.waiting.popleft()
            if not waiting.done:
                self._start(waiting, block, end)

    def retire(self) -> None:
        """Take no new streams; close once the running ones are over."""
        self.retiring = True
        if self.route is not None:
            self.route.drop(self)
        if not self.halves and not self.waiting:
            self.close(_RETIRED)

    # -- input -------------------------------------------------------------------------

    async def run(self) -> None:
        """Read and handle frames until the connection ends, then end its calls."""
        reason = "connection closed"
        try:
            await self._read_loop()
        except _Closed:
            reason = "connection closed by peer"
        except f.ProtocolError as err:
            reason = f"HTTP/2 protocol error: {err}"
            log.event(LOGGER, "protocol_error", level=logging.WARNING, peer=self.describe, error=err)
            if not self.closed:
                self.write(f.goaway(self.last_peer_id, err.code, str(err).encode()[:200]))
                self.try_send()
        except (OSError, trio.ClosedResourceError) as err:
            reason = str(err) or type(err).__name__
        except trio.Cancelled:
            reason = _STOPPED
            raise
        finally:
            self.close(reason)
            self.relay.flush()

    @property
    def describe(self) -> str:
        return self.route.describe if self.route is not None else "caller"

    async def _read_loop(self) -> None:
        sock = self.sock
        buf = bytearray()
        preface = self.server_side
        reads = 0
        while True:
            try:
                data = sock.recv(_RECV_SIZE)
            except BlockingIOError:
                reads = 0
                await trio.lowlevel.wait_readable(sock)
                continue
            if not data:
                raise _Closed()
            buf += data
            if preface:
                if len(buf) < len(f.PREFACE):
                    if not f.PREFACE.startswith(bytes(buf)):
                        raise f.ProtocolError("not an HTTP/2 connection preface")
                    continue
                if not buf.startswith(f.PREFACE):
                    raise f.ProtocolError("not an HTTP/2 connection preface")
                del buf[: len(f.PREFACE)]
                preface = False
            used = self._frames(buf)
            del buf[:used]
            self.relay.flush()
            reads += 1
            if reads >= _READS_PER_CHECKPOINT:
                reads = 0
                await trio.lowlevel.checkpoint()

    def _frames(self, buf: bytearray) -> int:
        offset, total = 0, len(buf)
        head = f.HEAD
        while total - offset >= f.HEAD_SIZE:
            high, low, kind, flags, stream_id = head.unpack_from(buf, offset)
            size = high << 16 | low
            if size > f.DEFAULT_MAX_FRAME:
                raise f.ProtocolError(f"frame of {size} bytes exceeds 16384", f.FRAME_SIZE_ERROR)
            end = offset + f.HEAD_SIZE + size
            if end > total:
                break
            payload = bytes(buf[offset + f.HEAD_SIZE : end])
            offset = end
            self._frame(kind, flags, stream_id & 0x7FFF_FFFF, payload)
        return offset

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuation is not None and kind != f.CONTINUATION:
            raise f.ProtocolError("header block interrupted before END_HEADERS")
        if kind == f.DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == f.HEADERS:
            self._require_stream(stream_id, "HEADERS")
            fragment = f.header_fragment(flags, payload)
            if flags & f.END_HEADERS:
                self._on_block(stream_id, flags, fragment)
            else:
                self._continuation = (stream_id, flags, bytearray(fragment))
        elif kind == f.CONTINUATION:
            if self._continuation is None or self._continuation[0] != stream_id:
                raise f.ProtocolError("CONTINUATION without a header block to continue")
            _, first_flags, block = self._continuation
            block += payload
            if len(block) > MAX_HEADER_BLOCK:
                raise f.ProtocolError("header block too large")
            if flags & f.END_HEADERS:
                self._continuation = None
                self._on_block(stream_id, first_flags, bytes(block))
        elif kind == f.SETTINGS:
            self._require_connection(stream_id, "SETTINGS")
            if not flags & f.ACK:
                self._on_settings(f.parse_settings(payload))
                self.write(f.frame(f.SETTINGS, f.ACK, 0))
        elif kind == f.WINDOW_UPDATE:
            self._on_window_update(stream_id, f.parse_u32(payload))
        elif kind == f.PING:
            self._require_connection(stream_id, "PING")
            if len(payload) != 8:
                raise f.ProtocolError("PING payload is not 8 bytes", f.FRAME_SIZE_ERROR)
            if not flags & f.ACK:
                self.write(f.frame(f.PING, f.ACK, 0, payload))
        elif kind == f.RST_STREAM:
            self._require_stream(stream_id, "RST_STREAM")
            self._on_reset(stream_id, f.parse_u32(payload))
        elif kind == f.GOAWAY:
            self._require_connection(stream_id, "GOAWAY")
            self._on_goaway(*f.parse_goaway(payload))
        elif kind == f.PUSH_PROMISE:
            raise f.ProtocolError("PUSH_PROMISE (push is disabled)")
        # PRIORITY and unknown frame types are ignored (RFC 9113 §5.5, §5.3.2).

    @staticmethod
    def _require_stream(stream_id: int, kind: str) -> None:
        if stream_id == 0:
            raise f.ProtocolError(f"{kind} on stream 0")

    @staticmethod
    def _require_connection(stream_id: int, kind: str) -> None:
        if stream_id != 0:
            raise f.ProtocolError(f"{kind} on stream {stream_id}")

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._require_stream(stream_id, "DATA")
        size = len(payload)
        self.recv_window -= size
        if self.recv_window < 0:
            raise f.ProtocolError("DATA beyond the connection window", f.FLOW_CONTROL_ERROR)
        data = f.unpad(flags, payload)
        half = self.halves.get(stream_id)
        if half is None or half.recv_ended or half.reset:
            self.grant(size)  # a stream that is over (or never was): nothing to pass on
            if self.server_side and stream_id > self.last_peer_id:
                raise f.ProtocolError(f"DATA on idle stream {stream_id}")
            return
        half.recv_window -= size
        if half.recv_window < 0:
            raise f.ProtocolError(f"DATA beyond the window of stream {stream_id}", f.FLOW_CONTROL_ERROR)
        if size != len(data):
            half.grant(size - len(data))  # padding is consumed here
        end = bool(flags & f.END_STREAM)
        if end:
            half.recv_ended = True
        if self.server_side:
            half.call.on_request_data(data, end)
        else:
            half.call.on_reply_data(data, end)

    def _on_block(self, stream_id: int, flags: int, block: bytes) -> None:
        try:
            headers = cast(Headers, self.decoder.decode(block, raw=True))
        except (hpack.exceptions.HPACKError, IndexError, ValueError) as err:
            raise f.ProtocolError(f"undecodable header block: {err}", f.COMPRESSION_ERROR) from None
        end = bool(flags & f.END_STREAM)
        half = self.halves.get(stream_id)
        if self.server_side:
            if half is None:
                if stream_id % 2 == 0:
                    raise f.ProtocolError(f"caller opened even stream {stream_id}")
                if stream_id <= self.last_peer_id:
                    return  # a late header block on a stream that is over
                self.last_peer_id = stream_id
                self.relay.open_call(self, stream_id, headers, end)
                return
            if half.recv_ended or half.reset:
                return
            half.recv_ended = end
            if not end:
                raise f.ProtocolError(f"second header block on stream {stream_id} without END_STREAM")
            half.call.on_request_trailers(headers)
            half.call.settle()
        elif half is not None and not half.recv_ended and not half.reset:
            if end:
                half.recv_ended = True
            half.call.on_reply_headers(headers, end)
            if end:
                half.call.settle()

    def _on_settings(self, values: Iterable[tuple[int, int]]) -> None:
        if not self._peer_settings_seen:
            self._peer_settings_seen = True
            self.peer_max_streams = 2**31  # the peer states its limit now, or has none
        for key, value in values:
            if key == f.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise f.ProtocolError("INITIAL_WINDOW_SIZE above 2^31-1", f.FLOW_CONTROL_ERROR)
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for half in self.halves.values():
                    half.send_window += delta
                if delta > 0:
                    self._pump_blocked()
            elif key == f.MAX_FRAME_SIZE:
                if not f.DEFAULT_MAX_FRAME <= value <= 2**24 - 1:
                    raise f.ProtocolError(f"MAX_FRAME_SIZE {value} out of range")
                self.peer_max_frame = value
            elif key == f.MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
            elif key == f.ENABLE_PUSH and value > 1:
                raise f.ProtocolError("ENABLE_PUSH above 1")
            # HEADER_TABLE_SIZE needs nothing: our header blocks never use the dynamic table.
        self._start_waiting()

    def _on_window_update(self, stream_id: int, increment: int) -> None:
        if increment == 0:
            raise f.ProtocolError("WINDOW_UPDATE of 0")
        if stream_id == 0:
            self.send_window += increment
            if self.send_window > f.MAX_WINDOW:
                raise f.ProtocolError("connection window above 2^31-1", f.FLOW_CONTROL_ERROR)
            self._pump_blocked()
            return
        half = self.halves.get(stream_id)
        if half is not None:
            half.send_window += increment
            if half.pending or half.trailers_pending is not None:
                half.pump()

    def _pump_blocked(self) -> None:
        for half in list(self.blocked.values()):
            half.pump()
            if self.send_window <= 0:
                break

    def _on_reset(self, stream_id: int, code: int) -> None:
        half = self.halves.get(stream_id)
        if half is None or half.reset:
            return
        half.reset = True
        if self.server_side:
            half.call.caller_gone()
        else:
            half.call.upstream_gone(f"stream reset by the runtime (HTTP/2 error code {code})")

    def _on_goaway(self, last_stream_id: int, code: int) -> None:
        if self.server_side:
            return  # the caller will open no more streams; the running ones go on
        self.retire()
        for half in [h for h in self.halves.values() if h.id > last_stream_id] + [w[0] for w in self.waiting]:
            half.reset = True
            half.call.upstream_gone(f"the runtime is going away (GOAWAY, HTTP/2 error code {code})")

    # -- the end ---------------------------------------------------------------------

    def close(self, reason: str) -> None:
        """Close the socket and end every call on it."""
        if self.closed:
            return
        self.closed = True
        if self.route is not None:
            self.route.lost(self, reason)
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()
        self.out.clear()
        for half in list(self.halves.values()) + [w[0] for w in self.waiting]:
            if half.call.finished:
                continue
            half.reset = True
            if self.server_side:
                half.call.caller_gone()
            else:
                half.call.upstream_gone(reason)
        self.halves.clear()
        self.waiting.clear()
        self.blocked.clear()


class Route:
    """Where one kind of call goes: a runtime socket, or the in-process server.

    Holds one upstream connection at a time, opened on first use and again after it was
    lost, so a restarted runtime is picked up by the next call. ``on_state(reachable, error)``
    is told when the runtime answers after being unreachable, and when it cannot be reached.
    """

    def __init__(
        self,
        relay: Relay,
        describe: str,
        connect: Callable[[], socket.socket],
        *,
        on_state: Callable[[bool, str], None] | None = None,
    ) -> None:
        self.relay = relay
        self.describe = describe
        self.connect = connect
        self.on_state = on_state
        self.reachable: bool | None = None
        self.ep: Endpoint | None = None

    def endpoint(self) -> Endpoint:
        """The connection new calls go on; connects first if there is none. Raises OSError."""
        ep = self.ep
        if ep is None or ep.closed or ep.retiring:
            try:
                sock = self.connect()
            except OSError as err:
                self._unreachable(str(err) or type(err).__name__)
                raise
            ep = self.ep = Endpoint(self.relay, sock, server_side=False, route=self)
            self.relay.nursery.start_soon(ep.run)
        return ep

    def drop(self, ep: Endpoint) -> None:
        if self.ep is ep:
            self.ep = None

    def lost(self, ep: Endpoint, reason: str) -> None:
        self.drop(ep)
        if reason in (_RETIRED, _STOPPED):
            return
        running = len(ep.halves) + len(ep.waiting)
        if running:
            self._unreachable(reason, calls=running)
        else:  # an idle connection ended: nothing was lost, the next call reconnects
            log.event(LOGGER, "backend_disconnected", backend=self.describe, reason=reason)

    def mark_reachable(self) -> None:
        if self.reachable is not True:
            self.reachable = True
            if self.on_state is not None:
                self.on_state(True, "")

    def _unreachable(self, error: str, calls: int = 0) -> None:
        self.reachable = False
        if self.on_state is not None:
            self.on_state(False, error)
        log.event(
            LOGGER,
            "backend_unavailable",
            level=logging.WARNING,
            backend=self.describe,
            error=error,
            calls=calls,
        )


def connect_unix(path: str) -> Callable[[], socket.socket]:
    """A connect function for :class:`Route`: a non-blocking connection to the socket at ``path``."""

    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
        except BlockingIOError:
            sock.close()  # a unix socket refuses at once when its backlog is full
            raise ConnectionRefusedError(f"{path}: listen backlog full") from None
        except BaseException:
            sock.close()
            raise
        return sock

    return connect


class Relay:
    """The CRI front end (see the module docstring).

    Args:
        observers: told about every finished call (:class:`krproxy.calls.CallRecord`).

    :meth:`configure` sets the routes (runtime; image, which may be the runtime's), the
    interceptors by method path, and the unary method paths (whose replies records carry).
    """

    def __init__(self, observers: list[calls.Observer] | None = None) -> None:
        self.observers = (
            observers if observers is not None else []
        )  # kept, not copied: the daemon shares it with the Forwarder
        self.runtime: Route = None  # type: ignore[assignment]  # set by configure()
        self.image: Route = None  # type: ignore[assignment]
        self.interceptors: dict[str, Interceptor] = {}
        self._routes: dict[str, Route] = {}  # to plugins and other sockets, by path
        self._unary_paths: frozenset[str] = frozenset()
        self.nursery: trio.Nursery = None  # type: ignore[assignment]  # set by serve()
        self.dirty: list[Endpoint] = []
        self.in_flight = 0
        self.draining = False
        self.stopping = False
        self._idle_waiters: list[trio.Event] = []
        self._accepting: trio.CancelScope | None = None
        self._clients: set[Endpoint] = set()
        self._deadlines: list[list[Any]] = []  # heap of [deadline, seq, call or None]
        self._dead_timers = 0
        self._seq = itertools.count()
        self._timer: trio.CancelScope | None = None

    def configure(
        self,
        runtime: Route,
        image: Route,
        interceptors: Mapping[str, Interceptor],
        unary_paths: Iterable[str],
    ) -> None:
        self.runtime, self.image = runtime, image
        self.interceptors = dict(interceptors)
        self._unary_paths = frozenset(unary_paths)

    def is_unary(self, path: str) -> bool:
        return path in self._unary_paths

    # -- serving -----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the relay's tasks (without accepting callers) until cancelled.

        Enough for calls of our own (:meth:`call`, :meth:`unary`). On cancellation every
        connection is closed; calls still running end (the upstream streams are reset).
        """
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                nursery.start_soon(self._expire_deadlines)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self.stopping = True
            for ep in list(self._clients):
                ep.close(_STOPPED)
            for route in {self.runtime, self.image, *self._routes.values()}:
                if route is not None and route.ep is not None:
                    route.ep.close(_STOPPED)
            self.flush()

    async def serve(
        self, listener: socket.socket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """:meth:`run`, accepting callers on ``listener`` (bound and listening) until cancelled
        or :meth:`stop_accepting`. The listener is left to the caller."""
        listener.setblocking(False)
        async with trio.open_nursery() as outer:
            await outer.start(self.run)
            with trio.CancelScope() as self._accepting:
                task_status.started()
                await self._accept(listener)

    async def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                await trio.lowlevel.wait_readable(listener)
                continue
            except OSError as err:  # e.g. EMFILE: keep serving the connections we have
                log.event(LOGGER, "accept_failed", level=logging.ERROR, error=err)
                await trio.sleep(0.1)
                continue
            ep = Endpoint(self, sock, server_side=True)
            self._clients.add(ep)
            self.nursery.start_soon(self._serve_client, ep)
            self.flush()

    async def _serve_client(self, ep: Endpoint) -> None:
        try:
            await ep.run()
        finally:
            self._clients.discard(ep)

    def stop_accepting(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()

    def flush(self) -> None:
        """Write out every connection something was queued on."""
        dirty = self.dirty
        while dirty:
            dirty.pop().try_send()

    # -- calls -------------------------------------------------------------------------

    def open_call(self, ep: Endpoint, stream_id: int, headers: Headers, end: bool) -> None:
        path = timeout = None
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"grpc-timeout":
                timeout = grpc_timeout(value)
        if path is None:
            ep.write(f.rst_stream(stream_id, f.PROTOCOL_ERROR))
            return
        text = path.decode("utf-8", "replace")
        route = self.image if b".ImageService/" in path else self.runtime
        interceptor = self.interceptors.get(text)
        call = (
            Call(self, text, route)
            if interceptor is None
            else LocalCall(self, text, route, interceptor, headers)
        )
        client = call.client = Half(ep, stream_id, call)
        ep.halves[stream_id] = client
        self.in_flight += 1
        if self.draining:
            client.recv_ended = end
            call.fail(Status.UNAVAILABLE, "krproxy is shutting down")
            return
        if timeout is not None:
            self._add_deadline(call, trio.current_time() + timeout)
        if interceptor is not None:
            if end:
                call.on_request_data(b"", True)
            return
        client.recv_ended = end
        try:
            upstream_ep = route.endpoint()
        except OSError as err:
            call.fail(Status.UNAVAILABLE, f"{route.describe} is unavailable: {err}")
            return
        upstream = call.upstream = Half(upstream_ep, 0, call)
        upstream.peer, client.peer = client, upstream
        upstream_ep.open_stream(upstream, f.encode_headers(headers), end)

    def call_finished(self, call: Call) -> None:
        self.in_flight -= 1
        if call.deadline != math.inf:
            self._dead_timers += 1
        if self.in_flight == 0 and self._idle_waiters:
            for event in self._idle_waiters:
                event.set()
            self._idle_waiters.clear()
        if self.observers:
            record = call.record()
            for observer in self.observers:
                try:
                    observer(record)
                except Exception:  # an observer must never break a call
                    LOGGER.exception("observer %r failed", observer)

    async def wait_idle(self) -> None:
        """Return once no call is in flight."""
        while self.in_flight:
            event = trio.Event()
            self._idle_waiters.append(event)
            await event.wait()

    # -- calls of our own --------------------------------------------------------------

    async def unary(
        self,
        route: Route,
        path: str,
        message: bytes,
        metadata: Iterable[tuple[bytes, bytes]] = (),
        deadline: float = math.inf,
    ) -> Answer:
        """Call ``path`` on ``route`` with ``message``, within ``deadline`` (trio clock).

        Returns the answer whatever its status. Raises OSError if the upstream cannot be
        reached, :class:`UpstreamError` if it went away or answered something that is not
        gRPC, and TimeoutError when the deadline passed first (the stream is reset then).
        """
        exchange = _Exchange()
        ep = route.endpoint()
        upstream = exchange.upstream = Half(ep, 0, exchange)  # type: ignore[arg-type]
        fields: Headers = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.encode()),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
        if deadline != math.inf:
            fields.append((b"grpc-timeout", b"%du" % max(1, int((deadline - trio.current_time()) * 1e6))))
        fields += metadata
        ep.open_stream(upstream, f.encode_headers(fields), False)
        upstream.send_data(_message(message), True)
        self.flush()
        try:
            with trio.move_on_at(deadline):
                await exchange.done.wait()
        finally:
            if not exchange.done.is_set():  # the deadline passed, or our caller was cancelled
                upstream.abort(f.CANCEL)
                exchange.settle()
                self.flush()
        if not exchange.done.is_set():
            raise TimeoutError()
        if exchange.error is not None:
            raise UpstreamError(exchange.error)
        return exchange.answer()

    async def call(self, route: Route, path: str, message: bytes, within: float) -> bytes:
        """:meth:`unary` for callers that want the reply message or an exception.

        Raises :class:`GRPCError` for an error status, and what :meth:`unary` raises.
        """
        answer = await self.unary(route, path, message, deadline=trio.current_time() + within)
        if answer.status is not Status.OK:
            raise GRPCError(answer.status, answer.message, answer.details)
        return answer.body

    def route_to(self, endpoint: str, describe: str) -> Route:
        """The route to the socket at ``endpoint``: one per path, kept until :meth:`drop_route`."""
        route = self._routes.get(endpoint)
        if route is None:
            route = self._routes[endpoint] = Route(self, describe, connect_unix(endpoint))
        return route

    def drop_route(self, endpoint: str) -> None:
        """Forget the route to ``endpoint``; its connection closes once its calls are over."""
        route = self._routes.pop(endpoint, None)
        if route is not None and route.ep is not None:
            route.ep.retire()

    # -- deadlines ---------------------------------------------------------------------

    def _add_deadline(self, call: Call, deadline: float) -> None:
        call.deadline = deadline
        heapq.heappush(self._deadlines, [deadline, next(self._seq), call])
        if self._timer is not None and deadline < self._timer.deadline:
            self._timer.deadline = deadline
        # Finished calls stay in the heap until due (kubelet's deadlines are minutes long):
        # rebuild it without them once they are the majority, so they do not pile up.
        if self._dead_timers > 100 and self._dead_timers * 2 > len(self._deadlines):
            self._deadlines = [entry for entry in self._deadlines if not entry[2].finished]
            heapq.heapify(self._deadlines)
            self._dead_timers = 0

    async def _expire_deadlines(self) -> None:
        while True:
            heap = self._deadlines
            with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as self._timer:
                await trio.sleep_forever()
            self._timer = None
            now = trio.current_time()
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                call = heapq.heappop(heap)[2]
                assert isinstance(call, Call)
                if call.finished:
                    self._dead_timers -= 1
                else:
                    route = call.route
                    call.fail(Status.DEADLINE_EXCEEDED, f"deadline exceeded waiting for {route.describe}")
            self.flush()

    # -- shutdown ----------------------------------------------------------------------

    def start_draining(self) -> None:
        """Refuse new calls (UNAVAILABLE) and stop accepting connections; running calls go on."""
        self.draining = True
        self.stop_accepting()


# -- calls the relay answers itself, and calls it makes ---------------------------------------

_PLAIN_HEADERS: Headers = [(b":status", b"200"), (b"content-type", b"application/grpc")]
_PLAIN_TRAILERS: Headers = [(b"grpc-status", b"0")]
#: Request header fields not passed on when the relay makes a call of its own.
_OWN_FIELDS = frozenset(
    (b":method", b":scheme", b":path", b":authority", b"content-type", b"te", b"grpc-timeout")
)


def _message(data: bytes) -> bytes:
    """gRPC's length-prefixed framing of one uncompressed message."""
    return b"\x00" + len(data).to_bytes(4, "big") + data


def _status_fields(status: Status, message: str | None, details: bytes | None) -> Headers:
    fields = [(b"grpc-status", b"%d" % status.value)]
    if message:
        fields.append((b"grpc-message", urllib.parse.quote(message, safe=" ").encode()))
    if details:
        fields.append((b"grpc-status-details-bin", base64.b64encode(details).rstrip(b"=")))
    return fields


class LocalCall(Call):
    """A call with hook points: the relay collects the request and runs the interceptor.

    The interceptor runs in a task of its own; its ``forward`` makes a unary call on the
    runtime route (:meth:`Relay.unary`), with the caller's metadata and what is left of the
    caller's deadline. Its reply, or the runtime's error answer, goes back unchanged.
    """

    __slots__ = ("_interceptor", "_metadata", "_scope", "_started", "ctx")

    def __init__(
        self, relay: Relay, path: str, route: Route, interceptor: Interceptor, headers: Headers
    ) -> None:
        super().__init__(relay, path, route)
        self.reply_tap = None
        self._interceptor = interceptor
        self._metadata = [field for field in headers if field[0] not in _OWN_FIELDS]
        self._scope: trio.CancelScope | None = None
        self._started = False
        self.ctx = calls.CallContext(path)

    def on_request_data(self, data: bytes, end: bool) -> None:
        assert self.request_tap is not None
        if data:
            self.request_tap.feed(data)
            self.client.grant(len(data))
        if end:
            self.client.recv_ended = True
            if not self._started and not self.finished and not self.answered:
                self._started = True
                self.relay.nursery.start_soon(self._handle)

    def on_request_trailers(self, headers: Headers) -> None:
        self.on_request_data(b"", True)

    async def _handle(self) -> None:
        tap = self.request_tap
        assert tap is not None
        ctx = self.ctx
        calls.CURRENT.set(ctx)  # this task's own context; asyncio tasks started from it inherit it
        try:
            if tap.first is None or tap.messages < 1:
                raise GRPCError(Status.INTERNAL, "the request carried no complete message")
            ctx.request = bytes(tap.first)
            with trio.CancelScope() as self._scope:
                reply = await self._interceptor(self.path, ctx.request, self._forward)
                ctx.reply, ctx.replies = reply.message, 1  # before answering: that may finish the call
                self._answer(
                    reply.headers or _PLAIN_HEADERS,
                    _message(reply.message),
                    reply.trailers or _PLAIN_TRAILERS,
                )
        except BackendError as err:
            self._answer(err.headers, None, err.trailers, err)
        except GRPCError as err:
            details = err.details if isinstance(err.details, bytes) else None
            self._answer(None, None, _status_fields(err.status, err.message, details), err)
        except Exception as err:  # a bug of ours: answer UNKNOWN, keep serving
            LOGGER.exception("interceptor for %s failed", self.path)
            unknown = GRPCError(Status.UNKNOWN, f"{type(err).__name__}: {err}")
            self._answer(None, None, _status_fields(unknown.status, unknown.message, None), unknown)
        finally:
            self.relay.flush()

    def _answer(
        self, headers: Headers | None, body: bytes | None, trailers: Headers, err: GRPCError | None = None
    ) -> None:
        client = self.client
        if self.answered or client.done or client.send_ended:
            return
        self.answered = True
        if err is not None:
            self.status, self.message = err.status, err.message
        if headers is None:  # trailers-only; a runtime's own such answer has its :status already
            whole = trailers if trailers and trailers[0][0] == b":status" else [*_PLAIN_HEADERS, *trailers]
            client.send_headers(f.encode_headers(whole), True)
            return
        client.send_headers(f.encode_headers(headers), False)
        if body is not None:
            client.send_data(body, False)
        client.send_trailers(f.encode_headers(trailers))

    async def _forward(self, data: bytes) -> Reply:
        ctx = self.ctx
        if data is not ctx.request:
            ctx.forwarded = data  # an interceptor changed it
        started = time.perf_counter()
        try:
            answer = await self.relay.unary(self.route, self.path, data, self._metadata, self.deadline)
        finally:
            ctx.backend_seconds += time.perf_counter() - started
        if answer.status is not Status.OK:
            raise BackendError(
                answer.status,
                answer.message,
                answer.details,
                headers=answer.headers,
                trailers=answer.trailers,
            )
        return Reply(answer.body, answer.headers or [], answer.trailers)

    def fail(self, status: Status, message: str) -> None:
        if self._scope is not None:
            self._scope.cancel()
        super().fail(status, message)

    def caller_gone(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
        super().caller_gone()

    def record(self) -> calls.CallRecord:
        ctx = self.ctx
        if self.status is not Status.OK:
            ctx.fail(self.status, self.message)
        return ctx.finish()


@attrs.frozen
class Answer:
    """What an upstream answered to a unary call the relay made (any status)."""

    status: Status
    message: str | None
    details: bytes | None
    body: bytes
    headers: Headers | None  # None for a trailers-only answer
    trailers: Headers


class UpstreamError(Exception):
    """A call the relay made got no answer: the stream or the connection ended first."""


class _Exchange:
    """The relay's side of a unary call it makes itself; the upstream half reports here."""

    __slots__ = ("backend_clock", "body", "done", "error", "finished", "headers", "trailers", "upstream")

    def __init__(self) -> None:
        self.upstream: Half = None  # type: ignore[assignment]  # set right after construction
        self.headers: Headers | None = None
        self.trailers: Headers | None = None
        self.body = bytearray()
        self.error: str | None = None
        self.done = trio.Event()
        self.finished = False
        self.backend_clock = 0.0

    def on_reply_headers(self, headers: Headers, end: bool) -> None:
        if end:
            self.trailers = headers
            self.done.set()
        else:
            self.headers = headers

    def on_reply_data(self, data: bytes, end: bool) -> None:
        self.body += data
        self.upstream.grant(len(data))
        if end:  # gRPC ends with trailers; an answer without them is broken
            self.error = "the answer ended without a status"
            self.done.set()

    def upstream_gone(self, reason: str) -> None:
        self.upstream.reset = True
        if not self.done.is_set():
            self.error = reason
            self.done.set()
        self.settle()

    def settle(self) -> None:
        upstream = self.upstream
        if upstream.recv_ended and not upstream.send_ended and not upstream.reset:
            upstream.abort(f.CANCEL)
        if upstream.done and not self.finished:
            self.finished = True
            upstream.ep.forget(upstream)

    def answer(self) -> Answer:
        trailers = self.trailers or []
        code = message = details = None
        for name, value in trailers:
            if name == b"grpc-status":
                code = value
            elif name == b"grpc-message":
                message = urllib.parse.unquote(value.decode("utf-8", "replace"))
            elif name == b"grpc-status-details-bin":
                details = base64.b64decode(value + b"=" * (-len(value) % 4))
        status = _STATUS_BY_CODE.get(int(code)) if code is not None and code.isdigit() else None
        if status is None:
            status, message = Status.UNKNOWN, message or "the answer carried no valid grpc-status"
        body = b""
        if status is Status.OK:
            raw = self.body
            if len(raw) < 5 or raw[0] != 0 or int.from_bytes(raw[1:5], "big") != len(raw) - 5:
                raise UpstreamError("the answer is not one uncompressed gRPC message")
            body = bytes(raw[5:])
        return Answer(status, message, details, body, self.headers, trailers)


async def _wait_answer(relay: Relay, exchange: _Exchange, deadline: float) -> Answer:
    try:
        with trio.move_on_at(deadline):
            await exchange.done.wait()
    finally:
        if not exchange.done.is_set():  # deadline, or our caller was cancelled
            exchange.upstream.abort(f.CANCEL)
            exchange.settle()
            relay.flush()
    if not exchange.done.is_set():
        raise TimeoutError()
    if exchange.error is not None:
        raise UpstreamError(exchange.error)
    return exchange.answer()
