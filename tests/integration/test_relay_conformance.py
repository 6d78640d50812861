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
import h2.exceptions
import pytest
import trio

from krproxy.relay import Relay
from krproxy.relay import frames as f

PATH = "/test.Conformance/Call"


def _after_preface(*frames: bytes) -> bytes:
    return f.PREFACE + f.frame(f.SETTINGS, 0, 0) + b"".join(frames)


CASES = {
    "settings-ack-with-payload": (
        _after_preface(f.frame(f.SETTINGS, f.ACK, 0, b"\x00\x03\x00\x00\x00\x64")),
        f.FRAME_SIZE_ERROR,
    ),
    "window-update-on-idle-stream": (_after_preface(f.window_update(11, 100)), f.PROTOCOL_ERROR),
    "rst-stream-on-idle-stream": (_after_preface(f.rst_stream(11, f.CANCEL)), f.PROTOCOL_ERROR),
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
        buf = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return 0
            buf += chunk
            while len(buf) >= f.HEAD_SIZE:
                high, low, kind, _flags, _stream = f.HEAD.unpack_from(buf, 0)
                size = high << 16 | low
                if len(buf) < f.HEAD_SIZE + size:
                    break
                payload = buf[f.HEAD_SIZE : f.HEAD_SIZE + size]
                buf = buf[f.HEAD_SIZE + size :]
                if kind == f.GOAWAY:
                    return int.from_bytes(payload[4:8], "big")


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_misbehaving_caller_gets_the_connection_error_h2_gives(
    nursery: trio.Nursery, short_tmp: Path, case: str
) -> None:
    """The relay ends the connection with the error code the RFC names, as an ``h2`` server does."""
    data, expected = CASES[case]
    relay = Relay()
    await nursery.start(relay.run)
    relay.configure(relay.route_to(str(short_tmp / "none.sock"), "upstream"), None, {}, unary_paths=[PATH])
    listen = str(short_tmp / "relay.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(listen)
    listener.listen(4)
    await nursery.start(relay.serve, listener)
    assert H2_DIFFERS.get(case, expected) == _h2_verdict(data)
    assert expected == await trio.to_thread.run_sync(_relay_verdict, listen, data)


async def test_a_window_update_of_0_on_a_stream_resets_only_that_stream(
    nursery: trio.Nursery, short_tmp: Path
) -> None:
    """WINDOW_UPDATE of 0 on an open stream is a stream error (RFC 9113 §6.9): RST_STREAM
    PROTOCOL_ERROR on it, and the connection still answers a PING."""
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a runtime that never answers
    silent.bind(str(short_tmp / "silent.sock"))
    silent.listen(4)
    relay = Relay()
    await nursery.start(relay.run)
    relay.configure(relay.route_to(str(short_tmp / "silent.sock"), "upstream"), None, {}, unary_paths=[PATH])
    listen = str(short_tmp / "relay.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(listen)
    listener.listen(4)
    await nursery.start(relay.serve, listener)
    encoder = h2.connection.H2Connection().encoder
    block = encoder.encode(
        [(":method", "POST"), (":scheme", "http"), (":path", PATH), ("content-type", "application/grpc")]
    )
    data = _after_preface(
        f.frame(f.HEADERS, f.END_HEADERS, 1, block),
        f.frame(f.WINDOW_UPDATE, 0, 1, b"\x00\x00\x00\x00"),
        f.frame(f.PING, 0, 0, b"12345678"),
    )

    def run() -> list[tuple[int, int, bytes]]:
        seen: list[tuple[int, int, bytes]] = []
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(listen)
            sock.sendall(data)
            buf = b""
            while not any(kind == f.PING for kind, _, _ in seen):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while len(buf) >= f.HEAD_SIZE:
                    high, low, kind, _flags, stream = f.HEAD.unpack_from(buf, 0)
                    size = high << 16 | low
                    if len(buf) < f.HEAD_SIZE + size:
                        break
                    seen.append((kind, stream, buf[f.HEAD_SIZE : f.HEAD_SIZE + size]))
                    buf = buf[f.HEAD_SIZE + size :]
        return seen

    try:
        seen = await trio.to_thread.run_sync(run)
    finally:
        silent.close()
    resets = [(stream, int.from_bytes(p, "big")) for kind, stream, p in seen if kind == f.RST_STREAM]
    assert [(1, f.PROTOCOL_ERROR)] == resets
    assert [] == [kind for kind, _, _ in seen if kind == f.GOAWAY]
    assert any(kind == f.PING for kind, _, _ in seen)
