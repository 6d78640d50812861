"""Tests of the HTTP/2 core's fast paths (32f228b, 791f766, 0e77749): the edges of each
condition that decides between the fast path and the general code, in memory.

- HEADERS: the PADDED and PRIORITY flags alone and together, padding up to and past the payload;
- connection credit on arrival and on acknowledgement across many DATA frames, padded, on reset
  streams, with the ``h2`` library as the peer: its view of the window must be ours, and the
  credit must come back whole (no drift); a WINDOW_UPDATE exactly at the quarter-window threshold.

The send side (trailers, the one-frame header block, release_stream after a GOAWAY) is in
test_h2_connection_sending.py.

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
from tests.unit.h2peer import REQUEST, RESPONSE, client, data_frame, goaway_code, parse, resets, server


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
def test_headers_depending_on_their_own_stream_reset_it(flags: int, split: bool) -> None:
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
def test_headers_on_stream_zero_end_the_connection(flags: int) -> None:
    """Headers on stream zero end the connection whatever the flags."""
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
    assert peer.h2.outbound_flow_control_window == ours.inflow.recv_window
    assert window == ours.inflow.recv_window + ours.inflow.to_grant


@pytest.mark.parametrize("seed", range(6))
def test_the_connection_window_agrees_with_an_h2_client(seed: int) -> None:
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
def test_the_client_connection_window_agrees_with_an_h2_server(seed: int) -> None:
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
def test_a_window_update_goes_out_at_a_quarter_of_the_window(role: Role) -> None:
    """A window update goes out exactly at a quarter of the window."""
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
    assert 4 * window == conn.inflow.recv_window and 0 == conn.inflow.to_grant
