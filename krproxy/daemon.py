"""``krproxy serve``: the proxy daemon's task tree.

::

    trio.run
    └── trio_asyncio.open_loop()            grpclib lives on this asyncio loop
        └── root nursery
            ├── CRI server (krproxy._grpc.serve)   forwards to the backend runtime
            └── signal watcher                      SIGTERM/SIGINT -> graceful drain

Shutdown: on SIGTERM or SIGINT the proxy stops accepting connections and new calls
(UNAVAILABLE "shutting down"), gives in-flight calls ``grace_period`` seconds to finish,
then cancels what is left, removes its socket file and returns.
"""

from __future__ import annotations

import functools
import logging
import signal
import socket

import attrs
import grpclib.server
import trio
import trio_asyncio

from krproxy import _grpc, log
from krproxy.config import BackendMode, ProxyConfig
from krproxy.forward import Backend, Forwarder

LOGGER = logging.getLogger("krproxy.daemon")


@attrs.define(eq=False)
class Daemon:
    """A running proxy, as handed to whoever started it (tests, the demo)."""

    config: ProxyConfig
    forwarder: Forwarder
    server: grpclib.server.Server
    _shutdown: trio.Event = attrs.field(factory=trio.Event, init=False)

    def request_shutdown(self) -> None:
        """Start a graceful shutdown, as SIGTERM does."""
        self._shutdown.set()

    async def _drain(self) -> None:
        self.forwarder.draining = True
        _grpc.stop_listening(self.server)
        log.event(
            LOGGER,
            "draining",
            in_flight=self.forwarder.in_flight,
            grace_period=self.config.grace_period,
        )
        with trio.move_on_after(self.config.grace_period) as scope:
            await trio_asyncio.aio_as_trio(self.forwarder.wait_idle)()
        if scope.cancelled_caught:
            log.event(LOGGER, "grace_period_over", level=logging.WARNING, cancelled=self.forwarder.in_flight)


async def _watch_signals(daemon: Daemon) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.event(LOGGER, "signal", signal=signal.Signals(signum).name)
            daemon.request_shutdown()
            return


async def serve(
    config: ProxyConfig,
    *,
    handle_signals: bool = True,
    sock: socket.socket | None = None,
    task_status: trio.TaskStatus[Daemon] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the proxy until a shutdown is requested; must run inside ``trio_asyncio.open_loop()``.

    ``sock`` is the listening socket if the caller bound it already (see :func:`run`).

    Reports the :class:`Daemon` through ``task_status`` once the socket accepts connections.
    """
    if config.backend_mode is not BackendMode.CONTAINERD:
        raise NotImplementedError(f"backend mode {config.backend_mode.value} is not supported yet")
    if sock is None:
        sock = _grpc.bind_unix_socket(config.listen, mode=config.socket_mode, gid=config.socket_group)
    runtime = Backend(config.runtime_endpoint)
    image = runtime if config.image_socket == config.runtime_endpoint else Backend(config.image_socket)
    forwarder = Forwarder(runtime, image)
    try:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                functools.partial(
                    _grpc.serve,
                    [forwarder],
                    config.listen,
                    codec=_grpc.BytesCodec(),
                    status_details_codec=_grpc.RawStatusDetailsCodec(),
                    fallback=forwarder.fallback,
                    sock=sock,
                )
            )
            daemon = Daemon(config, forwarder, server)
            if handle_signals:
                nursery.start_soon(_watch_signals, daemon)
            log.event(
                LOGGER,
                "ready",
                listen=config.listen,
                runtime=config.runtime_endpoint,
                image=config.image_socket,
            )
            task_status.started(daemon)
            await daemon._shutdown.wait()
            await daemon._drain()
            nursery.cancel_scope.cancel()
    finally:
        runtime.close()
        image.close()
    log.event(LOGGER, "stopped", listen=config.listen)


def run(config: ProxyConfig) -> None:
    """Blocking entry point: ``trio.run`` → ``open_loop`` → :func:`serve`.

    The socket is bound first, outside trio, so that start-up errors (socket in use, no
    permission) raise as themselves rather than inside exception groups.
    """
    sock = _grpc.bind_unix_socket(config.listen, mode=config.socket_mode, gid=config.socket_group)

    async def main() -> None:
        async with trio_asyncio.open_loop():
            await serve(config, sock=sock)

    trio.run(main)
