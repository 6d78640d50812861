"""Helpers for proxy integration tests (the fixtures that use them live in conftest.py).

:class:`ScriptedBackend` is a :class:`krproxy.rpc.Server` that answers *every* method path as raw
bytes, the way a test tells it to, and records what it received; it lets a test check exactly
what the proxy forwarded (bytes, metadata, deadline) and make the backend misbehave on purpose.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import attrs
import betterproto2
import grpc
import h2.connection
import h2.events
import trio
from cri_api.v1 import api_pb2 as pb

from krproxy import rpc
from krproxy.config import ProxyConfig
from krproxy.daemon import Daemon, serve
from krproxy.docker import DockerDaemon
from krproxy.fakes.containerd import FakeContainerd
from krproxy.fakes.grpc_go import metadata_items
from krproxy.relay import Relay

Behaviour = Callable[[rpc.Stream, list[bytes]], Awaitable[None]]
Reply = TypeVar("Reply", bound=betterproto2.Message)

#: The streams a :class:`ScriptedBackend` takes per connection (SETTINGS_MAX_CONCURRENT_STREAMS):
#: 100, as the h2-based server the tests were written against (grpclib) advertised; tests of the
#: relay's queueing depend on it.
BACKEND_MAX_STREAMS = 100


@attrs.frozen
class Received:
    """One call as the backend saw it."""

    path: str
    messages: list[bytes]
    metadata: dict[str, Any]
    timeout: float | None


async def echo(stream: rpc.Stream, messages: list[bytes]) -> None:
    """Answer with the request messages unchanged (one reply per request message)."""
    for message in messages:
        await stream.send_message(message)


async def hang(stream: rpc.Stream, messages: list[bytes]) -> None:
    """Never answer."""
    await trio.sleep_forever()


def hanging(started: Callable[[rpc.Stream], object], ended: Callable[[], object]) -> rpc.Handler:
    """A :class:`krproxy.rpc.Server` handler that never answers: it calls ``started`` with its stream, then
    ``ended`` when it is cancelled."""

    async def hang(stream: rpc.Stream) -> None:
        started(stream)
        try:
            await trio.sleep_forever()
        finally:
            ended()

    return hang


@attrs.define
class ScriptedBackend:
    """Answers any path: per-path behaviour, else :func:`echo`. Records every call."""

    received: list[Received] = attrs.field(factory=list)
    behaviours: dict[str, Behaviour] = attrs.field(factory=dict)
    started: list[str] = attrs.field(factory=list)
    cancelled: list[str] = attrs.field(factory=list)

    def messages_for(self, path: str) -> list[list[bytes]]:
        """The request messages of every call to ``path``, in arrival order."""
        return [r.messages for r in self.received if r.path == path]

    def server(self, *, max_streams: int | None = BACKEND_MAX_STREAMS) -> rpc.Server:
        """A server answering every path through this backend."""
        return rpc.Server({}, fallback=self._fallback, max_streams=max_streams)

    def _fallback(self, path: str) -> rpc.Handler:
        return functools.partial(self._handle, path)

    async def _handle(self, path: str, stream: rpc.Stream) -> None:
        self.started.append(path)
        try:
            messages = []
            while (message := await stream.recv_message()) is not None:
                messages.append(message)
            timeout = stream.deadline - trio.current_time() if stream.deadline is not None else None
            self.received.append(Received(path, messages, dict(metadata_items(stream.metadata)), timeout))
            await self.behaviours.get(path, echo)(stream, messages)
        except trio.Cancelled:
            self.cancelled.append(path)
            raise


async def start_scripted_backend(
    nursery: trio.Nursery, path: str, backend: ScriptedBackend | None = None, **options: Any
) -> tuple[ScriptedBackend, rpc.Server]:
    """Serve ``backend`` (a new one if None) on ``path``; ``options`` go to :meth:`ScriptedBackend.server`."""
    backend = backend or ScriptedBackend()
    server = backend.server(**options)
    await nursery.start(server.serve, path)
    return backend, server


@attrs.frozen
class ProxiedFake:
    """The fake containerd on ``socket`` and the proxy (``daemon``) in front of it."""

    fake: FakeContainerd
    socket: str
    daemon: Daemon


class ProxyHolder:
    """The proxy half of a test node (``hooks_support.Node``, ``test_docker_support.DockerNode``): the node
    starts ``daemon`` on ``proxy_socket`` its own way; this waits for its store and stops it."""

    daemon: Daemon | DockerDaemon | None
    proxy_socket: str

    async def wait_recovered(self) -> None:
        """Wait until the proxy's store is recovered."""
        daemon = self.daemon
        assert daemon is not None, "start_proxy() first"
        await wait_until(lambda: daemon.hooks.recovered)

    async def stop_proxy(self) -> None:
        """Shut the proxy down gracefully (as SIGTERM does) and wait until its socket is gone."""
        assert self.daemon is not None, "start_proxy() first"
        await shut_down(self.daemon, self.proxy_socket)
        self.daemon = None


async def start_proxy(nursery: trio.Nursery, sockdir: str, **config: Any) -> Daemon:
    """Start the proxy on ``sockdir/proxy.sock`` in front of ``sockdir/backend.sock`` (by default)."""
    config.setdefault("runtime_endpoint", os.path.join(sockdir, "backend.sock"))
    config.setdefault("listen", os.path.join(sockdir, "proxy.sock"))
    config.setdefault("hook_dir", os.path.join(sockdir, "hooks"))
    daemon: Daemon = await nursery.start(
        functools.partial(serve, ProxyConfig(**config), handle_signals=False)
    )
    return daemon


async def serve_relay(nursery: trio.Nursery, relay: Relay, listen_path: str) -> str:
    """Serve ``relay``'s callers on a unix socket at ``listen_path`` (returned)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(listen_path)
    listener.listen(16)
    await nursery.start(relay.serve, listener)
    return listen_path


async def serve_relay_to(
    nursery: trio.Nursery,
    relay: Relay,
    upstream: str,
    sockdir: str,
    unary_paths: list[str],
    name: str = "upstream",
) -> str:
    """Send every call of ``relay`` to the one upstream socket ``upstream`` (route ``name``; ``unary_paths`` are
    its unary methods) and serve its callers on ``sockdir/relay.sock`` (returned)."""
    relay.configure(relay.route_to(upstream, name), None, {}, unary_paths=unary_paths)
    return await serve_relay(nursery, relay, os.path.join(sockdir, "relay.sock"))


async def unary_call(
    channel: rpc.Channel,
    path: str,
    request: betterproto2.Message,
    reply_type: type[Reply],
    *,
    timeout: float | None = None,  # noqa: ASYNC109 - the call's deadline, sent as grpc-timeout
) -> Reply:
    """One unary call through a :class:`krproxy.rpc.Channel` with messages encoded and decoded
    here (raises :class:`krproxy.grpcstatus.GRPCError` for an error status)."""
    reply = await channel.unary(path, bytes(request.SerializeToString()), timeout=timeout)
    return reply_type.FromString(reply)


async def shut_down(daemon: Daemon | DockerDaemon, listen: str) -> None:
    """Shut ``daemon`` down gracefully (as SIGTERM does) and wait until its socket ``listen`` is gone."""
    daemon.request_shutdown()
    await wait_until(lambda: not os.path.exists(listen))


@contextlib.contextmanager
def grpcio_channels(*options: tuple[str, Any]) -> Iterator[Callable[[str], grpc.Channel]]:
    """A function that opens grpcio channels (with *options*) to unix socket paths; each channel it
    opened is closed on leaving."""
    channels: list[grpc.Channel] = []

    def open_channel(path: str) -> grpc.Channel:
        channel = grpc.insecure_channel(f"unix://{path}", options=list(options))
        channels.append(channel)
        return channel

    try:
        yield open_channel
    finally:
        for channel in channels:
            channel.close()


def raw_unary(channel: grpc.Channel, path: str) -> grpc.UnaryUnaryMultiCallable:
    """A grpcio callable sending and receiving raw bytes (no (de)serialisation)."""
    return channel.unary_unary(path, request_serializer=None, response_deserializer=None)


async def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a blocking grpcio call off the trio thread."""
    return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


#: Seconds a test waits for something that must happen (a socket to appear, a registration to be picked
#: up, the store to be recovered, a call to end) before it fails. A liveness bound, not a speed claim:
#: CI runs three suites at once on 2 cores, and other work may share the machine, so what takes
#: milliseconds alone can take seconds; only something that never happens takes this long. Speed is
#: measured by ``nox -s bench`` (krproxy/bench), and a timing that is a test's point runs in virtual
#: time (trio's MockClock) instead.
LIVENESS_LIMIT = 30.0

#: Seconds a test waits for a child Python process to start (import krproxy, bind, register). Under
#: ten runnable processes per core a start took over 30 s (a suite run beside six others and
#: stress-ng, load 19 on 2 cores), so start-up gets its own, longer bound; waiting ends as soon as
#: the child is up, so an idle machine pays nothing for it.
STARTUP_LIMIT = 120.0


async def wait_until(
    predicate: Callable[[], bool], limit: float = LIVENESS_LIMIT, interval: float = 0.02
) -> None:
    """Poll ``predicate`` until it holds; fail after ``limit`` seconds (a liveness bound).

    For conditions set by code in another thread or process, or by a peer (a connection arriving,
    a call starting), where there is no trio.Event to wait on.
    """
    with trio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110 - see docstring
            await trio.sleep(interval)


class ThreadedUnixServer:
    """A test server on a unix socket, on threads: one accepts, one serves each connection
    (:meth:`serve_connection`, which subclasses write, reading with :func:`received`). :meth:`close` stops accepting, joins the threads and closes the socket.
    A subclass sets what its connections need before calling ``__init__``, which starts accepting."""

    def __init__(self, path: str, backlog: int = 4) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(backlog)
        self.listener.settimeout(0.2)
        self.stopping = False
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def close(self) -> None:
        self.stopping = True
        # The accepting thread first: a connection it accepted as it was told to stop gets its
        # thread started after close began, which must be joined too (the relay closing the
        # connection under that thread made its first sendall fail: test_relay_attacks).
        self.threads[0].join(5)
        for thread in self.threads[1:]:
            thread.join(5)
        self.listener.close()

    def _accept(self) -> None:
        while not self.stopping:
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self.serve_connection, args=(sock,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def serve_connection(self, sock: socket.socket) -> None:
        raise NotImplementedError


def received(sock: socket.socket, stopping: Callable[[], bool]) -> Iterator[bytes]:
    """The chunks ``sock`` delivers until its peer closes it or ``stopping()`` holds.

    A quiet peer is waited for 0.2 s at a time, so that ``stopping`` is looked at; the socket
    itself gets the liveness bound as its timeout, which bounds every ``sendall`` of the caller
    too. (A 0.2 s socket timeout, as the servers had, bounds a whole ``sendall``: a 1 MiB answer
    to a relay slowed by a busy machine timed out, and the server dropped the connection.)
    """
    sock.settimeout(LIVENESS_LIMIT)
    while not stopping():
        ready, _, _ = select.select([sock], [], [], 0.2)
        if not ready:
            continue
        data = sock.recv(65536)
        if not data:
            return
        yield data


class RequestsByStream:
    """What an ``h2`` server connection (``header_encoding=None``) has received of each request: its
    path and body; the body's flow-control credit is given back as it arrives."""

    def __init__(self) -> None:
        self.paths: dict[int, bytes] = {}
        self.bodies: dict[int, bytearray] = {}

    def take(self, conn: h2.connection.H2Connection, event: h2.events.Event) -> tuple[bytes, bytes] | None:
        """Take in ``event`` of ``conn``: the path and body of the request whose stream it ends, else None."""
        if isinstance(event, h2.events.RequestReceived):
            self.paths[event.stream_id] = dict(event.headers)[b":path"]
            self.bodies[event.stream_id] = bytearray()
        elif isinstance(event, h2.events.DataReceived):
            self.bodies[event.stream_id] += event.data
            conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            return self.paths.pop(event.stream_id), bytes(self.bodies.pop(event.stream_id))
        return None


async def create_in_new_pod(runtime: Any) -> str:
    """Through the grpcio CRI ``runtime`` stub: RunPodSandbox (pod ``n/p``), then CreateContainer
    ``c`` (image ``x``) in it; the container's ID. Each call times out after 10 s."""
    config = pb.PodSandboxConfig(metadata=pb.PodSandboxMetadata(name="p", uid="u", namespace="n"))
    pod = await in_thread(runtime.RunPodSandbox, pb.RunPodSandboxRequest(config=config), timeout=10)
    created = await in_thread(
        runtime.CreateContainer,
        pb.CreateContainerRequest(
            pod_sandbox_id=pod.pod_sandbox_id,
            config=pb.ContainerConfig(metadata=pb.ContainerMetadata(name="c"), image=pb.ImageSpec(image="x")),
            sandbox_config=config,
        ),
        timeout=10,
    )
    return str(created.container_id)
