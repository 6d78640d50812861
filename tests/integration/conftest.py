"""Fixtures for proxy integration tests: real unix sockets in a short temp dir, one trio.run each."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import trio

from krproxy.daemon import Daemon
from tests.integration.support import ScriptedBackend, start_proxy, start_scripted_backend


@pytest.fixture
def sockdir(short_tmp: Path) -> str:
    """``short_tmp`` as a string: the directory for this test's sockets."""
    return str(short_tmp)


@pytest.fixture
async def scripted_backend(nursery: trio.Nursery, sockdir: str) -> ScriptedBackend:
    backend, _ = await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))
    return backend


@pytest.fixture
async def proxy(nursery: trio.Nursery, sockdir: str) -> Daemon:
    """The proxy on ``sockdir/proxy.sock`` in front of ``sockdir/backend.sock``."""
    return await start_proxy(nursery, sockdir)


@pytest.fixture
def channel_to() -> Iterator[Callable[[str], grpc.Channel]]:
    """Open grpcio channels to unix socket paths; all closed at teardown."""
    channels: list[grpc.Channel] = []

    def open_channel(path: str) -> grpc.Channel:
        channel = grpc.insecure_channel(
            f"unix://{path}",
            options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.enable_retries", 0)],
        )
        channels.append(channel)
        return channel

    yield open_channel
    for channel in channels:
        channel.close()
