"""HTTP/2 conformance of the relay's caller side (RFC 9113) at shutdown: the two-step GOAWAY
(§6.8), and a drained connection's linger: what the caller still sends is taken until it closes.
"""

from __future__ import annotations

import socket
from pathlib import Path

import hpack
import pytest
import trio

from krproxy.h2 import frames as f
from krproxy.relay import Relay, connection
from tests.integration.support import LIVENESS_LIMIT, wait_until
from tests.integration.test_relay_conformance import (
    GOOD,
    _after_preface,
    _relay_before_a_silent_runtime,
    _relay_frames_on,
)
from tests.unit.h2peer import Frame, read_frames, split_frames


async def test_shutdown_sends_the_two_step_goaway(nursery: trio.Nursery, short_tmp: Path) -> None:
    """RFC 9113 §6.8: GOAWAY with the largest id and a PING; a stream opened before the PING's
    answer is still taken; after the answer GOAWAY names it as the last, and a later stream is
    refused (REFUSED_STREAM: the caller sends it again elsewhere)."""
    listen, silent, relay = await _relay_before_a_silent_runtime(nursery, short_tmp)
    encoder = hpack.Encoder()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    unread: list[Frame] = []  # read from the socket, not yet looked at
    buf = b""

    def read_until(kind: int) -> Frame:
        nonlocal buf
        while True:
            while unread:
                frame = unread.pop(0)
                if frame[0] == kind:
                    return frame
            chunk = sock.recv(65536)
            assert chunk, "the relay closed the connection"
            frames, buf = split_frames(buf + chunk)
            unread.extend(frames)

    try:
        await trio.to_thread.run_sync(sock.connect, listen)
        sock.sendall(_after_preface(f.frame(f.HEADERS, f.END_HEADERS, 1, encoder.encode(list(GOOD)))))
        await trio.to_thread.run_sync(read_until, f.SETTINGS)
        await wait_until(lambda: relay.transport.in_flight == 1)
        relay.transport.start_draining()
        _, _, _, first = await trio.to_thread.run_sync(read_until, f.GOAWAY)
        _, ping_flags, _, ping = await trio.to_thread.run_sync(read_until, f.PING)
        # Stream 3 was on its way before we saw the GOAWAY: it is served.
        sock.sendall(f.frame(f.HEADERS, f.END_HEADERS, 3, encoder.encode(list(GOOD))))
        await wait_until(lambda: relay.transport.in_flight == 2)
        sock.sendall(f.frame(f.PING, f.ACK, 0, ping))
        _, _, _, final = await trio.to_thread.run_sync(read_until, f.GOAWAY)
        sock.sendall(f.frame(f.HEADERS, f.END_HEADERS, 5, encoder.encode(list(GOOD))))
        _, _, stream, code = await trio.to_thread.run_sync(read_until, f.RST_STREAM)
    finally:
        sock.close()
        silent.close()
    assert (2**31 - 1, f.NO_ERROR) == f.parse_goaway(first)
    assert 0 == ping_flags & f.ACK
    assert (3, f.NO_ERROR) == f.parse_goaway(final)
    assert (5, f.REFUSED_STREAM) == (stream, int.from_bytes(code, "big"))


def _frames_until_eof(sock: socket.socket) -> list[Frame]:
    """Every frame the relay writes before it ends its side of the connection."""
    buf = b""
    while chunk := sock.recv(65536):
        buf += chunk
    frames, rest = split_frames(buf)
    assert b"" == rest
    return frames


async def _drained_to_the_final_goaway(
    relay: Relay, listen: str, drained: trio.Event, nursery: trio.Nursery
) -> socket.socket:
    """A caller connection with no call, through the two-step GOAWAY of a stop (the PING answered),
    up to the relay's end of writing; ``drained`` is set when :meth:`Transport.wait_drained` returns."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(LIVENESS_LIMIT)
    await trio.to_thread.run_sync(sock.connect, listen)
    seen = await trio.to_thread.run_sync(_relay_frames_on, sock, _after_preface())
    assert any(kind == f.SETTINGS for kind, _, _ in seen)
    relay.transport.start_draining()

    async def stop() -> None:
        await relay.transport.wait_drained()
        drained.set()

    nursery.start_soon(stop)
    ping = next(
        p
        for kind, flags, _, p in await trio.to_thread.run_sync(read_frames, sock, _has_ping)
        if kind == f.PING
    )
    sock.sendall(f.frame(f.PING, f.ACK, 0, ping))
    frames = await trio.to_thread.run_sync(_frames_until_eof, sock)
    assert [(0, f.NO_ERROR)] == [f.parse_goaway(p) for kind, _, _, p in frames if kind == f.GOAWAY]
    return sock


def _has_ping(seen: list[Frame]) -> bool:
    return any(kind == f.PING and not flags & f.ACK for kind, flags, _, _ in seen)


async def test_a_drained_connection_reads_until_the_caller_closes(
    nursery: trio.Nursery, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After its final GOAWAY the relay ends only its own side of a caller's connection and reads
    on (a lingering close): a caller that opened a stream just before it read the GOAWAY can still
    write it, then read the GOAWAY that says the stream was not processed, and send it again
    elsewhere. A close at once failed that write with EPIPE, and grpcio failed the call UNAVAILABLE
    ("Stream removed (sendmsg: Broken pipe)") instead of retrying it, in test_relay_restart."""
    monkeypatch.setattr(connection, "LINGER", 10 * LIVENESS_LIMIT)  # only the caller's close ends it
    listen, silent, relay = await _relay_before_a_silent_runtime(nursery, short_tmp)
    drained = trio.Event()
    try:
        sock = await _drained_to_the_final_goaway(relay, listen, drained, nursery)
        with sock:
            # The relay has written its last byte; the caller's late stream is still taken in.
            sock.sendall(
                f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 1, hpack.Encoder().encode(list(GOOD)))
            )
            sock.sendall(f.frame(f.PING, 0, 0, b"late-one"))
            await trio.sleep(0.05)
            assert not drained.is_set()  # the relay waits for the caller to close
        with trio.fail_after(LIVENESS_LIMIT):
            await drained.wait()
        assert 0 == relay.transport.in_flight  # the late stream, above the last id, never became a call
    finally:
        silent.close()


async def test_a_drained_connection_kept_open_closes_after_linger(
    nursery: trio.Nursery, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lingering close is bounded: a caller that neither closes nor stops writing does not
    hold the stop up beyond connection.LINGER."""
    monkeypatch.setattr(connection, "LINGER", 0.2)
    listen, silent, relay = await _relay_before_a_silent_runtime(nursery, short_tmp)
    drained = trio.Event()
    try:
        sock = await _drained_to_the_final_goaway(relay, listen, drained, nursery)
        with sock:
            with trio.fail_after(LIVENESS_LIMIT):
                while not drained.is_set():
                    try:
                        sock.sendall(f.frame(f.PING, 0, 0, b"12345678"))
                    except OSError:  # the relay closed it at the bound (EPIPE, ECONNRESET) ...
                        break
                    await trio.sleep(0.01)
                await drained.wait()  # ... and the stop's wait for it ends
            with pytest.raises(OSError):  # closed, not merely quiet
                for _ in range(100):
                    sock.sendall(f.frame(f.PING, 0, 0, b"12345678"))
    finally:
        silent.close()


async def test_a_linger_begun_before_the_reader_ran_keeps_its_bound(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection drained before its reader task first ran (accepted just as the stop began)
    lingers LINGER, not the preface's HANDSHAKE_TIMEOUT, which run() would otherwise set."""
    monkeypatch.setattr(connection, "LINGER", 0.2)
    monkeypatch.setattr(connection, "HANDSHAKE_TIMEOUT", 10 * LIVENESS_LIMIT)
    relay = Relay()
    await nursery.start(relay.run)
    ours, caller = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with caller:
        ep = connection.Endpoint(relay.transport, ours, server_side=True)
        ep.announce_goaway()
        ep.final_goaway()  # no call on it: written out, then the linger
        assert ep.lingering
        with trio.fail_after(LIVENESS_LIMIT):
            await ep.run()
        assert not ep.lingering
        assert -1 == ours.fileno()
