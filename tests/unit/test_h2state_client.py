"""krproxy.h2.connection in the client role (the relay's side facing containerd and hook
servers, which a buggy or hostile plugin controls), bytes in and bytes out."""

from __future__ import annotations

import pytest

from krproxy.h2 import _control as control
from krproxy.h2 import connection as core
from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2.connection import CONNECTION_WINDOW, Connection, LocalProtocolError, Role
from tests.unit.h2peer import (
    REQUEST,
    RESPONSE,
    block,
    client,
    data_frame,
    headers_frame,
    parse,
    resets,
    terminated,
)

TRAILERS = [(b"grpc-status", b"0")]


def _code(conn: Connection, data: bytes) -> int | None:
    end = terminated(conn.receive_data(data))
    return None if end is None else end.error_code


def test_the_client_starts_with_the_preface_and_disables_push() -> None:
    out = Connection(Role.CLIENT).data_to_send()
    assert out.startswith(f.PREFACE)
    settings = parse(out[len(f.PREFACE) :])[0]
    assert (f.ENABLE_PUSH, 0) in f.parse_settings(settings[3])


def test_a_call_goes_out_and_its_answer_comes_back() -> None:
    conn = client()
    stream_id = conn.start_stream(REQUEST)
    assert 1 == stream_id
    assert 5 == conn.send_data(stream_id, b"hello", end_stream=True)
    assert [(f.HEADERS, f.END_HEADERS), (f.DATA, f.END_STREAM)] == [
        fr[:2] for fr in parse(conn.data_to_send())
    ]
    wire = headers_frame(1, RESPONSE) + data_frame(1, b"answer") + headers_frame(1, TRAILERS, end=True)
    assert [
        ev.HeadersReceived(1, RESPONSE, False),
        ev.DataReceived(1, b"answer", 6, False),
        ev.HeadersReceived(1, TRAILERS, True),
    ] == conn.receive_data(wire)
    assert conn.streams[1].done
    assert 3 == conn.start_stream(REQUEST, end_stream=True)


def test_connection_credit_on_arrival_stream_credit_when_taken() -> None:
    """Connection credit comes back on arrival and stream credit when taken."""
    conn = client()
    conn.start_stream(REQUEST, end_stream=True)
    conn.data_to_send()
    chunk = b"x" * 16384
    conn.receive_data(headers_frame(1, RESPONSE) + b"".join(data_frame(1, chunk) for _ in range(200)))
    assert CONNECTION_WINDOW == conn.inflow.recv_window + conn.inflow.to_grant  # all of it granted back
    assert [] == [sid for k, _, sid, _ in parse(conn.data_to_send()) if k == f.WINDOW_UPDATE and sid]
    conn.acknowledge_received_data(1, 200 * 16384)
    assert [1] == [sid for k, _, sid, _ in parse(conn.data_to_send()) if k == f.WINDOW_UPDATE]


def test_streams_wait_for_the_peers_limit_100_until_settings() -> None:
    """Streams wait for the peers limit default 100 until its settings."""
    conn = Connection(Role.CLIENT)
    for _ in range(100):
        conn.start_stream(REQUEST, end_stream=True)
    assert not conn.can_start_stream()
    with pytest.raises(LocalProtocolError):
        conn.start_stream(REQUEST)
    conn.receive_data(f.settings([]))  # no limit stated: none
    assert conn.can_start_stream()
    conn.receive_data(f.settings([(f.MAX_CONCURRENT_STREAMS, 100)]))
    assert not conn.can_start_stream()
    conn.release_stream(1)
    assert conn.can_start_stream()


def test_streams_we_reset_hold_their_slots_until_released() -> None:
    # Rapid Reset from our side (a caller cancelling call after call), and MadeYouReset by a
    # server whose WINDOW_UPDATE of 0 makes us reset: the peer's limit still holds.
    conn = client(settings=f.settings([(f.MAX_CONCURRENT_STREAMS, 2)]))
    first = conn.start_stream(REQUEST)
    conn.reset_stream(first, f.CANCEL)
    second = conn.start_stream(REQUEST)
    events = conn.receive_data(f.window_update(second, 0))
    assert [ev.StreamReset(second, f.PROTOCOL_ERROR, remote=False)] == events
    assert not conn.can_start_stream()
    conn.release_stream(first)
    assert conn.can_start_stream()


@pytest.mark.parametrize("value", [0, 16383, 2**24])
def test_an_upstream_bad_max_frame_size_ends_the_connection(value: int) -> None:
    """An upstreams invalid max frame size ends the connection at once."""
    # CVE-2026-33814: a client that took it hung; here the connection ends and so its calls.
    conn = client()
    conn.start_stream(REQUEST, end_stream=True)
    assert _code(conn, f.settings([(f.MAX_FRAME_SIZE, value)])) == f.PROTOCOL_ERROR


@pytest.mark.parametrize("kind", range(0x0A, 0x10))
def test_unknown_frame_types_from_an_upstream_are_ignored(kind: int) -> None:
    conn = client()
    conn.start_stream(REQUEST, end_stream=True)
    wire = f.frame(kind, 0, 1, b"junk") + headers_frame(1, RESPONSE) + f.frame(kind, 0xFF, 0, b"")
    assert [ev.HeadersReceived(1, RESPONSE, False)] == conn.receive_data(wire)


def test_an_upstreams_continuation_flood_ends_the_connection() -> None:
    """A flood of tiny fields past the block limit: ENHANCE_YOUR_CALM at the skimmer's bound."""
    conn = client()
    conn.start_stream(REQUEST, end_stream=True)
    wire = f.frame(f.HEADERS, 0, 1, b"\x00" * 16384)
    wire += b"".join(
        f.frame(f.CONTINUATION, 0, 1, b"\x00" * 16384) for _ in range(core.MAX_HEADER_BLOCK // 16384)
    )
    assert _code(conn, wire) == f.ENHANCE_YOUR_CALM


def test_an_upstream_trailer_flood_keeps_the_first_trailers() -> None:
    """An upstreams trailer flood leaves the first trailers in force."""
    conn = client()
    conn.start_stream(REQUEST, end_stream=True)
    conn.receive_data(headers_frame(1, RESPONSE))
    flood = b"".join(headers_frame(1, [(b"grpc-status", str(i).encode())], end=True) for i in range(50))
    assert [ev.HeadersReceived(1, [(b"grpc-status", b"0")], True)] == conn.receive_data(flood)
    assert None is conn.terminated


@pytest.mark.parametrize(
    "wire",
    [
        f.frame(f.DATA, f.PADDED, 1, b"\x09abc"),
        f.frame(f.HEADERS, f.PRIORITY_FLAG | f.END_HEADERS, 1, b"\x00"),
        f.frame(f.SETTINGS, 0, 0, b"\x00" * 7),
        f.frame(f.PUSH_PROMISE, f.END_HEADERS, 1, b"\x00\x00\x00\x02" + block(REQUEST)),
    ],
    ids=["padding", "short-headers", "settings-length", "push-promise"],
)
def test_an_upstreams_malformed_frame_ends_the_connection(wire: bytes) -> None:
    conn = client()
    conn.start_stream(REQUEST, end_stream=True)
    assert _code(conn, wire) in (f.PROTOCOL_ERROR, f.FRAME_SIZE_ERROR)


def test_upstream_window_size_changes_again_end_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An upstreams repeated initial window size changes end the connection."""
    monkeypatch.setattr(control, "MAX_WINDOW_SHIFTS", 500)
    conn = client()
    for _ in range(50):
        conn.start_stream(REQUEST)
    flips = b"".join(f.settings([(f.INITIAL_WINDOW_SIZE, 70000 + i % 2)]) for i in range(11))
    assert _code(conn, flips) == f.ENHANCE_YOUR_CALM


def test_a_lowered_header_table_size_is_announced_next_request() -> None:
    """A lowered header table size is announced in the next request."""
    conn = client(settings=f.settings([(f.HEADER_TABLE_SIZE, 100)]))
    conn.start_stream(REQUEST, end_stream=True)
    conn.start_stream(REQUEST, end_stream=True)
    first, second = parse(conn.data_to_send())
    assert 0x20 == first[3][0]
    assert 0x20 != second[3][0]


def test_an_upstream_reset_is_reported_later_frames_ignored() -> None:
    """A reset from the upstream is reported and later frames ignored."""
    conn = client()
    conn.start_stream(REQUEST, end_stream=True)
    events = conn.receive_data(f.rst_stream(1, f.REFUSED_STREAM))
    assert [ev.StreamReset(1, f.REFUSED_STREAM, remote=True)] == events
    assert [] == conn.receive_data(headers_frame(1, RESPONSE) + data_frame(1, b"late"))
    assert {} == resets(conn.data_to_send())


def test_data_on_a_never_opened_stream_is_ignored_but_credited() -> None:
    """Data on a stream the client never opened is ignored but credited."""
    conn = client()
    assert [] == conn.receive_data(data_frame(7, b"x" * 100))
    assert 100 == conn.inflow.to_grant
    assert {} == resets(conn.data_to_send())


def test_a_goaway_refuses_the_streams_above_its_last_id() -> None:
    conn = client()
    for _ in range(3):
        conn.start_stream(REQUEST, end_stream=True)
    events = conn.receive_data(f.goaway(1, f.NO_ERROR))
    assert [ev.GoAwayReceived(1, f.NO_ERROR, b"", (3, 5))] == events
    assert not conn.streams[1].reset
    assert conn.streams[3].reset and conn.streams[5].reset
    assert conn.control.goaway_received


def test_releasing_a_goaway_refused_stream_reports_its_data() -> None:
    """Releasing a stream a goaway refused reports its queued data."""
    conn = client()
    stream_id = conn.start_stream(REQUEST)
    assert f.DEFAULT_WINDOW == conn.send_data(stream_id, b"x" * (f.DEFAULT_WINDOW + 10))
    conn.send_trailers(stream_id, TRAILERS)
    conn.receive_data(f.goaway(0, f.NO_ERROR))
    assert not conn.sender.blocked  # refused: no longer waiting for a window, its data still queued
    assert 10 == conn.release_stream(stream_id)
    assert 0 == conn.sender.buffered


def test_a_large_header_block_goes_out_in_continuations() -> None:
    """A header block beyond the peers frame size goes out in continuations."""
    conn = client()
    big = [*REQUEST, (b"x-big", b"v" * 40000)]
    conn.start_stream(big, end_stream=True)
    frames = [fr for fr in parse(conn.data_to_send()) if fr[0] in (f.HEADERS, f.CONTINUATION)]
    assert [(f.HEADERS, f.END_STREAM), (f.CONTINUATION, 0), (f.CONTINUATION, f.END_HEADERS)] == [
        fr[:2] for fr in frames
    ]
    assert all(len(fr[3]) <= f.DEFAULT_MAX_FRAME for fr in frames)
    assert f.encode_headers(big) == b"".join(fr[3] for fr in frames)


def test_a_second_answer_block_no_end_stream_resets_the_stream() -> None:
    """After the answer's headers, only trailers may come (RFC 9113 §8.1): a second block
    without END_STREAM is malformed, the stream's error, not a second answer to pass on."""
    conn = client()
    conn.start_stream(REQUEST, end_stream=True)
    conn.start_stream(REQUEST, end_stream=True)
    conn.data_to_send()
    events = conn.receive_data(
        headers_frame(1, RESPONSE) + data_frame(1, b"answer") + headers_frame(1, [(b"x-more", b"1")])
    )
    assert ev.StreamReset(1, f.PROTOCOL_ERROR, remote=False, unsent=0) == events[-1]
    assert {1: f.PROTOCOL_ERROR} == resets(conn.data_to_send())
    wire = headers_frame(3, RESPONSE) + headers_frame(3, TRAILERS, end=True)  # the other goes on
    assert [
        ev.HeadersReceived(3, RESPONSE, False),
        ev.HeadersReceived(3, TRAILERS, True),
    ] == conn.receive_data(wire)


def test_data_before_the_answers_headers_resets_that_stream() -> None:
    """An answer starts with its header block (RFC 9113 §8.1): DATA first is malformed, the
    stream's error, never passed on (a relay has no headers to send before it)."""
    conn = client()
    conn.start_stream(REQUEST, end_stream=True)
    conn.data_to_send()
    events = conn.receive_data(data_frame(1, b"answer") + headers_frame(1, TRAILERS, end=True))
    assert [ev.StreamReset(1, f.PROTOCOL_ERROR, remote=False, unsent=0)] == events
    assert {1: f.PROTOCOL_ERROR} == resets(conn.data_to_send())
    # Its connection credit came back.
    assert CONNECTION_WINDOW == conn.inflow.recv_window + conn.inflow.to_grant
