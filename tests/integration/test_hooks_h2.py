"""The plugin client (krproxy.hooks.h2.PluginChannel) against independent gRPC servers: grpcio (C core, as
close to grpc-go as Python gets) and grpclib. Flow control, concurrency limits, statuses, timeouts,
reconnection and unreachable sockets, on real unix sockets."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import grpclib.const
import grpclib.server
import pytest
import trio
import trio_asyncio
from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from fakes.plugin.h2server import Exchange, start_server
from krproxy._grpc import BytesCodec, Raw, serve
from krproxy.hooks import h2
from krproxy.hooks.h2 import PluginChannel
from tests.integration.support import wait_until

SERVICE = "runtime.v1alpha1.RuntimeHookService"
METHOD = "PreCreateContainerHook"
PATH = f"/{SERVICE}/{METHOD}"

Handler = Callable[[bytes, grpc.ServicerContext], bytes]


@contextlib.contextmanager
def grpcio_server(path: str, handler: Handler, **options: Any) -> Iterator[grpc.Server]:
    """A grpcio server on ``path`` whose one method hands raw bytes to ``handler``."""
    server = grpc.server(ThreadPoolExecutor(max_workers=16), options=list(options.items()))
    methods = {METHOD: grpc.unary_unary_rpc_method_handler(handler)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        yield server
    finally:
        server.stop(None)


def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


async def call(channel: PluginChannel, message: bytes, seconds: float = 5.0) -> bytes:
    result: bytes = await trio_asyncio.aio_as_trio(channel.unary)(PATH, message, seconds)
    return result


@pytest.fixture
def channel_at(aio_loop: Any, short_tmp: Path) -> Iterator[Callable[[str], PluginChannel]]:
    channels: list[PluginChannel] = []

    def open_channel(name: str) -> PluginChannel:
        channels.append(PluginChannel(str(short_tmp / name)))
        return channels[-1]

    yield open_channel
    for channel in channels:
        channel.close()


class TestAgainstGrpcio:
    async def test_large_messages_both_ways(self, channel_at: Callable[[str], PluginChannel]) -> None:
        """A 1 MB request and answer: both sides' flow control (grpcio starts with 64 KiB windows)."""
        channel = channel_at("p.sock")
        message = os.urandom(1 << 20)
        with grpcio_server(channel.path, echo):
            assert message == await call(channel, message)
            assert b"small" == await call(channel, b"small")

    async def test_more_calls_than_the_server_allows_at_once(
        self, channel_at: Callable[[str], PluginChannel]
    ) -> None:
        """With grpc.max_concurrent_streams=2, twelve concurrent calls wait their turn and all succeed."""
        channel = channel_at("p.sock")
        active, peak = 0, 0
        lock = threading.Lock()

        def slow_echo(request: bytes, context: grpc.ServicerContext) -> bytes:
            nonlocal active, peak
            with lock:
                active += 1
                peak = max(peak, active)
            time.sleep(0.05)
            with lock:
                active -= 1
            return request

        answers: list[bytes] = []

        async def one(i: int) -> None:
            answers.append(await call(channel, b"%d" % i))

        with grpcio_server(channel.path, slow_echo, **{"grpc.max_concurrent_streams": 2}):
            await call(channel, b"warm-up")  # the server's SETTINGS are known from here on
            async with trio.open_nursery() as nursery:
                for i in range(12):
                    nursery.start_soon(one, i)

        assert sorted(b"%d" % i for i in range(12)) == sorted(answers)
        assert 2 == peak

    async def test_error_status_and_message(self, channel_at: Callable[[str], PluginChannel]) -> None:
        """The server's status and (percent-encoded, non-ASCII) message come back as a GRPCError."""
        channel = channel_at("p.sock")

        def refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "nö way: 100%")

        with grpcio_server(channel.path, refuse), pytest.raises(GRPCError) as info:
            await call(channel, b"x")

        assert (Status.FAILED_PRECONDITION, "nö way: 100%") == (info.value.status, info.value.message)

    async def test_timeout_cancels_the_call_on_the_server(
        self, channel_at: Callable[[str], PluginChannel]
    ) -> None:
        """No answer within the time: TimeoutError, and the server sees the call end (the stream is reset,
        or the deadline sent as grpc-timeout expired) long before its handler would have answered."""
        channel = channel_at("p.sock")
        ended = threading.Event()

        def stall(request: bytes, context: grpc.ServicerContext) -> bytes:
            context.add_callback(ended.set)
            time.sleep(3)
            return request

        with grpcio_server(channel.path, stall):
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await call(channel, b"x", seconds=0.2)
            assert time.monotonic() - started < 1.0
            await wait_until(ended.is_set, limit=2.0)
            assert b"again" == await call(channel, b"again")  # the connection is still good

    async def test_reconnects_to_a_restarted_plugin(self, channel_at: Callable[[str], PluginChannel]) -> None:
        """After the plugin's server went away, the next call opens a new connection to its successor."""
        channel = channel_at("p.sock")
        with grpcio_server(channel.path, lambda request, context: b"first"):
            assert b"first" == await call(channel, b"x")
        connection = channel._connection
        assert connection is not None
        await wait_until(lambda: not connection.usable)

        with grpcio_server(channel.path, lambda request, context: b"second"):
            assert b"second" == await call(channel, b"x")


class TestAgainstGrpclib:
    async def test_echo_and_status(
        self, nursery: trio.Nursery, channel_at: Callable[[str], PluginChannel]
    ) -> None:
        """A grpclib server: a 1 MB echo, then an error status with its message."""
        channel = channel_at("p.sock")

        async def handle(stream: grpclib.server.Stream[bytes, bytes]) -> None:
            request = await stream.recv_message()
            assert request is not None
            if request == b"fail":
                raise GRPCError(Status.RESOURCE_EXHAUSTED, "too much")
            await stream.send_message(request)

        class Routes:
            def __mapping__(self) -> dict[str, grpclib.const.Handler]:
                return {PATH: grpclib.const.Handler(handle, grpclib.const.Cardinality.UNARY_UNARY, Raw, Raw)}

        await nursery.start(functools.partial(serve, [Routes()], channel.path, codec=BytesCodec()))
        message = os.urandom(1 << 20)

        assert message == await call(channel, message)
        with pytest.raises(GRPCError) as info:
            await call(channel, b"fail")
        assert (Status.RESOURCE_EXHAUSTED, "too much") == (info.value.status, info.value.message)


class TestAgainstTheFakesServer:
    async def test_refused_calls_are_sent_again(
        self, nursery: trio.Nursery, channel_at: Callable[[str], PluginChannel]
    ) -> None:
        """A stream the server refused (REFUSED_STREAM: not processed) is sent again within the timeout."""
        channel = channel_at("p.sock")
        seen: list[bytes] = []

        def refuse_twice(exchange: Exchange) -> None:
            seen.append(exchange.message)
            if len(seen) <= 2:
                exchange.reset(h2.REFUSED_STREAM)
            else:
                exchange.answer(b"at last")

        server = await trio_asyncio.aio_as_trio(start_server)(channel.path, refuse_twice)
        try:
            assert b"at last" == await call(channel, b"x")
        finally:
            await trio_asyncio.aio_as_trio(server.close)()
        assert [b"x"] * 3 == seen


class TestUnreachable:
    async def test_no_socket_file(self, channel_at: Callable[[str], PluginChannel]) -> None:
        """No socket file: FileNotFoundError (the dispatcher reports "unreachable")."""
        with pytest.raises(FileNotFoundError):
            await call(channel_at("missing.sock"), b"x")

    async def test_nobody_listening(self, channel_at: Callable[[str], PluginChannel]) -> None:
        """A socket file nobody listens on: ConnectionRefusedError."""
        channel = channel_at("stale.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(channel.path)
            with pytest.raises(ConnectionRefusedError):
                await call(channel, b"x")

    async def test_closed_channel(self, channel_at: Callable[[str], PluginChannel]) -> None:
        """A closed channel refuses new calls."""
        channel = channel_at("p.sock")
        channel.close()
        with pytest.raises(StreamTerminatedError):
            await call(channel, b"x")
