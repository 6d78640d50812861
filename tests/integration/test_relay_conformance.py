"""HTTP/2 conformance of the relay's caller side (RFC 9113), with the ``h2`` library as oracle.

Each case is a frame sequence a caller might send after its preface. The relay's verdict (the
error code of the GOAWAY it answers with) is compared with the verdict of an ``h2`` server fed
the same bytes, so the expectation is not only ours. Where ``h2`` departs from the RFC, the
case names both codes and says why (``H2_DIFFERS``).
"""

from __future__ import annotations

import socket
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
import pytest
import trio

from krproxy.h2 import frames as f
from krproxy.relay import Relay
from tests.integration.support import serve_relay_to
from tests.unit.h2peer import parse, read_frames

PATH = "/test.Conformance/Call"


def _after_preface(*frames: bytes) -> bytes:
    return f.PREFACE + f.frame(f.SETTINGS, 0, 0) + b"".join(frames)


CASES = {
    "settings-ack-with-payload": (
        _after_preface(f.frame(f.SETTINGS, f.ACK, 0, b"\x00\x03\x00\x00\x00\x64")),
        f.FRAME_SIZE_ERROR,
    ),
    "window-update-on-idle-stream": (_after_preface(f.window_update(11, 100)), f.PROTOCOL_ERROR),
    "rst-stream-on-idle-stream": (_after_preface(f.rst_stream(11, f.CANCEL)), f.PROTOCOL_ERROR),
    # A peer's SETTINGS_MAX_FRAME_SIZE outside 16384..2^24-1 (RFC 9113 §6.5.2): a connection
    # error, never a frame size of 0 that would leave every DATA frame unsent (CVE-2026-33814).
    **{
        f"max-frame-size-{size}": (
            _after_preface(f.settings([(f.MAX_FRAME_SIZE, size)])),
            f.PROTOCOL_ERROR,
        )
        for size in (0, 16_383, 2**24)
    },
    # Malformed frame headers: lengths the frame type forbids, padding beyond the payload.
    "settings-length-not-a-multiple-of-6": (
        _after_preface(f.frame(f.SETTINGS, 0, 0, b"\x00\x03\x00\x00\x00\x64\x00")),
        f.FRAME_SIZE_ERROR,
    ),
    "ping-of-7-bytes": (_after_preface(f.frame(f.PING, 0, 0, b"1234567")), f.FRAME_SIZE_ERROR),
    "window-update-of-3-bytes": (
        _after_preface(f.frame(f.WINDOW_UPDATE, 0, 0, b"\x00\x00\x01")),
        f.FRAME_SIZE_ERROR,
    ),
    "headers-padding-beyond-the-payload": (
        _after_preface(f.frame(f.HEADERS, f.END_HEADERS | f.PADDED, 1, b"\x09\x82\x86\x84")),
        f.PROTOCOL_ERROR,
    ),
    "data-padding-beyond-the-payload": (
        _after_preface(
            f.frame(
                f.HEADERS, f.END_HEADERS, 1, hpack.Encoder().encode([(":method", "POST"), (":path", PATH)])
            ),
            f.frame(f.DATA, f.PADDED, 1, b"\x09abcd"),
        ),
        f.PROTOCOL_ERROR,
    ),
    "headers-with-priority-shorter-than-5-bytes": (
        _after_preface(f.frame(f.HEADERS, f.END_HEADERS | f.PRIORITY_FLAG, 1, b"\x00\x00\x00")),
        f.FRAME_SIZE_ERROR,
    ),
}

#: Cases where ``h2`` answers otherwise than RFC 9113 asks: h2 turns every frame hyperframe
#: cannot parse into PROTOCOL_ERROR, but §6.5 makes a SETTINGS ACK with a payload FRAME_SIZE_ERROR.
H2_DIFFERS = {"settings-ack-with-payload": f.PROTOCOL_ERROR}


def _h2_verdict(data: bytes) -> int:
    """The error code an ``h2`` server ends the connection with on ``data`` (0: accepted)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    try:
        conn.receive_data(data)
    except h2.exceptions.ProtocolError as err:
        return int(err.error_code)
    return 0


def _relay_verdict(path: str, data: bytes) -> int:
    """The error code of the GOAWAY the relay answers ``data`` with (0: closed without one)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(data)
        seen = read_frames(sock, lambda seen: any(kind == f.GOAWAY for kind, _, _, _ in seen))
    codes = [int.from_bytes(payload[4:8], "big") for kind, _, _, payload in seen if kind == f.GOAWAY]
    return codes[0] if codes else 0


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_misbehaving_caller_gets_the_connection_error_h2_gives(
    nursery: trio.Nursery, relay: Relay, short_tmp: Path, case: str
) -> None:
    """The relay ends the connection with the error code the RFC names, as an ``h2`` server does."""
    data, expected = CASES[case]
    listen = await serve_relay_to(nursery, relay, str(short_tmp / "none.sock"), str(short_tmp), [PATH])
    assert H2_DIFFERS.get(case, expected) == _h2_verdict(data)
    assert expected == await trio.to_thread.run_sync(_relay_verdict, listen, data)


async def test_a_window_update_of_0_resets_only_that_stream(nursery: trio.Nursery, short_tmp: Path) -> None:
    """WINDOW_UPDATE of 0 on an open stream is a stream error (RFC 9113 §6.9): RST_STREAM
    PROTOCOL_ERROR on it, and the connection still answers a PING."""
    listen, silent, _ = await _relay_before_a_silent_runtime(nursery, short_tmp)
    encoder = h2.connection.H2Connection().encoder
    block = encoder.encode(
        [(":method", "POST"), (":scheme", "http"), (":path", PATH), ("content-type", "application/grpc")]
    )
    data = _after_preface(
        f.frame(f.HEADERS, f.END_HEADERS, 1, block),
        f.frame(f.WINDOW_UPDATE, 0, 1, b"\x00\x00\x00\x00"),
    )
    try:
        seen = await trio.to_thread.run_sync(_relay_frames, listen, data)
    finally:
        silent.close()
    resets = [(stream, int.from_bytes(p, "big")) for kind, stream, p in seen if kind == f.RST_STREAM]
    assert [(1, f.PROTOCOL_ERROR)] == resets
    assert [] == [kind for kind, _, _ in seen if kind == f.GOAWAY]
    assert any(kind == f.PING for kind, _, _ in seen)


# -- stream errors: the relay resets the one stream, as RFC 9113 says; h2 as the oracle of the code ----


def _block(*fields: tuple[str, str]) -> bytes:
    return hpack.Encoder().encode(list(fields))


GOOD = (
    (":method", "POST"),
    (":scheme", "http"),
    (":path", PATH),
    (":authority", "relay-test"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
)


def _open(*fields: tuple[str, str], end: bool = False, priority: bytes = b"") -> bytes:
    flags = f.END_HEADERS | (f.END_STREAM if end else 0) | (f.PRIORITY_FLAG if priority else 0)
    return f.frame(f.HEADERS, flags, 1, priority + _block(*fields))


def _without(name: str) -> tuple[tuple[str, str], ...]:
    return tuple(field for field in GOOD if field[0] != name)


def _replaced(name: str, value: str) -> tuple[tuple[str, str], ...]:
    return tuple((key, value if key == name else old) for key, old in GOOD)


def _data(size: int, end: bool = False) -> bytes:
    return f.frame(f.DATA, f.END_STREAM if end else 0, 1, bytes(size))


STREAM_CASES = {
    "data-on-half-closed-stream": (
        _open(*GOOD, end=True) + f.frame(f.DATA, 0, 1, b"\x00\x00\x00\x00\x00"),
        f.STREAM_CLOSED,
    ),
    "data-after-the-callers-rst-stream": (
        _open(*GOOD) + f.rst_stream(1, f.CANCEL) + f.frame(f.DATA, 0, 1, b"\x00\x00\x00\x00\x00"),
        f.STREAM_CLOSED,
    ),
    "headers-on-half-closed-stream": (
        _open(*GOOD, end=True) + f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 1, _block(("x-late", "1"))),
        f.STREAM_CLOSED,
    ),
    "priority-of-wrong-length": (
        _open(*GOOD) + f.frame(f.PRIORITY, 0, 1, b"\x00\x00\x00"),
        f.FRAME_SIZE_ERROR,
    ),
    "priority-depending-on-itself": (
        _open(*GOOD) + f.frame(f.PRIORITY, 0, 1, b"\x00\x00\x00\x01\x10"),
        f.PROTOCOL_ERROR,
    ),
    "priority-depending-on-itself-on-an-idle-stream": (
        f.frame(f.PRIORITY, 0, 1, b"\x00\x00\x00\x01\x10"),
        f.PROTOCOL_ERROR,
    ),
    "headers-depending-on-itself": (_open(*GOOD, priority=b"\x00\x00\x00\x01\x10"), f.PROTOCOL_ERROR),
    "window-above-2^31-1-on-a-stream": (
        _open(*GOOD) + f.window_update(1, f.MAX_WINDOW),
        f.FLOW_CONTROL_ERROR,
    ),
    # RFC 9113 §8.1.1: DATA that does not add up to the content-length makes the request malformed.
    "content-length-below-the-data": (
        _open(*GOOD, ("content-length", "1")) + _data(5, end=True),
        f.PROTOCOL_ERROR,
    ),
    "content-length-below-two-data-frames": (
        _open(*GOOD, ("content-length", "6")) + _data(5) + _data(5, end=True),
        f.PROTOCOL_ERROR,
    ),
    "content-length-above-the-data": (
        _open(*GOOD, ("content-length", "9")) + _data(5, end=True),
        f.PROTOCOL_ERROR,
    ),
    "content-length-above-the-data-before-trailers": (
        _open(*GOOD, ("content-length", "9"))
        + _data(5)
        + f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 1, _block(("x-trailer", "1"))),
        f.PROTOCOL_ERROR,
    ),
    "content-length-without-data": (_open(*GOOD, ("content-length", "5"), end=True), f.PROTOCOL_ERROR),
    "content-length-not-a-number": (_open(*GOOD, ("content-length", "five")), f.PROTOCOL_ERROR),
    "uppercase-header-name": (_open(*GOOD, ("X-Upper", "1")), f.PROTOCOL_ERROR),
    "connection-specific-header": (_open(*GOOD, ("connection", "keep-alive")), f.PROTOCOL_ERROR),
    "te-other-than-trailers": (_open(*_without("te"), ("te", "gzip")), f.PROTOCOL_ERROR),
    "pseudo-header-after-regular": (_open(*_without(":path"), (":path", PATH)), f.PROTOCOL_ERROR),
    "unknown-pseudo-header": (_open(*GOOD, (":color", "blue")), f.PROTOCOL_ERROR),
    "response-pseudo-header": (_open((":status", "200"), *GOOD), f.PROTOCOL_ERROR),
    "missing-method": (_open(*_without(":method")), f.PROTOCOL_ERROR),
    "missing-scheme": (_open(*_without(":scheme")), f.PROTOCOL_ERROR),
    "missing-path": (_open(*_without(":path")), f.PROTOCOL_ERROR),
    "empty-path": (_open(*_replaced(":path", "")), f.PROTOCOL_ERROR),
    # RFC 9113 §8.2.1: the octets a field may not hold.
    "nul-in-header-value": (_open(*GOOD, ("x-id", "a\x00b")), f.PROTOCOL_ERROR),
    "lf-in-header-value": (_open(*GOOD, ("x-id", "a\nx-injected: 1")), f.PROTOCOL_ERROR),
    "cr-in-header-value": (_open(*GOOD, ("x-id", "a\rb")), f.PROTOCOL_ERROR),
    "crlf-in-path": (_open(*_replaced(":path", PATH + "\r\n")), f.PROTOCOL_ERROR),
    "leading-space-in-header-value": (_open(*GOOD, ("x-id", " a")), f.PROTOCOL_ERROR),
    "trailing-tab-in-header-value": (_open(*GOOD, ("x-id", "a\t")), f.PROTOCOL_ERROR),
    "control-character-in-header-value": (_open(*GOOD, ("x-id", "a\x01b")), f.PROTOCOL_ERROR),
    "nul-in-header-name": (_open(*GOOD, ("x-\x00id", "1")), f.PROTOCOL_ERROR),
    "lf-in-header-name": (_open(*GOOD, ("x-\nid", "1")), f.PROTOCOL_ERROR),
    "colon-in-header-name": (_open(*GOOD, ("x:id", "1")), f.PROTOCOL_ERROR),
    "separator-in-header-name": (_open(*GOOD, ("x(id)", "1")), f.PROTOCOL_ERROR),
}

#: ``h2`` raises a *connection* error (its ProtocolError) for a malformed header list and for bad
#: PRIORITY frames, where RFC 9113 (§8.1.1, §5.3.1, §6.3) makes them stream errors; the code is
#: the same, and that is what is compared. Where the code differs: fields the RFC allows but
#: grpc-go's framer (containerd's, behind us) refuses with RST_STREAM PROTOCOL_ERROR, as the
#: relay does; h2 accepts them (0).
H2_STREAM_DIFFERS: dict[str, int] = {
    "control-character-in-header-value": 0,  # httpguts.ValidHeaderFieldValue: no control but HTAB
    "separator-in-header-name": 0,  # validWireHeaderFieldName: token characters only
    # h2 compares the DATA with the content-length only when DATA ends the stream; RFC 9113
    # §8.1.1 calls the request malformed however it ends (golang.org/x/net's server checks
    # at the end of the stream too, trailers included).
    "content-length-without-data": 0,
    "content-length-above-the-data-before-trailers": 0,
}


def _h2_code(data: bytes) -> int:
    """The code an ``h2`` server answers ``data`` with: its connection error's, or the code of
    the RST_STREAM it sends for stream 1 (0: neither)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    conn.data_to_send()
    try:
        conn.receive_data(data)
    except h2.exceptions.ProtocolError as err:
        return int(err.error_code)
    for kind, _, stream, payload in parse(conn.data_to_send()):
        if kind == f.RST_STREAM and stream == 1:
            return int.from_bytes(payload[:4], "big")
    return 0


def _relay_frames(path: str, data: bytes) -> list[tuple[int, int, bytes]]:
    """The frames the relay answers ``data`` + a PING with, up to the PING's answer:
    ``(type, stream id, payload)``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        return _relay_frames_on(sock, data)


async def _relay_before_a_silent_runtime(
    nursery: trio.Nursery, short_tmp: Path
) -> tuple[str, socket.socket, Relay]:
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a runtime that never answers
    silent.bind(str(short_tmp / "silent.sock"))
    silent.listen(4)
    relay = Relay()
    await nursery.start(relay.run)
    listen = await serve_relay_to(nursery, relay, str(short_tmp / "silent.sock"), str(short_tmp), [PATH])
    return listen, silent, relay


async def _relay_before_no_runtime(nursery: trio.Nursery, short_tmp: Path) -> str:
    """A relay whose runtime is unreachable (its socket closed): it answers every call UNAVAILABLE
    itself. The relay's socket."""
    listen, silent, _ = await _relay_before_a_silent_runtime(nursery, short_tmp)
    silent.close()
    return listen


@pytest.mark.parametrize("case", sorted(STREAM_CASES))
async def test_a_stream_error_resets_only_that_stream(
    nursery: trio.Nursery, short_tmp: Path, case: str
) -> None:
    """RST_STREAM with the RFC's code on stream 1, no GOAWAY: the connection still answers."""
    body, expected = STREAM_CASES[case]
    data = _after_preface(body)
    listen, silent, _ = await _relay_before_a_silent_runtime(nursery, short_tmp)
    try:
        seen = await trio.to_thread.run_sync(_relay_frames, listen, data)
    finally:
        silent.close()
    resets = [(stream, int.from_bytes(p, "big")) for kind, stream, p in seen if kind == f.RST_STREAM]
    assert H2_STREAM_DIFFERS.get(case, expected) == _h2_code(data)
    assert ([(1, expected)], []) == (resets, [kind for kind, _, _ in seen if kind == f.GOAWAY])
    assert any(kind == f.PING for kind, _, _ in seen)


async def test_window_update_and_priority_on_half_closed_stream(
    nursery: trio.Nursery, short_tmp: Path
) -> None:
    """A request ended with its HEADERS (half-closed, remote) may still get WINDOW_UPDATE and
    PRIORITY frames (RFC 9113 §5.1): no reset, no GOAWAY."""
    listen, silent, _ = await _relay_before_a_silent_runtime(nursery, short_tmp)
    data = _after_preface(
        _open(*GOOD, end=True),
        f.window_update(1, 1),
        f.frame(f.PRIORITY, 0, 1, b"\x00\x00\x00\x00\xff"),
    )
    try:
        seen = await trio.to_thread.run_sync(_relay_frames, listen, data)
    finally:
        silent.close()
    assert [] == [kind for kind, _, _ in seen if kind in (f.RST_STREAM, f.GOAWAY)]
    assert any(kind == f.PING for kind, _, _ in seen)


async def test_data_on_a_closed_stream_is_refused_unless_we_reset_it(
    nursery: trio.Nursery, short_tmp: Path
) -> None:
    """Before an unreachable runtime the relay answers each call at once. Stream 1 ends both
    ways; stream 3 is answered before the caller ended it, so the relay resets it (NO_ERROR).
    DATA on 3 then was on its way before the caller saw that reset: ignored (RFC 9113 §5.1),
    never a reason to end kubelet's connection. DATA on 1 is on a closed stream: RST_STREAM
    STREAM_CLOSED (§6.1). The connection still answers a PING."""
    listen = await _relay_before_no_runtime(nursery, short_tmp)
    encoder = hpack.Encoder()
    message = b"\x00\x00\x00\x00\x00"
    data = _after_preface(
        f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 1, encoder.encode(list(GOOD))),
        f.frame(f.HEADERS, f.END_HEADERS, 3, encoder.encode(list(GOOD))),
        f.frame(f.DATA, 0, 3, message),
        f.frame(f.DATA, f.END_STREAM, 3, message),
        f.frame(f.DATA, f.END_STREAM, 1, message),
    )
    seen = await trio.to_thread.run_sync(_relay_frames, listen, data)
    resets = [(stream, int.from_bytes(p, "big")) for kind, stream, p in seen if kind == f.RST_STREAM]
    assert [(3, f.NO_ERROR), (1, f.STREAM_CLOSED)] == resets
    assert [] == [kind for kind, _, _ in seen if kind == f.GOAWAY]
    assert any(kind == f.PING for kind, _, _ in seen)


def _relay_frames_on(sock: socket.socket, data: bytes) -> list[tuple[int, int, bytes]]:
    sock.sendall(data + f.frame(f.PING, 0, 0, b"12345678"))
    seen = read_frames(sock, lambda seen: any(kind == f.PING and stream == 0 for kind, _, stream, _ in seen))
    return [(kind, stream, payload) for kind, _, stream, payload in seen]
