"""Tests of the lingering close at the daemon's stop and on krproxy's client side: callers that
close when they read the end do not hold the stop for the linger, one that never closes holds it at
most the grace period, a stream opened after the final GOAWAY never reaches the runtime, and an
upstream that drains krproxy's connection sees it closed at its EOF, not at its linger's bound."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest
import trio

from krproxy import rpc
from krproxy.h2 import frames as f
from krproxy.relay import connection
from tests.integration.support import (
    LIVENESS_LIMIT,
    grpcio_channels,
    start_proxy,
    start_scripted_backend,
    wait_until,
)
from tests.integration.test_grpc_go_client import goclient  # noqa: F401 - the fixture
from tests.integration.test_relay_conformance import _data, _open, _replaced
from tests.integration.test_relay_conformance_shutdown import _frames_until_eof, _has_ping
from tests.integration.test_relay_linger_close import lingered  # noqa: F401 - the fixture
from tests.unit.h2peer import read_frames

_STEADY = ("-duration", "120s", "-concurrency", "4", "-answered-file")
ECHO = "/krproxy.test.Linger/Echo"  # the scripted backend echoes it; no call of the store's recovery
SLOW = "/krproxy.test.Linger/Slow"  # answered after SLOW_FOR seconds: running at the final GOAWAY
SLOW_FOR = 1.5


@pytest.fixture(autouse=True)
def _long_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only a caller's close (or the grace period) can end a linger within these tests' limits.
    monkeypatch.setattr(connection, "LINGER", 10 * LIVENESS_LIMIT)


async def _slow(stream: rpc.Stream, messages: list[bytes]) -> None:
    await trio.sleep(SLOW_FOR)
    await stream.send_message(b"slow")


async def test_a_stop_is_not_held_by_a_grpcio_caller_that_closes(
    nursery: trio.Nursery,
    sockdir: str,
    lingered: list[connection.Endpoint],  # noqa: F811 - the fixture
) -> None:
    """grpcio with a call running at the final GOAWAY: the relay lingers once the answer is out,
    and grpcio's close (its call over, the server going away) ends the linger, long before its
    bound."""
    backend, _ = await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))
    backend.behaviours[SLOW] = _slow
    with grpcio_channels() as open_channel:
        async with trio.open_nursery() as daemon_nursery:
            proxy = await start_proxy(daemon_nursery, sockdir, grace_period=10 * LIVENESS_LIMIT)
            slow = open_channel(proxy.config.listen).unary_unary(SLOW)
            answer = slow.future(b"", timeout=LIVENESS_LIMIT)
            await wait_until(lambda: SLOW in backend.started)
            proxy.request_shutdown()
            with trio.fail_after(LIVENESS_LIMIT):  # the linger's bound is 10 times that
                await wait_until(lambda: not proxy.relay.transport._clients)
        # The daemon's serve() returned: it stopped.
        assert b"slow" == await trio.to_thread.run_sync(answer.result)
    assert 1 == len(lingered)


async def test_a_stop_is_not_held_by_a_grpc_go_caller_that_closes(
    nursery: trio.Nursery,
    sockdir: str,
    goclient: str,  # noqa: F811 - the fixture
    lingered: list[connection.Endpoint],  # noqa: F811 - the fixture,
) -> None:
    """kubelet's client (tests/goclient): calls running at the final GOAWAY, then its connection
    closed once they are answered; the stop ends long before the linger's bound."""
    backend, _ = await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))
    backend.behaviours[SLOW] = _slow
    answered = os.path.join(sockdir, "answered")
    async with trio.open_nursery() as daemon_nursery:
        proxy = await start_proxy(daemon_nursery, sockdir, grace_period=10 * LIVENESS_LIMIT)
        argv = [goclient, "-socket", proxy.config.listen, "-method", SLOW, "-mode", "steady", *_STEADY]
        client = subprocess.Popen(  # noqa: ASYNC220 - started at once, waited for by polling
            [*argv, answered],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            await wait_until(lambda: os.path.exists(answered))
            await wait_until(lambda: proxy.relay.transport.in_flight == 4)
            proxy.request_shutdown()
            with trio.fail_after(LIVENESS_LIMIT):
                await wait_until(lambda: not proxy.relay.transport._clients)
        finally:
            client.kill()
            client.wait()
    assert 1 == len(lingered)


async def test_a_caller_never_closing_holds_stop_at_most_the_grace(
    nursery: trio.Nursery, sockdir: str
) -> None:
    """The linger's bound is 10 times the test's limit here; the daemon's grace period (5 s: the
    PING's round trip of 1 s, then the linger) ends the stop first, and the connection is closed then."""
    await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))
    caller = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    caller.settimeout(LIVENESS_LIMIT)
    with caller:
        with trio.fail_after(LIVENESS_LIMIT):
            async with trio.open_nursery() as daemon_nursery:
                proxy = await start_proxy(daemon_nursery, sockdir, grace_period=5.0)
                await trio.to_thread.run_sync(caller.connect, proxy.config.listen)
                caller.sendall(f.PREFACE + f.frame(f.SETTINGS, 0, 0))
                await wait_until(lambda: len(proxy.relay.transport._clients) == 1)
                [ep] = proxy.relay.transport._clients
                proxy.request_shutdown()
                await wait_until(lambda: ep.lingering)  # the PING unanswered: final GOAWAY after 1 s
        # The daemon stopped with the caller's connection still open on its side: closed now.
        assert -1 == ep.sock.fileno()
        assert not proxy.relay.transport._clients


async def test_a_stream_after_the_final_goaway_never_goes_upstream(
    nursery: trio.Nursery, sockdir: str
) -> None:
    """A caller that opens a stream, and sends a PING and a SETTINGS, after the relay's final
    GOAWAY and end of writing: none is read (no answer, the runtime never sees the call), nothing
    fails, and the stop ends at the caller's close."""
    backend, _ = await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))
    caller = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    caller.settimeout(LIVENESS_LIMIT)
    async with trio.open_nursery() as daemon_nursery:
        proxy = await start_proxy(daemon_nursery, sockdir, grace_period=10 * LIVENESS_LIMIT)
        with caller:
            await trio.to_thread.run_sync(caller.connect, proxy.config.listen)
            caller.sendall(f.PREFACE + f.frame(f.SETTINGS, 0, 0))
            await wait_until(lambda: len(proxy.relay.transport._clients) == 1)
            proxy.request_shutdown()
            frames = await trio.to_thread.run_sync(read_frames, caller, _has_ping)
            ping = next(p for kind, flags, _, p in frames if kind == f.PING and not flags & f.ACK)
            caller.sendall(f.frame(f.PING, f.ACK, 0, ping))
            frames = await trio.to_thread.run_sync(_frames_until_eof, caller)
            assert [(0, f.NO_ERROR)] == [f.parse_goaway(p) for kind, _, _, p in frames if kind == f.GOAWAY]
            [ep] = proxy.relay.transport._clients
            assert ep.lingering
            caller.sendall(
                _open(*_replaced(":path", ECHO))
                + _data(5, end=True)
                + f.frame(f.PING, 0, 0, b"late-one")
                + f.frame(f.SETTINGS, 0, 0)
            )
            await trio.sleep(0.2)
            assert b"" == caller.recv(100)  # no answer to any of it
            assert ep.lingering  # still read on
        with trio.fail_after(LIVENESS_LIMIT):
            await wait_until(lambda: not proxy.relay.transport._clients)
    assert ECHO not in backend.started
    assert -1 == ep.sock.fileno()


async def test_an_upstream_that_drains_sees_krproxy_close_at_its_eof(
    nursery: trio.Nursery,
    sockdir: str,
    lingered: list[connection.Endpoint],  # noqa: F811 - the fixture
) -> None:
    """krproxy's relay as a client (to the runtime, or a hook server on the SDK's rpc.Server):
    when the upstream drains with a call of krproxy's running, krproxy closes its connection once
    the answer is in, so the upstream's linger ends there rather than at its bound (10 times the
    drain's limit here)."""
    backend, server = await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))
    backend.behaviours[SLOW] = _slow
    proxy = await start_proxy(nursery, sockdir, grace_period=10 * LIVENESS_LIMIT)
    with grpcio_channels() as open_channel:
        answer = open_channel(proxy.config.listen).unary_unary(SLOW).future(b"", timeout=LIVENESS_LIMIT)
        await wait_until(lambda: SLOW in backend.started)
        assert 1 == len(server.transport._clients)  # krproxy's connection to the backend
        assert await server.drain(LIVENESS_LIMIT)
        assert b"slow" == await trio.to_thread.run_sync(answer.result)
    assert not server.transport._clients
    assert 1 == len(lingered)


async def test_a_channel_closes_at_its_servers_drain(
    nursery: trio.Nursery,
    sockdir: str,
    lingered: list[connection.Endpoint],  # noqa: F811 - the fixture
) -> None:
    """krproxy.rpc.Channel (the SDK's client, krproxy's calls of its own) likewise."""
    backend, server = await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))
    backend.behaviours[SLOW] = _slow
    answers: list[bytes] = []
    async with rpc.Channel(os.path.join(sockdir, "backend.sock")) as channel:

        async def call() -> None:
            answers.append(await channel.unary(SLOW, b"", timeout=LIVENESS_LIMIT))

        nursery.start_soon(call)
        await wait_until(lambda: SLOW in backend.started)
        assert await server.drain(LIVENESS_LIMIT)
        assert not server.transport._clients
    assert [b"slow"] == answers
    assert 1 == len(lingered)
