"""What ``krproxy nri`` does at each NRI event: the hook points (:class:`EventHandlers`, which
:class:`krproxy.nri.plugin.NriPlugin` holds as ``events``; the plugin keeps the connection and tells the
handlers, at each Configure, the :class:`Terms` the runtime set).

Each handler reads the event's pod and container into records (:mod:`krproxy.nri.convert`), runs the hook
point through the shared :class:`~krproxy.hooks.lifecycle.Lifecycle` (the sequence of proxy and Docker mode),
and turns the merged record into what NRI can apply:

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

Every change NRI cannot make is logged (``nri_change_not_applied``) and counted
(``krproxy_nri_changes_not_applied_total{hook,field}``), never dropped silently.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import betterproto2
import trio

from krproxy import log
from krproxy.grpcstatus import Status
from krproxy.hooks import merge
from krproxy.hooks.dispatch import Dispatcher
from krproxy.hooks.guard import Guard, RequiredMissing
from krproxy.hooks.lifecycle import Lifecycle
from krproxy.hooks.model import ContainerInfo, PodInfo, PodResize
from krproxy.hooks.outcomes import HookRejected, RequiredFailed
from krproxy.hooks.points import HookPoint, Stage
from krproxy.hooks.required import NOTHING_NEEDED, AnnotationError, Needed
from krproxy.metrics import Metrics
from krproxy.nri import convert as nri_convert
from krproxy.nri import wire
from krproxy.nri._session import AsyncHandler, TtrpcError
from krproxy.nri.versions import RuntimeNri
from krproxy.proto.nri.pkg.api import v1alpha1 as api
from krproxy.proto.runtime import v1alpha1 as hookapi

LOGGER = logging.getLogger("krproxy.nri")

#: The hook points where a required hook server can hold the runtime back: NRI fails the CRI operation
#: when the plugin answers these events with an error. The others are events after the fact
#: (StateChange) or answers NRI does not wait on. PreUpdatePodSandboxResources (UpdatePodSandbox) only
#: with NRI 0.12 and later: an older runtime has no such event.
GUARDED = (
    HookPoint.PRE_CREATE_CONTAINER,
    HookPoint.PRE_UPDATE_CONTAINER_RESOURCES,
    HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES,
)
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
#: Time kept back from the runtime's request timeout for krproxy's own work and the answer's trip.
MARGIN = 0.2
#: NRI's default request timeout (``DefaultPluginRequestTimeout``), assumed when Configure says none.
DEFAULT_REQUEST_TIMEOUT = 2.0


#: The betterproto2 messages an event's handler writes (NRI answers) or reads (hook servers' answers); with
#: every message they hold, :func:`warm_up` prepares them.
EVENT_MESSAGES = (
    api.CreateContainerResponse,
    api.UpdateContainerResponse,
    api.StopContainerResponse,
    api.Empty,
    hookapi.PodSandboxHookResponse,
    hookapi.ContainerResourceHookResponse,
)


def _message_types(hint: Any) -> Iterator[type[betterproto2.Message]]:
    if isinstance(hint, type) and issubclass(hint, betterproto2.Message):
        yield hint
    for arg in typing.get_args(hint):
        yield from _message_types(arg)


def warm_up(roots: tuple[type[betterproto2.Message], ...] = EVENT_MESSAGES) -> int:
    """Make betterproto2 resolve the field metadata of *roots* and every message they hold, now; the number
    of message classes.

    betterproto2 does that at a class's first use, resolving its type hints (a few ms a class): ~90 ms for
    the first CreateContainer answer with an adjustment (a ContainerAdjustment holds some 40 message types),
    which the first pod after every start of ``krproxy nri`` paid on its way to running, inside NRI's
    request timeout. :func:`~krproxy.nri.plugin.serve` calls this before it registers.
    """
    seen: set[type[betterproto2.Message]] = set()
    todo = list(roots)
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        cls.FromString(bytes(cls()))  # resolves and caches the class's metadata
        for hint in typing.get_type_hints(cls).values():
            todo.extend(_message_types(hint))
    return len(seen)


def _present(message: Any, field: str) -> Any | None:
    """The upb sub-message ``field`` of ``message`` if set, else None (upb reads an unset one as empty)."""
    return getattr(message, field) if message.HasField(field) else None


@attrs.frozen
class Terms:
    """What a connection's Configure settled that the event handlers go by.

    Attributes:
        request_timeout: the runtime's request timeout, seconds: NRI drops a plugin that answers later.
        runtime_nri: what the runtime's NRI applies of an adjustment.
        store_kept: whether the events keep krproxy's store on this connection (the plugin's choice, with
            the events it subscribed).
    """

    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    runtime_nri: RuntimeNri = attrs.field(factory=RuntimeNri)
    store_kept: bool = False


@attrs.define(eq=False)
class EventHandlers:
    """The NRI plugin's handlers of the events that carry hook points (one instance across reconnections).

    Attributes:
        dispatcher: runs the hook servers; says which are registered at a point.
        metrics: where changes NRI cannot make are counted.
        lifecycle: the store and the sequence at each hook point.
        guard: required hook servers' states and the gate of the :data:`GUARDED` points (None: nothing
            required).
        own_names: krproxy's own NRI plugin name as NRI's validator matches it (``name`` and
            ``index-name``): a required server of such a name is met.
        restrict_oom_score_adj: containerd's setting: an ``oom_score_adj`` below containerd's is withheld.
        terms: the current connection's (:meth:`configure`).
        event_calls: how the runtime delivered the last event without an answer of its own: "dedicated"
            (NRI 0.12's methods) or "StateChange" (before 0.12, or a 0.12 runtime's deprecated fallback);
            "" before any.
    """

    dispatcher: Dispatcher
    metrics: Metrics
    lifecycle: Lifecycle
    guard: Guard | None
    own_names: frozenset[str]
    #: containerd's ``restrict_oom_score_adj`` (:mod:`krproxy.nri.cri_settings`; False when not read).
    restrict_oom_score_adj: bool = False
    #: The runtime process's own ``oom_score_adj`` (:func:`krproxy.nri.plugin.peer_oom_score_adj`,
    #: read at each connection; None: unknown).
    runtime_oom_score_adj: int | None = attrs.field(default=None, init=False)
    terms: Terms = attrs.field(factory=Terms, init=False)
    event_calls: str = attrs.field(default="", init=False)

    def configure(self, terms: Terms) -> None:
        """Go by *terms* from now on (a new connection's Configure); to a runtime before NRI 0.12, say which
        required servers' PreUpdatePodSandboxResources it cannot hold."""
        self.terms = terms
        if not terms.runtime_nri.has_0_12:
            self._pod_resize_not_held()

    def methods(self) -> dict[str, AsyncHandler]:
        """The Plugin-service methods these handlers answer, by name: the events with an answer, and
        those without one both as NRI 0.12's dedicated methods (:data:`EVENT_METHODS`) and as
        ``StateChange``."""
        methods: dict[str, AsyncHandler] = {
            "CreateContainer": self.create_container,
            "UpdateContainer": self.update_container,
            "StopContainer": self.stop_container,
            "UpdatePodSandbox": self.update_pod_sandbox,
            "StateChange": self.state_change,
        }
        for name, (event, request_type) in EVENT_METHODS.items():
            methods[name] = self._event_method(event, request_type)
        return methods

    def _deadline(self) -> float:
        """When the chain must be done: the runtime's request timeout (and the call's deadline) less MARGIN."""
        now, timeout = trio.current_time(), self.terms.request_timeout
        deadline = min(now + timeout, trio.current_effective_deadline())
        return deadline - max(MARGIN, 0.1 * timeout)

    def _hooked(self, point: HookPoint, pod: PodInfo) -> bool:
        """Whether *point*'s hook servers run for *pod*: some are registered, and the pod does not skip."""
        return bool(self.dispatcher.plugins_for(point)) and not self.lifecycle.skips(pod)

    def _not_applied(
        self,
        point: HookPoint,
        target: str,
        fields: tuple[str, ...] | list[str],
        reason: str | None = None,
    ) -> None:
        """Count and log changes not applied: one warning per reason (``reason``, else each field's
        :func:`~krproxy.nri.convert.why_not_applied`)."""
        by_reason: dict[str, list[str]] = {}
        for field in fields:
            self.metrics.nri_not_applied.labels(point.value, field.split("[")[0]).inc()
            by_reason.setdefault(reason or nri_convert.why_not_applied(field), []).append(field)
        for why, named in by_reason.items():
            log.warning(
                LOGGER,
                "nri_change_not_applied",
                hook=point.value,
                target=target,
                fields=",".join(named),
                reason=why,
            )

    def _not_applied_by_runtime(self, point: HookPoint, target: str, adjust: api.ContainerAdjustment) -> None:
        """Say what of ``adjust`` the runtime's NRI will not apply (:mod:`krproxy.nri.versions`: an env
        var's removal, fields newer than its NRI), once per reason."""
        by_reason: dict[str, list[str]] = {}
        for field, reason in self.terms.runtime_nri.not_applied(adjust):
            by_reason.setdefault(reason, []).append(field)
        for reason, fields in by_reason.items():
            self._not_applied(point, target, fields, reason)

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

    async def _require(self, point: HookPoint, pod: PodInfo, container: str | None) -> Needed:
        """The required hook servers of *point* for this container, once all are up; else an UNAVAILABLE
        error for the runtime, which fails the CRI operation (:data:`GUARDED` points only). Names that are
        krproxy's own NRI plugin name (``name`` or ``index-name``, as NRI's validator matches) are met."""
        if self.guard is None or point not in GUARDED:
            return NOTHING_NEEDED
        try:
            return await self.guard.require(
                point, pod.annotations, container, met=self.own_names, deadline=self._deadline()
            )
        except AnnotationError as err:
            raise TtrpcError(Status.INVALID_ARGUMENT, str(err)) from None
        except RequiredMissing as exc:
            raise TtrpcError(Status.UNAVAILABLE, exc.message or "") from None

    async def _run(
        self, point: HookPoint, record: Any, target: str, required: Needed = NOTHING_NEEDED
    ) -> Any:
        """Run ``point``'s hook servers within the budget (:meth:`Lifecycle.pre` / :meth:`Lifecycle.post`);
        a Fail (or required) server's failure of a pre hook becomes an error for the runtime."""
        if point.stage is Stage.POST:
            await self.lifecycle.post(point, record, target=target, deadline=self._deadline())
            return record
        try:
            return await self.lifecycle.pre(
                point, record, target=target, required=required, deadline=self._deadline()
            )
        except (HookRejected, RequiredFailed, RequiredMissing) as exc:
            raise TtrpcError(exc.status, exc.message or "") from None

    # -- events with an answer -----------------------------------------------------------------

    async def _container_request(
        self, point: HookPoint, request_type: str, payload: bytes
    ) -> tuple[Any, ContainerInfo, Needed] | None:
        """The request, its container and the required servers of an event whose answer can fail the CRI
        operation; None when no hook server (registered or required) is to run for it."""
        request = wire.parse(request_type, payload)
        info = nri_convert.container_from_nri(request.pod, request.container)
        if point is HookPoint.PRE_CREATE_CONTAINER and (wrong := nri_convert.another_pod_named(info)):
            raise TtrpcError(Status.INVALID_ARGUMENT, wrong)  # (whether or not hooks run, as proxy mode)
        if self.lifecycle.skips(info.pod):
            return None
        required = await self._require(point, info.pod, info.name)
        if not self.dispatcher.plugins_for(point) and not required.names:
            return None
        return request, info, required

    async def create_container(self, payload: bytes) -> bytes:
        point = HookPoint.PRE_CREATE_CONTAINER
        hooked = await self._container_request(point, "CreateContainerRequest", payload)
        if hooked is None:
            return bytes(api.CreateContainerResponse())
        _, info, required = hooked
        target = f"pod {info.pod.namespace}/{info.pod.name} container {info.name}"
        after = await self._run(point, info, target, required)
        adjusted = nri_convert.adjustment(
            info,
            after,
            oom_score_adj=self.terms.runtime_nri.has_0_8,
            restrict_oom_score_adj=self.restrict_oom_score_adj,
            runtime_oom_score_adj=self.runtime_oom_score_adj,
        )
        self._not_applied(point, target, adjusted.not_applied)
        if adjusted.adjust is not None:
            self._not_applied_by_runtime(point, target, adjusted.adjust)
        return bytes(api.CreateContainerResponse(adjust=adjusted.adjust))

    async def update_container(self, payload: bytes) -> bytes:
        point = HookPoint.PRE_UPDATE_CONTAINER_RESOURCES
        hooked = await self._container_request(point, "UpdateContainerRequest", payload)
        if hooked is None:
            return bytes(api.UpdateContainerResponse())
        request, info, required = hooked
        wanted = nri_convert.resources_from_nri(request.linux_resources)
        stored = self.lifecycle.store.get_container(info.id) or info
        current = stored.resources if stored.resources is not None else wanted
        prepared = attrs.evolve(stored, resources=merge.update_resource_by_update_request(current, wanted))
        after = await self._run(point, prepared, info.id, required)
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
        self.lifecycle.keep(point, info.id, after)
        return bytes(update)

    async def update_pod_sandbox(self, payload: bytes) -> bytes:
        """NRI 0.12's UpdatePodSandbox (CRI UpdatePodSandboxResources, a pod-level resize): the
        PreUpdatePodSandboxResources hook servers see the pod with the requested resources and overhead;
        a Fail server's refusal fails the resize. NRI can refuse the update but not change it: changed
        resources are logged and counted as not applied."""
        request = wire.parse("UpdatePodSandboxRequest", payload)
        pod = nri_convert.pod_from_nri(_present(request, "pod"))
        point = HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES
        if self.lifecycle.skips(pod):
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
        after: PodResize = await self._run(point, resize, target, required)
        if after.pod.resources != resize.pod.resources:
            self._not_applied(point, target, ["resources"])
        return b""  # UpdatePodSandboxResponse is an empty message

    async def stop_container(self, payload: bytes) -> bytes:
        request = wire.parse("StopContainerRequest", payload)
        info = nri_convert.container_from_nri(request.pod, request.container)
        if self._hooked(HookPoint.POST_STOP_CONTAINER, info.pod):
            await self._run(HookPoint.POST_STOP_CONTAINER, info, info.id)
        return bytes(api.StopContainerResponse())

    # -- events without an answer of their own -------------------------------------------------

    def _event_method(self, event: api.Event, request_type: str) -> AsyncHandler:
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
        store = self.terms.store_kept
        if kind == api.Event.RUN_POD_SANDBOX:
            if store and nri_pod is not None:
                self.lifecycle.keep(HookPoint.PRE_RUN_POD_SANDBOX, nri_pod.id, pod)
            await self._pod_hook(HookPoint.PRE_RUN_POD_SANDBOX, pod)
        elif kind == api.Event.STOP_POD_SANDBOX:
            await self._pod_hook(HookPoint.POST_STOP_POD_SANDBOX, pod)
        elif kind == api.Event.REMOVE_POD_SANDBOX:
            if store and nri_pod is not None:
                self.lifecycle.store.remove_pod(nri_pod.id)
        elif kind == api.Event.POST_CREATE_CONTAINER:
            if store:
                info = nri_convert.container_from_nri(nri_pod, nri_container)
                self.lifecycle.keep(HookPoint.PRE_CREATE_CONTAINER, info.id, info)
        elif kind == api.Event.START_CONTAINER:
            await self._container_hook(HookPoint.PRE_START_CONTAINER, nri_pod, nri_container)
        elif kind == api.Event.POST_START_CONTAINER:
            await self._container_hook(HookPoint.POST_START_CONTAINER, nri_pod, nri_container)
        elif kind == api.Event.REMOVE_CONTAINER and store and nri_container is not None:
            self.lifecycle.store.delete_container(nri_container.id)

    async def _pod_hook(self, point: HookPoint, pod: PodInfo) -> None:
        if not self._hooked(point, pod):
            return
        target = f"pod {pod.namespace}/{pod.name}"
        after = await self._run(point, pod, target)
        if point is HookPoint.PRE_RUN_POD_SANDBOX:
            self._not_applied(point, target, nri_convert.pod_changes(pod, after))

    async def _container_hook(self, point: HookPoint, nri_pod: Any | None, nri_container: Any | None) -> None:
        info = nri_convert.container_from_nri(nri_pod, nri_container)
        if not self._hooked(point, info.pod):
            return
        after = await self._run(point, self.lifecycle.store.get_container(info.id) or info, info.id)
        if point is HookPoint.PRE_START_CONTAINER:
            self.lifecycle.keep(point, info.id, after)  # as in proxy mode: the answer updates the store


def mask_of(events: set[api.Event]) -> int:
    mask = 0
    for event in events:
        mask |= 1 << (event - 1)
    return mask


def event_names(mask: int) -> str:
    """An event mask as the logs and ``krproxy status`` show it: NRI's event names in event order,
    ``RUN_POD_SANDBOX,CREATE_CONTAINER`` (``0x9`` said nothing to an operator); bits of no event NRI
    0.12 knows as ``bitN``; ``none`` for 0."""
    names = []
    for bit in range(mask.bit_length()):
        if mask >> bit & 1:
            event = bit + 1
            names.append(api.Event(event).name if 0 < event < api.Event.LAST else f"bit{bit}")
    return ",".join(names) or "none"
