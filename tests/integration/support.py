"""Helpers for proxy integration tests (the fixtures that use them live in conftest.py).

:class:`ScriptedBackend` is a grpclib server that answers *every* method path as raw bytes,
the way a test tells it to, and records what it received; it lets a test check exactly what
the proxy forwarded (bytes, metadata, deadline) and make the backend misbehave on purpose.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import grpc
import grpclib.config
import grpclib.const
import grpclib.server
import trio

from krproxy import _grpc
from krproxy.config import ProxyConfig
from krproxy.daemon import Daemon, serve

Behaviour = Callable[[grpclib.server.Stream[bytes, bytes], list[bytes]], Awaitable[None]]


@attrs.frozen
class Received:
    """One call as the backend saw it."""

    path: str
    messages: list[bytes]
    metadata: dict[str, Any]
    timeout: float | None


async def echo(stream: grpclib.server.Stream[bytes, bytes], messages: list[bytes]) -> None:
    """Answer with the request messages unchanged (one reply per request message)."""
    for message in messages:
        await stream.send_message(message)


async def hang(stream: grpclib.server.Stream[bytes, bytes], messages: list[bytes]) -> None:
    """Never answer."""
    await asyncio.sleep(3600)


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

    def fallback(self, path: str) -> grpclib.const.Handler:
        return grpclib.const.Handler(
            functools.partial(self._handle, path), grpclib.const.Cardinality.STREAM_STREAM, bytes, bytes
        )

    async def _handle(self, path: str, stream: grpclib.server.Stream[bytes, bytes]) -> None:
        self.started.append(path)
        try:
            messages = [m async for m in stream]
            timeout = stream.deadline.time_remaining() if stream.deadline else None
            self.received.append(Received(path, messages, dict(stream.metadata or {}), timeout))
            await self.behaviours.get(path, echo)(stream, messages)
        except asyncio.CancelledError:
            self.cancelled.append(path)
            raise

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {}


async def start_scripted_backend(
    nursery: trio.Nursery,
    path: str,
    backend: ScriptedBackend | None = None,
    config: grpclib.config.Configuration | None = None,
) -> tuple[ScriptedBackend, grpclib.server.Server]:
    backend = backend or ScriptedBackend()
    server = await nursery.start(
        functools.partial(
            _grpc.serve,
            [backend],
            path,
            codec=_grpc.BytesCodec(),
            status_details_codec=_grpc.RawStatusDetailsCodec(),
            fallback=backend.fallback,
            config=config,
        )
    )
    return backend, server


async def start_proxy(nursery: trio.Nursery, sockdir: str, **config: Any) -> Daemon:
    """Start the proxy on ``sockdir/proxy.sock`` in front of ``sockdir/backend.sock`` (by default)."""
    config.setdefault("runtime_endpoint", os.path.join(sockdir, "backend.sock"))
    config.setdefault("listen", os.path.join(sockdir, "proxy.sock"))
    config.setdefault("hook_dir", os.path.join(sockdir, "hooks"))
    daemon: Daemon = await nursery.start(
        functools.partial(serve, ProxyConfig(**config), handle_signals=False)
    )
    return daemon


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


async def wait_until(
    predicate: Callable[[], bool], limit: float = LIVENESS_LIMIT, interval: float = 0.02
) -> None:
    """Poll ``predicate`` until it holds; fail after ``limit`` seconds (a liveness bound).

    For conditions set by code on the asyncio side of the bridge or in another process,
    where there is no trio.Event to wait on.
    """
    with trio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110 - see docstring
            await trio.sleep(interval)
