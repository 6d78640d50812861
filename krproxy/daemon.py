"""``krproxy serve``: the proxy daemon's task tree.

::

    trio.run
    └── trio_asyncio.open_loop()            grpclib lives on this asyncio loop
        └── root nursery
            ├── hook directory watcher      registration files -> Dispatcher registry
            ├── store recovery              List/Status from the runtime, retried until it works
            ├── CRI server (krproxy._grpc.serve)   forwards to the backend, hooks on the way
            └── signal watcher              SIGTERM/SIGINT -> graceful drain

Start-up order: the socket is bound first; the plugins present in the hook directory are
loaded; then the server accepts calls. Store recovery runs in the background and retries
while the runtime is down: calls that carry hooks wait for it (within their deadline), all
other calls are forwarded at once.

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

from krproxy import _grpc, calls, log
from krproxy.config import BackendMode, ProxyConfig
from krproxy.forward import Backend, Forwarder
from krproxy.hooks.dispatch import Dispatcher
from krproxy.hooks.recovery import recover
from krproxy.hooks.runtime import HookRuntime
from krproxy.hooks.store import HookStore
from krproxy.hooks.watcher import watch
from krproxy.metrics import Metrics

LOGGER = logging.getLogger("krproxy.daemon")


@attrs.define(eq=False)
class Daemon:
    """A running proxy, as handed to whoever started it (tests, the demo)."""

    config: ProxyConfig
    forwarder: Forwarder
    hooks: HookRuntime
    metrics: Metrics
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


#: Retry delays of store recovery while the runtime is unreachable: doubling up to a cap.
RECOVERY_BACKOFF = (0.1, 5.0)


async def _recover_store(config: ProxyConfig, hooks: HookRuntime, metrics: Metrics) -> None:
    delay, cap = RECOVERY_BACKOFF
    while True:
        try:
            recovered = await trio_asyncio.aio_as_trio(recover)(config.runtime_endpoint)
        except Exception as err:
            log.event(
                LOGGER,
                "recovery_retry",
                level=logging.WARNING,
                runtime=config.runtime_endpoint,
                error=f"{type(err).__name__}: {err}",
                retry_in=delay,
            )
            await trio.sleep(delay)
            delay = min(delay * 2, cap)
            continue
        hooks.store.load(recovered.pods, recovered.containers)
        hooks.mark_recovered()
        metrics.recovered.set(1)
        log.event(
            LOGGER,
            "store_recovered",
            pods=len(recovered.pods),
            containers=len(recovered.containers),
            fallbacks=recovered.fallbacks,
            orphans=recovered.orphans,
            seconds=round(recovered.seconds, 3),
        )
        return


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
    metrics = Metrics()
    dispatcher = Dispatcher(observe=metrics.observe_hook, on_outcome=calls.add_hook_outcome)
    hooks = HookRuntime(HookStore(), dispatcher, config.skip_label)
    metrics.store_pods.set_function(lambda: hooks.store.statistics().pods)
    metrics.store_containers.set_function(lambda: hooks.store.statistics().containers)
    forwarder = Forwarder(runtime, image, hooks.interceptors(), observers=[metrics.observe_call])
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(
                    watch,
                    config.hook_dir,
                    dispatcher.publish,
                    on_error=lambda name: metrics.registration_errors.labels(name).inc(),
                )
            )
            nursery.start_soon(_recover_store, config, hooks, metrics)
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
            daemon = Daemon(config, forwarder, hooks, metrics, server)
            if handle_signals:
                nursery.start_soon(_watch_signals, daemon)
            log.event(
                LOGGER,
                "ready",
                listen=config.listen,
                runtime=config.runtime_endpoint,
                image=config.image_socket,
                hook_dir=config.hook_dir,
                plugins=len(dispatcher.registry.plugins),
            )
            task_status.started(daemon)
            await daemon._shutdown.wait()
            await daemon._drain()
            nursery.cancel_scope.cancel()
    finally:
        dispatcher.close()
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
