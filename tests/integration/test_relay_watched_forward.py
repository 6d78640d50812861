"""Tests of createlat3 (eacd1f9, fef5f70): an intercepted call's forward waits for the runtime in
no cancel scope of its own (``Transport.unary(watched=True)``), trusting the caller's call's timer, and
the recovery gate lets calls through without a checkpoint once set. Every way such a call can end
while its forward or its gate waits must end the forward and reset the runtime's stream: the
deadline, the caller's reset, the caller's connection gone, a call without a deadline, a second
forward after the first, a gate never set."""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import trio

from krproxy import rpc
from krproxy.forward import Forward, Reply, runtime_interceptors
from krproxy.h2 import frames as f
from krproxy.relay import Relay
from krproxy.relay.rpc import grpc_message, request_headers
from tests.integration.support import LIVENESS_LIMIT, hanging, serve_relay, wait_until

PATH = "/runtime.v1.RuntimeService/RemoveContainer"


class Runtime:
    """A runtime whose RemoveContainer never answers; counts the calls started and cancelled."""

    def __init__(self) -> None:
        self.started = 0
        self.ended = 0
        self.server = rpc.Server({PATH: hanging(self._started, self._ended)})

    def _started(self, stream: rpc.Stream) -> None:
        self.started += 1

    def _ended(self) -> None:
        self.ended += 1


async def _setup(
    relay: Relay,
    nursery: trio.Nursery,
    short_tmp: Path,
    *,
    twice: bool = False,
    gate: trio.Event | None = None,
) -> tuple[Runtime, str]:
    runtime = Runtime()
    up = str(short_tmp / "runtime.sock")
    await nursery.start(runtime.server.serve, up)

    async def remove(request: bytes, forward: Forward) -> Reply:
        reply = await forward(request)
        if twice:
            reply = await forward(request)
        return reply

    interceptors = runtime_interceptors({"RemoveContainer": remove}, gate=gate)
    relay.configure(relay.route_to(up, "runtime"), None, interceptors, unary_paths=[PATH])
    listen = await serve_relay(nursery, relay, os.path.join(short_tmp, "relay.sock"))
    return runtime, listen


async def _call(channel: grpc.Channel, timeout: float | None) -> grpc.StatusCode:  # noqa: ASYNC109 - the call's deadline, sent as grpc-timeout
    method = channel.unary_unary(PATH, request_serializer=None, response_deserializer=None)
    try:
        await trio.to_thread.run_sync(functools.partial(method, b"\x0a\x01c", timeout=timeout))
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


@pytest.mark.parametrize("twice", [False, True], ids=["one-forward", "second-forward"])
async def test_the_deadline_ends_a_watched_forward_and_resets_it(
    relay: Relay,
    nursery: trio.Nursery,
    short_tmp: Path,
    channel_to: Callable[[str], grpc.Channel],
    twice: bool,
) -> None:
    """The deadline ends a watched forward and resets the runtimes stream."""
    runtime, listen = await _setup(relay, nursery, short_tmp, twice=twice)
    with trio.fail_after(LIVENESS_LIMIT):
        for count in (1, 2):
            assert grpc.StatusCode.DEADLINE_EXCEEDED == await _call(channel_to(listen), 0.5)
            await wait_until(lambda: runtime.ended == count)  # noqa: B023 - awaited here
            await relay.transport.wait_idle()
    assert 2 == runtime.started


async def test_a_call_without_deadline_ends_with_its_connection(
    relay: Relay, nursery: trio.Nursery, short_tmp: Path
) -> None:
    """No grpc-timeout (no timer): the forward waits, then the caller resets the stream, or closes
    its connection: the forward ends and the runtime's stream is reset each time."""
    runtime, listen = await _setup(relay, nursery, short_tmp)
    request = f.frame(f.HEADERS, f.END_HEADERS, 1, f.encode_headers(request_headers(PATH))) + f.frame(
        f.DATA, f.END_STREAM, 1, grpc_message(b"\x0a\x01c")
    )
    with trio.fail_after(LIVENESS_LIMIT):
        for count, ending in enumerate((f.rst_stream(1, f.CANCEL), b"close"), start=1):
            sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with sock:
                await sock.connect(listen)
                await sock.send(f.PREFACE + f.settings([]) + request)
                await wait_until(lambda: runtime.started == count)  # noqa: B023 - awaited here
                if ending != b"close":
                    await sock.send(ending)
            await wait_until(lambda: runtime.ended == count)  # noqa: B023 - awaited here
            await relay.transport.wait_idle()


async def test_a_call_at_the_gate_ends_at_its_deadline(
    relay: Relay, nursery: trio.Nursery, short_tmp: Path, channel_to: Callable[[str], grpc.Channel]
) -> None:
    """Recovery not done: the call waits at the gate; its deadline ends it; the gate opened later
    lets no forward of that call out, and a new call goes through to the runtime."""
    gate = trio.Event()
    runtime, listen = await _setup(relay, nursery, short_tmp, gate=gate)
    with trio.fail_after(LIVENESS_LIMIT):
        assert grpc.StatusCode.DEADLINE_EXCEEDED == await _call(channel_to(listen), 0.5)
        await relay.transport.wait_idle()
        gate.set()
        await trio.sleep(0.2)
        assert 0 == runtime.started
        assert grpc.StatusCode.DEADLINE_EXCEEDED == await _call(channel_to(listen), 0.5)
        await wait_until(lambda: runtime.ended == 1)
    assert 1 == runtime.started
