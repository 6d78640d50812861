"""``python -m krproxy.bench.h2core``: Python calls and time per message of the HTTP/2 core.

A client-role and a server-role :class:`~krproxy.h2.connection.Connection` exchange unary gRPC
calls through bytes, in memory, as a driver would: the client opens a stream with HEADERS and
sends its message with END_STREAM; the server answers HEADERS, DATA and trailers; each side
acknowledges the data it received and releases the stream. Both read *stepwise*, as the relay's
endpoints do: one frame's events per call, :meth:`~Connection.next_events` for the rest. No
sockets, no event loop: what is measured is the core alone, the share of every forwarded call,
hook call and SDK call it costs (a forwarded call passes through two connections, as here).

Two figures per run: Python-level function calls per call (``sys.setprofile``'s ``call``
events, and ``c_call`` events for builtins and C methods), which do not depend on the load of
the machine; and µs per call (``time.perf_counter`` around many calls, best of a few rounds),
which does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from types import FrameType

from krproxy.h2.connection import Connection, Role
from krproxy.h2.events import DataReceived, HeadersReceived, RequestReceived
from krproxy.h2.frames import HEAD_SIZE

REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/runtime.v1.RuntimeService/ContainerStatus"),
    (b":authority", b"localhost"),
    (b"content-type", b"application/grpc"),
    (b"user-agent", b"grpc-go/1.65.0"),
    (b"te", b"trailers"),
    (b"grpc-timeout", b"1999887u"),
]
RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc")]
TRAILERS = [(b"grpc-status", b"0"), (b"grpc-message", b"")]


def _pair() -> tuple[Connection, Connection]:
    client, server = Connection(Role.CLIENT, stepwise=True), Connection(Role.SERVER, stepwise=True)
    for reader, writer in ((server, client), (client, server), (server, client)):  # SETTINGS, their ACKs
        reader.receive_data(writer.data_to_send())
        while len(reader.unread) >= HEAD_SIZE:
            reader.next_events()
    return client, server


def _read(conn: Connection, data: bytes) -> None:
    """Feed ``data`` to ``conn`` as the relay's endpoints do (stepwise), acknowledging DATA."""
    events = conn.receive_data(data)
    while events:
        for event in events:
            if event.__class__ is DataReceived:
                conn.acknowledge_received_data(event.stream_id, event.flow_controlled_length)
            elif event.__class__ not in _EXPECTED:
                raise AssertionError(f"unexpected {event}")
        events = conn.next_events() if len(conn.unread) >= HEAD_SIZE else []  # as the relay tests it


_EXPECTED = {RequestReceived, HeadersReceived}


def _calls(client: Connection, server: Connection, message: bytes) -> Callable[[int], None]:
    def run(count: int) -> None:
        for _ in range(count):
            stream_id = client.start_stream(REQUEST)
            client.send_data(stream_id, message, end_stream=True)
            _read(server, client.data_to_send())
            server.send_headers(stream_id, RESPONSE)
            server.send_data(stream_id, message)
            server.send_trailers(stream_id, TRAILERS)
            server.release_stream(stream_id)
            _read(client, server.data_to_send())
            client.release_stream(stream_id)

    return run


def count_calls(message_size: int, calls: int) -> tuple[float, float]:
    """Python calls and C calls per unary call, counted with ``sys.setprofile``."""
    run = _calls(*_pair(), b"\x00" * message_size)
    run(10)  # warm the caches (header fields, HPACK blocks)
    counts = {"call": 0, "c_call": 0}

    def profile(frame: FrameType, event: str, arg: object) -> None:
        # The driver's own calls (run, _read) and the C calls made there are not the core's.
        if event in counts and frame.f_code.co_filename != __file__:
            counts[event] += 1

    sys.setprofile(profile)
    try:
        run(calls)
    finally:
        sys.setprofile(None)
    return counts["call"] / calls, counts["c_call"] / calls


def time_calls(message_size: int, calls: int, rounds: int) -> float:
    """µs per unary call, best of ``rounds``."""
    run = _calls(*_pair(), b"\x00" * message_size)
    run(100)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        run(calls)
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m krproxy.bench.h2core", description=__doc__)
    parser.add_argument("--calls", type=int, default=2000, help="unary calls per timed round")
    parser.add_argument(
        "--rounds",
        type=int,
        default=25,
        help="timed rounds (the best is printed: short rounds, many, so that one of them runs while the machine lets it)",
    )
    parser.add_argument(
        "--sizes", default="100,4096", help="message sizes in bytes, comma separated (default 100,4096)"
    )
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    print(f"h2 core, in memory: client and server Connection, unary gRPC calls (load {load:.2f})")
    for size in (int(s) for s in args.sizes.split(",")):
        python_calls, c_calls = count_calls(size, 1000)
        us = time_calls(size, args.calls, args.rounds)
        print(
            f"  message {size:>6} B: {python_calls:6.1f} Python calls, {c_calls:6.1f} C calls,"
            f" {us:6.2f} µs per call (5 frames: 2 in, 3 out)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
