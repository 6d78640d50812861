"""Wire input for the in-memory tests of :mod:`krproxy.h2.connection`: frames as a peer writes
them, and a reader of what the connection wrote back. :func:`split_frames` and :func:`read_frames`
also serve the integration tests that speak raw HTTP/2 to the relay over a socket."""

from __future__ import annotations

import socket
from collections.abc import Callable

import hpack

from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2.connection import Connection, Role


def grpc_request(path: bytes, authority: bytes = b"x") -> list[tuple[bytes, bytes]]:
    """The headers of a gRPC request to ``path`` as a client writes them, pseudo-headers first."""
    pseudo = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path), (b":authority", authority)]
    return [*pseudo, (b"content-type", b"application/grpc")]


REQUEST = grpc_request(b"/runtime.v1.RuntimeService/Version")
RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc")]


def block(headers: list[tuple[bytes, bytes]]) -> bytes:
    return hpack.Encoder().encode(headers)


def headers_frame(stream_id: int, headers: list[tuple[bytes, bytes]] = REQUEST, end: bool = False) -> bytes:
    return f.frame(f.HEADERS, f.END_HEADERS | (f.END_STREAM if end else 0), stream_id, block(headers))


def data_frame(stream_id: int, data: bytes, end: bool = False) -> bytes:
    return f.frame(f.DATA, f.END_STREAM if end else 0, stream_id, data)


#: One frame as read: ``(type, flags, stream id, payload)``.
Frame = tuple[int, int, int, bytes]


def split_frames(buf: bytes) -> tuple[list[Frame], bytes]:
    """The whole frames at the start of ``buf``, and the bytes after them (the start of a frame
    not yet all read)."""
    frames: list[Frame] = []
    offset = 0
    while len(buf) - offset >= f.HEAD_SIZE:
        high, low, kind, flags, stream_id = f.HEAD.unpack_from(buf, offset)
        end = offset + f.HEAD_SIZE + (high << 16 | low)
        if len(buf) < end:
            break
        frames.append((kind, flags, stream_id, bytes(buf[offset + f.HEAD_SIZE : end])))
        offset = end
    return frames, bytes(buf[offset:])


def parse(out: bytes) -> list[Frame]:
    """Each frame in ``out``, which holds whole frames only."""
    frames, rest = split_frames(out)
    assert not rest, f"{len(rest)} bytes after the last whole frame"
    return frames


def read_frames(sock: socket.socket, until: Callable[[list[Frame]], bool]) -> list[Frame]:
    """Frames read from the blocking ``sock`` until ``until`` holds for those read so far, or the
    peer closes (or resets) the connection; all the whole frames of the last read are kept."""
    seen: list[Frame] = []
    buf = b""
    while not until(seen):
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            break
        if not chunk:
            break
        frames, buf = split_frames(buf + chunk)
        seen += frames
    return seen


def resets(out: bytes) -> dict[int, int]:
    """Stream id -> RST_STREAM code, of the frames in ``out``."""
    return {sid: int.from_bytes(p, "big") for kind, _, sid, p in parse(out) if kind == f.RST_STREAM}


def goaway_code(out: bytes) -> int | None:
    codes = [f.parse_goaway(p)[1] for kind, _, _, p in parse(out) if kind == f.GOAWAY]
    return codes[-1] if codes else None


def window_updates(out: bytes) -> list[tuple[int, int]]:
    return [(sid, f.parse_u32(p)) for kind, _, sid, p in parse(out) if kind == f.WINDOW_UPDATE]


def server(max_streams: int | None = 1000, settings: bytes = f.settings([])) -> Connection:
    """A server connection that took a client's preface and SETTINGS; its output so far dropped."""
    conn = Connection(Role.SERVER, max_concurrent_streams=max_streams)
    conn.receive_data(f.PREFACE + settings)
    conn.data_to_send()
    return conn


def client(settings: bytes = f.settings([])) -> Connection:
    """A client connection that took a server's SETTINGS; its output so far dropped."""
    conn = Connection(Role.CLIENT)
    conn.receive_data(settings)
    conn.data_to_send()
    return conn


def terminated(events: list[ev.Event]) -> ev.ConnectionTerminated | None:
    last = events[-1] if events else None
    return last if isinstance(last, ev.ConnectionTerminated) else None


def kinds(events: list[ev.Event]) -> list[str]:
    return [type(e).__name__ for e in events]
