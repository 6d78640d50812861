"""The adapter between trio and grpclib (asyncio): the only module that imports grpclib first.

The daemon itself speaks HTTP/2 through its own relay (:mod:`krproxy.relay`) and never imports
this module, grpclib or trio-asyncio; grpclib serves the SDK's hook servers, ``krproxy trace
serve``, the fakes and the tests' backends, inside trio through trio-asyncio. This module owns
the import order (trio-asyncio, then grpclib: see the imports) and keeps the grpclib-specific
pieces in one place:

- :class:`BytesCodec` lets a handler or a client pass ``bytes`` instead of a message, so
  forwarded calls are never decoded (betterproto2 messages still encode/decode as usual).
- :class:`RawStatusDetailsCodec` carries ``grpc-status-details-bin`` through as bytes.
- :func:`install_fallback` answers method paths nobody registered (grpclib's own answer
  lacks ``content-type``, which grpc-go reports as UNKNOWN instead of UNIMPLEMENTED).
- :func:`bind_unix_socket` (from :mod:`krproxy.unixsock`) replaces a stale socket file but
  refuses to take over a live one.
- :func:`serve` runs a grpclib server as a trio task: ready only once it listens.

Create grpclib ``Server`` and ``Channel`` objects only inside ``trio_asyncio.open_loop()``:
both capture the running asyncio loop when constructed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import os
import socket
import warnings
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import trio

with warnings.catch_warnings():
    # trio-asyncio 0.16 subclasses asyncio.AbstractChildWatcher, deprecated since Python 3.12 and
    # removed in 3.14 (where trio-asyncio cannot be imported at all; see README). Nothing of ours
    # starts subprocesses through asyncio, so the warning is only noise, silenced for this import.
    warnings.filterwarnings("ignore", "'AbstractChildWatcher' is deprecated", DeprecationWarning)
    import trio_asyncio

# isort: split
# grpclib after trio-asyncio: grpclib keeps its own reference to asyncio.current_task when it is
# imported, trio-asyncio replaces that function when *it* is imported, and on Python 3.12+ a grpclib
# imported first fails every call ("no running event loop"); see also the fix-up below, for a
# grpclib imported before this module. Every module that imports grpclib or trio-asyncio imports
# this module too (tests/integration/test_imports.py checks that).
import grpclib.config
import grpclib.const
import grpclib.server
import grpclib.utils
import h2.connection
from grpclib.encoding.base import StatusDetailsCodecBase
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError

from krproxy.unixsock import SocketInUseError, bind_unix_socket, strip_unix_scheme, unlink_if_ours

__all__ = [
    "BytesCodec",
    "Raw",
    "RawStatusDetailsCodec",
    "SocketInUseError",
    "bind_unix_socket",
    "install_fallback",
    "open_loop",
    "purge_cancelled_timers",
    "serve",
    "strip_unix_scheme",
    "unimplemented_fallback",
    "unlink_if_ours",
]

# A program that imported grpclib itself before this module left grpclib holding asyncio's
# unpatched current_task; give it trio-asyncio's, so the order cannot matter any more.
if getattr(grpclib.utils, "_current_task", asyncio.current_task) is not asyncio.current_task:
    grpclib.utils._current_task = asyncio.current_task

LOGGER = logging.getLogger("krproxy.grpc")

#: The request/reply "type" for methods handled as raw bytes.
Raw = bytes

#: Closed streams h2 remembers per connection (h2's default: 65536), for every connection of the
#: process. h2 keeps how each one ended, to tell a late frame on a stream it reset from a protocol
#: error; about 120 bytes each, so 7.5 MB for each long-lived connection (kubelet's, the runtime's,
#: each plugin's) once it carried 65536 calls. Late frames arrive within a round trip on a unix
#: socket, while 4096 other streams closing first takes seconds even at a soak's call rate.
CLOSED_STREAMS_KEPT = 4096
h2.connection.H2Connection.MAX_CLOSED_STREAMS = CLOSED_STREAMS_KEPT

StreamHandler = Callable[[grpclib.server.Stream[Any, Any]], Awaitable[None]]


class BytesCodec(ProtoCodec):
    """Protobuf codec that passes ``bytes`` through untouched.

    Content subtype stays ``proto``, so peers see an ordinary gRPC protobuf service.
    """

    def encode(self, message: Any, message_type: Any) -> bytes:
        if message_type is Raw:
            return bytes(message)
        return bytes(message.SerializeToString())

    def decode(self, data: bytes, message_type: Any) -> Any:
        if message_type is Raw:
            return data
        return message_type.FromString(data)


class RawStatusDetailsCodec(StatusDetailsCodecBase):
    """Keeps rich error details (``grpc-status-details-bin``) as opaque bytes, both ways."""

    def encode(self, status: grpclib.const.Status, message: str | None, details: Any) -> bytes:
        return bytes(details)

    def decode(self, status: grpclib.const.Status, message: str | None, data: bytes) -> bytes:
        return data


class _FallbackMapping(dict[str, grpclib.const.Handler]):
    """A route table whose ``get`` builds a handler for paths that are not registered."""

    def __init__(
        self,
        routes: Mapping[str, grpclib.const.Handler],
        fallback: Callable[[str], grpclib.const.Handler],
    ) -> None:
        super().__init__(routes)
        self._fallback = fallback

    def get(self, path: str, default: Any = None) -> grpclib.const.Handler:
        handler = super().get(path)
        return handler if handler is not None else self._fallback(path)


def install_fallback(server: grpclib.server.Server, fallback: Callable[[str], grpclib.const.Handler]) -> None:
    """Route every unregistered method path of ``server`` to ``fallback(path)``.

    grpclib copies the handlers' ``__mapping__()`` into ``Server._mapping`` and looks paths up
    with ``.get()``; there is no public hook for unknown paths, so this swaps that dict for
    one with a default. Call it before :meth:`Server.start`.
    """
    server._mapping = _FallbackMapping(server._mapping, fallback)


async def _unimplemented(path: str, stream: grpclib.server.Stream[Any, Any]) -> None:
    raise GRPCError(grpclib.const.Status.UNIMPLEMENTED, f"unknown method {path}")


def unimplemented_fallback(path: str) -> grpclib.const.Handler:
    """A fallback answering UNIMPLEMENTED the way a real gRPC server does (with content-type)."""
    return grpclib.const.Handler(
        functools.partial(_unimplemented, path), grpclib.const.Cardinality.STREAM_STREAM, Raw, Raw
    )


def _track_connections(server: grpclib.server.Server) -> set[asyncio.BaseTransport]:
    """The transports of the connections ``server`` accepts, kept current as they come and go.

    grpclib's ``Server.close()`` stops the listener and cancels running calls but leaves
    accepted connections open, so clients would keep talking to a stopped server (grpcio even
    shares one connection between channels). Wrapping the protocol factory, before
    ``start()``, is the only place to see every connection.
    """
    transports: set[asyncio.BaseTransport] = set()
    make_protocol = server._protocol_factory

    def factory() -> Any:
        protocol = make_protocol()
        made, lost = protocol.connection_made, protocol.connection_lost

        mine: list[asyncio.BaseTransport] = []  # grpclib drops its own reference when it closes

        def connection_made(transport: asyncio.BaseTransport) -> None:
            mine.append(transport)
            transports.add(transport)
            made(transport)

        def connection_lost(exc: BaseException | None) -> None:
            for transport in mine:
                transports.discard(transport)
            lost(exc)

        protocol.connection_made = connection_made  # type: ignore[method-assign]
        protocol.connection_lost = connection_lost  # type: ignore[method-assign]
        return protocol

    server._protocol_factory = factory  # type: ignore[method-assign]
    return transports


class _CancelledTimerPurge:
    """Drops cancelled timers from a trio-asyncio loop's heap, as asyncio's own loops do.

    grpclib starts a timer for every call with a deadline (server and client side) and cancels
    it when the call ends. trio-asyncio 0.16 keeps cancelled timers in its heap until they would
    have fired (its ``_timer_handle_cancelled`` does nothing), and each keeps the context it was
    created in: in the proxy, the call's :class:`krproxy.calls.CallContext` with the request and
    reply bytes. At hundreds of calls per second with kubelet's 2-minute deadlines that is
    tens of thousands of finished calls held in memory. Like ``asyncio.BaseEventLoop``, this
    rebuilds the heap once more than half of it (and over 100 timers) was cancelled.
    """

    def __init__(self, loop: Any) -> None:
        self._loop = loop
        self._timers: list[asyncio.TimerHandle] = loop._timers
        self._cancelled = 0

    def __call__(self, handle: asyncio.TimerHandle) -> None:
        # Counts every cancel, also of timers that later leave the heap unnoticed (when due): an
        # overestimate, which only makes a purge come early; the purge resets the count.
        self._cancelled += 1
        # Not while the loop shuts down: it cancels its timers while iterating over the heap.
        if self._cancelled > 100 and self._cancelled * 2 > len(self._timers) and self._loop.is_running():
            # In place: the loop holds this list (no await in between, the loop is single-threaded).
            self._timers[:] = [timer for timer in self._timers if not timer.cancelled()]
            heapq.heapify(self._timers)
            self._cancelled = 0


def purge_cancelled_timers(loop: asyncio.AbstractEventLoop) -> None:
    """Make the trio-asyncio ``loop`` forget cancelled timers (see :class:`_CancelledTimerPurge`).

    Idempotent; does nothing to other loops (asyncio's own purge them already).
    """
    timers = getattr(loop, "_timers", None)
    if not isinstance(loop, trio_asyncio.BaseTrioEventLoop) or not isinstance(timers, list):
        return
    if not isinstance(vars(loop).get("_timer_handle_cancelled"), _CancelledTimerPurge):
        loop._timer_handle_cancelled = _CancelledTimerPurge(loop)


def open_loop() -> contextlib.AbstractAsyncContextManager[asyncio.AbstractEventLoop]:
    """The asyncio loop grpclib runs on, inside trio: ``async with _grpc.open_loop(): ...``.

    Create grpclib ``Server`` and ``Channel`` objects only inside it (both capture the loop).
    """
    loop: contextlib.AbstractAsyncContextManager[asyncio.AbstractEventLoop] = trio_asyncio.open_loop()
    return loop


async def serve(
    handlers: Iterable[Any],
    path: str,
    *,
    codec: ProtoCodec | None = None,
    status_details_codec: StatusDetailsCodecBase | None = None,
    fallback: Callable[[str], grpclib.const.Handler] | None = unimplemented_fallback,
    mode: int = 0o660,
    gid: int | None = None,
    sock: socket.socket | None = None,
    configure: Callable[[grpclib.server.Server], None] | None = None,
    config: grpclib.config.Configuration | None = None,
    task_status: trio.TaskStatus[grpclib.server.Server] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve grpclib ``handlers`` on the unix socket ``path`` until cancelled.

    Must run inside ``trio_asyncio.open_loop()``. Binds ``path`` itself unless given a
    socket already bound there by :func:`bind_unix_socket` as ``sock``. Reports the started ``Server`` through
    ``task_status`` only once the socket accepts connections. ``configure`` is called with the
    ``Server`` before it starts (the fakes make it as strict as grpc-go there: :mod:`fakes.strict`).

    Resource handling: on cancellation the server stops listening, in-flight handlers are
    cancelled, open client connections are closed, and the socket file is removed (it is
    ours: we bound it).
    """
    if sock is None:
        sock = bind_unix_socket(path, mode=mode, gid=gid)
    server = grpclib.server.Server(
        list(handlers), codec=codec, status_details_codec=status_details_codec, config=config
    )
    if fallback is not None:
        install_fallback(server, fallback)
    if configure is not None:  # first: what it changes (e.g. the protocol factory) is then tracked
        configure(server)
    connections = _track_connections(server)
    purge_cancelled_timers(trio_asyncio.current_loop.get())
    # The inode of the socket file we bound: at the end we remove the file only if it is still
    # ours (a successor may have replaced it while we were draining).
    inode = os.stat(path).st_ino
    try:
        await trio_asyncio.aio_as_trio(server.start)(sock=sock)
        task_status.started(server)
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            if server._server is not None:  # close() raises if start() failed; keep that error
                server.close()
                # Connections first: from Python 3.12.1 on, wait_closed() waits for every
                # connection to close, and kubelet's never would.
                for transport in list(connections):
                    transport.close()
                await trio_asyncio.aio_as_trio(server.wait_closed)()
            sock.close()
            unlink_if_ours(path, inode)
