"""Tests of dc00bf0 (relay/_input: after a read shorter than its buffer, the reader waits for the socket to
be readable instead of reading again into EAGAIN): whatever sizes the caller's bytes arrive in, every frame
is read and every call answered, and nothing hangs. A caller whose writes are exactly the reader's buffer
(256 KiB, and twice that), one that sends a byte or a few at a time, and one that half-closes its socket
right after its last request."""

from __future__ import annotations

import random
import socket
import time

import trio
from cri_api.v1 import api_pb2 as pb

from krproxy.fakes.containerd import FakeContainerd
from krproxy.h2 import frames as f
from krproxy.relay import _input
from krproxy.relay.rpc import grpc_message, request_headers
from tests.integration.support import LIVENESS_LIMIT, in_thread, start_proxy, wait_until
from tests.unit.h2peer import Frame, read_frames

VERSION = "/runtime.v1.RuntimeService/Version"
UNKNOWN_FRAME = 0xF0  # an extension frame type: ignored (RFC 9113 §5.5)


def calls(count: int) -> tuple[bytes, list[int]]:
    """The preface, SETTINGS and ``count`` Version calls (each a HEADERS and a DATA frame ending it)."""
    block = f.encode_headers(request_headers(VERSION))
    message = grpc_message(pb.VersionRequest(version="v1").SerializeToString())
    out = [f.PREFACE, f.settings([])]
    ids = list(range(1, 2 * count, 2))
    for stream_id in ids:
        out.append(f.frame(f.HEADERS, f.END_HEADERS, stream_id, block))
        out.append(f.frame(f.DATA, f.END_STREAM, stream_id, message))
    return b"".join(out), ids


def padded(data: bytes, size: int) -> bytes:
    """``data`` and extension frames (ignored) making exactly ``size`` bytes."""
    left = size - len(data)
    assert left >= f.HEAD_SIZE
    pad = []
    while left:
        payload = min(left - f.HEAD_SIZE, 16384)
        if 0 < left - f.HEAD_SIZE - payload < f.HEAD_SIZE:  # leave room for one more frame's head
            payload -= f.HEAD_SIZE
        pad.append(f.frame(UNKNOWN_FRAME, 0, 0, bytes(payload)))
        left -= f.HEAD_SIZE + payload
    out = data + b"".join(pad)
    assert len(out) == size
    return out


def answered(ids: list[int]) -> object:
    def done(frames: list[Frame]) -> bool:
        ended = {
            sid for kind, flags, sid, _ in frames if kind in (f.HEADERS, f.DATA) and flags & f.END_STREAM
        }
        return set(ids) <= ended

    return done


def ended_streams(frames: list[Frame]) -> dict[int, str]:
    out: dict[int, str] = {}
    for kind, flags, sid, _ in frames:
        if kind in (f.HEADERS, f.DATA) and flags & f.END_STREAM:
            out[sid] = "ended"
        elif kind == f.RST_STREAM:
            out[sid] = "reset"
    return out


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(LIVENESS_LIMIT)
    sock.connect(path)
    return sock


async def test_writes_of_exactly_the_readers_buffer_are_all_read(
    fake_containerd: tuple[FakeContainerd, str], nursery: trio.Nursery, sockdir: str
) -> None:
    _, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    size = _input._RECV_SIZE

    def run(buffers: int) -> dict[int, str]:
        data, ids = calls(200)
        sock = connect(proxy.config.listen)
        try:
            sock.sendall(padded(data, buffers * size))
            return ended_streams(read_frames(sock, answered(ids)))
        finally:
            sock.close()

    for buffers in (1, 2):
        ended = await in_thread(run, buffers)
        assert {sid: "ended" for sid in range(1, 400, 2)} == ended


async def test_bytes_that_come_a_few_at_a_time_are_all_read(
    fake_containerd: tuple[FakeContainerd, str], nursery: trio.Nursery, sockdir: str
) -> None:
    _, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)

    def run() -> dict[int, str]:
        data, ids = calls(5)
        rng = random.Random(5)
        sock = connect(proxy.config.listen)
        try:
            pos = 0
            while pos < len(data):
                step = rng.choice([1, 1, 2, 3, 9, 10, 40])
                sock.sendall(data[pos : pos + step])
                pos += step
                time.sleep(0.001)  # a short read each time
            return ended_streams(read_frames(sock, answered(ids)))
        finally:
            sock.close()

    assert {sid: "ended" for sid in range(1, 10, 2)} == await in_thread(run)


async def test_a_caller_that_half_closes_its_socket_is_let_go(
    fake_containerd: tuple[FakeContainerd, str], nursery: trio.Nursery, sockdir: str
) -> None:
    """EOF after the answers, and EOF in the same read as the requests (a short read, then EOF): the
    relay ends the connection at once, as grpc-go's transport does on EOF (the calls still open are
    cancelled: so before dc00bf0 too), and keeps no call counted. Nothing waits for bytes that cannot come."""
    _, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)

    def run(wait_for_answers: bool) -> dict[int, str]:
        data, ids = calls(3)
        sock = connect(proxy.config.listen)
        try:
            sock.sendall(data)
            ended = ended_streams(read_frames(sock, answered(ids))) if wait_for_answers else {}
            sock.shutdown(socket.SHUT_WR)
            read_frames(sock, lambda frames: False)  # to the end of the connection (or the socket's timeout)
            return ended
        finally:
            sock.close()

    started = time.monotonic()
    assert {1: "ended", 3: "ended", 5: "ended"} == await in_thread(run, True)
    assert {} == await in_thread(run, False)
    assert time.monotonic() - started < LIVENESS_LIMIT  # the relay closed: no read ran into its timeout
    await wait_until(lambda: proxy.relay.transport.in_flight == 0)
