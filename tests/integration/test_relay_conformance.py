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

from krproxy.fakes.containerd import FakeContainerd
from krproxy.h2 import frames as f
from krproxy.relay import Relay, connection
from tests.integration.support import LIVENESS_LIMIT, serve_relay_to, start_proxy, wait_until
from tests.unit.h2peer import Frame, parse, read_frames, split_frames

PATH = "/test.Conformance/Call"
VERSION = "/runtime.v1.RuntimeService/Version"


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


async def test_a_window_update_of_0_on_a_stream_resets_only_that_stream(
    nursery: trio.Nursery, short_tmp: Path
) -> None:
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


async def test_window_update_and_priority_on_a_half_closed_stream_are_accepted(
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


def _three_versions(
    listen: str, middle: list[tuple[bytes, bytes]]
) -> tuple[dict[int, str], dict[int, bytes]]:
    """Three Version calls on one connection, ``middle`` added to the headers of the second:
    how each stream ended, and the grpc-status of those answered."""
    fields = [(name.encode(), value.encode()) for name, value in _replaced(":path", VERSION)]
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
    )
    conn.initiate_connection()
    for stream_id, extra in ((1, []), (3, middle), (5, [])):
        conn.send_headers(stream_id, [*fields, *extra])
        conn.send_data(stream_id, b"\x00\x00\x00\x00\x00", end_stream=True)
    endings: dict[int, str] = {}
    statuses: dict[int, bytes] = {}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(LIVENESS_LIMIT)
        sock.connect(listen)
        sock.sendall(conn.data_to_send())
        while len(endings) < 3:
            data = sock.recv(65536)
            assert data, "the relay closed the connection"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.TrailersReceived):
                    statuses[event.stream_id] = dict(event.headers)[b"grpc-status"]
                elif isinstance(event, h2.events.StreamEnded):
                    endings[event.stream_id] = "ended"
                elif isinstance(event, h2.events.StreamReset):
                    endings[event.stream_id] = f.ERROR_NAMES[event.error_code]
                elif isinstance(event, h2.events.ConnectionTerminated):
                    raise AssertionError(f"GOAWAY {event.error_code!r}")
            sock.sendall(conn.data_to_send())
    return endings, statuses


@pytest.mark.parametrize(
    "field",
    [(b"x-id", b"a\x00b"), (b"x-id", b"a\r\nx-injected: 1"), (b"x-id", b"a\x01"), (b"x(id)", b"1")],
    ids=["nul", "crlf", "control", "separator-in-name"],
)
async def test_a_forbidden_octet_fails_its_own_stream_and_never_reaches_the_runtime(
    fake_containerd: tuple[FakeContainerd, str],
    nursery: trio.Nursery,
    sockdir: str,
    field: tuple[bytes, bytes],
) -> None:
    """Three Version calls on one connection, the middle one carrying a field RFC 9113 §8.2.1 (or
    grpc-go's framer) forbids: that stream is reset PROTOCOL_ERROR, the calls before and after it
    are answered, and the runtime sees those two only, never the field."""
    fake, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    endings, statuses = await trio.to_thread.run_sync(_three_versions, proxy.config.listen, [field])
    assert {1: "ended", 3: "PROTOCOL_ERROR", 5: "ended"} == endings
    assert {1: b"0", 5: b"0"} == statuses
    seen = fake.headers("Version")
    assert 2 == len(seen)
    assert [] == [headers for headers in seen if field[0].decode("latin-1") in dict(headers)]
    assert [] == fake.rejected


@pytest.mark.parametrize(("length", "answered"), [(b"5", True), (b"4", False), (b"6", False)])
async def test_a_content_length_the_data_does_not_match_never_reaches_the_runtime(
    fake_containerd: tuple[FakeContainerd, str],
    nursery: trio.Nursery,
    sockdir: str,
    length: bytes,
    answered: bool,
) -> None:
    """The middle of three Version calls (a 5-byte message each) declares a content-length: the
    right one is passed on and answered; a wrong one makes the request malformed (RFC 9113
    §8.1.1): that stream is reset PROTOCOL_ERROR and its message never reaches the runtime
    (which saw its headers, then a reset), the others go on."""
    fake, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    middle = [(b"content-length", length)]
    endings, statuses = await trio.to_thread.run_sync(_three_versions, proxy.config.listen, middle)
    assert {1: "ended", 3: "ended" if answered else "PROTOCOL_ERROR", 5: "ended"} == endings
    assert {1: b"0", 5: b"0", **({3: b"0"} if answered else {})} == statuses
    assert (3 if answered else 2) == len(fake.requests("Version"))


async def test_a_request_on_a_lower_stream_id_is_a_connection_error(
    nursery: trio.Nursery, short_tmp: Path
) -> None:
    """HEADERS opening stream 1 after stream 3 (RFC 9113 §5.1.1): GOAWAY PROTOCOL_ERROR, as h2
    says, instead of silence (the caller would wait for its deadline)."""
    encoder = hpack.Encoder()
    data = _after_preface(
        f.frame(f.HEADERS, f.END_HEADERS, 3, encoder.encode(list(GOOD))),
        f.frame(f.HEADERS, f.END_HEADERS, 1, encoder.encode(list(GOOD))),
    )
    listen, silent, _ = await _relay_before_a_silent_runtime(nursery, short_tmp)
    try:
        verdict = await trio.to_thread.run_sync(_relay_verdict, listen, data)
    finally:
        silent.close()
    assert f.PROTOCOL_ERROR == _h2_verdict(data) == verdict


async def test_a_lowered_header_table_size_is_acknowledged(nursery: trio.Nursery, short_tmp: Path) -> None:
    """A caller's SETTINGS_HEADER_TABLE_SIZE of 0: the relay's next header block starts with a
    dynamic table size update (RFC 7541 §4.2), which h2's decoder (as nghttp2's) insists on."""
    listen = await _relay_before_no_runtime(nursery, short_tmp)

    def call() -> list[object]:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 0})
        conn.send_headers(1, list(GOOD), end_stream=True)
        events: list[object] = []
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(listen)
            sock.sendall(conn.data_to_send())
            while not any(isinstance(e, h2.events.StreamEnded) for e in events):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                events += conn.receive_data(chunk)  # raises on a block without the update
                sock.sendall(conn.data_to_send())
        return events

    events = await trio.to_thread.run_sync(call)
    assert any(isinstance(e, h2.events.ResponseReceived) for e in events)


def test_never_indexed_fields_keep_their_flag() -> None:
    """A field the caller sent never-indexed (RFC 7541 §6.2.3) is passed on never-indexed."""
    block = hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(b"authorization", b"secret"), (b"a", b"b")])
    decoded = hpack.Decoder().decode(f.encode_headers(hpack.Decoder().decode(block, raw=True)), raw=True)
    assert [(b"authorization", b"secret"), (b"a", b"b")] == decoded
    assert [False, True] == [getattr(field, "indexable", True) for field in decoded]


async def test_a_connection_without_preface_is_closed(
    nursery: trio.Nursery, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that connects and never sends the preface is not kept forever."""
    monkeypatch.setattr("krproxy.relay.connection.HANDSHAKE_TIMEOUT", 0.3)
    listen = await _relay_before_no_runtime(nursery, short_tmp)

    def idle() -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(listen)
            received = b""
            while chunk := sock.recv(65536):  # the relay's SETTINGS, then the end
                received += chunk
            return received

    received = await trio.to_thread.run_sync(idle)
    assert f.SETTINGS == f.HEAD.unpack_from(received, 0)[2]


async def test_connections_beyond_the_cap_are_closed(
    nursery: trio.Nursery, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With MAX_CONNECTIONS open, one more is closed at once; the open ones still answer."""
    monkeypatch.setattr("krproxy.relay.relay.MAX_CONNECTIONS", 2)
    listen = await _relay_before_no_runtime(nursery, short_tmp)

    def three() -> tuple[bool, bool]:
        socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
        try:
            for sock in socks[:2]:
                sock.settimeout(10)
                sock.connect(listen)
                sock.recv(65536)  # its SETTINGS: accepted and served
            third = socks[2]
            third.settimeout(10)
            third.connect(listen)
            closed = third.recv(65536) == b""
            frames = _relay_frames_on(socks[0], _after_preface())
            return closed, any(kind == f.PING for kind, _, _ in frames)
        finally:
            for sock in socks:
                sock.close()

    assert (True, True) == await trio.to_thread.run_sync(three)


def _relay_frames_on(sock: socket.socket, data: bytes) -> list[tuple[int, int, bytes]]:
    sock.sendall(data + f.frame(f.PING, 0, 0, b"12345678"))
    seen = read_frames(sock, lambda seen: any(kind == f.PING and stream == 0 for kind, _, stream, _ in seen))
    return [(kind, stream, payload) for kind, _, stream, payload in seen]


async def test_shutdown_sends_the_two_step_goaway(nursery: trio.Nursery, short_tmp: Path) -> None:
    """RFC 9113 §6.8: GOAWAY with the largest id and a PING; a stream opened before the PING's
    answer is still taken; after the answer GOAWAY names it as the last, and a later stream is
    refused (REFUSED_STREAM: the caller sends it again elsewhere)."""
    listen, silent, relay = await _relay_before_a_silent_runtime(nursery, short_tmp)
    encoder = hpack.Encoder()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    unread: list[Frame] = []  # read from the socket, not yet looked at
    buf = b""

    def read_until(kind: int) -> Frame:
        nonlocal buf
        while True:
            while unread:
                frame = unread.pop(0)
                if frame[0] == kind:
                    return frame
            chunk = sock.recv(65536)
            assert chunk, "the relay closed the connection"
            frames, buf = split_frames(buf + chunk)
            unread.extend(frames)

    try:
        await trio.to_thread.run_sync(sock.connect, listen)
        sock.sendall(_after_preface(f.frame(f.HEADERS, f.END_HEADERS, 1, encoder.encode(list(GOOD)))))
        await trio.to_thread.run_sync(read_until, f.SETTINGS)
        await wait_until(lambda: relay.in_flight == 1)
        relay.start_draining()
        _, _, _, first = await trio.to_thread.run_sync(read_until, f.GOAWAY)
        _, ping_flags, _, ping = await trio.to_thread.run_sync(read_until, f.PING)
        # Stream 3 was on its way before we saw the GOAWAY: it is served.
        sock.sendall(f.frame(f.HEADERS, f.END_HEADERS, 3, encoder.encode(list(GOOD))))
        await wait_until(lambda: relay.in_flight == 2)
        sock.sendall(f.frame(f.PING, f.ACK, 0, ping))
        _, _, _, final = await trio.to_thread.run_sync(read_until, f.GOAWAY)
        sock.sendall(f.frame(f.HEADERS, f.END_HEADERS, 5, encoder.encode(list(GOOD))))
        _, _, stream, code = await trio.to_thread.run_sync(read_until, f.RST_STREAM)
    finally:
        sock.close()
        silent.close()
    assert (2**31 - 1, f.NO_ERROR) == f.parse_goaway(first)
    assert 0 == ping_flags & f.ACK
    assert (3, f.NO_ERROR) == f.parse_goaway(final)
    assert (5, f.REFUSED_STREAM) == (stream, int.from_bytes(code, "big"))


def _frames_until_eof(sock: socket.socket) -> list[Frame]:
    """Every frame the relay writes before it ends its side of the connection."""
    buf = b""
    while chunk := sock.recv(65536):
        buf += chunk
    frames, rest = split_frames(buf)
    assert b"" == rest
    return frames


async def _drained_to_the_final_goaway(
    relay: Relay, listen: str, drained: trio.Event, nursery: trio.Nursery
) -> socket.socket:
    """A caller connection with no call, through the two-step GOAWAY of a stop (the PING answered),
    up to the relay's end of writing; ``drained`` is set when :meth:`Relay.wait_drained` returns."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(LIVENESS_LIMIT)
    await trio.to_thread.run_sync(sock.connect, listen)
    seen = await trio.to_thread.run_sync(_relay_frames_on, sock, _after_preface())
    assert any(kind == f.SETTINGS for kind, _, _ in seen)
    relay.start_draining()

    async def stop() -> None:
        await relay.wait_drained()
        drained.set()

    nursery.start_soon(stop)
    ping = next(
        p
        for kind, flags, _, p in await trio.to_thread.run_sync(read_frames, sock, _has_ping)
        if kind == f.PING
    )
    sock.sendall(f.frame(f.PING, f.ACK, 0, ping))
    frames = await trio.to_thread.run_sync(_frames_until_eof, sock)
    assert [(0, f.NO_ERROR)] == [f.parse_goaway(p) for kind, _, _, p in frames if kind == f.GOAWAY]
    return sock


def _has_ping(seen: list[Frame]) -> bool:
    return any(kind == f.PING and not flags & f.ACK for kind, flags, _, _ in seen)


async def test_a_drained_connection_takes_what_the_caller_still_sends_until_it_closes(
    nursery: trio.Nursery, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After its final GOAWAY the relay ends only its own side of a caller's connection and reads
    on (a lingering close): a caller that opened a stream just before it read the GOAWAY can still
    write it, then read the GOAWAY that says the stream was not processed, and send it again
    elsewhere. A close at once failed that write with EPIPE, and grpcio failed the call UNAVAILABLE
    ("Stream removed (sendmsg: Broken pipe)") instead of retrying it, in test_relay_restart."""
    monkeypatch.setattr(connection, "LINGER", 10 * LIVENESS_LIMIT)  # only the caller's close ends it
    listen, silent, relay = await _relay_before_a_silent_runtime(nursery, short_tmp)
    drained = trio.Event()
    try:
        sock = await _drained_to_the_final_goaway(relay, listen, drained, nursery)
        with sock:
            # The relay has written its last byte; the caller's late stream is still taken in.
            sock.sendall(
                f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 1, hpack.Encoder().encode(list(GOOD)))
            )
            sock.sendall(f.frame(f.PING, 0, 0, b"late-one"))
            await trio.sleep(0.05)
            assert not drained.is_set()  # the relay waits for the caller to close
        with trio.fail_after(LIVENESS_LIMIT):
            await drained.wait()
        assert 0 == relay.in_flight  # the late stream, above the last id, never became a call
    finally:
        silent.close()


async def test_a_drained_connection_the_caller_keeps_open_is_closed_after_the_linger(
    nursery: trio.Nursery, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lingering close is bounded: a caller that neither closes nor stops writing does not
    hold the stop up beyond connection.LINGER."""
    monkeypatch.setattr(connection, "LINGER", 0.2)
    listen, silent, relay = await _relay_before_a_silent_runtime(nursery, short_tmp)
    drained = trio.Event()
    try:
        sock = await _drained_to_the_final_goaway(relay, listen, drained, nursery)
        with sock:
            with trio.fail_after(LIVENESS_LIMIT):
                while not drained.is_set():
                    try:
                        sock.sendall(f.frame(f.PING, 0, 0, b"12345678"))
                    except OSError:  # the relay closed it at the bound (EPIPE, ECONNRESET) ...
                        break
                    await trio.sleep(0.01)
                await drained.wait()  # ... and the stop's wait for it ends
            with pytest.raises(OSError):  # closed, not merely quiet
                for _ in range(100):
                    sock.sendall(f.frame(f.PING, 0, 0, b"12345678"))
    finally:
        silent.close()


async def test_a_linger_begun_before_the_reader_ran_keeps_its_bound(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection drained before its reader task first ran (accepted just as the stop began)
    lingers LINGER, not the preface's HANDSHAKE_TIMEOUT, which run() would otherwise set."""
    monkeypatch.setattr(connection, "LINGER", 0.2)
    monkeypatch.setattr(connection, "HANDSHAKE_TIMEOUT", 10 * LIVENESS_LIMIT)
    relay = Relay()
    await nursery.start(relay.run)
    ours, caller = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with caller:
        ep = connection.Endpoint(relay, ours, server_side=True)
        ep.announce_goaway()
        ep.final_goaway()  # no call on it: written out, then the linger
        assert ep.lingering
        with trio.fail_after(LIVENESS_LIMIT):
            await ep.run()
        assert not ep.lingering
        assert -1 == ours.fileno()
