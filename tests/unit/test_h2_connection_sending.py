"""Tests of the HTTP/2 core's fast paths (32f228b, 791f766, 0e77749), the send side, in memory:
trailers framed at once only when nothing is queued before them, the one-frame header block at
and one byte past the peer's SETTINGS_MAX_FRAME_SIZE, and release_stream after a GOAWAY either way (the receive side: test_h2_connection_fast_paths.py).

DATA and trailers keep their order on the wire whether the data waits for the stream's window, the
connection's or a frame size, and nothing goes out on a stream the peer reset; the header block is
tried before and after the peer changes its frame size, with a table size update owed. The
``h2`` library as the peer checks every frame we send and raises on any it would refuse.
"""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import pytest

from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2.connection import Connection
from krproxy.h2.streams import Stream
from tests.unit.h2peer import REQUEST, RESPONSE, client, parse
from tests.unit.test_h2_connection_fast_paths import _client_with_h2_server, _H2Peer, _server_with_h2_client

TRAILERS = [(b"grpc-status", b"0")]


# -- trailers: at once only when nothing waits before them ---------------------------------


def _h2_client_stream(ours: Connection, peer: _H2Peer) -> int:
    peer.h2.send_headers(1, REQUEST, end_stream=True)
    peer.exchange()
    ours.send_headers(1, RESPONSE)
    return 1


def _stream_frames(peer: _H2Peer, sid: int) -> list[tuple[int, int]]:
    """The DATA and HEADERS frames ours sent on ``sid``: (kind, payload size)."""
    return [
        (kind, len(p))
        for kind, _, s, p in peer.wire
        if s == sid and kind in (f.DATA, f.HEADERS, f.CONTINUATION)
    ]


@pytest.mark.parametrize("blocked_by", ["stream", "connection", "frame-size"])
def test_trailers_follow_the_data_queued_before_them(blocked_by: str) -> None:
    """Trailers follow the data queued before them whatever holds it."""
    ours, peer = _server_with_h2_client()
    if blocked_by == "stream":  # the peer's stream window: its SETTINGS' 65535 less 100
        peer.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100})
        peer.exchange()
    sid = _h2_client_stream(ours, peer)
    size = {"stream": 1000, "connection": 70000, "frame-size": 16384 * 2 + 5}[blocked_by]
    ours.send_data(sid, b"m" * size)
    ours.send_trailers(sid, TRAILERS)
    peer.to_theirs()
    ended = [e for e in peer.theirs if isinstance(e, h2.events.StreamEnded)]
    if blocked_by != "frame-size":
        assert not ended  # the data still waits for a window: the trailers with it
        assert ours.sender.blocked
    received = sum(len(e.data) for e in peer.theirs if isinstance(e, h2.events.DataReceived))
    peer.h2.acknowledge_received_data(received, sid) if received else None
    for _ in range(10):  # the peer grants what it took, the rest goes out
        peer.exchange()
        got = [e for e in peer.theirs if isinstance(e, h2.events.DataReceived)]
        taken = sum(e.flow_controlled_length for e in got)
        if taken > received:
            peer.h2.acknowledge_received_data(taken - received, sid)
            received = taken
    frames = _stream_frames(peer, sid)
    assert size == sum(n for kind, n in frames if kind == f.DATA)
    assert (f.HEADERS, len(f.encode_headers(TRAILERS))) == frames[-1]  # last, after all the data
    assert [f.HEADERS] == [kind for kind, _ in frames[1:] if kind != f.DATA]  # no HEADERS between
    trailers = [e for e in peer.theirs if isinstance(e, h2.events.TrailersReceived)]
    assert [TRAILERS] == [list(e.headers) for e in trailers]
    assert not ours.sender.blocked and 0 == ours.sender.buffered


def test_trailers_after_data_that_fit_go_out_at_once_after_it() -> None:
    ours, peer = _server_with_h2_client()
    sid = _h2_client_stream(ours, peer)
    assert 5 == ours.send_data(sid, b"hello")
    assert 0 == ours.send_trailers(sid, TRAILERS)
    peer.to_theirs()
    sizes = [
        (f.HEADERS, len(f.encode_headers(RESPONSE))),
        (f.DATA, 5),
        (f.HEADERS, len(f.encode_headers(TRAILERS))),
    ]
    assert sizes == _stream_frames(peer, sid)
    assert ours.streams[sid].send_ended


def test_trailers_on_a_stream_the_peer_reset_send_nothing() -> None:
    ours, peer = _server_with_h2_client()
    sid = _h2_client_stream(ours, peer)
    peer.to_theirs()
    peer.h2.reset_stream(sid)
    peer.to_ours()
    before = len(peer.wire)
    assert 0 == ours.send_trailers(sid, TRAILERS)
    assert b"" == ours.data_to_send()
    ours.release_stream(sid)
    assert 0 == ours.send_trailers(sid, TRAILERS)  # released: still nothing
    assert b"" == ours.data_to_send() and before == len(peer.wire)


def test_trailers_of_a_stream_reset_with_data_waiting_drop() -> None:
    """Trailers on a stream reset while its data waits are dropped with it."""
    ours, peer = _server_with_h2_client()
    sid = _h2_client_stream(ours, peer)
    ours.send_data(sid, b"m" * 70000)  # beyond the peer's 65535 windows
    ours.send_trailers(sid, TRAILERS)
    peer.to_theirs()
    peer.h2.reset_stream(sid)
    peer.to_ours()
    reset = [e for e in peer.got if isinstance(e, ev.StreamReset)]
    assert [70000 - 65535] == [e.unsent for e in reset]
    assert not ours.sender.blocked and 0 == ours.sender.buffered
    peer.h2.increment_flow_control_window(100000)
    peer.exchange()
    assert [] == [k for k, _ in _stream_frames(peer, sid)[2:] if k == f.HEADERS]  # no trailers went out


# -- the one-frame header block, at the edge of the peer's frame size ----------------------


def _headers_of_block_size(size: int, pad_name: bytes = b"x-pad") -> list[tuple[bytes, bytes]]:
    """Answer headers whose encoded block is exactly ``size`` bytes."""
    for n in range(size, 0, -1):
        headers = [*RESPONSE, (pad_name, b"v" * n)]
        if len(f.encode_headers(headers)) == size:
            return headers
    raise AssertionError(f"no block of {size} bytes")


@pytest.mark.parametrize("max_frame", [None, 20000, 60000])
@pytest.mark.parametrize("over", [0, 1])
@pytest.mark.parametrize("table_update", [False, True])
def test_a_header_block_at_and_one_past_the_peer_s_frame_size(
    max_frame: int | None, over: int, table_update: bool
) -> None:
    ours, peer = _server_with_h2_client()
    settings: dict[int, int] = {}
    if max_frame is not None:  # the peer changes it mid-connection
        settings[h2.settings.SettingCodes.MAX_FRAME_SIZE] = max_frame
    if table_update:  # a table size update (one byte) is owed at the start of the next block
        settings[h2.settings.SettingCodes.HEADER_TABLE_SIZE] = 0
    if settings:
        peer.h2.update_settings(settings)
        peer.exchange()
    block_size = (max_frame or f.DEFAULT_MAX_FRAME) + over - (1 if table_update else 0)
    headers = _headers_of_block_size(block_size)
    peer.h2.send_headers(1, REQUEST, end_stream=True)
    peer.exchange()
    ours.send_headers(1, headers, end_stream=True)
    peer.to_theirs()
    frames = [(kind, flags, len(p)) for kind, flags, s, p in peer.wire if s == 1]
    peer_limit = max_frame or f.DEFAULT_MAX_FRAME
    total = block_size + (1 if table_update else 0)
    if total <= peer_limit:
        assert [(f.HEADERS, f.END_HEADERS | f.END_STREAM, total)] == frames
    else:
        assert [f.HEADERS, f.CONTINUATION] == [kind for kind, _, _ in frames]
        assert [peer_limit, total - peer_limit] == [n for _, _, n in frames]
    got = [e for e in peer.theirs if isinstance(e, h2.events.ResponseReceived)]
    assert [headers] == [list(e.headers) for e in got]


def test_a_raised_max_frame_size_is_used_by_trailers_too() -> None:
    """A lowered max frame size is impossible and a raised one is used by trailers too."""
    ours, peer = _server_with_h2_client()
    peer.h2.update_settings({h2.settings.SettingCodes.MAX_FRAME_SIZE: 16385})
    peer.exchange()
    sid = _h2_client_stream(ours, peer)
    ours.send_data(sid, b"m" * 70000)
    trailers = [(b"grpc-status", b"0"), (b"x-t", b"t" * (16385 - 27))]
    block = f.encode_headers(trailers)
    assert 16380 < len(block) <= 16385
    ours.send_trailers(sid, trailers)
    peer.h2.increment_flow_control_window(100000)
    peer.h2.increment_flow_control_window(100000, sid)
    peer.exchange()
    frames = _stream_frames(peer, sid)
    assert (f.HEADERS, len(block)) == frames[-1]
    assert all(n <= 16385 for _, n in frames)
    assert [trailers] == [list(e.headers) for e in peer.theirs if isinstance(e, h2.events.TrailersReceived)]


# -- release_stream ------------------------------------------------------------------------


def test_release_after_our_goaway_reports_queued_bytes() -> None:
    """Release after our goaway reports queued bytes and forgets the stream."""
    ours, peer = _server_with_h2_client()
    sid = _h2_client_stream(ours, peer)
    ours.send_data(sid, b"m" * 70000)
    ours.goaway()
    assert sid in ours.sender.blocked and 70000 - 65535 == ours.sender.buffered
    assert 70000 - 65535 == ours.release_stream(sid)
    assert not ours.sender.blocked and 0 == ours.sender.buffered and sid not in ours.streams
    peer.to_theirs()  # (h2 takes no frame after a GOAWAY: the windows open by hand)
    ours.receive_data(f.window_update(0, 100000) + f.window_update(sid, 100000))
    assert [] == [k for k, *_ in parse(ours.data_to_send()) if k in (f.DATA, f.HEADERS)]
    assert 65535 == sum(n for k, n in _stream_frames(peer, sid) if k == f.DATA)


def test_release_below_a_received_goaway_drops_the_queue() -> None:
    """Release of a blocked stream below a received goaway's last id drops its queue."""
    ours = client()
    sid = ours.start_stream(REQUEST)
    assert 65535 == ours.send_data(sid, b"x" * 70000)
    ours.send_trailers(sid, TRAILERS)
    ours.receive_data(f.goaway(sid, f.NO_ERROR))  # our stream is below its last id: it goes on
    assert sid in ours.sender.blocked and not ours.streams[sid].reset
    ours.data_to_send()
    assert 70000 - 65535 == ours.release_stream(sid)
    assert not ours.sender.blocked and 0 == ours.sender.buffered
    ours.receive_data(f.window_update(0, 100000) + f.window_update(sid, 100000))
    assert b"" == ours.data_to_send()  # nothing of a released stream, no trailers


def test_release_of_streams_without_queued_bytes_after_a_goaway() -> None:
    ours = client()
    done = ours.start_stream(REQUEST, end_stream=True)
    refused = ours.start_stream(REQUEST, end_stream=True)
    ours.receive_data(f.goaway(done, f.NO_ERROR))
    assert ours.streams[refused].reset
    assert 0 == ours.release_stream(refused) == ours.release_stream(done) == ours.release_stream(done)
    assert {} == ours.streams and not ours.sender.blocked and 0 == ours.sender.buffered


@pytest.mark.parametrize("size", [0, 100, 70000])
def test_a_waiting_stream_sends_kept_data_and_trailers_in_order(size: int) -> None:
    """The relay keeps a request's data and trailers on the Stream while it waits for a slot
    (start_stream(stream=...)): they go out behind the headers, the trailers last, as the windows allow."""
    ours, peer = _client_with_h2_server()
    kept = Stream(0, 0, 0)
    kept.pending += b"r" * size
    kept.trailers_pending = f.encode_headers(TRAILERS)
    sid = ours.start_stream(REQUEST, stream=kept)
    peer.exchange()
    received = sum(e.flow_controlled_length for e in peer.theirs if isinstance(e, h2.events.DataReceived))
    if received < size:  # held by the peer's 65535 windows: the trailers with it
        assert not [e for e in peer.theirs if isinstance(e, h2.events.StreamEnded)]
        peer.h2.acknowledge_received_data(received, sid)
        peer.h2.increment_flow_control_window(size, sid)
        peer.exchange()
    frames = _stream_frames(peer, sid)
    assert [f.HEADERS] == [kind for kind, _ in frames[:1]]
    assert size == sum(n for kind, n in frames if kind == f.DATA)
    assert (f.HEADERS, len(f.encode_headers(TRAILERS))) == frames[-1]
    assert [TRAILERS] == [list(e.headers) for e in peer.theirs if isinstance(e, h2.events.TrailersReceived)]
    assert not ours.sender.blocked and 0 == ours.sender.buffered and 0 == ours.release_stream(sid)
