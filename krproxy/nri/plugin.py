"""``krproxy nri``: the hook servers of the hook directory, attached through NRI instead of a proxy.

krproxy registers with the runtime as an external NRI plugin and, at each NRI event, runs the hook
servers registered for the matching hook point, with ``krproxy serve``'s own machinery: the same
registration files and directory watcher, order, per-plugin timeouts, failure policies, skip label and
answer validation (:class:`krproxy.hooks.dispatch.Dispatcher`). The hook requests are built from the pod
and container NRI sends with the event, and the answers turned into what NRI can apply
(:mod:`krproxy.nri.convert`):

======================  ==============================  ===============================================
hook point              NRI event                       what NRI applies of the answer
======================  ==============================  ===============================================
PreRunPodSandbox        RUN_POD_SANDBOX                 nothing: the pod exists already (logged)
PostStopPodSandbox      STOP_POD_SANDBOX                (answer ignored, as in proxy mode)
PreCreateContainer      CREATE_CONTAINER                annotations, env, resources, oom_score_adj (NRI
                                                        0.8+) (ContainerAdjustment); not the pod cgroup
                                                        parent
PreStartContainer       START_CONTAINER                 nothing in the runtime; krproxy's store, as in
                                                        proxy mode
PostStartContainer      POST_START_CONTAINER            (answer ignored)
PostStopContainer       STOP_CONTAINER                  (answer ignored)
PreUpdateContainer-     UPDATE_CONTAINER                resources (a ContainerUpdate of that container);
Resources                                               not annotations, not oom_score_adj
PreUpdatePodSandbox-    UPDATE_POD_SANDBOX (NRI 0.12)   nothing: NRI can refuse a pod's resize (a Fail
Resources                                               server's refusal) but not change it (logged)
======================  ==============================  ===============================================

The events without an answer of their own (pods run, stopped, removed; containers created, started,
removed) come as NRI 0.12's dedicated methods (``RunPodSandbox``, ``StartContainer``, ...; see
:data:`EVENT_METHODS`) from a runtime of NRI 0.12 (containerd 2.3), and as ``StateChange`` from older
ones (containerd 1.7: NRI 0.6.1 or 0.8.0; 2.0-2.1: 0.8.0; 2.2: 0.10/0.11), which krproxy still serves. A
0.12 runtime calls ``StateChange`` only for a plugin that answers Unimplemented to the dedicated method,
and records a deprecation for it; krproxy implements each method it subscribes the event of.

Every change NRI cannot make is logged (``nri_change_not_applied``) and counted
(``krproxy_nri_changes_not_applied_total{hook,field}``), never dropped silently.

Failure policies under NRI's rules: a ``Fail`` hook server's failure of a pre hook is answered to the
runtime as an error, and NRI then fails the CRI operation; ``Ignore`` goes on without that server's
changes. NRI drops a plugin that misses its request timeout (2 s unless configured; sent in Configure by
NRI 0.8, assumed by 0.6): the chain of hook servers is given that timeout less a margin
(:data:`MARGIN`), so a slow hook server fails (by its policy) but krproxy stays registered.

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
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import attrs
import trio

from krproxy import __version__, admin, log
from krproxy.config import check_metrics_address
from krproxy.grpcstatus import Status
from krproxy.hooks import convert as hook_convert
from krproxy.hooks import merge
from krproxy.hooks.dispatch import Dispatcher
from krproxy.hooks.guard import Guard, RequiredMissing
from krproxy.hooks.model import ContainerInfo, PodInfo, PodResize
from krproxy.hooks.outcomes import HookRejected, Outcome, RequiredFailed
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import Registry
from krproxy.hooks.required import NOTHING_NEEDED, AnnotationError, Needed, Requirements
from krproxy.hooks.store import HookStore
from krproxy.hooks.watcher import watch_hook_dir
from krproxy.metrics import Metrics
from krproxy.nri import DEFAULT_SOCKET, PLUGIN_SERVICE, RUNTIME_SERVICE, _mux, wire
from krproxy.nri import convert as nri_convert
from krproxy.nri._session import ConnectionLost, Handler, Session, TtrpcError
from krproxy.nri.validator import ValidatorCheck, Verdict, check_containerd_config
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
#: The hook points where a required hook server can hold the runtime back: NRI fails the CRI operation
#: when the plugin answers these events with an error. The others are events after the fact
#: (StateChange) or answers NRI does not wait on. PreUpdatePodSandboxResources (UpdatePodSandbox) only
#: with NRI 0.12 and later: an older runtime has no such event.
GUARDED = (
    HookPoint.PRE_CREATE_CONTAINER,
    HookPoint.PRE_UPDATE_CONTAINER_RESOURCES,
    HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES,
)
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
#: The NRI version krproxy speaks, sent in RegisterPlugin (NRI 0.12's version exchange).
NRI_VERSION = "v0.12.2"
#: NRI 0.12's dedicated method of each event that has no answer of its own (before 0.12: StateChange),
#: with its request message's name.
EVENT_METHODS: Mapping[str, tuple[api.Event, str]] = {
    "RunPodSandbox": (api.Event.RUN_POD_SANDBOX, "RunPodSandboxRequest"),
    "StopPodSandbox": (api.Event.STOP_POD_SANDBOX, "StopPodSandboxRequest"),
    "RemovePodSandbox": (api.Event.REMOVE_POD_SANDBOX, "RemovePodSandboxRequest"),
    "PostCreateContainer": (api.Event.POST_CREATE_CONTAINER, "PostCreateContainerRequest"),
    "StartContainer": (api.Event.START_CONTAINER, "StartContainerRequest"),
    "PostStartContainer": (api.Event.POST_START_CONTAINER, "PostStartContainerRequest"),
    "RemoveContainer": (api.Event.REMOVE_CONTAINER, "RemoveContainerRequest"),
}
#: The events a runtime before NRI 0.12 knows (its ``ValidEvents``: 0.8.0's ``LAST`` is 12); it refuses
#: a plugin that subscribes to any other. 0.12 says its version in Configure and knows every event.
EVENTS_BEFORE_0_12 = (1 << api.Event.REMOVE_CONTAINER) - 1
#: Every event of NRI 0.12 (its ``ValidEvents``).
ALL_EVENTS = (1 << (api.Event.LAST - 1)) - 1
#: The one event subscribed to when no hook server needs any (NRI reads an empty mask as every event):
#: once per pod, at its removal, never on the way to a running container.
IDLE_EVENT = api.Event.REMOVE_POD_SANDBOX
#: NRI's default request timeout (``DefaultPluginRequestTimeout``), assumed when Configure says none.
DEFAULT_REQUEST_TIMEOUT = 2.0
#: Registration must be answered within this (NRI's ``DefaultPluginRegistrationTimeout``).
REGISTRATION_TIMEOUT = 5.0
#: Time kept back from the runtime's request timeout for krproxy's own work and the answer's trip.
MARGIN = 0.2
#: Reconnection backoff: first wait, and the longest.
RECONNECT_MIN, RECONNECT_MAX = 0.5, 10.0


def mask_of(events: set[api.Event]) -> int:
    mask = 0
    for event in events:
        mask |= 1 << (event - 1)
    return mask


def _check_index(index: str) -> str:
    if len(index) != 2 or not (index.isascii() and index.isdigit()):  # NRI: two bytes, each 0-9
        raise ValueError(f"NRI plugin index must be two digits, 00..99 (got {index!r})")
    return index


def _check_name(name: str) -> str:
    if not name or "/" in name:
        raise ValueError(f"NRI plugin name must be non-empty, without '/' (got {name!r})")
    return name


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
    """The NRI plugin's state and its Plugin-service handlers (one instance across reconnections)."""

    config: NriConfig
    dispatcher: Dispatcher
    metrics: Metrics
    store: HookStore = attrs.field(factory=HookStore)
    runtime: str = ""
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    #: The event mask sent at the last Configure.
    subscribed: int = 0
    #: Whether the store is kept on this connection (decided at Configure, with the events).
    store_kept: bool = False
    #: Whether the runtime's NRI is 0.8 or later (its Configure carries timeouts; 0.6.1's does not). 0.6.1
    #: has no ``oom_score_adj`` in ContainerAdjustment.
    nri_0_8: bool = True
    #: The runtime's NRI version from Configure (NRI 0.12 and later; "" before).
    nri_version: str = ""
    #: The events the runtime accepts a subscription to (:data:`EVENTS_BEFORE_0_12` until it says 0.12).
    runtime_events: int = EVENTS_BEFORE_0_12
    #: How the runtime delivered the last event without an answer of its own: "dedicated" (NRI 0.12's
    #: methods) or "StateChange" (before 0.12, or a 0.12 runtime's deprecated fallback); "" before any.
    event_calls: str = ""
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
    _sync_pods: list[Any] = attrs.field(factory=list, init=False)  # upb PodSandbox and Container
    _sync_containers: list[Any] = attrs.field(factory=list, init=False)
    _resubscribe: trio.Event = attrs.field(factory=trio.Event, init=False)

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
        log.event(LOGGER, "nri_hooks_published", events=hex(needed), resubscribe=needed != self.subscribed)
        if needed != self.subscribed:
            log.event(LOGGER, "nri_resubscribe", events=hex(needed), was=hex(self.subscribed))
            self._resubscribe.set()

    def handlers(self) -> dict[tuple[str, str], Handler]:
        methods: dict[str, Handler] = {
            "Configure": self.configure,
            "Synchronize": self.synchronize,
            "Shutdown": self.shutdown,
            "CreateContainer": self.create_container,
            "UpdateContainer": self.update_container,
            "StopContainer": self.stop_container,
            "UpdatePodSandbox": self.update_pod_sandbox,
            "StateChange": self.state_change,
        }
        for name, (event, request_type) in EVENT_METHODS.items():
            methods[name] = self._event_method(event, request_type)
        return {(PLUGIN_SERVICE, name): handler for name, handler in methods.items()}

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
                log.event(
                    LOGGER,
                    "nri_unreachable",
                    level=logging.WARNING,
                    socket=self.config.socket,
                    error=str(exc),
                    hint=hint,
                    retry=wait,
                )
                await trio.sleep(wait)
                wait = min(wait * 2, RECONNECT_MAX)
                continue
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
        log.event(LOGGER, "nri_disconnected", level=logging.WARNING, reason=session.reason)
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
            log.event(LOGGER, "nri_registration_failed", level=logging.WARNING, error=str(exc) or "timed out")
            await session.aclose()
            return
        self.registered, self.last_error = True, ""
        log.event(LOGGER, "nri_registered", plugin=self.config.plugin_name, index=self.config.plugin_index)
        await self.synchronized.wait()
        log.event(LOGGER, "nri_synchronized", runtime=self.runtime, pods=self.store.statistics().pods)
        await self._resubscribe.wait()
        # Answer the calls in flight first: NRI takes a call cut off by the close as krproxy's failure and
        # goes on without its changes. (A call still on its way when the socket closes is lost all the same.)
        with trio.move_on_after(self.request_timeout):
            await session.wait_idle()
        await session.aclose()

    # -- Plugin service ------------------------------------------------------------------------

    async def configure(self, payload: bytes) -> bytes:
        request = api.ConfigureRequest.parse(payload)
        self.runtime = f"{request.runtime_name} {request.runtime_version}".strip()
        self.request_timeout = (
            request.request_timeout / 1000 if request.request_timeout > 0 else DEFAULT_REQUEST_TIMEOUT
        )
        self.nri_version = request.NRI_version
        # NRI 0.12 says its version here; older runtimes refuse a plugin subscribing to events they lack.
        self.runtime_events = ALL_EVENTS if self.nri_version else EVENTS_BEFORE_0_12
        if not self.nri_version:
            self._pod_resize_not_held()
        self.subscribed = self.events_needed()
        self.store_kept = self.keeps_store()
        unavailable = [
            point.value
            for point in HookPoint
            if self.dispatcher.plugins_for(point) and not mask_of({EVENT_OF[point]}) & self.runtime_events
        ]
        if unavailable:
            log.event(
                LOGGER,
                "nri_hook_point_unavailable",
                level=logging.WARNING,
                hooks=",".join(unavailable),
                reason="the runtime's NRI has no event for them (NRI 0.12 and later has)",
            )
        self.nri_0_8 = request.registration_timeout > 0 or request.request_timeout > 0
        log.event(
            LOGGER,
            "nri_configured",
            runtime=self.runtime,
            nri=self.nri_version or ("0.8 to 0.11" if self.nri_0_8 else "before 0.8"),
            request_timeout=self.request_timeout,
            events=hex(self.subscribed),
            store=self.store_kept,
        )
        return bytes(api.ConfigureResponse(events=self.subscribed))

    def _pod_resize_not_held(self) -> None:
        """Say which required servers' PreUpdatePodSandboxResources a runtime before NRI 0.12 cannot hold."""
        point = HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES
        for server in self.guard.requirements.servers if self.guard is not None else ():
            if point in server.points:
                log.event(
                    LOGGER,
                    "required_points_not_held",
                    level=logging.WARNING if server.points == {point} else logging.INFO,
                    server=server.name,
                    points=point.value,
                    reason="the runtime's NRI is older than 0.12: it has no UpdatePodSandbox",
                )

    async def synchronize(self, payload: bytes) -> bytes:
        request = wire.parse("SynchronizeRequest", payload)
        self._sync_pods += request.pods
        self._sync_containers += request.containers
        if request.more:  # NRI 0.8 sends large states in parts: answer each, keep them all
            return bytes(api.SynchronizeResponse(more=True))
        if not self.store_kept:  # no event would keep it current: hold nothing rather than a stale copy
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

    def _deadline(self) -> float:
        """When the chain must be done: the runtime's request timeout (and the call's deadline) less MARGIN."""
        now = trio.current_time()
        deadline = min(now + self.request_timeout, trio.current_effective_deadline())
        return deadline - max(MARGIN, 0.1 * self.request_timeout)

    def _skips(self, pod: PodInfo) -> bool:
        return pod.has_label(*self.config.skip_label)

    def _not_applied(self, point: HookPoint, target: str, fields: tuple[str, ...] | list[str]) -> None:
        for field in fields:
            self.metrics.nri_not_applied.labels(point.value, field.split("[")[0]).inc()
        if fields:
            log.event(
                LOGGER,
                "nri_change_not_applied",
                level=logging.WARNING,
                hook=point.value,
                target=target,
                fields=",".join(fields),
                reason="NRI cannot make these changes at this event",
            )

    async def _require(self, point: HookPoint, pod: PodInfo, container: str | None) -> Needed:
        """The required hook servers of *point* for this container, once all are up; else an UNAVAILABLE
        error for the runtime, which fails the CRI operation (:data:`GUARDED` points only). Names that are
        krproxy's own NRI plugin name (``name`` or ``index-name``, as NRI's validator matches) are met."""
        if self.guard is None or point not in GUARDED:
            return NOTHING_NEEDED
        own = {self.config.plugin_name, f"{self.config.plugin_index}-{self.config.plugin_name}"}
        try:
            return await self.guard.require(
                point, pod.annotations, container, met=own, deadline=self._deadline()
            )
        except AnnotationError as err:
            raise TtrpcError(Status.INVALID_ARGUMENT, str(err)) from None
        except RequiredMissing as exc:
            raise TtrpcError(Status.UNAVAILABLE, exc.message or "") from None

    async def _pod_chain(self, point: HookPoint, pod: PodInfo, target: str) -> PodInfo:
        chain = self._run(point, pod, hook_convert.pod_hook_request_bytes, merge.merge_pod_info, target)
        result: PodInfo = await chain
        return result

    async def _container_chain(
        self, point: HookPoint, info: ContainerInfo, target: str, required: Needed = NOTHING_NEEDED
    ) -> ContainerInfo:
        chain = self._run(
            point,
            info,
            hook_convert.container_hook_request_bytes,
            merge.merge_container_info,
            target,
            required,
        )
        result: ContainerInfo = await chain
        return result

    async def _run(
        self,
        point: HookPoint,
        record: Any,
        to_request: Any,
        fold: Any,
        target: str,
        required: Needed = NOTHING_NEEDED,
    ) -> Any:
        """Run ``point``'s hook servers within the budget; a Fail (or required) server's failure becomes an
        error for the runtime."""
        try:
            chain = await self.dispatcher.run(
                point,
                record,
                to_request,
                fold,
                target=target,
                deadline=self._deadline(),
                required=required.names,
                hooked=required.hooked,
            )
        except (HookRejected, RequiredFailed, RequiredMissing) as exc:
            raise TtrpcError(exc.status, exc.message or "") from None
        return chain.value

    async def create_container(self, payload: bytes) -> bytes:
        request = wire.parse("CreateContainerRequest", payload)
        info = nri_convert.container_from_nri(request.pod, request.container)
        point = HookPoint.PRE_CREATE_CONTAINER
        if self._skips(info.pod):
            return bytes(api.CreateContainerResponse())
        required = await self._require(point, info.pod, info.name)
        if not self.dispatcher.plugins_for(point) and not required.names:
            return bytes(api.CreateContainerResponse())
        target = f"pod {info.pod.namespace}/{info.pod.name} container {info.name}"
        after = await self._container_chain(point, info, target, required)
        adjusted = nri_convert.adjustment(info, after, oom_score_adj=self.nri_0_8)
        self._not_applied(point, target, adjusted.not_applied)
        return bytes(api.CreateContainerResponse(adjust=adjusted.adjust))

    async def update_container(self, payload: bytes) -> bytes:
        request = wire.parse("UpdateContainerRequest", payload)
        info = nri_convert.container_from_nri(request.pod, request.container)
        point = HookPoint.PRE_UPDATE_CONTAINER_RESOURCES
        if self._skips(info.pod):
            return bytes(api.UpdateContainerResponse())
        required = await self._require(point, info.pod, info.name)
        if not self.dispatcher.plugins_for(point) and not required.names:
            return bytes(api.UpdateContainerResponse())
        wanted = nri_convert.resources_from_nri(request.linux_resources)
        stored = self.store.get_container(info.id) or info
        current = stored.resources if stored.resources is not None else wanted
        prepared = attrs.evolve(stored, resources=merge.update_resource_by_update_request(current, wanted))
        after = await self._container_chain(point, prepared, info.id, required)
        not_applied = [
            f"annotations[{k}]"
            for k in after.annotations
            if prepared.annotations.get(k) != after.annotations[k]
        ]
        update = api.UpdateContainerResponse()
        if after.resources is not None and prepared.resources is not None:
            resources, missing = nri_convert.resources_update(prepared.resources, after.resources)
            not_applied += missing
            if after.resources.oom_score_adj != prepared.resources.oom_score_adj:
                not_applied.append("oom_score_adj")  # NRI's ContainerUpdate has no such field
            if resources is not None:
                update.update = [
                    api.ContainerUpdate(
                        container_id=info.id, linux=api.LinuxContainerUpdate(resources=resources)
                    )
                ]
        self._not_applied(point, info.id, not_applied)
        self.store.update_container(info.id, after)
        return bytes(update)

    async def update_pod_sandbox(self, payload: bytes) -> bytes:
        """NRI 0.12's UpdatePodSandbox (CRI UpdatePodSandboxResources, a pod-level resize): the
        PreUpdatePodSandboxResources hook servers see the pod with the requested resources and overhead;
        a Fail server's refusal fails the resize. NRI can refuse the update but not change it: changed
        resources are logged and counted as not applied."""
        request = wire.parse("UpdatePodSandboxRequest", payload)
        pod = nri_convert.pod_from_nri(_present(request, "pod"))
        point = HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES
        if self._skips(pod):
            return b""
        required = await self._require(point, pod, None)
        if not self.dispatcher.plugins_for(point) and not required.names:
            return b""
        wanted = _present(request, "linux_resources")
        overhead = _present(request, "overhead_linux_resources")
        resize = PodResize(
            pod_sandbox_id=request.pod.id,
            pod=attrs.evolve(
                pod,
                resources=nri_convert.resources_from_nri(wanted) if wanted is not None else None,
                overhead=nri_convert.resources_from_nri(overhead) if overhead is not None else None,
            ),
        )
        target = f"pod {pod.namespace}/{pod.name}"
        after: PodResize = await self._run(
            point,
            resize,
            hook_convert.pod_resize_hook_request_bytes,
            merge.merge_pod_resize,
            target,
            required,
        )
        if after.pod.resources != resize.pod.resources:
            self._not_applied(point, target, ["resources"])
        return b""  # UpdatePodSandboxResponse is an empty message

    async def stop_container(self, payload: bytes) -> bytes:
        request = wire.parse("StopContainerRequest", payload)
        info = nri_convert.container_from_nri(request.pod, request.container)
        if not self._skips(info.pod) and self.dispatcher.plugins_for(HookPoint.POST_STOP_CONTAINER):
            await self._container_chain(HookPoint.POST_STOP_CONTAINER, info, info.id)
        return bytes(api.StopContainerResponse())

    def _event_method(self, event: api.Event, request_type: str) -> Handler:
        """The handler of NRI 0.12's dedicated method for ``event`` (e.g. ``StartContainer``)."""
        message = wire.message_class(request_type)
        has_container = "container" in message.DESCRIPTOR.fields_by_name

        async def handle(payload: bytes) -> bytes:
            request = message()
            request.ParseFromString(payload)
            self.event_calls = "dedicated"
            container = _present(request, "container") if has_container else None
            await self._on_event(event, _present(request, "pod"), container)
            return b""  # every such response is an empty message

        return handle

    async def state_change(self, payload: bytes) -> bytes:
        """The same events from a runtime before NRI 0.12 (or a 0.12 one's deprecated fallback)."""
        event = wire.parse("StateChangeEvent", payload)
        self.event_calls = "StateChange"
        await self._on_event(event.event, _present(event, "pod"), _present(event, "container"))
        return bytes(api.Empty())

    async def _on_event(self, kind: api.Event, nri_pod: Any | None, nri_container: Any | None) -> None:
        """An event without an answer of its own: keep the store, run the hook point's servers."""
        pod = nri_convert.pod_from_nri(nri_pod)
        store = self.store_kept
        if kind == api.Event.RUN_POD_SANDBOX:
            if store and nri_pod is not None:
                self.store.put_pod(nri_pod.id, pod)
            await self._pod_hook(HookPoint.PRE_RUN_POD_SANDBOX, pod)
        elif kind == api.Event.STOP_POD_SANDBOX:
            await self._pod_hook(HookPoint.POST_STOP_POD_SANDBOX, pod)
        elif kind == api.Event.REMOVE_POD_SANDBOX:
            if store and nri_pod is not None:
                self.store.remove_pod(nri_pod.id)
        elif kind == api.Event.POST_CREATE_CONTAINER:
            if store:
                info = nri_convert.container_from_nri(nri_pod, nri_container)
                self.store.put_container(info.id, info)
        elif kind == api.Event.START_CONTAINER:
            await self._container_hook(HookPoint.PRE_START_CONTAINER, nri_pod, nri_container)
        elif kind == api.Event.POST_START_CONTAINER:
            await self._container_hook(HookPoint.POST_START_CONTAINER, nri_pod, nri_container)
        elif kind == api.Event.REMOVE_CONTAINER and store and nri_container is not None:
            self.store.delete_container(nri_container.id)

    async def _pod_hook(self, point: HookPoint, pod: PodInfo) -> None:
        if self._skips(pod) or not self.dispatcher.plugins_for(point):
            return
        target = f"pod {pod.namespace}/{pod.name}"
        after = await self._pod_chain(point, pod, target)
        if point is HookPoint.PRE_RUN_POD_SANDBOX:
            self._not_applied(point, target, nri_convert.pod_changes(pod, after))

    async def _container_hook(self, point: HookPoint, nri_pod: Any | None, nri_container: Any | None) -> None:
        info = nri_convert.container_from_nri(nri_pod, nri_container)
        if self._skips(info.pod) or not self.dispatcher.plugins_for(point):
            return
        after = await self._container_chain(point, self.store.get_container(info.id) or info, info.id)
        if point is HookPoint.PRE_START_CONTAINER:
            self.store.update_container(info.id, after)  # as in proxy mode: the answer updates the store


def _present(message: Any, field: str) -> Any | None:
    """The upb sub-message ``field`` of ``message`` if set, else None (upb reads an unset one as empty)."""
    return getattr(message, field) if message.HasField(field) else None


@attrs.define(eq=False)
class NriView:
    """What ``krproxy nri``'s admin endpoint reports (:class:`krproxy.admin.View`)."""

    plugin: NriPlugin
    metrics: Metrics
    address: str = ""
    started: float = attrs.field(factory=time.time)
    _clock_start: float = attrs.field(factory=time.monotonic)

    def readiness(self) -> tuple[bool, list[str]]:
        """Ready once registered with the runtime and synchronized by it."""
        plugin = self.plugin
        reasons: list[str] = []
        if not plugin.registered:
            why = f" ({plugin.last_error})" if plugin.last_error else ""
            reasons.append(f"not registered with the runtime's NRI at {plugin.config.socket}{why}")
        elif not plugin.synchronized.is_set():
            reasons.append("registered, not synchronized by the runtime yet")
        reasons += admin.required_reasons(plugin.guard)
        return not reasons, reasons

    def status(self) -> dict[str, Any]:
        ready, reasons = self.readiness()
        plugin = self.plugin
        stats = plugin.store.statistics()
        config = plugin.config
        return {
            "version": __version__,
            "pid": os.getpid(),
            "ready": ready,
            "reasons": reasons,
            "mode": "nri",
            "admin_address": self.address,
            "started": self.started,
            "uptime_seconds": round(time.monotonic() - self._clock_start, 3),
            "nri": {
                "socket": config.socket,
                "plugin": f"{config.plugin_index}-{config.plugin_name}",
                "registered": plugin.registered,
                "last_error": plugin.last_error,
                "runtime": plugin.runtime,
                "nri_version": plugin.nri_version,
                "event_calls": plugin.event_calls,
                "request_timeout": plugin.request_timeout,
                "events": hex(plugin.subscribed),
                "runtime_requires_plugin": plugin.validator.required,
                "runtime_validator": plugin.validator.describe(),
            },
            "store": {
                "kept": plugin.store_kept,
                "recovered": plugin.synchronized.is_set(),
                "pods": stats.pods,
                "containers": stats.containers,
            },
            "hook_dir": config.hook_dir,
            **admin.registry_status(plugin.dispatcher.registry),
            "required_servers": admin.required_status(plugin.guard),
        }


def _check_validator(config: NriConfig) -> ValidatorCheck:
    """Read containerd's configuration (if given) and log whether it requires krproxy's registration.

    Raises:
        ConfigError: the file cannot be read or parsed.
    """
    if not config.containerd_config:
        check = ValidatorCheck()
    else:
        check = check_containerd_config(config.containerd_config, config.plugin_name, config.plugin_index)
    log.event(
        LOGGER,
        "nri_runtime_validator",
        level=logging.INFO if check.verdict in (Verdict.REQUIRED, Verdict.NOT_CHECKED) else logging.WARNING,
        required={True: "yes", False: "no", None: "unknown"}[check.required],
        plugin=f"{config.plugin_index}-{config.plugin_name}",
        detail=check.describe(),
        files=",".join(check.files),
        tolerate_annotation=check.tolerate_annotation,
    )
    return check


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
        guard = Guard(
            config.requirements,
            dispatcher,
            config.hook_dir,
            held=metrics.required_call_held,
            forget=metrics.forget_required_server,
        )
        metrics.track_required(guard)
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
    plugin = NriPlugin(config, dispatcher, metrics, guard=guard, validator=_check_validator(config))
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
            await nursery.start(plugin.run)
            log.event(LOGGER, "nri_started", socket=config.socket, hook_dir=config.hook_dir)
            task_status.started(plugin)
    finally:
        dispatcher.close()
        if admin_sock is not None:
            admin_sock.close()
