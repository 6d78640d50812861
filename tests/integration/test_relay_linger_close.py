"""Tests of the relay's lingering close (Endpoint.close(DRAINED) on a caller connection): every
way a lingering connection ends closes its socket once and ends its reader, whatever the caller
does meanwhile, and the stop is held at most LINGER by it."""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from krproxy.h2 import frames as f
from krproxy.relay import _input, connection
from krproxy.relay import relay as relay_module
from tests.integration.support import LIVENESS_LIMIT, wait_until
from tests.integration.test_relay_conformance import (
    GOOD,
    PATH,
    _after_preface,
    _data,
    _open,
    _relay_before_a_silent_runtime,
    _relay_frames_on,
)
from tests.integration.test_relay_conformance_shutdown import _frames_until_eof
from tests.ticks import Ticks

#: Seconds a flooding caller writes before it gives up waiting for the relay to close.
_FLOOD_FOR = 20.0

#: A caller that writes WINDOW_UPDATE frames (increment 1, on the connection: valid, unanswered) as
#: fast as it can on the inherited socket, from before the stop to after its final GOAWAY, until
#: the relay closes the connection (exit 0), or _FLOOD_FOR seconds pass with the relay still
#: reading (exit 3). It creates the file named second once it has written a megabyte.
_FLOOD = """
import socket, sys, time
sock = socket.socket(fileno=int(sys.argv[1]))
sock.setblocking(True)  # the parent's timeout left it non-blocking
chunk = bytes.fromhex("000004080000000000" "00000001") * (1 << 16)
end = time.monotonic() + float(sys.argv[3])
sent = 0
try:
    while time.monotonic() < end:
        sock.sendall(chunk)
        sent += len(chunk)
        if sent == len(chunk):
            open(sys.argv[2], "w").close()
except OSError:
    sys.exit(0)
sys.exit(3)
"""


@pytest.fixture
def lingered(monkeypatch: pytest.MonkeyPatch) -> list[connection.Endpoint]:
    """The connections that began a linger (tests check that it was reached)."""
    begun: list[connection.Endpoint] = []
    linger = connection.Endpoint._linger

    def noted(ep: connection.Endpoint) -> None:
        begun.append(ep)
        linger(ep)

    monkeypatch.setattr(connection.Endpoint, "_linger", noted)
    return begun


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_caller_flooding_the_linger_is_closed_at_its_bound(
    nursery: trio.Nursery,
    short_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    lingered: list[connection.Endpoint],
) -> None:
    """A caller that writes megabytes without pause through the stop: after the final GOAWAY the
    relay discards them and still closes the connection after LINGER, and the rest of the relay
    runs meanwhile."""
    monkeypatch.setattr(connection, "LINGER", 1.0)
    listen, silent, relay = await _relay_before_a_silent_runtime(nursery, short_tmp)
    drained = trio.Event()
    started = short_tmp / "flooding"
    ticks = Ticks(0.05)

    async def stop() -> None:
        await relay.transport.wait_drained(round_trip=0.2)  # the PING unanswered
        drained.set()

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(LIVENESS_LIMIT)
            await trio.to_thread.run_sync(sock.connect, listen)
            await trio.to_thread.run_sync(_relay_frames_on, sock, _after_preface())
            flood = await trio.lowlevel.open_process(
                [sys.executable, "-c", _FLOOD, str(sock.fileno()), str(started), str(_FLOOD_FOR)],
                pass_fds=[sock.fileno()],
            )
        try:
            await wait_until(started.exists)
            relay.transport.start_draining()
            nursery.start_soon(stop)
            nursery.start_soon(ticks.run)
            status = await flood.wait()
        finally:
            if flood.returncode is None:
                flood.kill()
                await flood.wait()
        assert 0 == status, f"the relay read the flood for {_FLOOD_FOR:g} s without closing"
        with trio.fail_after(LIVENESS_LIMIT):
            await drained.wait()
        assert 1 == len(lingered)
        assert not relay.transport._clients
        assert ticks.count > 0  # other tasks ran while the flood was read
    finally:
        silent.close()


#: Caller connections lingering at once in the tests below.
_MANY = 200


async def _many_draining(
    listen: str, relay: relay_module.Relay, nursery: trio.Nursery, drained: trio.Event
) -> list[trio.socket.SocketType]:
    """_MANY caller connections through the preface, then a stop's drain begun (their PINGs
    unanswered: the final GOAWAY comes after the round trip); ``drained`` is set at its end."""
    callers = []
    for _ in range(_MANY):
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.connect(listen)
        await sock.send(f.PREFACE + f.frame(f.SETTINGS, 0, 0))
        callers.append(sock)
    await wait_until(lambda: len(relay.transport._clients) == _MANY)

    async def stop() -> None:
        await relay.transport.wait_drained(round_trip=0.2)
        drained.set()

    relay.transport.start_draining()
    nursery.start_soon(stop)
    return callers


async def _many_drained(
    listen: str, relay: relay_module.Relay, nursery: trio.Nursery, drained: trio.Event
) -> list[trio.socket.SocketType]:
    """:func:`_many_draining`, each connection read up to the relay's end of writing."""
    callers = await _many_draining(listen, relay, nursery, drained)
    with trio.fail_after(LIVENESS_LIMIT):
        for sock in callers:
            while await sock.recv(65536):  # up to the relay's SHUT_WR
                pass
    return callers


async def test_hundreds_of_lingering_connections_end_at_the_bound(
    nursery: trio.Nursery, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Callers that keep their connections open: each lingers LINGER from its own final GOAWAY, all
    at once (not LINGER after one another), and every socket of the relay's is closed then."""
    monkeypatch.setattr(connection, "LINGER", 1.0)
    listen, silent, relay = await _relay_before_a_silent_runtime(nursery, short_tmp)
    drained = trio.Event()
    try:
        callers = await _many_drained(listen, relay, nursery, drained)
        ours = [ep.sock for ep in relay.transport._clients]
        assert all(ep.lingering for ep in relay.transport._clients)
        fds = _open_fds()
        with trio.fail_after(LIVENESS_LIMIT):  # one after another would be _MANY seconds
            await drained.wait()
        assert fds - _MANY == _open_fds()
        assert all(-1 == sock.fileno() for sock in ours)
        for sock in callers:
            assert b"" == await sock.recv(10)
            sock.close()
    finally:
        silent.close()


@pytest.mark.parametrize("read_first", [True, False], ids=["eof", "reset"])
async def test_lingering_connections_end_at_the_callers_close(
    nursery: trio.Nursery, short_tmp: Path, monkeypatch: pytest.MonkeyPatch, read_first: bool
) -> None:
    """Callers that close once they read the end (eof), or with the relay's last bytes unread
    (reset: the relay's read fails ECONNRESET, a unix socket's way to say so): the linger ends at
    their close, not at its bound, and the relay's sockets are closed."""
    monkeypatch.setattr(connection, "LINGER", 10 * LIVENESS_LIMIT)
    listen, silent, relay = await _relay_before_a_silent_runtime(nursery, short_tmp)
    drained = trio.Event()
    try:
        if read_first:
            callers = await _many_drained(listen, relay, nursery, drained)
        else:
            callers = await _many_draining(listen, relay, nursery, drained)
            await wait_until(lambda: all(ep.lingering for ep in relay.transport._clients))
        ours = [ep.sock for ep in relay.transport._clients]
        fds = _open_fds()
        for sock in callers:
            sock.close()
        with trio.fail_after(LIVENESS_LIMIT):
            await drained.wait()
        assert fds - 2 * _MANY == _open_fds()
        assert all(-1 == sock.fileno() for sock in ours)
    finally:
        silent.close()


async def test_a_stop_during_the_linger_closes_every_socket(
    nursery: trio.Nursery, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay's run() cancelled (the daemon's grace period over, or a stop) while connections
    linger: Relay.run's close(STOPPED) and the readers' cancellation close each socket, once."""
    monkeypatch.setattr(connection, "LINGER", 10 * LIVENESS_LIMIT)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(short_tmp / "silent.sock"))
    silent.listen(4)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # ours: left open by the relay
    drained = trio.Event()
    try:
        async with trio.open_nursery() as inner:
            relay = relay_module.Relay()
            relay.configure(relay.route_to(str(short_tmp / "silent.sock"), "silent"), None, {}, [PATH])
            listen = str(short_tmp / "relay.sock")
            listener.bind(listen)
            listener.listen(16)
            await inner.start(relay.serve, listener)
            callers = await _many_drained(listen, relay, inner, drained)
            ours = [ep.sock for ep in relay.transport._clients]
            fds = _open_fds()
            inner.cancel_scope.cancel()
        assert not drained.is_set()
        assert not relay.transport._clients
        assert all(-1 == sock.fileno() for sock in ours)
        assert fds - _MANY == _open_fds()
        for sock in callers:
            sock.close()
    finally:
        silent.close()
        listener.close()


async def test_a_linger_begun_while_a_block_is_decoded_aside_reads_on(
    nursery: trio.Nursery, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's new stream has a header block too large to decode in the event loop
    (DECODE_PER_TURN): the reader waits for a worker thread, and meanwhile the stop's final GOAWAY
    (the PING unanswered, after the round trip) begins the linger; the stream is above the
    GOAWAY's last id (0), so the caller sends it again elsewhere, but only if it can still write
    its DATA and read that GOAWAY. The reader back from the thread found the connection closed and
    ended it with ClosedResourceError, which closed the socket at once: the caller's next write
    failed (EPIPE), grpcio's way to fail the call UNAVAILABLE instead of retrying it."""
    monkeypatch.setattr(connection, "LINGER", 10 * LIVENESS_LIMIT)  # only the caller's close ends it
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    decode = _input._decode_aside

    def held(*args: Any) -> Any:
        entered.set()
        release.wait(LIVENESS_LIMIT)
        try:
            return decode(*args)
        finally:
            returned.set()

    monkeypatch.setattr(_input, "_decode_aside", held)
    listen, silent, relay = await _relay_before_a_silent_runtime(nursery, short_tmp)
    drained = trio.Event()

    async def stop() -> None:
        await relay.transport.wait_drained(round_trip=0.2)
        drained.set()

    big = (*GOOD, ("x-big", "v" * (2 * connection.DECODE_PER_TURN)))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(LIVENESS_LIMIT)
    try:
        with sock:
            await trio.to_thread.run_sync(sock.connect, listen)
            await trio.to_thread.run_sync(_relay_frames_on, sock, _after_preface())
            [ep] = relay.transport._clients
            sock.sendall(_open(*big))  # stream 1, its DATA to follow
            await trio.to_thread.run_sync(entered.wait, LIVENESS_LIMIT)
            relay.transport.start_draining()
            nursery.start_soon(stop)
            await wait_until(lambda: ep.lingering)  # the final GOAWAY is out, the write side shut
            release.set()
            await trio.to_thread.run_sync(returned.wait, LIVENESS_LIMIT)
            # The reader back from its thread: on to its next read (which resets the decoding
            # budget the block overdrew), or out with the connection closed.
            budget = connection.DECODE_PER_TURN
            await wait_until(lambda: ep.h2.blocks.decode_budget == budget or not ep.lingering)
            assert ep.lingering and ep.sock.fileno() >= 0
            sock.sendall(_data(5, end=True))  # the stream's DATA: taken in, not read
            frames = await trio.to_thread.run_sync(_frames_until_eof, sock)
            assert (0, f.NO_ERROR) == f.parse_goaway([p for kind, _, _, p in frames if kind == f.GOAWAY][-1])
            assert not drained.is_set()
        with trio.fail_after(LIVENESS_LIMIT):
            await drained.wait()
        assert 0 == relay.transport.in_flight
    finally:
        release.set()
        silent.close()
