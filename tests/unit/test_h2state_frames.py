"""krproxy.h2.connection in the server role, bytes in and bytes out: settings, header blocks and
CONTINUATION, malformed frames, the decode budget and GOAWAY. No sockets."""

from __future__ import annotations

import hpack
import pytest

from krproxy.h2 import _control as control
from krproxy.h2 import connection as core
from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2.connection import Connection, LocalProtocolError, Role
from krproxy.h2.hpackskim import MAX_FIELDS
from tests.unit.h2peer import (
    REQUEST,
    RESPONSE,
    block,
    data_frame,
    headers_frame,
    kinds,
    parse,
    resets,
    server,
    terminated,
)
from tests.unit.test_h2state import _code, _open

# -- settings ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 16383, 2**24])
def test_an_invalid_max_frame_size_ends_the_connection(value: int) -> None:
    assert _code(server(), f.settings([(f.MAX_FRAME_SIZE, value)])) == f.PROTOCOL_ERROR


def test_the_largest_max_frame_size_is_taken() -> None:
    conn = server(settings=f.settings([(f.MAX_FRAME_SIZE, 2**24 - 1), (f.INITIAL_WINDOW_SIZE, 10**6)]))
    conn.receive_data(f.window_update(0, 10**6))
    _open(conn, 1)
    conn.send_headers(1, RESPONSE)
    conn.data_to_send()
    conn.send_data(1, b"x" * 100000)
    assert [100000] == [len(p) for _, _, _, p in parse(conn.data_to_send())]


@pytest.mark.parametrize(
    ("wire", "code"),
    [
        (f.frame(f.SETTINGS, 0, 0, b"\x00\x04\x00\x00"), f.FRAME_SIZE_ERROR),
        (f.frame(f.SETTINGS, f.ACK, 0, b"\x00" * 6), f.FRAME_SIZE_ERROR),
        (f.frame(f.SETTINGS, 0, 1, b""), f.PROTOCOL_ERROR),
        (f.settings([(f.INITIAL_WINDOW_SIZE, 2**31)]), f.FLOW_CONTROL_ERROR),
        (f.settings([(f.ENABLE_PUSH, 2)]), f.PROTOCOL_ERROR),
    ],
    ids=["length", "ack-payload", "on-stream", "window-max", "enable-push"],
)
def test_bad_settings_end_the_connection(wire: bytes, code: int) -> None:
    assert _code(server(), wire) == code


def test_unknown_settings_are_ignored() -> None:
    conn = server()
    assert [ev.SettingsChanged(((0x99, 5),))] == conn.receive_data(f.settings([(0x99, 5)]))


def test_initial_window_size_changes_adjust_open_streams() -> None:
    """Initial window size changes adjust open streams and may overflow one."""
    conn = server()
    _open(conn, 1)
    conn.receive_data(f.settings([(f.INITIAL_WINDOW_SIZE, 1000)]))
    assert 1000 == conn.streams[1].send_window
    conn.receive_data(f.window_update(1, f.MAX_WINDOW - 1000))
    assert _code(conn, f.settings([(f.INITIAL_WINDOW_SIZE, 1001)])) == f.FLOW_CONTROL_ERROR


def test_a_stream_reset_for_overflow_skips_later_window_changes() -> None:
    """A stream reset for its overflowed window is left out of later window changes."""
    # Its overflow was that stream's error (§6.9.1); a later SETTINGS change must not find the
    # dead window above 2^31-1 and end the connection (the h2 oracle's seed 1619 found it).
    conn = server()
    _open(conn, 1)
    _open(conn, 3)
    conn.receive_data(f.window_update(1, f.MAX_WINDOW))
    assert {1: f.FLOW_CONTROL_ERROR} == resets(conn.data_to_send())
    assert None is _code(conn, f.settings([(f.INITIAL_WINDOW_SIZE, 16383)]))
    assert 16383 == conn.streams[3].send_window


def test_repeated_initial_window_size_changes_end_the_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "MAX_WINDOW_SHIFTS", 1000)
    conn = server()
    for i in range(1, 200, 2):
        _open(conn, i)
    flips = b"".join(f.settings([(f.INITIAL_WINDOW_SIZE, 1000 + i % 2)]) for i in range(20))
    assert _code(conn, flips) == f.ENHANCE_YOUR_CALM
    conn = server()
    _open(conn, 1)
    assert None is _code(conn, flips)  # one stream: 20 shifts


def test_a_lowered_header_table_size_is_announced_next_block() -> None:
    """A lowered header table size is announced in the next block only."""
    conn = server(settings=f.settings([(f.HEADER_TABLE_SIZE, 0)]))
    _open(conn, 1)
    _open(conn, 3)
    conn.send_headers(1, RESPONSE)
    conn.send_headers(3, RESPONSE)
    (_, _, _, first), (_, _, _, second) = parse(conn.data_to_send())
    assert 0x20 == first[0]  # a dynamic table size update to 0
    assert second == first[1:]
    decoder = hpack.Decoder()
    decoder.header_table_size = 0  # a strict peer's decoder after lowering its table
    assert RESPONSE == decoder.decode(first, raw=True)


# -- frames ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", range(0x0A, 0x10))
def test_unknown_frame_types_are_ignored_outside_header_blocks(kind: int) -> None:
    """Unknown frame types are ignored but not inside a header block."""
    conn = server()
    wire = f.frame(kind, 0xFF, 0, b"?" * 30) + f.frame(kind, 0, 1, b"") + headers_frame(1)
    assert [ev.RequestReceived(1, REQUEST, False)] == conn.receive_data(wire)
    opened = f.frame(f.HEADERS, 0, 3, block(REQUEST))
    assert _code(conn, opened + f.frame(kind, 0, 3, b"")) == f.PROTOCOL_ERROR


def test_a_continuation_flood_ends_at_the_skim_bound() -> None:
    """A continuation flood of tiny fields past the block limit ends the connection once the
    skimmer's field bound is passed (ENHANCE_YOUR_CALM), not later."""
    conn = server()
    wire = f.frame(f.HEADERS, 0, 1, b"\x00" * 16384)
    wire += b"".join(
        f.frame(f.CONTINUATION, 0, 1, b"\x00" * 16384) for _ in range(core.MAX_HEADER_BLOCK // 16384)
    )
    end = terminated(conn.receive_data(wire))
    assert end is not None
    assert (f.ENHANCE_YOUR_CALM, f"header block of more than {MAX_FIELDS} fields") == (
        end.error_code,
        end.reason,
    )


def test_a_header_block_split_in_continuations_is_decoded_whole() -> None:
    conn = server()
    raw = block(REQUEST)
    wire = f.frame(f.HEADERS, 0, 1, raw[:3]) + f.frame(f.CONTINUATION, 0, 1, raw[3:6])
    wire += f.frame(f.CONTINUATION, f.END_HEADERS, 1, raw[6:])
    assert [ev.RequestReceived(1, REQUEST, False)] == conn.receive_data(wire)


@pytest.mark.parametrize(
    "wire",
    [
        f.frame(f.CONTINUATION, f.END_HEADERS, 1, b""),
        f.frame(f.HEADERS, 0, 1, b"") + f.frame(f.CONTINUATION, 0, 3, b""),
        f.frame(f.HEADERS, 0, 1, b"") + f.frame(f.PING, 0, 0, b"\x00" * 8),
    ],
    ids=["no-block", "other-stream", "interrupted"],
)
def test_a_continuation_out_of_place_ends_the_connection(wire: bytes) -> None:
    assert _code(server(), wire) == f.PROTOCOL_ERROR


@pytest.mark.parametrize(
    ("wire", "code"),
    [
        (f.frame(f.DATA, f.PADDED, 1, b"\x05abc"), f.PROTOCOL_ERROR),
        (f.frame(f.HEADERS, f.PADDED | f.END_HEADERS, 1, b"\x03ab"), f.PROTOCOL_ERROR),
        (f.frame(f.HEADERS, f.PRIORITY_FLAG | f.END_HEADERS, 1, b"\x00\x00\x00"), f.FRAME_SIZE_ERROR),
        (f.frame(f.HEADERS, f.END_HEADERS, 0, block(REQUEST)), f.PROTOCOL_ERROR),
        (f.frame(f.PING, 0, 0, b"\x00" * 7), f.FRAME_SIZE_ERROR),
        (f.frame(f.PING, 0, 1, b"\x00" * 8), f.PROTOCOL_ERROR),
        (f.frame(f.WINDOW_UPDATE, 0, 0, b"\x00\x00\x01"), f.FRAME_SIZE_ERROR),
        (f.frame(f.GOAWAY, 0, 0, b"\x00" * 7), f.FRAME_SIZE_ERROR),
        (f.frame(f.PUSH_PROMISE, f.END_HEADERS, 1, b"\x00\x00\x00\x02"), f.PROTOCOL_ERROR),
        (f.frame(f.DATA, 0, 1, b"x" * 16385), f.FRAME_SIZE_ERROR),
        (f.frame(f.HEADERS, f.END_HEADERS, 1, b"\xff\xff\xff"), f.COMPRESSION_ERROR),
    ],
    ids=[
        "data-padding",
        "headers-padding",
        "headers-short-priority",
        "headers-stream-0",
        "ping-length",
        "ping-on-stream",
        "window-update-length",
        "goaway-short",
        "push-promise",
        "oversized",
        "hpack",
    ],
)
def test_malformed_frames_end_the_connection(wire: bytes, code: int) -> None:
    assert _code(server(), wire) == code


def test_an_http1_answer_is_named() -> None:
    conn = Connection(Role.CLIENT)
    end = terminated(conn.receive_data(b"HTTP/1.1 400 Bad Request\r\n\r\n"))
    assert end is not None
    assert "speaks HTTP/1" in end.reason


def test_a_ping_is_answered() -> None:
    conn = server()
    assert [ev.PingReceived(b"12345678")] == conn.receive_data(f.frame(f.PING, 0, 0, b"12345678"))
    assert [(f.PING, f.ACK, 0, b"12345678")] == parse(conn.data_to_send())


def test_no_input_is_taken_after_the_connection_ended() -> None:
    conn = server()
    assert _code(conn, f.frame(f.PUSH_PROMISE, 0, 1, b"")) == f.PROTOCOL_ERROR
    assert [] == conn.receive_data(headers_frame(1))


# -- large header blocks -----------------------------------------------------------------


def test_a_block_beyond_the_decode_budget_makes_input_wait() -> None:
    """A block beyond the decode budget is handed out and input waits for it."""
    conn = server()
    conn.blocks.decode_budget = 100
    big = [*REQUEST, (b"x-big", b"v" * 200)]
    wire = headers_frame(1) + headers_frame(3, big) + data_frame(3, b"d")
    events = conn.receive_data(wire)
    assert ["RequestReceived", "HeaderBlockReceived"] == kinds(events)
    handed = events[-1]
    assert isinstance(handed, ev.HeaderBlockReceived)
    with pytest.raises(LocalProtocolError):
        conn.receive_data(b"")
    headers = conn.decode_block(handed.block)
    assert [ev.RequestReceived(3, big, False), ev.DataReceived(3, b"d", 1, False)] == conn.receive_headers(
        headers
    )


def test_an_undecodable_handed_out_block_ends_the_connection() -> None:
    conn = server()
    conn.blocks.decode_budget = 0
    events = conn.receive_data(f.frame(f.HEADERS, f.END_HEADERS, 1, b"\xff\xff\xff\xff"))
    handed = events[-1]
    assert isinstance(handed, ev.HeaderBlockReceived)
    end = terminated(conn.receive_headers(conn.decode_block(handed.block)))
    assert end is not None
    assert f.COMPRESSION_ERROR == end.error_code


# -- GOAWAY ------------------------------------------------------------------------------


def test_graceful_shutdown_refuses_streams_after_the_ping() -> None:
    """Graceful shutdown refuses streams after the ping round trip."""
    conn = server()
    _open(conn, 1)
    conn.announce_goaway()
    (goaway, ping) = parse(conn.data_to_send())
    assert (f.MAX_STREAM_ID, f.NO_ERROR) == f.parse_goaway(goaway[3])
    _open(conn, 3)  # on its way before the caller saw the GOAWAY: served
    conn.receive_data(f.frame(f.PING, f.ACK, 0, ping[3]))
    assert [(3, f.NO_ERROR)] == [
        f.parse_goaway(p) for k, _, _, p in parse(conn.data_to_send()) if k == f.GOAWAY
    ]
    assert [] == conn.receive_data(headers_frame(5))
    assert {5: f.REFUSED_STREAM} == resets(conn.data_to_send())


def test_a_goaway_from_the_caller_is_reported() -> None:
    conn = server()
    events = conn.receive_data(f.goaway(0, f.NO_ERROR, b"bye"))
    assert [ev.GoAwayReceived(0, f.NO_ERROR, b"bye", ())] == events


def test_data_fitting_the_windows_is_split_at_the_frame_size() -> None:
    """Data that fits the windows is still split at the peers frame size."""
    conn = server(settings=f.settings([(f.INITIAL_WINDOW_SIZE, 100000)]))
    conn.receive_data(f.window_update(0, 100000))
    _open(conn, 1)
    conn.send_headers(1, RESPONSE)
    conn.data_to_send()
    assert 20000 == conn.send_data(1, b"x" * 20000)
    assert [16384, 3616] == [len(p) for _, _, _, p in parse(conn.data_to_send())]


def test_resetting_a_stream_drops_its_queued_data() -> None:
    """Resetting a stream drops its queued data and a closed one is not reset."""
    conn = server(settings=f.settings([(f.INITIAL_WINDOW_SIZE, 0)]))
    _open(conn, 1)
    conn.send_headers(1, RESPONSE)
    conn.send_data(1, b"q" * 70)
    conn.data_to_send()
    assert 70 == conn.reset_stream(1, f.CANCEL)
    assert {1: f.CANCEL} == resets(conn.data_to_send())
    assert 0 == conn.sender.buffered
    _open(conn, 3, end=True)
    conn.send_headers(3, RESPONSE, end_stream=True)
    conn.data_to_send()
    assert 0 == conn.reset_stream(3, f.CANCEL)
    assert b"" == conn.data_to_send()
