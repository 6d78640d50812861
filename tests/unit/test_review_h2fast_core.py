"""A review of the HTTP/2 core's fast paths (32f228b, 791f766, 0e77749): the edges of each
condition that decides between the fast path and the general code, in memory.

- HEADERS: the PADDED and PRIORITY flags alone and together, padding up to and past the payload;
- the send side's one-frame header block: exactly at and one byte past the peer's
  SETTINGS_MAX_FRAME_SIZE, before and after the peer changes it, with a table size update owed;
- trailers framed at once only when nothing is queued before them: DATA and trailers keep their
  order on the wire whether the data waits for the stream's window, the connection's or a frame
  size, and nothing goes out on a stream the peer reset;
- connection credit on arrival and on acknowledgement across many DATA frames, padded, on reset
  streams, with the ``h2`` library as the peer: its view of the window must be ours, and the
  credit must come back whole (no drift); a WINDOW_UPDATE exactly at the quarter-window threshold;
- release_stream with and without queued bytes, after a GOAWAY either way.

Where the ``h2`` library is the peer, it checks every frame we send (frame sizes, windows,
header blocks, stream states) and raises on any it would refuse.
"""

from __future__ import annotations

import random
from typing import Any

import h2.config
import h2.connection
import h2.events
import hpack
import pytest

from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2.connection import Connection, Role
from krproxy.h2.streams import Stream
from tests.unit.h2peer import REQUEST, RESPONSE, client, data_frame, goaway_code, parse, resets, server

TRAILERS = [(b"grpc-status", b"0")]


def _block(headers: list[tuple[bytes, bytes]]) -> bytes:
    return hpack.Encoder().encode(headers)


# -- HEADERS: the flags that leave the fast path -------------------------------------------


def _priority(depends_on: int, weight: int = 15) -> bytes:
    return depends_on.to_bytes(4, "big") + bytes((weight,))


@pytest.mark.parametrize(
    ("flags", "payload"),
    [
        (0, _block(REQUEST)),
        (f.PRIORITY_FLAG, _priority(0) + _block(REQUEST)),
        (f.PRIORITY_FLAG, _priority(3) + _block(REQUEST)),  # on another stream: fine
        (f.PADDED, b"\x00" + _block(REQUEST)),
        (f.PADDED, b"\x07" + _block(REQUEST) + b"\x00" * 7),
        (f.PADDED | f.PRIORITY_FLAG, b"\x02" + _priority(0) + _block(REQUEST) + b"\x00\x00"),
    ],
    ids=["plain", "priority", "priority-other", "padded-0", "padded-7", "padded-priority"],
)
def test_a_request_s_headers_read_alike_with_padding_or_priority(flags: int, payload: bytes) -> None:
    conn = server()
    events = conn.receive_data(f.frame(f.HEADERS, flags | f.END_HEADERS, 1, payload))
    assert [ev.RequestReceived(1, REQUEST, False)] == events
    assert {} == resets(conn.data_to_send())


@pytest.mark.parametrize("flags", [f.PRIORITY_FLAG, f.PRIORITY_FLAG | f.PADDED])
@pytest.mark.parametrize("split", [False, True])
def test_headers_depending_on_their_own_stream_reset_it_split_or_not(flags: int, split: bool) -> None:
    """The self-dependency is read from the HEADERS frame; with the block in CONTINUATIONs the
    flag must ride along to the end of the block."""
    conn = server()
    body = _priority(1) + _block(REQUEST)
    if flags & f.PADDED:
        body = b"\x03" + body + b"\x00" * 3
    if split:
        wire = f.frame(f.HEADERS, flags, 1, body[:-4]) + f.frame(f.CONTINUATION, f.END_HEADERS, 1, body[-4:])
        if flags & f.PADDED:  # the padding sits at the end of the HEADERS frame, not the block
            cut = len(body) - 3 - 4
            head = b"\x03" + body[1:cut] + b"\x00" * 3
            wire = f.frame(f.HEADERS, flags, 1, head) + f.frame(
                f.CONTINUATION, f.END_HEADERS, 1, body[cut : len(body) - 3]
            )
    else:
        wire = f.frame(f.HEADERS, flags | f.END_HEADERS, 1, body)
    assert [] == conn.receive_data(wire)
    assert {1: f.PROTOCOL_ERROR} == resets(conn.data_to_send())
    assert conn.terminated is None
    # The block was decoded (HPACK state kept): the next request on the connection reads.
    assert [ev.RequestReceived(3, REQUEST, True)] == conn.receive_data(
        f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 3, _block(REQUEST))
    )


@pytest.mark.parametrize(
    ("flags", "payload", "ok"),
    [
        (f.PADDED, b"", False),  # no pad length at all
        (f.PADDED, b"\x00", True),  # pad length 0, an empty block
        (f.PADDED, b"\x01\x00", True),  # pad length = payload - 1: an empty block
        (f.PADDED, b"\x02\x00", False),  # pad length = payload
        (f.PADDED, b"\x09\x00", False),  # pad length past the payload
        (f.PRIORITY_FLAG, b"\x00\x00\x00\x00", False),  # priority fields cut short
        (f.PADDED | f.PRIORITY_FLAG, b"\x01" + _priority(0)[:4] + b"\x00", False),  # cut by the padding
    ],
    ids=[
        "padded-empty",
        "pad0-empty",
        "pad-len-1",
        "pad-eq-len",
        "pad-past-len",
        "short-prio",
        "prio-padded-short",
    ],
)
def test_headers_padding_up_to_and_past_the_payload(flags: int, payload: bytes, ok: bool) -> None:
    """Padding that fills the payload (or more) is a connection error (RFC 9113 §6.2); up to one
    byte less leaves an empty block, a request without pseudo-headers: a stream error."""
    conn = server()
    events = conn.receive_data(f.frame(f.HEADERS, flags | f.END_HEADERS, 1, payload))
    if ok:
        assert conn.terminated is None and [] == events
        assert {1: f.PROTOCOL_ERROR} == resets(conn.data_to_send())
    else:
        assert conn.terminated is not None
        assert goaway_code(conn.data_to_send()) in (f.PROTOCOL_ERROR, f.FRAME_SIZE_ERROR)


@pytest.mark.parametrize("flags", [0, f.PADDED, f.PRIORITY_FLAG, f.PADDED | f.PRIORITY_FLAG])
def test_headers_on_stream_zero_end_the_connection_whatever_the_flags(flags: int) -> None:
    conn = server()
    conn.receive_data(f.frame(f.HEADERS, flags | f.END_HEADERS, 0, b"\x00" * 6 + _block(REQUEST)))
    assert conn.terminated is not None and f.PROTOCOL_ERROR == goaway_code(conn.data_to_send())


@pytest.mark.parametrize("flags", [0, f.PADDED, f.PRIORITY_FLAG, f.PADDED | f.PRIORITY_FLAG])
def test_an_answer_s_headers_read_alike_with_padding_or_priority(flags: int) -> None:
    conn = client()
    conn.start_stream(REQUEST, end_stream=True)
    body = _block(RESPONSE)
    if flags & f.PRIORITY_FLAG:
        body = _priority(0) + body
    if flags & f.PADDED:
        body = b"\x04" + body + b"\x00" * 4
    events = conn.receive_data(f.frame(f.HEADERS, flags | f.END_HEADERS, 1, body))
    assert [ev.HeadersReceived(1, RESPONSE, False)] == events


# -- the h2 library as the peer ------------------------------------------------------------


class _H2Peer:
    """An ``h2`` connection joined to one of ours by bytes, in memory."""

    def __init__(self, ours: Connection, *, client_side: bool) -> None:
        config = h2.config.H2Configuration(client_side=client_side, header_encoding=None)
        self.h2 = h2.connection.H2Connection(config)
        self.h2.initiate_connection()
        self.ours = ours
        self.got: list[ev.Event] = []
        self.theirs: list[h2.events.Event] = []
        self.wire: list[tuple[int, int, int, bytes]] = []  # what ours sent, frame by frame
        self.exchange()

    def to_ours(self) -> bytes:
        data = self.h2.data_to_send()
        if data:
            self.got += self.ours.receive_data(data)
        return data

    def to_theirs(self) -> bytes:
        data = self.ours.data_to_send()
        if data:
            self.wire += parse(data.removeprefix(f.PREFACE))
            self.theirs += self.h2.receive_data(data)
        return data

    def exchange(self) -> None:
        """Bytes both ways until neither side has more to say."""
        while self.to_ours() + self.to_theirs():
            pass


def _server_with_h2_client(**kwargs: int) -> tuple[Connection, _H2Peer]:
    ours = Connection(Role.SERVER, max_concurrent_streams=1000, **kwargs)  # type: ignore[arg-type]
    return ours, _H2Peer(ours, client_side=True)


def _client_with_h2_server(**kwargs: int) -> tuple[Connection, _H2Peer]:
    ours = Connection(Role.CLIENT, **kwargs)  # type: ignore[arg-type]
    return ours, _H2Peer(ours, client_side=False)


def _pass_on_and_compare(ours: Connection, peer: _H2Peer, acknowledge: Any, window: int) -> None:
    """Take what the peer sent, pass the data on (``acknowledge`` its bytes, padding not counted:
    the core credits that itself), answer; the peer's send window must be our receive window,
    and the whole connection window ours less what waits to be granted."""
    peer.to_ours()
    for event in peer.got:
        if isinstance(event, ev.DataReceived):
            acknowledge(event.stream_id, len(event.data))
    peer.got.clear()
    peer.to_theirs()
    assert ours.terminated is None
    assert peer.h2.outbound_flow_control_window == ours.recv_window
    assert window == ours.recv_window + ours.to_grant


@pytest.mark.parametrize("seed", range(6))
def test_the_connection_window_never_drifts_from_the_h2_client_s_view(seed: int) -> None:
    """Server role, credit when acknowledged: many DATA frames of random sizes, padded or not, on
    streams that go on, that we reset while the peer's DATA is in flight, or that the peer
    resets. The peer's send window is always our receive window, and once every byte passed on
    is acknowledged, the credit is all back (the window less what waits to be granted)."""
    rng = random.Random(seed)
    window = 64 * 1024
    ours, peer = _server_with_h2_client(connection_window=4 * window, stream_window=window)
    open_ids: list[int] = []
    next_id = 1
    for _ in range(300):
        action = rng.random()
        if action < 0.15 or not open_ids:
            peer.h2.send_headers(next_id, REQUEST)
            open_ids.append(next_id)
            next_id += 2
        elif action < 0.8:
            sid = rng.choice(open_ids)
            room = min(peer.h2.local_flow_control_window(sid), peer.h2.max_outbound_frame_size)
            pad = rng.choice([None, None, 0, 1, 255 if room > 300 else None])
            size = rng.randrange(0, max(1, min(room - (pad or 0) - (1 if pad is not None else 0), 9000)))
            if size < 0:
                continue
            peer.h2.send_data(sid, b"d" * size, pad_length=pad)
        elif action < 0.9:  # we reset it with the peer's DATA still on its way
            sid = rng.choice(open_ids)
            room = peer.h2.local_flow_control_window(sid)
            if room > 10:
                peer.h2.send_data(sid, b"x" * min(room - 10, 5000), pad_length=rng.choice([None, 9]))
            ours.reset_stream(sid, f.CANCEL)  # before its DATA arrives
            open_ids.remove(sid)
        else:  # the peer resets it
            sid = rng.choice(open_ids)
            peer.h2.reset_stream(sid)
            open_ids.remove(sid)
        _pass_on_and_compare(ours, peer, ours.acknowledge_received_data, 4 * window)


@pytest.mark.parametrize("seed", range(4))
def test_the_client_s_connection_window_never_drifts_from_the_h2_server_s_view(seed: int) -> None:
    """Client role, connection credit on arrival: answers' DATA, padded or not, on streams that
    go on, that we reset with the peer's DATA in flight, and after a stream's end."""
    rng = random.Random(seed)
    window = 64 * 1024
    ours, peer = _client_with_h2_server(connection_window=4 * window, stream_window=window)
    open_ids: list[int] = []
    for _ in range(200):
        action = rng.random()
        if action < 0.15 or not open_ids:
            sid = ours.start_stream(REQUEST, end_stream=True)
            peer.to_theirs()
            peer.h2.send_headers(sid, RESPONSE)
            open_ids.append(sid)
        elif action < 0.85:
            sid = rng.choice(open_ids)
            room = min(peer.h2.local_flow_control_window(sid), peer.h2.max_outbound_frame_size)
            pad = rng.choice([None, 0, 7])
            size = rng.randrange(0, max(1, min(room - (pad or 0) - 1, 9000)))
            if size >= 0:
                peer.h2.send_data(sid, b"a" * size, pad_length=pad)
        else:
            sid = rng.choice(open_ids)
            room = peer.h2.local_flow_control_window(sid)
            if room > 10:
                peer.h2.send_data(sid, b"z" * min(room - 10, 3000), pad_length=rng.choice([None, 3]))
            ours.reset_stream(sid, f.CANCEL)
            open_ids.remove(sid)
        _pass_on_and_compare(ours, peer, ours.acknowledge_stream_data, 4 * window)


@pytest.mark.parametrize("role", [Role.CLIENT, Role.SERVER])
def test_a_window_update_goes_out_exactly_at_a_quarter_of_the_window(role: Role) -> None:
    window = 4096
    conn = Connection(role, connection_window=4 * window, stream_window=4 * window)
    if role is Role.SERVER:
        conn.receive_data(f.PREFACE + f.settings([]))
        conn.receive_data(f.frame(f.HEADERS, f.END_HEADERS, 1, _block(REQUEST)))
    else:
        conn.receive_data(f.settings([]))
        conn.start_stream(REQUEST, end_stream=True)
        conn.receive_data(f.frame(f.HEADERS, f.END_HEADERS, 1, _block(RESPONSE)))
    conn.data_to_send()

    def feed(size: int) -> list[tuple[int, int]]:
        for event in conn.receive_data(data_frame(1, b"q" * size)):
            if isinstance(event, ev.DataReceived) and role is Role.SERVER:
                conn.acknowledge_received_data(1, len(event.data))
        return [
            (sid, n)
            for kind, _, sid, p in parse(conn.data_to_send())
            if kind == f.WINDOW_UPDATE
            for n in [f.parse_u32(p)]
        ]

    assert [] == feed(window - 1)  # one byte short of the threshold: nothing yet
    got = feed(1)
    assert (0, window) in got  # at it: the connection's quarter, at once
    assert 4 * window == conn.recv_window and 0 == conn.to_grant


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
def test_trailers_follow_the_data_queued_before_them_whatever_holds_it(blocked_by: str) -> None:
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
        assert ours.blocked
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
    assert not ours.blocked and 0 == ours.buffered


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


def test_trailers_on_a_stream_reset_while_its_data_waits_are_dropped_with_it() -> None:
    ours, peer = _server_with_h2_client()
    sid = _h2_client_stream(ours, peer)
    ours.send_data(sid, b"m" * 70000)  # beyond the peer's 65535 windows
    ours.send_trailers(sid, TRAILERS)
    peer.to_theirs()
    peer.h2.reset_stream(sid)
    peer.to_ours()
    reset = [e for e in peer.got if isinstance(e, ev.StreamReset)]
    assert [70000 - 65535] == [e.unsent for e in reset]
    assert not ours.blocked and 0 == ours.buffered
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


def test_a_lowered_max_frame_size_is_impossible_and_a_raised_one_is_used_by_trailers_too() -> None:
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


def test_release_after_our_goaway_reports_queued_bytes_and_forgets_the_stream() -> None:
    ours, peer = _server_with_h2_client()
    sid = _h2_client_stream(ours, peer)
    ours.send_data(sid, b"m" * 70000)
    ours.goaway()
    assert sid in ours.blocked and 70000 - 65535 == ours.buffered
    assert 70000 - 65535 == ours.release_stream(sid)
    assert not ours.blocked and 0 == ours.buffered and sid not in ours.streams
    peer.to_theirs()  # (h2 takes no frame after a GOAWAY: the windows open by hand)
    ours.receive_data(f.window_update(0, 100000) + f.window_update(sid, 100000))
    assert [] == [k for k, *_ in parse(ours.data_to_send()) if k in (f.DATA, f.HEADERS)]
    assert 65535 == sum(n for k, n in _stream_frames(peer, sid) if k == f.DATA)


def test_release_of_a_blocked_stream_below_a_received_goaway_s_last_id_drops_its_queue() -> None:
    ours = client()
    sid = ours.start_stream(REQUEST)
    assert 65535 == ours.send_data(sid, b"x" * 70000)
    ours.send_trailers(sid, TRAILERS)
    ours.receive_data(f.goaway(sid, f.NO_ERROR))  # our stream is below its last id: it goes on
    assert sid in ours.blocked and not ours.streams[sid].reset
    ours.data_to_send()
    assert 70000 - 65535 == ours.release_stream(sid)
    assert not ours.blocked and 0 == ours.buffered
    ours.receive_data(f.window_update(0, 100000) + f.window_update(sid, 100000))
    assert b"" == ours.data_to_send()  # nothing of a released stream, no trailers


def test_release_of_streams_without_queued_bytes_after_a_goaway() -> None:
    ours = client()
    done = ours.start_stream(REQUEST, end_stream=True)
    refused = ours.start_stream(REQUEST, end_stream=True)
    ours.receive_data(f.goaway(done, f.NO_ERROR))
    assert ours.streams[refused].reset
    assert 0 == ours.release_stream(refused) == ours.release_stream(done) == ours.release_stream(done)
    assert {} == ours.streams and not ours.blocked and 0 == ours.buffered


@pytest.mark.parametrize("size", [0, 100, 70000])
def test_a_stream_started_with_data_and_trailers_kept_while_it_waited_sends_them_in_order(size: int) -> None:
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
    assert not ours.blocked and 0 == ours.buffered and 0 == ours.release_stream(sid)
