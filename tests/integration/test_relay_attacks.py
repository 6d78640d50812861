"""The 2023-2026 HTTP/2 attack classes against the relay, from both sides (issue 24, item 7).

Server side: a caller (kubelet's place) sends the attack; the relay must keep its stream
accounting, its memory and the runtime's streams bounded, and its other calls served. Client
side: the upstream (containerd, or a hook server a hostile plugin controls) sends it; the relay's
call must end with an error at once, never hang, and the next call must work.

Each test names the rule it checks; removing the rule makes it fail (docs/testing.md lists them).
The connection errors of the classes (SETTINGS_MAX_FRAME_SIZE out of range, malformed frame
headers) are compared with ``h2`` in test_relay_conformance.py.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import hpack
import pytest
import trio

from krproxy.grpcstatus import Status
from krproxy.h2 import frames as f
from krproxy.relay import Relay
from krproxy.relay.connection import CONNECTION_WINDOW, MAX_HEADER_BLOCK
from krproxy.relay.rpc import UpstreamError, grpc_message, request_headers
from tests.integration.support import (
    LIVENESS_LIMIT,
    ThreadedUnixServer,
    received,
    serve_relay_to,
    wait_until,
)
from tests.unit.h2peer import read_frames, split_frames

PATH = "/test.Attack/Call"
MESSAGE = grpc_message(b"ping")


def _after_preface(*frames: bytes) -> bytes:
    return f.PREFACE + f.frame(f.SETTINGS, 0, 0) + b"".join(frames)


def _pinged(seen: list[tuple[int, int, int, bytes]]) -> bool:
    return any(kind == f.PING and flags & f.ACK for kind, flags, _, _ in seen)


def _stream_limits(seen: list[tuple[int, int, int, bytes]]) -> list[int]:
    """The SETTINGS_MAX_CONCURRENT_STREAMS values the relay advertised in ``seen``."""
    return [
        value
        for kind, flags, _, payload in seen
        if kind == f.SETTINGS and not flags & f.ACK
        for setting, value in f.parse_settings(payload)
        if setting == f.MAX_CONCURRENT_STREAMS
    ]


# -- server side: a hostile caller -------------------------------------------------------------


class SilentRuntime(ThreadedUnixServer):
    """An ``h2`` server that takes requests and never answers; counts the streams it has open
    (received, not reset) and the most it had open at once."""

    def __init__(self, path: str) -> None:
        self.received = 0
        self.reset = 0
        self.open: set[int] = set()
        self.most_open = 0
        super().__init__(path, backlog=4)

    def serve_connection(self, sock: socket.socket) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        with sock:
            for data in received(sock, lambda: self.stopping):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        self.received += 1
                        self.open.add(event.stream_id)
                        self.most_open = max(self.most_open, len(self.open))
                    elif isinstance(event, h2.events.StreamReset):
                        self.reset += 1
                        self.open.discard(event.stream_id)
                sock.sendall(conn.data_to_send())


@pytest.fixture
async def silent_relay(
    nursery: trio.Nursery, relay: Relay, short_tmp: Path
) -> tuple[str, SilentRuntime, Relay]:
    """A relay allowing a caller 10 streams, before a runtime that never answers. (The relay fixture's
    Relay read ``connection.CALLER_MAX_STREAMS`` when it was made: patching the constant now would
    leave it at 1000.)"""
    relay.transport.caller_max_streams = 10
    runtime = SilentRuntime(str(short_tmp / "runtime.sock"))
    listen = await serve_relay_to(
        nursery, relay, str(short_tmp / "runtime.sock"), str(short_tmp), [PATH], name="runtime"
    )
    yield listen, runtime, relay
    runtime.close()


def _exchange(listen: str, data: bytes) -> list[tuple[int, int, int, bytes]]:
    """Send ``data`` and a PING; the frames the relay answers with, up to the PING's answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(LIVENESS_LIMIT)
        sock.connect(listen)
        sock.sendall(data + f.frame(f.PING, 0, 0, b"attacked"))
        return read_frames(sock, _pinged)


def _request(stream_id: int, encoder: hpack.Encoder) -> bytes:
    block = encoder.encode([(n.decode(), v.decode()) for n, v in request_headers(PATH)])
    return f.frame(f.HEADERS, f.END_HEADERS, stream_id, block) + f.frame(
        f.DATA, f.END_STREAM, stream_id, MESSAGE
    )


async def test_rapid_reset_holds_no_more_streams_than_caller_may_open(
    silent_relay: tuple[str, SilentRuntime, Relay],
) -> None:
    """Rapid Reset (CVE-2023-44487): 2000 requests each reset by the caller at once, on one
    connection allowed 10 streams. Rule: a caller's reset ends the call upstream too (RST_STREAM
    CANCEL), so the runtime never has more than 10 of this caller's streams open, and none once
    the flood is over; the connection still answers."""
    listen, runtime, relay = silent_relay
    encoder = hpack.Encoder()
    flood = b"".join(_request(i, encoder) + f.rst_stream(i, f.CANCEL) for i in range(1, 4001, 2))
    seen = await trio.to_thread.run_sync(_exchange, listen, _after_preface(flood))
    assert [10] == _stream_limits(seen)  # the limit the rule is measured against
    assert _pinged(seen)
    assert [] == [kind for kind, _, _, _ in seen if kind == f.GOAWAY]
    await wait_until(lambda: relay.transport.in_flight == 0 and runtime.received == runtime.reset)
    assert runtime.most_open <= 10


async def test_made_you_reset_holds_at_most_the_callers_streams(
    silent_relay: tuple[str, SilentRuntime, Relay],
) -> None:
    """MadeYouReset (CVE-2025-8671): 2000 requests each followed by a frame that makes the
    relay reset the stream itself (WINDOW_UPDATE of 0, a stream error), so the caller's stream
    limit is never reached. Rule: a stream error the relay raises ends the call upstream too,
    so the runtime never has more than the caller's 10 streams open, and none at the end."""
    listen, runtime, relay = silent_relay
    encoder = hpack.Encoder()
    zero = b"\x00\x00\x00\x00"
    flood = b"".join(_request(i, encoder) + f.frame(f.WINDOW_UPDATE, 0, i, zero) for i in range(1, 4001, 2))
    seen = await trio.to_thread.run_sync(_exchange, listen, _after_preface(flood))
    assert [10] == _stream_limits(seen)
    assert _pinged(seen)
    resets = [int.from_bytes(p, "big") for kind, _, _, p in seen if kind == f.RST_STREAM]
    assert [f.PROTOCOL_ERROR] * 2000 == resets
    await wait_until(lambda: relay.transport.in_flight == 0 and runtime.received == runtime.reset)
    assert runtime.most_open <= 10


async def test_a_continuation_flood_ends_at_the_skim_bound(
    silent_relay: tuple[str, SilentRuntime, Relay],
) -> None:
    """CONTINUATION flood (CVE-2023-45288, CVE-2024-27316): a header block that never ends.
    Rule: a block is collected up to MAX_HEADER_BLOCK bytes, then only skimmed for its HPACK
    state, within krproxy.h2.hpackskim's bounds; past them (here its 4096 tiny fields) the
    connection ends (GOAWAY ENHANCE_YOUR_CALM) instead of growing or waiting forever."""
    listen, _, _ = silent_relay
    chunk = bytes(16_384)
    count = MAX_HEADER_BLOCK // len(chunk) + 2
    data = _after_preface(f.frame(f.HEADERS, 0, 1, chunk)) + f.frame(f.CONTINUATION, 0, 1, chunk) * count

    def run() -> list[tuple[int, int, int, bytes]]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(LIVENESS_LIMIT)
            sock.connect(listen)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(data)  # the relay may close before taking it all
            return read_frames(sock, lambda seen: any(kind == f.GOAWAY for kind, _, _, _ in seen))

    seen = await trio.to_thread.run_sync(run)
    assert [f.ENHANCE_YOUR_CALM] == [
        int.from_bytes(p[4:8], "big") for kind, _, _, p in seen if kind == f.GOAWAY
    ]


@pytest.mark.parametrize("kind", range(0x0A, 0x10))
async def test_unknown_frame_types_are_ignored(
    nursery: trio.Nursery, relay: Relay, short_tmp: Path, kind: int, fake_containerd: tuple[object, str]
) -> None:
    """Frame types 0x0a-0x0f (CVE-2026-27141) on the connection and on an open stream, with
    flags and a payload, in the middle of a request: ignored (RFC 9113 §5.5), the call is
    answered and nothing is reset. Rule: an unknown frame type is never an error."""
    _, backend = fake_containerd
    version = "/runtime.v1.RuntimeService/Version"
    listen = await serve_relay_to(nursery, relay, backend, str(short_tmp), [version], name="runtime")
    block = hpack.Encoder().encode([(n.decode(), v.decode()) for n, v in request_headers(version)])
    data = _after_preface(
        f.frame(kind, 0xFF, 0, b"unknown"),
        f.frame(f.HEADERS, f.END_HEADERS, 1, block),
        f.frame(kind, 0xFF, 1, b"unknown"),
        f.frame(f.DATA, f.END_STREAM, 1, grpc_message(b"")),
        f.frame(kind, 0, 3, b""),
    )

    def run() -> list[tuple[int, int, int, bytes]]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(LIVENESS_LIMIT)
            sock.connect(listen)
            sock.sendall(data)
            return read_frames(
                sock, lambda seen: any(k == f.HEADERS and fl & f.END_STREAM for k, fl, _, _ in seen)
            )

    seen = await trio.to_thread.run_sync(run)
    trailers = [hpack.Decoder().decode(p) for k, fl, _, p in seen if k == f.HEADERS and fl & f.END_STREAM]
    assert [] == [k for k, _, _, _ in seen if k in (f.RST_STREAM, f.GOAWAY)]
    assert trailers and ("grpc-status", "0") in trailers[-1]


async def test_a_trailer_flood_on_a_stream_is_one_stream_error(
    silent_relay: tuple[str, SilentRuntime, Relay],
) -> None:
    """Trailer flood: 500 header blocks after the request's END_STREAM. Rule: the first is a
    stream error (RST_STREAM STREAM_CLOSED), the rest arrive on a stream the relay reset and are
    ignored (RFC 9113 §5.1): one reset, no GOAWAY, the connection still answers."""
    listen, _, _ = silent_relay
    encoder = hpack.Encoder()
    block = encoder.encode([(n.decode(), v.decode()) for n, v in request_headers(PATH)])
    trailers = b"".join(
        f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 1, encoder.encode([("x-trailer", str(i))]))
        for i in range(500)
    )
    data = _after_preface(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 1, block), trailers)
    seen = await trio.to_thread.run_sync(_exchange, listen, data)
    assert [(1, f.STREAM_CLOSED)] == [
        (stream, int.from_bytes(p, "big")) for kind, _, stream, p in seen if kind == f.RST_STREAM
    ]
    assert [] == [kind for kind, _, _, _ in seen if kind == f.GOAWAY]
    assert _pinged(seen)


def _window_flips(count: int) -> bytes:
    return b"".join(f.settings([(f.INITIAL_WINDOW_SIZE, 65_535 + i % 2)]) for i in range(1, count + 1))


@pytest.mark.parametrize(("flips", "ended"), [(40, False), (120, True)])
async def test_repeated_initial_window_size_changes_end_the_connection(
    silent_relay: tuple[str, SilentRuntime, Relay], monkeypatch: pytest.MonkeyPatch, flips: int, ended: bool
) -> None:
    """CPU from SETTINGS_INITIAL_WINDOW_SIZE changes: each adjusts every open stream's window.
    Rule: a connection gets MAX_WINDOW_SHIFTS such adjustments (here 1000, with 10 streams open:
    100 changes); beyond them it ends with GOAWAY ENHANCE_YOUR_CALM. Fewer changes are served."""
    monkeypatch.setattr("krproxy.relay.connection.MAX_WINDOW_SHIFTS", 1000)
    listen, _, _ = silent_relay
    encoder = hpack.Encoder()
    block = encoder.encode([(n.decode(), v.decode()) for n, v in request_headers(PATH)])
    opened = b"".join(f.frame(f.HEADERS, f.END_HEADERS, i, block) for i in range(1, 21, 2))
    seen = await trio.to_thread.run_sync(_exchange, listen, _after_preface(opened, _window_flips(flips)))
    goaways = [int.from_bytes(p[4:8], "big") for kind, _, _, p in seen if kind == f.GOAWAY]
    assert ([f.ENHANCE_YOUR_CALM] if ended else []) == goaways


def _connection_credit(seen: list[tuple[int, int, int, bytes]]) -> int:
    return sum(f.parse_u32(p) for kind, _, stream, p in seen if kind == f.WINDOW_UPDATE and stream == 0)


async def test_data_dropped_on_reset_streams_is_credited_back_once(
    silent_relay: tuple[str, SilentRuntime, Relay],
) -> None:
    """Double refund: 8 MiB of DATA the relay drops, on streams it resets (a content-length the
    DATA exceeds) and on streams already reset, padding included. Rule: each dropped byte's
    connection credit comes back exactly once, so the caller's window is what we can take:
    WINDOW_UPDATEs on stream 0 add up to the 8 MiB (after the initial grant), not more, not less."""
    listen, _, _ = silent_relay
    encoder = hpack.Encoder()
    chunk = b"\x07" + bytes(16_376) + bytes(7)  # padded: 1 + 16376 data + 7 padding = 16384
    frames = []
    sent = 0
    stream = 1
    while sent < 2 * CONNECTION_WINDOW // 4:
        fields = [(n.decode(), v.decode()) for n, v in request_headers(PATH)] + [("content-length", "1")]
        frames.append(f.frame(f.HEADERS, f.END_HEADERS, stream, encoder.encode(fields)))
        for _ in range(16):
            frames.append(f.frame(f.DATA, f.PADDED, stream, chunk))
            sent += len(chunk)
        stream += 2
    seen = await trio.to_thread.run_sync(_exchange, listen, _after_preface(*frames))
    initial = CONNECTION_WINDOW - f.DEFAULT_WINDOW
    assert 2 * CONNECTION_WINDOW // 4 == sent
    assert sent == _connection_credit(seen) - initial


# -- client side: a hostile upstream -----------------------------------------------------------


class ScriptedUpstream(ThreadedUnixServer):
    """An upstream on a unix socket answering each connection with raw bytes: ``answer(stream_id)``
    gives what to send once the relay's request on that stream has arrived. Records the GOAWAY
    codes the relay sends it."""

    def __init__(self, path: str, answer: Callable[[int], bytes], settings: bytes = b"") -> None:
        self.answer = answer
        self.settings = settings or f.settings([])
        self.goaways: list[int] = []
        super().__init__(path, backlog=4)

    def serve_connection(self, sock: socket.socket) -> None:
        buf = b""
        preface = True
        with sock:
            try:
                sock.sendall(self.settings)
                for chunk in received(sock, lambda: self.stopping):
                    buf += chunk
                    if preface:
                        if len(buf) < len(f.PREFACE):
                            continue
                        buf, preface = buf[len(f.PREFACE) :], False
                    frames, buf = split_frames(buf)
                    self.goaways += [int.from_bytes(p[4:8], "big") for k, _, _, p in frames if k == f.GOAWAY]
                    # A send fails once the relay has closed; its GOAWAY may still be unread.
                    with contextlib.suppress(OSError):
                        for kind, flags, stream, _ in frames:
                            if kind == f.SETTINGS and not flags & f.ACK:
                                sock.sendall(f.frame(f.SETTINGS, f.ACK, 0))
                            elif kind == f.DATA and flags & f.END_STREAM:
                                sock.sendall(self.answer(stream))
            except OSError:
                return


async def _call_until_goaway(relay: Relay, path: str, upstream: ScriptedUpstream) -> object:
    """One call through ``relay`` to ``upstream`` (serving ``path``), then a wait for the GOAWAY the
    relay sends it; the call's answer or error. The upstream is closed after."""
    try:
        answer = await _call(relay, path)
        await wait_until(lambda: bool(upstream.goaways))
    finally:
        upstream.close()
    return answer


def _headers(stream_id: int, fields: list[tuple[str, str]], end: bool = False) -> bytes:
    flags = f.END_HEADERS | (f.END_STREAM if end else 0)
    return f.frame(
        f.HEADERS, flags, stream_id, f.encode_headers([(n.encode(), v.encode()) for n, v in fields])
    )


def _answer(stream_id: int, *between: bytes, status: str = "0") -> bytes:
    """A whole gRPC answer on ``stream_id``, with ``between`` after its DATA."""
    return b"".join(
        (
            _headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")]),
            f.frame(f.DATA, 0, stream_id, grpc_message(b"pong")),
            *between,
            _headers(stream_id, [("grpc-status", status)], end=True),
        )
    )


async def _call(relay: Relay, path: str) -> object:
    """The relay's own call to the upstream at ``path``: its answer or the error, within LIVENESS_LIMIT
    (never a hang)."""
    with trio.fail_after(LIVENESS_LIMIT):
        try:
            return await relay.transport.unary(relay.route_to(path, "upstream"), PATH, b"ping")
        except (UpstreamError, OSError) as err:
            return err


@pytest.mark.parametrize("kind", range(0x0A, 0x10))
async def test_unknown_frame_types_from_an_upstream_are_ignored(
    relay: Relay, short_tmp: Path, kind: int
) -> None:
    """An upstream's frames of types 0x0a-0x0f (CVE-2026-27141) amid its answer: ignored, the
    call gets the answer."""
    path = str(short_tmp / "upstream.sock")
    unknown = f.frame(kind, 0xFF, 0, b"x") + f.frame(kind, 0xFF, 1, b"y")
    upstream = ScriptedUpstream(path, lambda stream: _answer(stream, unknown), f.settings([]) + unknown)
    try:
        answer = await _call(relay, path)
    finally:
        upstream.close()
    assert Status.OK == getattr(answer, "status", answer)
    assert b"pong" == getattr(answer, "body", None)


@pytest.mark.parametrize("size", [0, 16_383, 2**24])
async def test_an_upstream_bad_max_frame_size_fails_the_call(
    relay: Relay, short_tmp: Path, size: int
) -> None:
    """An upstream's SETTINGS_MAX_FRAME_SIZE out of range (CVE-2026-33814: a frame size of 0
    left a client's DATA unsent forever). Rule: a connection error (GOAWAY PROTOCOL_ERROR); the
    call fails at once instead of hanging."""
    path = str(short_tmp / "upstream.sock")
    upstream = ScriptedUpstream(path, _answer, f.settings([(f.MAX_FRAME_SIZE, size)]))
    answer = await _call_until_goaway(relay, path, upstream)
    assert isinstance(answer, UpstreamError)
    assert [f.PROTOCOL_ERROR] == upstream.goaways


async def test_an_upstreams_continuation_flood_fails_the_call_at_once(relay: Relay, short_tmp: Path) -> None:
    """An upstream answering with a header block that never ends (CONTINUATION flood). Rule:
    past MAX_HEADER_BLOCK it is skimmed within hpackskim's bounds; past them the connection ends
    with GOAWAY ENHANCE_YOUR_CALM and the call fails."""
    path = str(short_tmp / "upstream.sock")
    chunk = bytes(16_384)

    def flood(stream: int) -> bytes:
        frames = [f.frame(f.HEADERS, 0, stream, chunk)]
        frames += [f.frame(f.CONTINUATION, 0, stream, chunk)] * (MAX_HEADER_BLOCK // len(chunk) + 2)
        return b"".join(frames)

    upstream = ScriptedUpstream(path, flood)
    answer = await _call_until_goaway(relay, path, upstream)
    assert isinstance(answer, UpstreamError)
    assert [f.ENHANCE_YOUR_CALM] == upstream.goaways


@pytest.mark.parametrize(
    ("name", "frame", "code"),
    [
        (
            "settings-not-a-multiple-of-6",
            f.frame(f.SETTINGS, 0, 0, b"\x00\x05\x00\x00\x40"),
            f.FRAME_SIZE_ERROR,
        ),
        ("ping-of-7-bytes", f.frame(f.PING, 0, 0, b"1234567"), f.FRAME_SIZE_ERROR),
        ("data-padding-beyond-the-payload", f.frame(f.DATA, f.PADDED, 1, b"\x09abcd"), f.PROTOCOL_ERROR),
        (
            "headers-with-short-priority",
            f.frame(f.HEADERS, f.PRIORITY_FLAG | f.END_HEADERS, 1, b"\x00"),
            f.FRAME_SIZE_ERROR,
        ),
    ],
)
async def test_an_upstreams_malformed_frame_fails_the_call_at_once(
    relay: Relay, short_tmp: Path, name: str, frame: bytes, code: int
) -> None:
    """Malformed frame headers from an upstream: a connection error with the RFC's code
    (GOAWAY), and the call fails at once."""
    path = str(short_tmp / "upstream.sock")
    upstream = ScriptedUpstream(path, lambda stream: frame)
    answer = await _call_until_goaway(relay, path, upstream)
    assert isinstance(answer, UpstreamError)
    assert [code] == upstream.goaways


async def test_an_upstream_trailer_flood_keeps_the_first_trailers(relay: Relay, short_tmp: Path) -> None:
    """An upstream sending trailers, then 200 more header blocks on the ended stream (a trailer
    flood, each claiming another status). Rule: a stream's answer ends with its first trailers;
    later blocks are ignored, and the connection serves the next call."""
    path = str(short_tmp / "upstream.sock")

    def answer(stream: int) -> bytes:
        late = b"".join(
            _headers(stream, [("grpc-status", "13"), ("x-n", str(i))], end=True) for i in range(200)
        )
        return _answer(stream) + late

    upstream = ScriptedUpstream(path, answer)
    try:
        first = await _call(relay, path)
        second = await _call(relay, path)
    finally:
        upstream.close()
    assert (Status.OK, Status.OK) == (getattr(first, "status", first), getattr(second, "status", second))
    assert [] == upstream.goaways


async def test_upstream_window_size_changes_again_fail_the_call(
    relay: Relay, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upstream flipping SETTINGS_INITIAL_WINDOW_SIZE while a call is open: beyond
    MAX_WINDOW_SHIFTS stream adjustments (here 100) the relay ends the connection with
    ENHANCE_YOUR_CALM and the call fails at once."""
    monkeypatch.setattr("krproxy.relay.connection.MAX_WINDOW_SHIFTS", 100)
    path = str(short_tmp / "upstream.sock")
    upstream = ScriptedUpstream(path, lambda stream: _window_flips(300))
    answer = await _call_until_goaway(relay, path, upstream)
    assert isinstance(answer, UpstreamError)
    assert [f.ENHANCE_YOUR_CALM] == upstream.goaways
