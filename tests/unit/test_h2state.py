"""krproxy.h2.connection in the server role, bytes in and bytes out: stream, window, settings
and GOAWAY rules, and the attack classes of issue 24 that a caller can mount. No sockets."""

from __future__ import annotations

import pytest

from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2.connection import ADVERTISED_HEADER_LIST, CONNECTION_WINDOW, STREAM_WINDOW, Connection, Role
from tests.unit.h2peer import (
    REQUEST,
    RESPONSE,
    block,
    data_frame,
    goaway_code,
    headers_frame,
    parse,
    resets,
    server,
    terminated,
    window_updates,
)


def _open(conn: Connection, stream_id: int = 1, end: bool = False) -> None:
    events = conn.receive_data(headers_frame(stream_id, end=end))
    assert [ev.RequestReceived(stream_id, REQUEST, end)] == events


def _code(conn: Connection, data: bytes) -> int | None:
    """The connection error ``data`` is (the GOAWAY's code), None if it is none."""
    end = terminated(conn.receive_data(data))
    if end is None:
        return None
    assert end.error_code == goaway_code(conn.data_to_send())
    return end.error_code


# -- the start ---------------------------------------------------------------------------


def test_the_server_writes_its_settings_and_acks_the_peers() -> None:
    """The server writes its settings and connection window and acknowledges the peers."""
    conn = Connection(Role.SERVER, max_concurrent_streams=7)
    first = parse(conn.data_to_send())
    assert (f.SETTINGS, 0, 0) == first[0][:3]
    assert {
        (f.INITIAL_WINDOW_SIZE, STREAM_WINDOW),
        (f.MAX_CONCURRENT_STREAMS, 7),
        (f.MAX_HEADER_LIST_SIZE, ADVERTISED_HEADER_LIST),
    } == set(f.parse_settings(first[0][3]))
    assert [(0, CONNECTION_WINDOW - f.DEFAULT_WINDOW)] == window_updates(conn.data_to_send() or b"") + [
        (sid, f.parse_u32(p)) for kind, _, sid, p in first if kind == f.WINDOW_UPDATE
    ]
    events = conn.receive_data(f.PREFACE + f.settings([(f.MAX_FRAME_SIZE, 20000)]))
    assert [ev.SettingsChanged(((f.MAX_FRAME_SIZE, 20000),))] == events
    assert [(f.SETTINGS, f.ACK, 0, b"")] == parse(conn.data_to_send())
    assert conn.preface_received


def test_a_wrong_preface_ends_the_connection() -> None:
    conn = Connection(Role.SERVER)
    assert _code(conn, b"GET / HTTP/1.1\r\n\r\n") == f.PROTOCOL_ERROR
    conn = Connection(Role.SERVER)
    assert [] == conn.receive_data(f.PREFACE[:10])
    assert not conn.preface_received


# -- streams -----------------------------------------------------------------------------


def test_a_request_and_data_arrive_as_events_split_anywhere() -> None:
    """A request and its data arrive as events and a frame split anywhere waits."""
    conn = server()
    wire = headers_frame(1) + data_frame(1, b"hello", end=True)
    events = []
    for i in range(len(wire)):
        events += conn.receive_data(wire[i : i + 1])
    assert [ev.RequestReceived(1, REQUEST, False), ev.DataReceived(1, b"hello", 5, True)] == events


def test_stepwise_input_stops_after_each_frames_events() -> None:
    """A driver that answers stream 1 and resets it (NO_ERROR) on its RequestReceived, before the
    core has read on: the DATA that followed in the same read meets a reset stream (ignored,
    §5.1), not a live one, and the RST_STREAM goes out before anything the later frames cause."""
    conn = Connection(Role.SERVER, stepwise=True)
    conn.receive_data(f.PREFACE + f.settings([]))
    conn.data_to_send()
    wire = headers_frame(1) + data_frame(1, b"hello", end=True) + f.frame(f.PING, 0, 0, b"12345678")
    assert [ev.RequestReceived(1, REQUEST, False)] == conn.receive_data(wire)
    assert conn.input_left
    conn.send_headers(1, RESPONSE, end_stream=True)
    conn.reset_stream(1, f.NO_ERROR)
    # The DATA meets a stream we reset: ignored, no event; the PING's comes next.
    assert [ev.PingReceived(b"12345678")] == conn.receive_data(b"")
    assert [(f.HEADERS, 1), (f.RST_STREAM, 1), (f.PING, 0)] == [
        (kind, sid) for kind, _, sid, _ in parse(conn.data_to_send())
    ]
    assert not conn.input_left
    assert [] == conn.receive_data(b"")


def _whole(max_streams: int | None = 1000) -> Connection:
    """A server connection reading stepwise with whole requests, past the client's preface."""
    conn = Connection(Role.SERVER, stepwise=True, whole_requests=True, max_concurrent_streams=max_streams)
    conn.receive_data(f.PREFACE + f.settings([]))
    conn.data_to_send()
    return conn


def test_a_whole_request_is_read_in_one_step() -> None:
    """With whole_requests, a request's HEADERS and the DATA frame ending it right after are read
    in one step: the RequestReceived carries the DATA's event, the stream's state and windows as
    if the two were read one after the other; the next frame waits."""
    conn = _whole()
    wire = headers_frame(1) + data_frame(1, b"hello", end=True) + f.frame(f.PING, 0, 0, b"12345678")
    body = ev.DataReceived(1, b"hello", 5, True)
    assert [ev.RequestReceived(1, REQUEST, False, body)] == conn.receive_data(wire)
    stream = conn.streams[1]
    assert (True, STREAM_WINDOW - 5) == (stream.recv_ended, stream.recv_window)
    assert CONNECTION_WINDOW - 5 == conn.inflow.recv_window
    assert [ev.PingReceived(b"12345678")] == conn.receive_data(b"")
    conn.acknowledge_received_data(1, 5)  # as for a DataReceived: the credit is the consumer's
    assert 5 == conn.inflow.to_grant
    _open(conn, 3, end=True)  # a request without a body: no DATA to carry
    events = conn.receive_data(headers_frame(5) + data_frame(5, b"", end=True))
    assert [ev.RequestReceived(5, REQUEST, False, ev.DataReceived(5, b"", 0, True))] == events


def test_a_request_read_whole_only_with_its_ending_data() -> None:
    """DATA not ending the stream, padded, of another stream or not yet whole is read as
    before, in a step of its own; so is every request without whole_requests."""
    conn = _whole()
    padded = f.frame(f.DATA, f.PADDED | f.END_STREAM, 3, b"\x02hi\x00\x00")
    cases = [
        (1, data_frame(1, b"ab"), ev.DataReceived(1, b"ab", 2, False)),
        (3, padded, ev.DataReceived(3, b"hi", 5, True)),
        (5, headers_frame(7) + data_frame(5, b"x", end=True), ev.RequestReceived(7, REQUEST, False)),
    ]
    for stream_id, after, then in cases:
        assert [ev.RequestReceived(stream_id, REQUEST, False)] == conn.receive_data(
            headers_frame(stream_id) + after
        )
        assert [then] == conn.receive_data(b"")
    assert [ev.DataReceived(5, b"x", 1, True)] == conn.receive_data(b"")
    wire = headers_frame(9) + data_frame(9, b"hello", end=True)
    assert [ev.RequestReceived(9, REQUEST, False)] == conn.receive_data(wire[:-1])
    assert [ev.DataReceived(9, b"hello", 5, True)] == conn.receive_data(wire[-1:])
    plain = Connection(Role.SERVER, stepwise=True)
    plain.receive_data(f.PREFACE + f.settings([]))
    wire = headers_frame(1) + data_frame(1, b"hello", end=True)
    assert [ev.RequestReceived(1, REQUEST, False)] == plain.receive_data(wire)
    assert [ev.DataReceived(1, b"hello", 5, True)] == plain.receive_data(b"")


def test_a_whole_requests_data_breaking_a_rule() -> None:
    """The DATA read with its HEADERS is held to the rules as if read alone: DATA other than its
    content-length resets the stream in the same step, DATA beyond the connection window ends
    the connection; the RequestReceived carries no body then."""
    conn = _whole()
    fields = [*REQUEST, (b"content-length", b"3")]
    events = conn.receive_data(headers_frame(1, fields) + data_frame(1, b"hello", end=True))
    assert [ev.RequestReceived(1, fields, False), ev.StreamReset(1, f.PROTOCOL_ERROR, False)] == events
    assert {1: f.PROTOCOL_ERROR} == resets(conn.data_to_send())
    conn = Connection(Role.SERVER, stepwise=True, whole_requests=True, connection_window=f.DEFAULT_WINDOW)
    conn.receive_data(f.PREFACE + f.settings([]))
    big = b"x" * 16_000
    wire = b"".join(headers_frame(i) + data_frame(i, big, end=True) for i in (1, 3, 5, 7, 9))
    events = []
    while True:
        events += conn.receive_data(wire)
        wire = b""
        if not conn.input_left:
            break
    assert ev.RequestReceived(9, REQUEST, False) == events[-2]
    end = terminated(events)
    assert end is not None and f.FLOW_CONTROL_ERROR == end.error_code


def test_an_even_or_non_increasing_stream_id_ends_the_connection() -> None:
    """An even stream id or one not above the last ends the connection."""
    assert _code(server(), headers_frame(2)) == f.PROTOCOL_ERROR
    conn = server()
    _open(conn, 5)
    assert _code(conn, headers_frame(3)) == f.PROTOCOL_ERROR


def test_late_headers_of_a_stream_we_reset_are_ignored() -> None:
    conn = server()
    _open(conn, 1)
    conn.reset_stream(1, f.CANCEL)
    conn.release_stream(1)
    assert [] == conn.receive_data(headers_frame(1, end=True))
    assert None is conn.terminated


def test_a_stream_beyond_the_advertised_limit_is_refused() -> None:
    conn = server(max_streams=2)
    _open(conn, 1)
    _open(conn, 3)
    assert [] == conn.receive_data(headers_frame(5))
    assert {5: f.REFUSED_STREAM} == resets(conn.data_to_send())
    conn.release_stream(1)
    _open(conn, 7)


def test_rapid_reset_streams_hold_their_slots_until_released() -> None:
    """Rapid reset streams the caller resets hold their slots until released."""
    # CVE-2023-44487: open and reset at once, again and again. The slot is the driver's until
    # the work for the stream is over, so resets never let more streams run than advertised.
    conn = server(max_streams=10)
    wire = b"".join(headers_frame(i) + f.rst_stream(i, f.CANCEL) for i in range(1, 41, 2))
    events = conn.receive_data(wire)
    assert 10 == sum(isinstance(e, ev.RequestReceived) for e in events)
    assert 10 == sum(isinstance(e, ev.StreamReset) and e.remote for e in events)
    assert set(range(21, 41, 2)) == set(resets(conn.data_to_send()))  # refused
    assert 10 == len(conn.streams)


def test_made_you_reset_streams_hold_their_slots() -> None:
    """Made you reset streams we reset for the callers errors hold their slots."""
    # CVE-2025-8671: frames that make the server reset the stream (here WINDOW_UPDATE of 0).
    conn = server(max_streams=10)
    wire = b"".join(headers_frame(i) + f.window_update(i, 0) for i in range(1, 41, 2))
    events = conn.receive_data(wire)
    assert 10 == sum(isinstance(e, ev.RequestReceived) for e in events)
    assert [ev.StreamReset(i, f.PROTOCOL_ERROR, remote=False) for i in range(1, 21, 2)] == [
        e for e in events if isinstance(e, ev.StreamReset)
    ]
    out = resets(conn.data_to_send())
    assert {i: f.REFUSED_STREAM for i in range(21, 41, 2)} == {i: c for i, c in out.items() if i > 20}
    assert 10 == len(conn.streams)


@pytest.mark.parametrize(
    "headers",
    [
        [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"")],
        [(b":method", b"POST"), (b":scheme", b"http")],
        [*REQUEST, (b"connection", b"close")],
        [*REQUEST, (b"content-length", b"x")],
    ],
    ids=["empty-path", "no-path", "connection-specific", "content-length-nan"],
)
def test_a_malformed_request_is_a_stream_error(headers: list[tuple[bytes, bytes]]) -> None:
    conn = server()
    assert [] == conn.receive_data(headers_frame(1, headers))
    assert {1: f.PROTOCOL_ERROR} == resets(conn.data_to_send())
    _open(conn, 3)  # the connection goes on


def test_malformed_requests_pass_when_checks_are_off() -> None:
    conn = Connection(Role.SERVER, check_request_headers=False)
    conn.receive_data(f.PREFACE + f.settings([]))
    headers = [(b":method", b"POST"), (b":path", b"")]
    assert [ev.RequestReceived(1, headers, True)] == conn.receive_data(headers_frame(1, headers, end=True))


def test_a_stream_depending_on_itself_is_a_stream_error() -> None:
    conn = server()
    payload = (1).to_bytes(4, "big") + b"\x10" + block(REQUEST)
    assert [] == conn.receive_data(f.frame(f.HEADERS, f.END_HEADERS | f.PRIORITY_FLAG, 1, payload))
    assert {1: f.PROTOCOL_ERROR} == resets(conn.data_to_send())
    assert [] == conn.receive_data(f.frame(f.PRIORITY, 0, 3, (3).to_bytes(4, "big") + b"\x10"))
    assert {3: f.PROTOCOL_ERROR} == resets(conn.data_to_send())
    assert [] == conn.receive_data(f.frame(f.PRIORITY, 0, 5, b"\x00\x00\x00\x01"))  # 4 bytes, not 5
    assert {5: f.FRAME_SIZE_ERROR} == resets(conn.data_to_send())
    assert _code(conn, f.frame(f.PRIORITY, 0, 0, b"\x00" * 5)) == f.PROTOCOL_ERROR


def test_data_beyond_content_length_is_a_stream_error() -> None:
    """Data other than the content length is a stream error and not passed on."""
    conn = server()
    headers = [*REQUEST, (b"content-length", b"3")]
    conn.receive_data(headers_frame(1, headers))
    events = conn.receive_data(data_frame(1, b"four", end=True))
    assert [ev.StreamReset(1, f.PROTOCOL_ERROR, remote=False)] == events  # no DataReceived
    assert {1: f.PROTOCOL_ERROR} == resets(conn.data_to_send())
    assert 4 == conn.inflow.to_grant  # its connection credit came back
    conn.receive_data(headers_frame(3, [*REQUEST, (b"content-length", b"3")], end=True))
    assert {3: f.PROTOCOL_ERROR} == resets(conn.data_to_send())


def test_data_on_a_half_closed_or_closed_stream_resets_it() -> None:
    """Data on a half closed stream resets it and on a closed one too."""
    conn = server()
    _open(conn, 1, end=True)
    events = conn.receive_data(data_frame(1, b"x"))
    assert [ev.StreamReset(1, f.STREAM_CLOSED, remote=False)] == events
    assert {1: f.STREAM_CLOSED} == resets(conn.data_to_send())
    _open(conn, 3)
    conn.receive_data(f.rst_stream(3, f.CANCEL))
    assert [] == conn.receive_data(data_frame(3, b"x"))  # the peer reset it: closed
    assert {3: f.STREAM_CLOSED} == resets(conn.data_to_send())


def test_data_in_flight_on_a_reset_stream_is_ignored() -> None:
    """Data in flight on a stream we reset is ignored and on an idle one ends the connection."""
    conn = server()
    _open(conn, 1)
    conn.reset_stream(1, f.CANCEL)
    conn.data_to_send()
    assert [] == conn.receive_data(data_frame(1, b"late"))
    assert b"" == conn.data_to_send()
    assert _code(conn, data_frame(9, b"x")) == f.PROTOCOL_ERROR


def test_a_second_header_block_no_end_stream_ends_connection() -> None:
    """A second header block without end stream ends the connection."""
    conn = server()
    _open(conn, 1)
    assert _code(conn, headers_frame(1, [(b"x-a", b"1")])) == f.PROTOCOL_ERROR


def test_a_trailer_flood_is_one_stream_error() -> None:
    conn = server()
    _open(conn, 1)
    trailers = [(b"x-trailer", b"1")]
    events = conn.receive_data(b"".join(headers_frame(1, trailers, end=True) for _ in range(50)))
    assert [ev.TrailersReceived(1, trailers), ev.StreamReset(1, f.STREAM_CLOSED, remote=False)] == events
    assert [(f.RST_STREAM, 0, 1, b"\x00\x00\x00\x05")] == parse(conn.data_to_send())
    assert None is conn.terminated


def test_trailers_with_a_pseudo_header_are_a_stream_error() -> None:
    conn = server()
    _open(conn, 1)
    events = conn.receive_data(headers_frame(1, [(b":path", b"/")], end=True))
    assert [ev.StreamReset(1, f.PROTOCOL_ERROR, remote=False)] == events


@pytest.mark.parametrize("kind", [f.RST_STREAM, f.WINDOW_UPDATE])
def test_reset_or_window_update_on_idle_stream_ends_connection(kind: int) -> None:
    """Reset or window update on an idle stream ends the connection."""
    assert _code(server(), f.frame(kind, 0, 1, b"\x00\x00\x00\x01")) == f.PROTOCOL_ERROR


# -- flow control ------------------------------------------------------------------------


def test_received_data_is_credited_only_when_acknowledged() -> None:
    conn = server()
    _open(conn, 1)
    chunk = b"x" * 16384
    conn.receive_data(b"".join(data_frame(1, chunk) for _ in range(80)))
    assert [] == window_updates(conn.data_to_send())  # nothing taken yet
    for _ in range(80):
        conn.acknowledge_received_data(1, len(chunk))
    updates = window_updates(conn.data_to_send())
    assert sum(n for sid, n in updates if sid == 1) == STREAM_WINDOW // 4 * (
        80 * 16384 // (STREAM_WINDOW // 4)
    )
    assert all(n >= STREAM_WINDOW // 4 for sid, n in updates if sid == 1)


def test_data_beyond_a_window_ends_the_connection() -> None:
    conn = Connection(Role.SERVER, stream_window=100, connection_window=65535)
    conn.receive_data(f.PREFACE + f.settings([]))
    _open(conn, 1)
    assert _code(conn, data_frame(1, b"x" * 101)) == f.FLOW_CONTROL_ERROR
    conn = Connection(Role.SERVER, connection_window=65535)
    conn.receive_data(f.PREFACE + f.settings([]))
    _open(conn, 1)
    assert None is _code(conn, b"".join(data_frame(1, b"x" * 16383) for _ in range(4)))
    assert _code(conn, data_frame(1, b"x" * 4)) == f.FLOW_CONTROL_ERROR


def test_padding_is_credited_at_once() -> None:
    conn = Connection(Role.SERVER, stream_window=8, connection_window=65535)  # grant at 2 bytes
    conn.receive_data(f.PREFACE + f.settings([]))
    _open(conn, 1)
    events = conn.receive_data(f.frame(f.DATA, f.PADDED, 1, b"\x02ab\x00\x00"))
    assert [ev.DataReceived(1, b"ab", 5, False)] == events
    assert (1, 3) in window_updates(conn.data_to_send())


def test_send_data_keeps_to_the_peers_windows_and_frame_size() -> None:
    conn = server(settings=f.settings([(f.INITIAL_WINDOW_SIZE, 40000)]))
    _open(conn, 1)
    conn.send_headers(1, RESPONSE)
    conn.data_to_send()
    assert 40000 == conn.send_data(1, b"x" * 50000, end_stream=True)
    frames = parse(conn.data_to_send())
    assert [16384, 16384, 7232] == [len(p) for kind, _, _, p in frames]
    assert all(flags == 0 for _, flags, _, _ in frames)
    assert 10000 == conn.sender.buffered
    events = conn.receive_data(f.window_update(1, 20000))
    assert [ev.DataSent(1, 10000, True)] == events
    assert [(f.DATA, f.END_STREAM, 1)] == [fr[:3] for fr in parse(conn.data_to_send())]
    assert 0 == conn.sender.buffered


def test_send_data_keeps_to_the_connection_window() -> None:
    conn = server(settings=f.settings([(f.INITIAL_WINDOW_SIZE, 100000)]))
    _open(conn, 1)
    conn.send_headers(1, RESPONSE)
    assert f.DEFAULT_WINDOW == conn.send_data(1, b"x" * 70000)
    assert [] == conn.receive_data(f.window_update(1, 1000))  # the connection's is spent
    assert [ev.DataSent(1, 70000 - f.DEFAULT_WINDOW, False)] == conn.receive_data(f.window_update(0, 10000))


def test_trailers_wait_for_the_data_queued_before_them() -> None:
    conn = server(settings=f.settings([(f.INITIAL_WINDOW_SIZE, 10)]))
    _open(conn, 1, end=True)
    conn.send_headers(1, RESPONSE)
    assert 10 == conn.send_data(1, b"y" * 30)
    conn.send_trailers(1, [(b"grpc-status", b"0")])
    assert [f.HEADERS, f.DATA] == [k for k, *_ in parse(conn.data_to_send())]
    assert [ev.DataSent(1, 20, True)] == conn.receive_data(f.window_update(1, 100))
    assert [(f.DATA, 0), (f.HEADERS, f.END_STREAM | f.END_HEADERS)] == [
        fr[:2] for fr in parse(conn.data_to_send())
    ]
    assert conn.streams[1].done


def test_a_stream_window_past_the_maximum_resets_that_stream() -> None:
    """A stream window driven past the maximum resets that stream only."""
    conn = server()
    _open(conn, 1)
    _open(conn, 3)
    events = conn.receive_data(f.window_update(1, f.MAX_WINDOW))
    assert [ev.StreamReset(1, f.FLOW_CONTROL_ERROR, remote=False)] == events
    assert {1: f.FLOW_CONTROL_ERROR} == resets(conn.data_to_send())
    assert _code(conn, f.window_update(0, f.MAX_WINDOW)) == f.FLOW_CONTROL_ERROR


def test_a_window_update_of_zero_resets_or_ends_the_connection() -> None:
    """A window update of zero resets a stream and ends the connection on stream zero."""
    conn = server()
    _open(conn, 1)
    assert [ev.StreamReset(1, f.PROTOCOL_ERROR, remote=False)] == conn.receive_data(f.window_update(1, 0))
    assert _code(conn, f.window_update(0, 0)) == f.PROTOCOL_ERROR


def test_a_reset_refunds_connection_credit_exactly_once() -> None:
    # Data taken before a reset, data dropped by it, and data that arrives after it: each byte
    # comes back to the peer's connection window once (a double refund would let a peer send
    # more than we granted, a missing one would shrink the window for good).
    conn = Connection(Role.SERVER, max_concurrent_streams=10, connection_window=65535)
    conn.receive_data(f.PREFACE + f.settings([]))
    _open(conn, 1)
    conn.receive_data(data_frame(1, b"a" * 1000))
    conn.acknowledge_received_data(1, 400)
    conn.reset_stream(1, f.CANCEL)
    conn.acknowledge_received_data(1, 600)  # the consumer dropped the rest
    conn.receive_data(data_frame(1, b"b" * 500))  # in flight when we reset it
    conn.receive_data(f.rst_stream(1, f.CANCEL))
    conn.release_stream(1)
    assert 65535 == conn.inflow.recv_window + conn.inflow.to_grant
    assert 1500 == conn.inflow.to_grant


def test_queued_data_dropped_by_a_reset_is_reported_once() -> None:
    conn = server(settings=f.settings([(f.INITIAL_WINDOW_SIZE, 0)]))
    _open(conn, 1)
    conn.send_headers(1, RESPONSE)
    assert 0 == conn.send_data(1, b"z" * 300)
    events = conn.receive_data(f.rst_stream(1, f.CANCEL))
    assert [ev.StreamReset(1, f.CANCEL, remote=True, unsent=300)] == events
    assert 0 == conn.sender.buffered
    assert 0 == conn.release_stream(1)
    assert 5 == conn.send_data(1, b"after")  # over: taken (dropped) at once
