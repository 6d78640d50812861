"""krproxy.h2.connection with whole_requests (the server role, stepwise): odd requests read
with their ending DATA in one step give the events, output and windows of two steps. No sockets."""

from __future__ import annotations

import pytest

from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2.connection import Connection, Role
from tests.unit.h2peer import REQUEST, block, data_frame, headers_frame


def _read_all(conn: Connection, wire: bytes) -> tuple[list[ev.Event], bytes, list[int]]:
    """What ``conn`` makes of ``wire`` read stepwise to its end: its events (a request's body
    as the DataReceived after it), its output, its windows (the connection's, each stream's)."""
    events: list[ev.Event] = []
    step = conn.receive_data(wire)
    while True:
        for event in step:
            if isinstance(event, ev.RequestReceived) and event.body is not None:
                events += [ev.RequestReceived(event.stream_id, event.headers, False), event.body]
            else:
                events.append(event)
        if not conn.input_left or conn.terminated is not None:
            break
        step = conn.receive_data(b"")
    windows = [conn.inflow.recv_window, *(s.recv_window for _, s in sorted(conn.streams.items()))]
    return events, conn.data_to_send(), windows


def _split_block(stream_id: int, data: bytes) -> bytes:
    """A request's HEADERS (its block's first 3 bytes) and a CONTINUATION with the rest."""
    wire = block(REQUEST)
    return f.frame(f.HEADERS, 0, stream_id, wire[:3]) + f.frame(
        f.CONTINUATION, f.END_HEADERS, stream_id, wire[3:]
    )


WHOLE_WIRES = {
    "continuation": _split_block(1, b"") + data_frame(1, b"hello", end=True),
    "priority": f.frame(
        f.HEADERS, f.END_HEADERS | f.PRIORITY_FLAG, 1, b"\x00\x00\x00\x00\x10" + block(REQUEST)
    )
    + data_frame(1, b"hello", end=True),
    "self-dependent": f.frame(
        f.HEADERS, f.END_HEADERS | f.PRIORITY_FLAG, 1, b"\x00\x00\x00\x01\x10" + block(REQUEST)
    )
    + data_frame(1, b"hello", end=True),
    "padded headers": f.frame(f.HEADERS, f.END_HEADERS | f.PADDED, 1, b"\x02" + block(REQUEST) + b"\x00\x00")
    + data_frame(1, b"hello", end=True),
    "reserved bit": headers_frame(1) + f.frame(f.DATA, f.END_STREAM, 1 | 1 << 31, b"hello"),
    "no :path": headers_frame(1, [h for h in REQUEST if h[0] != b":path"])
    + data_frame(1, b"hello", end=True),
    "content-length short": headers_frame(1, [*REQUEST, (b"content-length", b"9")])
    + data_frame(1, b"hello", end=True),
    "content-length right": headers_frame(1, [*REQUEST, (b"content-length", b"5")])
    + data_frame(1, b"hello", end=True),
    "over the stream limit": headers_frame(1)
    + headers_frame(3)
    + data_frame(3, b"hello", end=True)
    + data_frame(1, b"x", end=True),
    "then reset and goaway": headers_frame(1)
    + data_frame(1, b"hello", end=True)
    + f.rst_stream(1, f.CANCEL)
    + headers_frame(3)
    + data_frame(3, b"", end=True)
    + f.frame(f.PING, 0, 0, b"12345678")
    + f.goaway(3, f.NO_ERROR),
    "data on stream 0 next": headers_frame(1) + data_frame(1, b"hello", end=True) + data_frame(0, b"x"),
    "beyond the stream window": headers_frame(1) + data_frame(1, b"x" * 200, end=True),
    "over max frame": headers_frame(1) + data_frame(1, b"x" * 16_385, end=True),
    "a second request": headers_frame(1) + data_frame(1, b"a", end=True) + headers_frame(1),
}


@pytest.mark.parametrize("name", sorted(WHOLE_WIRES))
def test_a_whole_request_read_as_two_steps(name: str) -> None:
    """Odd requests (CONTINUATION, PRIORITY, padded HEADERS, the reserved bit, malformed
    headers, content-length, the stream limit, a reset or GOAWAY after, a stream window too
    small, a frame too large): with whole_requests the same events, output and windows as
    read one frame a step."""
    results = []
    for whole in (False, True):
        conn = Connection(
            Role.SERVER, stepwise=True, whole_requests=whole, max_concurrent_streams=1, stream_window=100
        )
        conn.receive_data(f.PREFACE + f.settings([]))
        conn.data_to_send()
        results.append(_read_all(conn, WHOLE_WIRES[name]))
    assert results[0] == results[1]
