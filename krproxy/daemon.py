"""``krproxy serve``: the proxy daemon's task tree.

::

    trio.run
    └── root nursery
        ├── admin endpoint (--metrics-address) /metrics /healthz /readyz /status (krproxy.admin)
        ├── hook directory watcher      registration files -> Dispatcher registry (and Guard)
        ├── required servers' prober    --required-hook-server states (krproxy.hooks.guard)
        ├── OCI hooks.d watcher (--oci-hooks-dir)   hook files -> OCI hook interceptors
        ├── trace recorder (--record)   writes recorded calls to the trace file
        ├── CRI front end (krproxy.relay)   relays calls to the runtime, frame by frame; runs the
        │                               interceptors of the calls with hook points; calls plugins
        ├── store recovery              List/Status from the runtime, retried until it works; then
        │                               the heap onto huge pages (krproxy.hugepages)
        └── signal watchers             SIGTERM/SIGINT -> graceful drain; SIGUSR1 -> recording on/off

Everything runs on trio, in one thread (OCI hooks run in worker threads).

Start-up order: the socket is bound first; the plugins present in the hook directory are
loaded; then the relay accepts calls. A call that needs a required hook server (``--required-hook-server``,
or a pod's required-plugins annotation) probes it before anything is forwarded, and during the start-up
grace waits for it (:mod:`krproxy.hooks.guard`). Store recovery runs in the background and retries
while the runtime is down: calls that carry hooks wait for it (within their deadline, and no longer than
``--recovery-grace``: :mod:`krproxy.hooks.startup`), all other calls are forwarded at once.

``--backend-runtime-mode=Docker`` runs a different server instead (:mod:`krproxy.docker`).

Shutdown: on SIGTERM or SIGINT the proxy stops accepting connections, sends each caller
connection the two-step GOAWAY (new calls go to a new connection), gives in-flight calls
``grace_period`` seconds to finish, then cancels what is left, removes its socket file (unless
systemd passed it: socket activation) and returns.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from typing import Any, cast

import attrs
import trio

from krproxy import _supervise, admin, calls, hugepages, log, unixsock
from krproxy.config import BackendMode, ProxyConfig
from krproxy.forward import Backend, known_routes
from krproxy.grpcstatus import Cardinality
from krproxy.hooks.dispatch import Dispatcher
from krproxy.hooks.guard import Guard, counted_guard
from krproxy.hooks.outcomes import Outcome
from krproxy.hooks.recovery import CALL_TIMEOUT, MAX_ANSWER, Recovered, recover
from krproxy.hooks.registration import Registry
from krproxy.hooks.runtime import HookRuntime
from krproxy.hooks.store import HookStore
from krproxy.hooks.watcher import watch_hook_dir
from krproxy.metrics import Metrics
from krproxy.ocihooks import proxy as ocihooks
from krproxy.relay import Relay, Route, connect_unix
from krproxy.relay.rpc import AnswerTooLarge
from krproxy.routing import CRI_VERSION, Routing
from krproxy.trace.recorder import Recorder, watch_toggle_signal

LOGGER = logging.getLogger("krproxy.daemon")


@attrs.define(eq=False)
class Daemon:
    """A running proxy, as handed to whoever started it (tests, the demo)."""

    config: ProxyConfig
    relay: Relay
    hooks: HookRuntime
    metrics: Metrics
    recorder: Recorder | None = None
    admin_view: admin.AdminView | None = None
    oci_hooks: ocihooks.OciHooks | None = None
    listener: socket.socket | None = None  # closed when draining starts
    _shutdown: trio.Event = attrs.field(factory=trio.Event, init=False)

    def request_shutdown(self) -> None:
        """Start a graceful shutdown, as SIGTERM does."""
        self._shutdown.set()

    async def _drain(self) -> None:
        self.relay.transport.start_draining()
        if self.listener is not None:
            # New connections are refused at once (kubelet retries elsewhere or later) instead of
            # waiting unserved in the backlog. The accept loop is no longer waiting on it.
            trio.lowlevel.notify_closing(self.listener)
            self.listener.close()
        log.event(
            LOGGER,
            "draining",
            in_flight=self.relay.transport.in_flight,
            grace_period=self.config.grace_period,
        )
        with trio.move_on_after(self.config.grace_period) as scope:
            await self.relay.transport.wait_drained()
        if scope.cancelled_caught:
            log.warning(LOGGER, "grace_period_over", cancelled=self.relay.transport.in_flight)


async def _recover_store(
    config: ProxyConfig, relay: Relay, runtime: Route, hooks: HookRuntime, metrics: Metrics
) -> None:
    gate = hooks.store_gate

    async def call(path: str, message: bytes) -> bytes:
        try:  # the limit is on the message; the relay's counts its 5-byte gRPC prefix too
            return await relay.transport.call(
                runtime, path, message, within=CALL_TIMEOUT, max_answer=MAX_ANSWER + 5
            )
        except AnswerTooLarge:
            raise AnswerTooLarge(
                f"the runtime's answer to {path} is over {MAX_ANSWER} bytes, kubelet's limit (kubelet cannot"
                " read it either): remove exited containers and pods, or shorten their labels and annotations"
            ) from None

    async def attempt() -> Recovered:
        try:
            return await recover(call)
        except Exception as err:  # what calls waiting at hook points are told they wait for
            gate.failed(f"{type(err).__name__}: {err}")
            raise

    recovered = await _supervise.retry(
        attempt,
        retry_on=(Exception,),  # whatever the runtime does, recovery is tried again
        runtime=config.runtime_endpoint,
    )
    for record in recovered.repaired:
        log.warning(LOGGER, "recovery_record_repaired", kind=record.kind, id=record.id, reason=record.reason)
    for record in recovered.left_out.values():
        log.warning(LOGGER, "recovery_record_left_out", kind=record.kind, id=record.id, reason=record.reason)
    gate.leave_out(recovered.left_out)
    _supervise.store_recovered(
        hooks, recovered, metrics, LOGGER, fallbacks=recovered.fallbacks, left_out=len(recovered.left_out)
    )
    # The imports, the relay and now the store are in memory: onto huge pages (krproxy.hugepages).
    await hugepages.advise_heap("store recovered")


async def serve(
    config: ProxyConfig,
    *,
    handle_signals: bool = True,
    sock: socket.socket | None = None,
    admin_sock: socket.socket | None = None,
    inherited: bool = False,
    task_status: trio.TaskStatus[Daemon] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the proxy until a shutdown is requested.

    ``sock`` is the listening socket if the caller bound it already (see :func:`run`), and
    ``admin_sock`` likewise the admin endpoint's (else bound here if ``config.metrics_address``).
    ``inherited``: ``sock`` is systemd's (socket activation): its file is left in place at the end.

    Reports the :class:`Daemon` through ``task_status`` once the socket accepts connections.
    """
    if config.backend_mode is BackendMode.DOCKER:
        # Docker mode is an HTTP proxy with its own task tree; it reports a DockerDaemon.
        from krproxy.docker.server import serve as serve_docker

        if config.metrics_address:  # the admin endpoint (krproxy.admin) reads the CRI daemon's parts
            log.warning(LOGGER, "admin_unavailable", reason="not served in Docker mode")
        if admin_sock is not None:
            admin_sock.close()

        await serve_docker(
            config,
            handle_signals=handle_signals,
            sock=sock,
            inherited=inherited,
            task_status=cast("trio.TaskStatus[Any]", task_status),
        )
        return
    if sock is None:
        sock = unixsock.bind_unix_socket(config.listen, mode=config.socket_mode, gid=config.socket_group)
    # At the end the socket file is removed only if it is still ours: a successor may have
    # replaced it while we were draining.
    inode = 0 if inherited else os.stat(config.listen).st_ino
    runtime = Backend(config.runtime_endpoint)
    image = runtime if config.image_socket == config.runtime_endpoint else Backend(config.image_socket)
    metrics = Metrics()
    relay = Relay(observers=[metrics.observe_call, calls.log_call])
    relay.transport.max_request = config.max_request_message_size
    runtime_route = _route(relay, runtime)
    image_route = runtime_route if image is runtime else _route(relay, image)
    guard: Guard | None = None

    def observe_hook(outcome: Outcome) -> None:
        metrics.observe_hook(outcome)
        if guard is not None:
            guard.observe(outcome)

    dispatcher = Dispatcher(
        relay,
        observe=observe_hook,
        on_outcome=calls.add_hook_outcome,
        call_deadline=calls.current_deadline,
    )
    publish = dispatcher.publish
    if config.requirements.active:
        guard = counted_guard(config.requirements, dispatcher, config.hook_dir, metrics)
        publish = functools.partial(_publish, dispatcher, guard)
    hooks = HookRuntime(HookStore(), dispatcher, config.skip_label, guard)
    metrics.track_store(lambda: hooks.store)
    interceptors = plugin_interceptors = hooks.interceptors()
    # OCI hooks (--oci-hooks-dir): their interceptors wrap the plugin ones (krproxy/ocihooks/proxy.py).
    oci_hooks = None
    if config.oci_hook_dirs:
        oci_hooks = ocihooks.for_daemon(
            functools.partial(relay.transport.call, runtime_route, within=ocihooks.LOOKUP_TIMEOUT)
        )
        interceptors = oci_hooks.wrap(interceptors)
    # A call at a hook point without plugins goes upstream as the caller's bytes (hooks/watched.py);
    # not where OCI hooks wrapped the interceptor, which has work of its own.
    watches = {p: w for p, w in hooks.watches().items() if interceptors[p] is plugin_interceptors[p]}
    # Which method a call is, and which calls krproxy refuses instead of forwarding (docs/security.md).
    routing = Routing.for_cri(
        refuse_unknown=bool(config.requirements.servers), forward_unhooked=config.forward_unhooked_methods
    )
    relay.configure(
        runtime=runtime_route,
        image=image_route,
        interceptors=interceptors,
        unary_paths=[p for p, c in known_routes().items() if c is Cardinality.UNARY_UNARY],
        watches=watches,
        routing=routing,
    )
    backends = [("runtime", runtime)] if image is runtime else [("runtime", runtime), ("image", image)]
    view = admin.AdminView(config, relay.transport, hooks, metrics, backends)
    admin.wire_metrics(view)
    if admin_sock is None and config.metrics_address:
        admin_sock = admin.bind(config.metrics_address)
    try:
        async with trio.open_nursery() as nursery:
            if admin_sock is not None:
                await nursery.start(admin.serve, view, admin_sock)
            await nursery.start(watch_hook_dir, config, publish, metrics.registration_error)
            if oci_hooks is not None:
                await nursery.start(ocihooks.serve_hook_dirs, oci_hooks, config.oci_hook_dirs)
            recorder = None
            if config.record:
                recorder = Recorder(
                    config.record,
                    max_bytes=config.record_max_bytes,
                    keep=config.record_keep,
                    active=not config.record_paused,
                )
                await nursery.start(recorder.run)
                relay.transport.observers.append(recorder.observe)
                metrics.recording.set_function(functools.partial(_is_recording, recorder))
                relay.transport.keep_messages = True
            await nursery.start(relay.serve, sock)
            if guard is not None:
                # Calls needing a required server probe it themselves (and wait out the start-up
                # grace); this keeps /readyz, the metrics and the log current.
                nursery.start_soon(guard.run)
            # Calls with hook points wait for the store (within the grace); all others are relayed meanwhile.
            hooks.store_gate.start(config.recovery_grace)
            nursery.start_soon(_recover_store, config, relay, runtime_route, hooks, metrics)
            view.listening = True
            daemon = Daemon(config, relay, hooks, metrics, recorder, admin_view=view)
            daemon.oci_hooks = oci_hooks
            daemon.listener = sock
            if handle_signals:
                await nursery.start(_supervise.watch_signals, daemon.request_shutdown)
                await nursery.start(watch_toggle_signal, recorder)
            log.event(
                LOGGER,
                "methods",
                cri=CRI_VERSION,
                unknown="refused" if routing.refuse_unknown else "forwarded",
                forward_unhooked=",".join(sorted(routing.forward_unhooked)),
            )
            _supervise.log_ready(LOGGER, config, len(dispatcher.registry.plugins), image=config.image_socket)
            task_status.started(daemon)
            await daemon._shutdown.wait()
            await daemon._drain()
            nursery.cancel_scope.cancel()
    finally:
        sock.close()
        if not inherited:
            unixsock.unlink_if_ours(config.listen, inode)
        if admin_sock is not None:
            admin_sock.close()
        dispatcher.close()
    log.event(LOGGER, "stopped", listen=config.listen)


def _is_recording(recorder: Recorder) -> float:
    """``krproxy_recording`` (and /status's ``recording``): 1 while calls are being recorded."""
    return 1.0 if recorder.active else 0.0


def _publish(dispatcher: Dispatcher, guard: Guard, registry: Registry) -> None:
    dispatcher.publish(registry)
    guard.publish(registry)


def _route(relay: Relay, backend: Backend) -> Route:
    """The relay's route to a runtime socket; it keeps ``backend``'s reachability current."""

    return Route(
        relay.transport,
        f"backend runtime {backend.path}",
        connect_unix(backend.path),
        on_state=backend.set_state,
    )


def run(config: ProxyConfig) -> None:
    """Blocking entry point: ``trio.run`` → :func:`serve`.

    The socket is bound first, outside trio, so that start-up errors (socket in use, no
    permission) raise as themselves rather than inside exception groups. Under systemd socket
    activation (``deploy/krproxy.socket``) the listening socket is systemd's, passed as fd 3.
    """
    # The admin address first: when it is taken, nothing has been created yet (no socket file).
    admin_sock = admin.bind(config.metrics_address) if config.metrics_address else None
    try:
        sock = activated_listener(config.listen)
        inherited = sock is not None
        if sock is None:
            sock = unixsock.bind_unix_socket(config.listen, mode=config.socket_mode, gid=config.socket_group)
    except BaseException:
        if admin_sock is not None:
            admin_sock.close()
        raise

    trio.run(functools.partial(serve, config, sock=sock, admin_sock=admin_sock, inherited=inherited))


#: The first file descriptor systemd passes (sd_listen_fds(3)).
_LISTEN_FDS_START = 3


def activated_listener(path: str) -> socket.socket | None:
    """The listening socket systemd passed us (``LISTEN_PID`` is ours, ``LISTEN_FDS`` ≥ 1), or None.

    With socket activation the socket outlives the process: during a restart kubelet's new
    connections wait in its backlog for the successor instead of being refused. The variables
    are removed from the environment (children must not take them for theirs).
    """
    pid, count = os.environ.get("LISTEN_PID", ""), os.environ.get("LISTEN_FDS", "")
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    if pid != str(os.getpid()) or not count.isdigit() or int(count) < 1:
        return None
    if int(count) > 1:
        raise ValueError(f"systemd passed {count} sockets; the krproxy.socket unit must listen on one")
    sock = socket.socket(fileno=_LISTEN_FDS_START)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        sock.close()
        raise ValueError("the socket systemd passed is not a unix stream socket (ListenStream=<path>)")
    os.set_inheritable(sock.fileno(), False)
    name = sock.getsockname()
    if name != path:
        log.warning(
            LOGGER,
            "activated_socket_elsewhere",
            socket=name,
            listen=path,
            hint="make ListenStream= in krproxy.socket and --koord-runtimeproxy-endpoint the same path",
        )
    log.event(LOGGER, "socket_activated", socket=name)
    return sock
