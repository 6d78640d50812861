"""krproxy.h2.connection and SETTINGS_MAX_HEADER_LIST_SIZE: the limit we advertise, and a header
block over the peer's limit ending its stream only (as grpc-go's server does). No sockets."""

from __future__ import annotations

import hpack

from krproxy.h2 import connection as core
from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2.connection import Connection, Role
from tests.unit.h2peer import REQUEST, RESPONSE, client, kinds, parse, resets, server
from tests.unit.test_h2state import _open

BIG_TRAILERS = [(b"grpc-status", b"5"), (b"grpc-message", b"m" * 100_000)]


def _advertised(conn: Connection) -> dict[int, int]:
    out = conn.data_to_send()
    frames = parse(out.removeprefix(f.PREFACE))
    settings = next(p for kind, flags, _, p in frames if kind == f.SETTINGS and not flags & f.ACK)
    return dict(f.parse_settings(settings))


def test_both_roles_advertise_the_header_list_limit() -> None:
    """Server and client both advertise a header list limit a block within MAX_HEADER_BLOCK meets."""
    for role in (Role.SERVER, Role.CLIENT):
        conn = Connection(role)
        advertised = _advertised(conn)[f.MAX_HEADER_LIST_SIZE]
        assert (core.ADVERTISED_HEADER_LIST, True) == (advertised, advertised < core.MAX_HEADER_BLOCK)


def test_trailers_over_the_peers_limit_reset_one_stream() -> None:
    """Trailers whose header list exceeds the peer's SETTINGS_MAX_HEADER_LIST_SIZE are not
    sent: that stream is reset with INTERNAL_ERROR, another stream's trailers go out."""
    conn = server(settings=f.settings([(f.MAX_HEADER_LIST_SIZE, 16384)]))
    _open(conn, 1)
    _open(conn, 3)
    conn.send_headers(1, RESPONSE)
    conn.send_headers(3, RESPONSE)
    conn.data_to_send()
    assert 0 == conn.send_trailers(1, BIG_TRAILERS)
    conn.send_trailers(3, [(b"grpc-status", b"0")])
    frames = parse(conn.data_to_send())
    assert [(f.RST_STREAM, 1), (f.HEADERS, 3)] == [(kind, sid) for kind, _, sid, _ in frames]
    assert f.INTERNAL_ERROR == int.from_bytes(frames[0][3], "big")
    stream = conn.stream(1)
    assert stream is not None and stream.reset
    assert ["StreamReset"] == kinds(conn.receive_data(b""))
    assert conn.terminated is None


def test_trailers_within_the_peers_limit_are_sent() -> None:
    """A 100 KB status message goes out whole to a peer that states no limit or a larger one."""
    for settings in (b"", f.settings([(f.MAX_HEADER_LIST_SIZE, 200_000)])):
        conn = server(settings=settings or f.settings([]))
        _open(conn, 1)
        conn.send_headers(1, RESPONSE)
        conn.data_to_send()
        conn.send_trailers(1, BIG_TRAILERS)
        sent = parse(conn.data_to_send())
        assert f.HEADERS == sent[0][0]
        assert f.RST_STREAM not in [kind for kind, _, _, _ in sent]


def test_request_over_the_peers_limit_is_told_apart() -> None:
    """A request's header list over the server's SETTINGS_MAX_HEADER_LIST_SIZE: over_peer_limit
    names the limit (the driver fails that call unsent); a request within it, or a server that
    stated no limit, gets None."""
    metadata = [*REQUEST, (b"x-big", b"v" * 20_000)]
    limited = client(settings=f.settings([(f.MAX_HEADER_LIST_SIZE, 16384)]))
    unlimited = client()
    assert 16384 == limited.over_peer_limit(f.encode_headers(metadata))
    assert limited.over_peer_limit(f.encode_headers([*REQUEST, (b"x-small", b"v" * 16_000)])) is None
    assert unlimited.over_peer_limit(f.encode_headers(metadata)) is None


#: More than MAX_HEADER_BLOCK in one value: a peer that ignores the limit we advertise.
HUGE = b"m" * (core.MAX_HEADER_BLOCK + 500_000)


def _peer_blocks(first: list[tuple[bytes, bytes]]) -> tuple[bytes, bytes, list[tuple[bytes, bytes]]]:
    """Two blocks from one ``hpack`` encoder (the oracle peer): ``first`` + a huge value + a field
    it indexes after it, then a block naming that field from its dynamic table."""
    encoder = hpack.Encoder()
    oversized = encoder.encode([*first, (b"x-big", HUGE), (b"x-after", b"1")], huffman=False)
    second = [*first, (b"x-after", b"1")]
    return oversized, encoder.encode(second), second


def test_an_oversized_request_resets_its_stream_only() -> None:
    """A request block over MAX_HEADER_BLOCK: stream 1 is reset FRAME_SIZE_ERROR (as grpc-go), the
    connection lives, and the next request, naming an entry the oversized block added, decodes."""
    conn = server()
    oversized, following, second = _peer_blocks(REQUEST)
    wire = f.header_frames(1, oversized, True, 16384) + f.header_frames(3, following, True, 16384)
    events = conn.receive_data(wire)
    assert [ev.RequestReceived(3, second, True)] == events
    assert {1: f.FRAME_SIZE_ERROR} == resets(conn.data_to_send())
    assert conn.terminated is None and 1 not in conn.streams


def test_an_oversized_answer_resets_its_stream_only() -> None:
    """An answer block over MAX_HEADER_BLOCK (client role): that call's stream is reset
    FRAME_SIZE_ERROR with a StreamReset event; the next answer, indexed against it, decodes."""
    conn = client()
    first, next_ = conn.start_stream(REQUEST, True), conn.start_stream(REQUEST, True)
    conn.data_to_send()
    oversized, following, second = _peer_blocks(RESPONSE)
    wire = f.header_frames(first, oversized, False, 16384) + f.header_frames(next_, following, False, 16384)
    events = conn.receive_data(wire)
    assert [
        ev.StreamReset(first, f.FRAME_SIZE_ERROR, remote=False, unsent=0),
        ev.HeadersReceived(next_, second, False),
    ] == events
    assert {first: f.FRAME_SIZE_ERROR} == resets(conn.data_to_send())
    assert conn.terminated is None
