"""The relay's own unary calls (Transport.call: plugin calls, forwards of intercepted calls, store
recovery) against an independent gRPC server: grpcio (C core, as close to grpc-go as Python
gets). Flow control, stream limits, statuses, timeouts, reconnection, unreachable sockets."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio

from krproxy.grpcstatus import GRPCError, Status
from krproxy.relay import Relay, Route
from krproxy.relay.rpc import UpstreamError
from tests.integration.support import LIVENESS_LIMIT, wait_until

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


@pytest.fixture
def route(relay: Relay, short_tmp: Path) -> Route:
    return relay.route_to(str(short_tmp / "p.sock"), "plugin p")


def _path(route: Route, short_tmp: Path) -> str:
    return str(short_tmp / "p.sock")


class TestAgainstGrpcio:
    async def test_large_messages_both_ways(self, relay: Relay, route: Route, short_tmp: Path) -> None:
        """A 1 MB request and answer: both sides' flow control (grpcio starts with 64 KiB windows)."""
        message = os.urandom(1 << 20)
        with grpcio_server(_path(route, short_tmp), echo):
            assert message == await relay.transport.call(route, PATH, message, within=LIVENESS_LIMIT)
            assert b"small" == await relay.transport.call(route, PATH, b"small", within=LIVENESS_LIMIT)

    async def test_more_calls_than_the_server_allows_at_once(
        self, relay: Relay, route: Route, short_tmp: Path
    ) -> None:
        """With grpc.max_concurrent_streams=2, twelve concurrent calls wait their turn and all succeed."""
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
            answers.append(await relay.transport.call(route, PATH, b"%d" % i, within=LIVENESS_LIMIT))

        with grpcio_server(_path(route, short_tmp), slow_echo, **{"grpc.max_concurrent_streams": 2}):
            await relay.transport.call(
                route, PATH, b"warm-up", within=LIVENESS_LIMIT
            )  # the server's SETTINGS are known from here on
            async with trio.open_nursery() as nursery:
                for i in range(12):
                    nursery.start_soon(one, i)

        assert sorted(b"%d" % i for i in range(12)) == sorted(answers)
        assert 2 == peak

    async def test_error_status_and_message(self, relay: Relay, route: Route, short_tmp: Path) -> None:
        """The server's status and (percent-encoded, non-ASCII) message come back as a GRPCError."""

        def refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "nö way: 100%")

        with grpcio_server(_path(route, short_tmp), refuse), pytest.raises(GRPCError) as info:
            await relay.transport.call(route, PATH, b"x", within=LIVENESS_LIMIT, max_answer=100_000)

        assert (Status.FAILED_PRECONDITION, "nö way: 100%") == (info.value.status, info.value.message)

    async def test_timeout_cancels_the_call_on_the_server(
        self, relay: Relay, route: Route, short_tmp: Path
    ) -> None:
        """No answer in time: TimeoutError (or the server's own DEADLINE_EXCEEDED, if the grpc-timeout the
        relay sent fires there first: both ends keep the deadline, and under load either may be first),
        and the server sees the call end long before its handler would have answered; the connection
        stays good."""
        ended = threading.Event()

        def stall(request: bytes, context: grpc.ServicerContext) -> bytes:
            if request == b"stall":
                context.add_callback(ended.set)
                ended.wait(60)  # answers after a minute, unless the call ends first
            return request

        with grpcio_server(_path(route, short_tmp), stall):
            started = time.monotonic()
            with pytest.raises((TimeoutError, GRPCError)) as raised:
                await relay.transport.call(route, PATH, b"stall", within=0.2)
            if isinstance(raised.value, GRPCError):
                assert Status.DEADLINE_EXCEEDED == raised.value.status
            assert time.monotonic() - started < 30  # at its 0.2 s deadline, not at the handler's minute
            await wait_until(ended.is_set)
            connection = route.ep
            assert b"again" == await relay.transport.call(route, PATH, b"again", within=LIVENESS_LIMIT)
            assert connection is route.ep  # the reset stream did not cost the connection

    async def test_reconnects_to_a_restarted_server(
        self, relay: Relay, route: Route, short_tmp: Path
    ) -> None:
        """After the server went away, the next call opens a new connection to its successor."""
        with grpcio_server(_path(route, short_tmp), lambda request, context: b"first"):
            assert b"first" == await relay.transport.call(route, PATH, b"x", within=LIVENESS_LIMIT)
        first = route.ep
        assert first is not None
        await wait_until(lambda: first.closed)
        with grpcio_server(_path(route, short_tmp), lambda request, context: b"second"):
            assert b"second" == await relay.transport.call(route, PATH, b"x", within=LIVENESS_LIMIT)


class TestConnectionTrouble:
    async def test_no_socket_file(self, relay: Relay, route: Route) -> None:
        with pytest.raises(FileNotFoundError):
            await relay.transport.call(route, PATH, b"x", within=LIVENESS_LIMIT)

    async def test_nobody_listening(self, relay: Relay, route: Route, short_tmp: Path) -> None:
        import socket

        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(_path(route, short_tmp))  # bound, never listening: connect() is refused
        try:
            with pytest.raises(ConnectionRefusedError):
                await relay.transport.call(route, PATH, b"x", within=LIVENESS_LIMIT)
        finally:
            dead.close()

    async def test_peer_that_is_not_http2(self, relay: Relay, route: Route, short_tmp: Path) -> None:
        """Something that answers garbage and hangs up: the call fails at once with UpstreamError."""
        import socket

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(_path(route, short_tmp))
        listener.listen(1)

        def answer_garbage() -> None:
            conn, _ = listener.accept()
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.close()

        thread = threading.Thread(target=answer_garbage)
        thread.start()
        try:
            with pytest.raises(UpstreamError):
                await relay.transport.call(route, PATH, b"x", within=LIVENESS_LIMIT)
        finally:
            thread.join()
            listener.close()

    async def test_an_endless_answer_is_cut_off(
        self, relay: Relay, route: Route, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A peer answering more than the call's answer limit: the call fails, the stream is reset."""
        with (
            grpcio_server(_path(route, short_tmp), lambda request, context: b"x" * 300_000),
            pytest.raises(UpstreamError, match="larger than 100000 bytes"),
        ):
            await relay.transport.call(route, PATH, b"x", within=LIVENESS_LIMIT, max_answer=100_000)
