"""Fixtures for proxy integration tests: real unix sockets in a short temp dir, one trio.run each."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import trio

from krproxy.daemon import Daemon
from krproxy.fakes.containerd import FakeContainerd
from krproxy.relay import Relay
from tests.integration.handover_support import Harness
from tests.integration.processes import ECHO_BACKEND, wait_for_socket
from tests.integration.support import (
    ProxiedFake,
    ScriptedBackend,
    grpcio_channels,
    start_proxy,
    start_scripted_backend,
)


@pytest.fixture
def sockdir(short_tmp: Path) -> str:
    """``short_tmp`` as a string: the directory for this test's sockets."""
    return str(short_tmp)


@pytest.fixture
def sock(short_tmp: Path) -> str:
    """``short_tmp/rpc.sock``: where a test's own krproxy.rpc server listens."""
    return str(short_tmp / "rpc.sock")


@pytest.fixture
async def scripted_backend(nursery: trio.Nursery, sockdir: str) -> ScriptedBackend:
    backend, _ = await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))
    return backend


@pytest.fixture
async def proxy(nursery: trio.Nursery, sockdir: str) -> Daemon:
    """The proxy on ``sockdir/proxy.sock`` in front of ``sockdir/backend.sock``."""
    return await start_proxy(nursery, sockdir)


@pytest.fixture
async def proxied_fake(
    fake_containerd: tuple[FakeContainerd, str], nursery: trio.Nursery, sockdir: str
) -> ProxiedFake:
    """The proxy on ``sockdir/proxy.sock`` in front of the fake containerd."""
    fake, backend = fake_containerd
    return ProxiedFake(fake, backend, await start_proxy(nursery, sockdir, runtime_endpoint=backend))


@pytest.fixture
async def relay(nursery: trio.Nursery) -> Relay:
    """A :class:`krproxy.relay.Relay` running in the test's nursery, not yet configured or serving."""
    relay = Relay()
    await nursery.start(relay.run)
    return relay


@pytest.fixture
def channel_to() -> Iterator[Callable[[str], grpc.Channel]]:
    """Open grpcio channels to unix socket paths (grpcio's retries off); all closed at teardown."""
    with grpcio_channels(
        ("grpc.max_receive_message_length", 64 << 20), ("grpc.enable_retries", 0)
    ) as open_channel:
        yield open_channel


@pytest.fixture
def harness(
    relay: Relay, nursery: trio.Nursery, short_tmp: Path, channel_to: Callable[[str], grpc.Channel]
) -> Iterator[Harness]:
    """The hand-over tests' relay, scripted runtime and interceptor (handover_support); the runtimes
    it started are stopped at teardown."""
    made = Harness(relay, nursery, short_tmp, channel_to)
    yield made
    for runtime in made.runtimes:
        runtime.close()


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test started (it appends them); killed at teardown if still running, and reaped."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


@pytest.fixture
def echo_backend(sockdir: str) -> Iterator[str]:
    """The echo backend (echo_backend.py) as a process of its own, on ``sockdir/backend.sock``."""
    path = os.path.join(sockdir, "backend.sock")
    process = subprocess.Popen([sys.executable, ECHO_BACKEND, path], stderr=subprocess.PIPE)
    wait_for_socket(path, process)
    yield path
    process.kill()
    process.wait()
