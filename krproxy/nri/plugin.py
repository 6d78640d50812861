"""``krproxy nri``: the hook servers of the hook directory, attached through NRI instead of a proxy.

krproxy registers with the runtime as an external NRI plugin and, at each NRI event, runs the hook
servers registered for the matching hook point, with ``krproxy serve``'s own machinery: the same
registration files and directory watcher, order, per-plugin timeouts, failure policies, skip label and
answer validation (:class:`krproxy.hooks.dispatch.Dispatcher`), and the same sequence at each hook point
(:class:`krproxy.hooks.lifecycle.Lifecycle`). The hook requests are built from the pod and container NRI
sends with the event, and the answers turned into what NRI can apply: the table of hook points, NRI events
and what NRI applies is in :mod:`krproxy.nri._events`, whose :class:`~krproxy.nri._events.EventHandlers`
handle those events; this module's :class:`NriPlugin` holds them, registers, subscribes and keeps the
connection.

The events without an answer of their own (pods run, stopped, removed; containers created, started,
removed) come as NRI 0.12's dedicated methods (``RunPodSandbox``, ``StartContainer``, ...; see
:data:`EVENT_METHODS`) from a runtime of NRI 0.12 (containerd 2.3), and as ``StateChange`` from older
ones (containerd 1.7: NRI 0.6.1 or 0.8.0; 2.0-2.1: 0.8.0; 2.2: 0.10/0.11), which krproxy still serves. A
0.12 runtime calls ``StateChange`` only for a plugin that answers Unimplemented to the dedicated method,
and records a deprecation for it; krproxy implements each method it subscribes the event of.

Failure policies under NRI's rules: a ``Fail`` hook server's failure of a pre hook is answered to the
runtime as an error, and NRI then fails the CRI operation; ``Ignore`` goes on without that server's
changes. NRI drops a plugin that misses its request timeout (2 s unless configured; sent in Configure by
NRI 0.8, assumed by 0.6): the chain of hook servers is given that timeout less a margin
(:data:`~krproxy.nri._events.MARGIN`), so a slow hook server fails (by its policy) but krproxy stays registered.

Subscription: the events of the hook points registered hook servers name; plus, while one of them is on
a point whose request comes from krproxy's store (:data:`STORE_READERS`: PreStartContainer,
PostStartContainer, PreUpdateContainerResources), the four that keep the store (pods run and removed,
containers created and removed). Every subscribed event is a call the runtime makes and waits for, most
on a pod's way to running; nothing else is subscribed (with no hook server, only :data:`IDLE_EVENT`: NRI
reads an empty mask as every event). When the registrations change the events needed, krproxy answers
the calls in flight and re-registers (NRI fixes the subscription at Configure).

State: while kept, the store is filled from Synchronize (in parts when NRI 0.8 splits it) and the events;
otherwise it stays empty rather than go stale. When the
connection drops (the runtime restarts, or drops the plugin) krproxy reconnects with backoff and
registers again; the runtime synchronizes it again, so nothing is lost.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any

import attrs
import trio

from krproxy import admin, hugepages, log
from krproxy.config import check_metrics_address
from krproxy.hooks.dispatch import Dispatcher
from krproxy.hooks.guard import Guard, counted_guard
from krproxy.hooks.lifecycle import Lifecycle
from krproxy.hooks.outcomes import Outcome
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import Registry
from krproxy.hooks.required import Requirements
from krproxy.hooks.store import HookStore
from krproxy.hooks.watcher import watch_hook_dir
from krproxy.metrics import Metrics
from krproxy.nri import DEFAULT_SOCKET, NRI_VERSION, PLUGIN_SERVICE, RUNTIME_SERVICE, _mux, wire
from krproxy.nri import check_index as _check_index
from krproxy.nri import check_name as _check_name
from krproxy.nri import convert as nri_convert
from krproxy.nri._events import DEFAULT_REQUEST_TIMEOUT as DEFAULT_REQUEST_TIMEOUT
from krproxy.nri._events import EVENT_METHODS as EVENT_METHODS
from krproxy.nri._events import GUARDED as GUARDED
from krproxy.nri._events import MARGIN as MARGIN
from krproxy.nri._events import EventHandlers, Terms, event_names, mask_of, warm_up
from krproxy.nri._session import AsyncHandler, ConnectionLost, Handler, Session, TtrpcError
from krproxy.nri._view import NriView
from krproxy.nri.cri_settings import restricts_oom_score_adj
from krproxy.nri.validator import ValidatorCheck, log_validator_check
from krproxy.nri.versions import RuntimeNri
from krproxy.proto.nri.pkg.api import v1alpha1 as api
from krproxy.relay import Relay

__all__ = ["EVENT_OF", "MARGIN", "NriConfig", "NriPlugin", "serve"]

LOGGER = logging.getLogger("krproxy.nri")

#: The NRI event each hook point runs at.
EVENT_OF: Mapping[HookPoint, api.Event] = {
    HookPoint.PRE_RUN_POD_SANDBOX: api.Event.RUN_POD_SANDBOX,
    HookPoint.POST_STOP_POD_SANDBOX: api.Event.STOP_POD_SANDBOX,
    HookPoint.PRE_CREATE_CONTAINER: api.Event.CREATE_CONTAINER,
    HookPoint.PRE_START_CONTAINER: api.Event.START_CONTAINER,
    HookPoint.POST_START_CONTAINER: api.Event.POST_START_CONTAINER,
    HookPoint.POST_STOP_CONTAINER: api.Event.STOP_CONTAINER,
    HookPoint.PRE_UPDATE_CONTAINER_RESOURCES: api.Event.UPDATE_CONTAINER,
    HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES: api.Event.UPDATE_POD_SANDBOX,  # NRI 0.12 and later
}
#: The hook points whose requests come from krproxy's store (the container as created and as the hook
#: servers left it), not from the event alone.
STORE_READERS = frozenset(
    {
        HookPoint.PRE_START_CONTAINER,
        HookPoint.POST_START_CONTAINER,
        HookPoint.PRE_UPDATE_CONTAINER_RESOURCES,
    }
)
#: Events subscribed to while a hook server of a :data:`STORE_READERS` point is registered: they keep the
#: store current. Without one the store is not kept, and these events (each a call from the runtime on a
#: pod's path) are not subscribed unless a hook point needs them.
STORE_EVENTS = (
    api.Event.RUN_POD_SANDBOX,
    api.Event.REMOVE_POD_SANDBOX,
    api.Event.POST_CREATE_CONTAINER,
    api.Event.REMOVE_CONTAINER,
)
#: The events a runtime before NRI 0.12 knows (its ``ValidEvents``: 0.8.0's ``LAST`` is 12); it refuses
#: a plugin that subscribes to any other. 0.12 says its version in Configure and knows every event.
EVENTS_BEFORE_0_12 = (1 << api.Event.REMOVE_CONTAINER) - 1
#: Every event of NRI 0.12 (its ``ValidEvents``).
ALL_EVENTS = (1 << (api.Event.LAST - 1)) - 1
#: The one event subscribed to when no hook server needs any (NRI reads an empty mask as every event):
#: once per pod, at its removal, never on the way to a running container.
IDLE_EVENT = api.Event.REMOVE_POD_SANDBOX
#: Registration must be answered within this (NRI's ``DefaultPluginRegistrationTimeout``).
REGISTRATION_TIMEOUT = 5.0
#: Reconnection backoff: first wait, and the longest.
RECONNECT_MIN, RECONNECT_MAX = 0.5, 10.0


@attrs.frozen
class NriConfig:
    """What ``krproxy nri`` is told on its command line."""

    socket: str = DEFAULT_SOCKET
    plugin_name: str = attrs.field(default="krproxy", converter=_check_name)
    plugin_index: str = attrs.field(default="50", converter=_check_index)
    hook_dir: str = "/etc/runtime/hookserver.d"
    skip_label: tuple[str, str] = ("runtimeproxy.koordinator.sh/skip-hookserver", "true")
    insecure_registration_files: bool = False
    metrics_allow_remote: bool = False
    #: ``HOST:PORT`` of the admin endpoint (/metrics, /healthz, /readyz, /status); "" for none.
    metrics_address: str = attrs.field(default="")
    #: Required hook servers and the annotations naming them (held at :data:`GUARDED` points only).
    requirements: Requirements = attrs.field(factory=Requirements)
    #: containerd's configuration file, read at start to tell whether its NRI validator requires krproxy
    #: (:mod:`krproxy.nri.validator`); "": not checked.
    containerd_config: str = ""

    @metrics_address.validator
    def _check_metrics_address(self, attribute: attrs.Attribute[str], value: str) -> None:
        check_metrics_address(value, self.metrics_allow_remote)


@attrs.define(eq=False)
class NriPlugin:
    """The NRI plugin (one instance across reconnections): the connection, registration and subscription,
    and the Plugin service's methods; it holds the handlers of the events that carry hook points
    (``events``, an :class:`~krproxy.nri._events.EventHandlers`) and tells them each Configure's
    :class:`~krproxy.nri._events.Terms`."""

    config: NriConfig
    dispatcher: Dispatcher
    metrics: Metrics
    store: HookStore = attrs.field(factory=HookStore)
    runtime: str = ""
    #: The event mask sent at the last Configure.
    subscribed: int = 0
    #: The events the runtime accepts a subscription to (:data:`EVENTS_BEFORE_0_12` until it says 0.12).
    runtime_events: int = EVENTS_BEFORE_0_12
    #: Set once the runtime synchronized the current connection (/readyz's meaning).
    synchronized: trio.Event = attrs.field(factory=trio.Event)
    #: Whether the current connection is registered.
    registered: bool = False
    #: Why krproxy is not connected, for /readyz and /status ("" when it is).
    last_error: str = ""
    #: ``HOST:PORT`` the admin endpoint listens on ("" without one).
    admin_address: str = ""
    #: Required hook servers' states and the gate of the :data:`GUARDED` points (None: nothing required).
    guard: Guard | None = None
    #: What containerd's configuration says of krproxy's own registration (``--containerd-config``).
    validator: ValidatorCheck = attrs.field(factory=ValidatorCheck)
    #: containerd's ``restrict_oom_score_adj`` (``--containerd-config``; False when not read).
    restrict_oom_score_adj: bool = False
    #: The handlers of the events that carry hook points, and the terms of the last Configure they go by.
    events: EventHandlers = attrs.field(init=False)
    _sync_pods: list[Any] = attrs.field(factory=list, init=False)  # upb PodSandbox and Container
    _sync_containers: list[Any] = attrs.field(factory=list, init=False)
    _resubscribe: trio.Event = attrs.field(factory=trio.Event, init=False)

    def __attrs_post_init__(self) -> None:
        name, index = self.config.plugin_name, self.config.plugin_index
        self.events = EventHandlers(
            self.dispatcher,
            self.metrics,
            Lifecycle(self.store, self.dispatcher.run, self.config.skip_label),
            self.guard,
            own_names=frozenset({name, f"{index}-{name}"}),
            restrict_oom_score_adj=self.restrict_oom_score_adj,
        )

    def keeps_store(self) -> bool:
        """Whether a registered hook server's point reads the store (:data:`STORE_READERS`)."""
        return any(self.dispatcher.plugins_for(point) for point in STORE_READERS)

    def events_needed(self) -> int:
        """The event mask to subscribe: what the registered hook servers, the required servers' guarded
        points and the store need, of what the runtime knows."""
        events = {EVENT_OF[point] for point in HookPoint if self.dispatcher.plugins_for(point)}
        events.update(EVENT_OF[p] for p in self._guarded_points())
        if self.keeps_store():
            events.update(STORE_EVENTS)
        # NRI reads an empty mask as every event: with nothing to do, one event off the pods' start path.
        return mask_of(events) & self.runtime_events or mask_of({IDLE_EVENT})

    def _guarded_points(self) -> list[HookPoint]:
        """The :data:`GUARDED` points a required server may hold: their events are needed even with no
        hook server registered (that is when they must fail)."""
        if self.guard is None:
            return []
        requirements = self.guard.requirements
        points = {p for server in requirements.servers for p in server.points}
        if requirements.annotation:
            points.add(HookPoint.PRE_CREATE_CONTAINER)
        return [p for p in GUARDED if p in points]

    def publish(self, registry: Registry) -> None:
        """The watcher's callback: new registrations; re-register when they need other events."""
        self.dispatcher.publish(registry)
        if self.guard is not None:
            self.guard.publish(registry)
        self.metrics.plugins.set(len(registry.plugins))
        if not self.subscribed:  # not configured yet: Configure will subscribe to what is needed then
            return
        needed = self.events_needed()
        # Said either way, so that an operator (and the e2e tests) can tell when new hook servers are in
        # effect: at once, or after the re-registration.
        log.event(
            LOGGER, "nri_hooks_published", events=event_names(needed), resubscribe=needed != self.subscribed
        )
        if needed != self.subscribed:
            log.event(LOGGER, "nri_resubscribe", events=event_names(needed), was=event_names(self.subscribed))
            self._resubscribe.set()

    def handlers(self) -> dict[tuple[str, str], Handler]:
        """The Plugin service's methods as the ttrpc session finds them: the connection's own (Configure,
        Synchronize, Shutdown) and the events' (:meth:`EventHandlers.methods`), each timed."""
        methods: dict[str, AsyncHandler] = {
            "Configure": self.configure,
            "Synchronize": self.synchronize,
            "Shutdown": self.shutdown,
            **self.events.methods(),
        }
        return {(PLUGIN_SERVICE, name): self._timed(name, handler) for name, handler in methods.items()}

    def _timed(self, method: str, handler: AsyncHandler) -> Handler:
        """*handler*, its time observed in ``krproxy_nri_call_seconds{method}`` (answered or failed)."""
        histogram = self.metrics.nri_call_seconds.labels(method)

        async def timed(payload: bytes) -> bytes:
            started = time.perf_counter()
            try:
                return await handler(payload)
            finally:
                histogram.observe(time.perf_counter() - started)

        return timed

    # -- the connection --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect, register and serve; reconnect with backoff whenever the connection ends. Never returns."""
        task_status.started()
        wait = RECONNECT_MIN
        while True:
            try:
                stream = await trio.open_unix_socket(self.config.socket)
            except OSError as exc:
                hint = ""
                if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):  # nobody serves NRI there
                    hint = (
                        "is NRI enabled in the runtime (docs/nri.md, Enabling NRI; containerd 1.7 ships "
                        "it off, 1.6 has none), and is --nri-socket its socket_path?"
                    )
                self.last_error = f"cannot connect: {exc.strerror or exc}" + (f"; {hint}" if hint else "")
                log.warning(
                    LOGGER,
                    "nri_unreachable",
                    socket=self.config.socket,
                    error=str(exc),
                    hint=hint,
                    retry=wait,
                )
                await trio.sleep(wait)
                wait = min(wait * 2, RECONNECT_MAX)
                continue
            if self.restrict_oom_score_adj:
                self.events.runtime_oom_score_adj = peer_oom_score_adj(stream.socket)
            served = await self._serve(stream)
            self.registered = False
            if served:  # it was up: come back at once, then back off if that fails
                wait = RECONNECT_MIN
                if self._resubscribe.is_set():
                    continue
            await trio.sleep(wait)
            wait = min(wait * 2, RECONNECT_MAX)

    async def _serve(self, stream: trio.SocketStream) -> bool:
        """One connection, until it ends; True if the runtime got as far as synchronizing krproxy."""
        session = Session(stream, _mux.PLUGIN_SERVICE_CONN, _mux.RUNTIME_SERVICE_CONN, self.handlers())
        self.synchronized = trio.Event()
        self._resubscribe = trio.Event()  # a new connection is configured with what is needed now
        self._sync_pods, self._sync_containers = [], []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._register, session)
            await session.run()
            nursery.cancel_scope.cancel()
        self.last_error = f"disconnected: {session.reason}"
        log.warning(LOGGER, "nri_disconnected", reason=session.reason)
        return self.synchronized.is_set()

    async def _register(self, session: Session) -> None:
        """Register; then report readiness once synchronized, and close the connection to re-subscribe."""
        request = api.RegisterPluginRequest(
            plugin_name=self.config.plugin_name, plugin_idx=self.config.plugin_index, NRI_version=NRI_VERSION
        )
        try:
            with trio.fail_after(REGISTRATION_TIMEOUT):
                await session.call(RUNTIME_SERVICE, "RegisterPlugin", bytes(request))
        except (TtrpcError, ConnectionLost, trio.TooSlowError) as exc:
            self.last_error = f"registration failed: {str(exc) or 'timed out'}"
            log.warning(LOGGER, "nri_registration_failed", error=str(exc) or "timed out")
            await session.aclose(f"closed by krproxy: registration failed ({str(exc) or 'timed out'})")
            return
        self.registered, self.last_error = True, ""
        log.event(LOGGER, "nri_registered", plugin=self.config.plugin_name, index=self.config.plugin_index)
        await self.synchronized.wait()
        log.event(LOGGER, "nri_synchronized", runtime=self.runtime, pods=self.store.statistics().pods)
        await self._resubscribe.wait()
        # Answer the calls in flight first: NRI takes a call cut off by the close as krproxy's failure and
        # goes on without its changes. (A call still on its way when the socket closes is lost all the same.)
        with trio.move_on_after(self.events.terms.request_timeout):
            await session.wait_idle()
        await session.aclose("closed by krproxy to subscribe to the events its hook servers now need")

    # -- Plugin service ------------------------------------------------------------------------

    async def configure(self, payload: bytes) -> bytes:
        request = api.ConfigureRequest.parse(payload)
        self.runtime = f"{request.runtime_name} {request.runtime_version}".strip()
        runtime_nri = RuntimeNri.configured(request)
        # NRI 0.12 says its version here; older runtimes refuse a plugin subscribing to events they lack.
        self.runtime_events = ALL_EVENTS if runtime_nri.has_0_12 else EVENTS_BEFORE_0_12
        self.subscribed = self.events_needed()
        timeout = request.request_timeout / 1000 if request.request_timeout > 0 else DEFAULT_REQUEST_TIMEOUT
        terms = Terms(timeout, runtime_nri, store_kept=self.keeps_store())
        self.events.configure(terms)
        unavailable = [
            point.value
            for point in HookPoint
            if self.dispatcher.plugins_for(point) and not mask_of({EVENT_OF[point]}) & self.runtime_events
        ]
        if unavailable:
            log.warning(
                LOGGER,
                "nri_hook_point_unavailable",
                hooks=",".join(unavailable),
                reason="the runtime's NRI has no event for them (NRI 0.12 and later has)",
            )
        log.event(
            LOGGER,
            "nri_configured",
            runtime=self.runtime,
            nri=terms.runtime_nri.describe(),
            request_timeout=terms.request_timeout,
            events=event_names(self.subscribed),
            store=terms.store_kept,
        )
        return bytes(api.ConfigureResponse(events=self.subscribed))

    async def synchronize(self, payload: bytes) -> bytes:
        request = wire.parse("SynchronizeRequest", payload)
        self._sync_pods += request.pods
        self._sync_containers += request.containers
        if request.more:  # NRI 0.8 sends large states in parts: answer each, keep them all
            return bytes(api.SynchronizeResponse(more=True))
        if (
            not self.events.terms.store_kept
        ):  # no event would keep it current: hold nothing rather than a stale copy
            self._sync_pods, self._sync_containers = [], []
        pods = {pod.id: nri_convert.pod_from_nri(pod) for pod in self._sync_pods}
        by_id = {pod.id: pod for pod in self._sync_pods}
        containers = [
            (c.id, nri_convert.container_from_nri(by_id.get(c.pod_sandbox_id), c))
            for c in self._sync_containers
        ]
        self.store.load(pods.items(), containers)
        self._sync_pods, self._sync_containers = [], []
        self.synchronized.set()
        return bytes(api.SynchronizeResponse())

    async def shutdown(self, payload: bytes) -> bytes:
        log.event(LOGGER, "nri_runtime_shutdown", runtime=self.runtime)
        return bytes(api.Empty())


def peer_oom_score_adj(sock: Any) -> int | None:
    """The ``oom_score_adj`` of the process at the other end of the unix socket *sock* (containerd, serving
    NRI): the value its ``restrict_oom_score_adj`` keeps containers at or above. None when it cannot be
    read (the process not in krproxy's pid namespace: SO_PEERCRED says pid 0, or no such /proc entry)."""
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if pid <= 0:
            return None
        with open(f"/proc/{pid}/oom_score_adj") as file:
            return int(file.read())
    except (OSError, ValueError, AttributeError):
        return None


def log_cri_settings(path: str) -> bool:
    """containerd's ``restrict_oom_score_adj`` in its configuration at ``path`` ("": not read, False),
    logged as ``nri_cri_settings`` when read.

    Raises:
        ConfigError: the file cannot be read or parsed.
    """
    if not path:
        return False
    restrict = restricts_oom_score_adj(path)
    log.event(LOGGER, "nri_cri_settings", restrict_oom_score_adj="yes" if restrict else "no")
    return restrict


async def serve(
    config: NriConfig,
    *,
    admin_sock: socket.socket | None = None,
    task_status: trio.TaskStatus[NriPlugin] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run ``krproxy nri`` until cancelled: the admin endpoint, the hook directory watcher and the NRI
    connection. ``admin_sock`` is the endpoint's listening socket if the caller bound it (else bound here
    when ``config.metrics_address`` is set)."""
    metrics = Metrics()
    relay = Relay()
    guard: Guard | None = None

    def observe_hook(outcome: Outcome) -> None:
        metrics.observe_hook(outcome)
        if guard is not None:
            guard.observe(outcome)

    dispatcher = Dispatcher(relay, observe=observe_hook)
    if config.requirements.active:
        guard = counted_guard(config.requirements, dispatcher, config.hook_dir, metrics)
        for server in config.requirements.servers:
            unheld = [p.value for p in HookPoint if p in server.points and p not in GUARDED]
            if unheld:  # an explicit list, or the default of every point: say what NRI cannot hold
                log.event(
                    LOGGER,
                    "required_points_not_held",
                    level=logging.WARNING if len(unheld) == len(server.points) else logging.INFO,
                    server=server.name,
                    points=",".join(unheld),
                    reason="NRI fails the CRI operation only for CreateContainer, UpdateContainer and "
                    "(NRI 0.12) UpdatePodSandbox",
                )
    plugin = NriPlugin(
        config,
        dispatcher,
        metrics,
        guard=guard,
        validator=log_validator_check(config.containerd_config, config.plugin_name, config.plugin_index),
        restrict_oom_score_adj=log_cri_settings(config.containerd_config),
    )
    metrics.track_store(lambda: plugin.store)
    view = NriView(plugin, metrics)
    metrics.ready.set_function(lambda: view.readiness()[0])
    if admin_sock is None and config.metrics_address:
        admin_sock = admin.bind(config.metrics_address)
    try:
        async with trio.open_nursery() as nursery:
            if admin_sock is not None:
                plugin.admin_address = await nursery.start(admin.serve, view, admin_sock)
            await nursery.start(relay.run)  # not serving: only the dispatcher's calls to the hook servers
            await nursery.start(watch_hook_dir, config, plugin.publish, metrics.registration_error)
            if guard is not None:
                nursery.start_soon(guard.run)
            warm_up()  # before the runtime's first event, not during it (a few tenths of a second)
            await nursery.start(plugin.run)
            log.event(LOGGER, "nri_started", socket=config.socket, hook_dir=config.hook_dir)
            nursery.start_soon(hugepages.advise_heap, "started")  # (krproxy.hugepages)
            task_status.started(plugin)
    finally:
        dispatcher.close()
        if admin_sock is not None:
            admin_sock.close()
