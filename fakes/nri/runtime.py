"""A fake NRI runtime: the runtime side of NRI, as containerd runs it, for tests without root.

It listens on a unix socket for external plugins and does what containerd's NRI adaptation (containerd/nri
``pkg/adaptation``, 0.6.1, 0.8.0 and 0.12) does with them:

* **Registration.** A plugin must call ``RegisterPlugin`` within the registration timeout, with a non-empty
  name and a two-digit index; then it is sent ``Configure`` (the runtime's name and version, the plugin's
  config and — unless the fake plays NRI 0.6.1 — the registration and request timeouts in milliseconds;
  playing 0.12, its NRI version) and answers its event mask (0: every event; bits outside the events the
  played version knows: refused). Then
  ``Synchronize`` with every pod and container; when ``sync_chunk`` is set, in parts of at most that many
  objects with ``more`` set on all but the last, and a plugin that does not echo ``more`` (or sends
  updates before the last part) is dropped, as NRI 0.8 does. Plugins are then called in index order.
* **Events.** The test drives the lifecycle (:meth:`FakeNriRuntime.run_pod`, :meth:`create_container`, ...)
  as containerd's CRI plugin does; each subscribed plugin gets its call with the runtime's request
  timeout. A plugin that times out or whose connection fails is dropped and the operation goes on
  without it; a plugin that answers an error fails the operation (:class:`NriError`), as NRI does.
  Events without an answer of their own (pods run, stopped, removed; containers created, started,
  removed, updated) go to NRI 0.12's dedicated methods (``RunPodSandbox``, ...) when the fake plays 0.12:
  a plugin that answers one Unimplemented is switched to ``StateChange`` for good (that event included)
  and a deprecation is recorded (:attr:`FakeNriRuntime.deprecations`), as containerd 2.3 does. Playing
  an older NRI (``nri_version=""``), every such event is a ``StateChange``.
* **Adjustments.** A ``CreateContainer`` answer's ``ContainerAdjustment`` (annotations, env, mounts,
  resources, cgroups path, rlimits, OCI hooks) is applied to the container being created, each plugin
  seeing the previous ones' result; two plugins setting the same field (or annotation, env variable,
  unified key, device path) is an error naming both, as NRI's ownership rules make it. ``-KEY`` removes
  (annotations, device paths; env only what a plugin set: the runtime's own stay, hidden from later
  plugins). Playing 0.12, every plugin subscribed to VALIDATE_CONTAINER_ADJUSTMENT (a mask of 0 included,
  as in NRI) is then shown the merged adjustment; a rejection or failure fails the creation with NRI's
  words (``validator "10-x" rejected container adjustment, reason: ...``), after every validator was asked.
  ``ContainerUpdate``\\ s (in answers or in ``UpdateContainers``) change the resources of the named
  containers; an update of an unknown container fails unless ``ignore_failure``.

:attr:`FakeNriRuntime.log` records every call made and received, for assertions.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import trio

from krproxy.fakes.nri.adjust import NriError, adjust, created_env, merge_resources, resources_of
from krproxy.fakes.nri.events import all_events, event_mask
from krproxy.fakes.nri.validation import validate
from krproxy.grpcstatus import Status
from krproxy.nri import PLUGIN_SERVICE, RUNTIME_SERVICE, _mux
from krproxy.nri._session import ConnectionLost, Session, TtrpcError
from krproxy.nri.notices import NOTICE_METHODS
from krproxy.proto.nri.pkg.api import v1alpha1 as api
from krproxy.unixsock import bind_unix_socket, unlink_if_ours

__all__ = ["ConnectedPlugin", "FakeNriRuntime", "NriError"]

LOGGER = logging.getLogger("krproxy.fakes.nri")


@attrs.define(eq=False)
class ConnectedPlugin:
    """A registered, configured and synchronized plugin."""

    name: str
    index: str
    events: int
    session: Session
    #: The NRI version the plugin said at registration ("" from a plugin before NRI 0.12).
    nri_version: str = ""
    #: Set once the plugin answered a dedicated event method Unimplemented: it gets StateChange since.
    state_change_only: bool = False

    @property
    def full_name(self) -> str:
        return f"{self.index}-{self.name}"

    def subscribed(self, event: api.Event) -> bool:
        return bool(self.events & (1 << (event - 1)))


@attrs.define(eq=False)
class FakeNriRuntime:
    """The runtime side of NRI on ``socket_path``; see the module docstring.

    Attributes:
        request_timeout / registration_timeout: seconds, sent in Configure (as ms) unless ``nri_0_6``.
        nri_version: the NRI version played, sent in Configure: "v0.12.2" (containerd 2.3) calls the
            dedicated event methods; "" plays NRI before 0.12 (containerd 1.7 to 2.2): StateChange only,
            and only the events up to REMOVE_CONTAINER may be subscribed.
        nri_0_6: behave as NRI 0.6.1 (containerd 1.7): no timeouts in Configure, Synchronize in one part,
            an adjustment's ``oom_score_adj`` (field 4 of ``LinuxContainerAdjustment``, new in 0.8) unknown
            and so ignored; implies ``nri_version=""``.
        sync_chunk: objects (pods + containers) per Synchronize part; None: one part.
        pods / containers: the runtime's state, by id.
        log: ``(direction, what)`` of every call: ``("call", "Configure")``, ``("serve", "RegisterPlugin")``,
            ``("call", "StateChange:RUN_POD_SANDBOX")``.
        deprecations: ``(plugin, details)`` of each plugin switched to StateChange, e.g.
            ``("50-krproxy", "does not implement RunPodSandbox")`` (containerd's ``nri-plugin-interface``).
        evictions: ``(plugin, container id, reason)`` of each eviction answered; not acted on, as by NRI.
    """

    socket_path: str
    runtime_name: str = "fake-containerd"
    runtime_version: str = "2.3.4"
    request_timeout: float = 2.0
    registration_timeout: float = 5.0
    plugin_config: str = ""
    nri_version: str = "v0.12.2"
    nri_0_6: bool = False
    sync_chunk: int | None = None
    pods: dict[str, api.PodSandbox] = attrs.field(factory=dict)
    containers: dict[str, api.Container] = attrs.field(factory=dict)
    plugins: list[ConnectedPlugin] = attrs.field(factory=list, init=False)
    log: list[tuple[str, str]] = attrs.field(factory=list, init=False)
    dropped: list[tuple[str, str]] = attrs.field(factory=list, init=False)
    deprecations: list[tuple[str, str]] = attrs.field(factory=list, init=False)
    evictions: list[tuple[str, str, str]] = attrs.field(factory=list, init=False)
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)

    @property
    def nri_0_12(self) -> bool:
        """Whether the fake plays NRI 0.12 (dedicated event methods, the version in Configure)."""
        return bool(self.nri_version) and not self.nri_0_6

    def valid_events(self) -> int:
        """The events a plugin may subscribe to: every one with 0.12, up to REMOVE_CONTAINER before."""
        return (
            all_events()
            if self.nri_0_12
            else event_mask(e for e in api.Event if 0 < e <= api.Event.REMOVE_CONTAINER)
        )

    # -- serving -----------------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[FakeNriRuntime] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept plugins until cancelled; reports itself once the socket listens."""
        sock = bind_unix_socket(self.socket_path)
        inode = os.stat(self.socket_path).st_ino
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        try:
            async with trio.open_nursery() as nursery:
                task_status.started(self)
                while True:
                    stream = await listener.accept()
                    nursery.start_soon(self._connect, stream)
        finally:
            for plugin in self.plugins:
                with trio.CancelScope(shield=True):
                    await plugin.session.aclose()
            self.plugins.clear()
            sock.close()
            unlink_if_ours(self.socket_path, inode)

    async def _connect(self, stream: trio.SocketStream) -> None:
        registered: trio.MemorySendChannel[api.RegisterPluginRequest]
        registered, registrations = trio.open_memory_channel[api.RegisterPluginRequest](1)

        async def register(payload: bytes) -> bytes:
            self.log.append(("serve", "RegisterPlugin"))
            request = api.RegisterPluginRequest.parse(payload)
            if not request.plugin_name:
                raise TtrpcError(Status.UNKNOWN, "invalid (empty) plugin name")
            index = request.plugin_idx
            if len(index.encode()) != 2 or not (index.isascii() and index.isdigit()):  # Go: bytes, 0-9
                raise TtrpcError(
                    Status.UNKNOWN, f'invalid plugin index: invalid plugin index "{index}", must be 2 digits'
                )
            registered.send_nowait(request)
            return bytes(api.Empty())

        async def update_containers(payload: bytes) -> bytes:
            self.log.append(("serve", "UpdateContainers"))
            request = api.UpdateContainersRequest.parse(payload)
            failed = self._apply_updates(request.update)
            return bytes(api.UpdateContainersResponse(failed=failed))

        session = Session(
            stream,
            _mux.RUNTIME_SERVICE_CONN,
            _mux.PLUGIN_SERVICE_CONN,
            {
                (RUNTIME_SERVICE, "RegisterPlugin"): register,
                (RUNTIME_SERVICE, "UpdateContainers"): update_containers,
            },
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.run)
            plugin = await self._start(session, registrations)
            if plugin is None:
                await session.aclose()
                return
            self.plugins.append(plugin)
            self.plugins.sort(key=lambda p: p.index)
            self._notify()
            # Serve UpdateContainers until the connection goes; then forget the plugin.
        if plugin in self.plugins:
            self._drop(plugin, session.reason or "connection closed")

    async def _start(
        self, session: Session, registrations: trio.MemoryReceiveChannel[api.RegisterPluginRequest]
    ) -> ConnectedPlugin | None:
        with trio.move_on_after(self.registration_timeout) as scope:
            request = await registrations.receive()
        if scope.cancelled_caught:
            self.dropped.append(("?", "plugin registration timed out"))
            return None
        try:
            with trio.fail_after(self.request_timeout):
                self.log.append(("call", "Configure"))
                configure = api.ConfigureRequest(
                    config=self.plugin_config,
                    runtime_name=self.runtime_name,
                    runtime_version=self.runtime_version,
                )
                if not self.nri_0_6:
                    configure.registration_timeout = int(self.registration_timeout * 1000)
                    configure.request_timeout = int(self.request_timeout * 1000)
                if self.nri_0_12:
                    configure.NRI_version = self.nri_version
                answer = api.ConfigureResponse.parse(
                    await session.call(PLUGIN_SERVICE, "Configure", bytes(configure))
                )
            valid = self.valid_events()
            events = answer.events or valid
            if events & ~valid:
                raise NriError(f"invalid plugin events: 0x{events & ~valid:x}")
            plugin = ConnectedPlugin(
                request.plugin_name, request.plugin_idx, events, session, nri_version=request.NRI_version
            )
            with trio.fail_after(self.request_timeout):
                updates = await self._synchronize(plugin)
        except (TtrpcError, ConnectionLost, trio.TooSlowError, NriError, ValueError) as exc:
            self.dropped.append(
                (f"{request.plugin_idx}-{request.plugin_name}", f"{type(exc).__name__}: {exc}")
            )
            return None
        self._apply_updates(updates)
        return plugin

    async def _synchronize(self, plugin: ConnectedPlugin) -> list[api.ContainerUpdate]:
        pods, containers = list(self.pods.values()), list(self.containers.values())
        chunk = None if self.nri_0_6 else self.sync_chunk
        while True:
            if chunk is None:
                part_pods, part_containers, pods, containers = pods, containers, [], []
            else:
                part_pods, pods = pods[:chunk], pods[chunk:]
                room = chunk - len(part_pods)
                part_containers, containers = containers[:room], containers[room:]
            more = bool(pods or containers)
            self.log.append(("call", "Synchronize"))
            request = api.SynchronizeRequest(pods=part_pods, containers=part_containers)
            if more:
                request.more = True
            answer = api.SynchronizeResponse.parse(
                await plugin.session.call(PLUGIN_SERVICE, "Synchronize", bytes(request))
            )
            if not more:
                return list(answer.update)
            if answer.update or answer.more != more:
                raise NriError("plugin does not handle split sync requests")

    def _drop(self, plugin: ConnectedPlugin, reason: str) -> None:
        if plugin in self.plugins:
            self.plugins.remove(plugin)
            self.dropped.append((plugin.full_name, reason))
            LOGGER.info("event=plugin_dropped plugin=%s reason=%s", plugin.full_name, reason)
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for_plugins(self, count: int) -> None:
        """Until ``count`` plugins are registered, configured and synchronized."""
        while len(self.plugins) != count:
            await self._changed.wait()

    # -- calling plugins ---------------------------------------------------------------------------

    async def _call_each(
        self,
        event: api.Event,
        method: str,
        request: Any,
        reply_type: type[Any],
        apply: Callable[[str, Any], None],
        fallback: api.StateChangeEvent | None = None,
    ) -> None:
        """Call every subscribed plugin in order, as NRI's adaptation does (see the module docstring).

        With ``fallback``, ``method`` is a dedicated event method of NRI 0.12: playing an older NRI, or for
        a plugin that answered one Unimplemented, ``fallback`` goes to StateChange instead.
        """
        for plugin in list(self.plugins):
            if not plugin.subscribed(event):
                continue
            try:
                with trio.fail_after(self.request_timeout):
                    answer = await self._call(plugin, event, method, request, fallback)
            except (
                trio.TooSlowError,
                ConnectionLost,
            ) as exc:  # fatal: the plugin is dropped, the operation goes on
                reason = "timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
                self._drop(plugin, f"failed to handle {method} request: {reason}")
                await plugin.session.aclose()
                continue
            except TtrpcError as exc:
                raise NriError(f"plugin {plugin.full_name}: {exc.code.name}: {exc.message}") from None
            apply(plugin.full_name, reply_type.parse(answer))

    async def _call(
        self,
        plugin: ConnectedPlugin,
        event: api.Event,
        method: str,
        request: Any,
        fallback: api.StateChangeEvent | None,
    ) -> bytes:
        if fallback is None or (self.nri_0_12 and not plugin.state_change_only):
            self.log.append(("call", method))
            try:
                return await plugin.session.call(PLUGIN_SERVICE, method, bytes(request))
            except TtrpcError as exc:
                if fallback is None or exc.code != Status.UNIMPLEMENTED:
                    raise
            plugin.state_change_only = True  # as NRI 0.12's adaptation: for good, every event
            self.deprecations.append((plugin.full_name, f"does not implement {method}"))
            LOGGER.warning(
                "event=nri_deprecated_interface plugin=%s deprecated=StateChange details=%s",
                plugin.full_name,
                f"does not implement {method}",
            )
        assert fallback is not None
        self.log.append(("call", f"StateChange:{event.name}"))
        return await plugin.session.call(PLUGIN_SERVICE, "StateChange", bytes(fallback))

    async def _event(
        self, event: api.Event, pod: api.PodSandbox, container: api.Container | None = None
    ) -> None:
        """An event without an answer of its own: NRI 0.12's dedicated method, or StateChange."""
        method, request_type = NOTICE_METHODS[event]
        request = (
            request_type(pod=pod, container=container) if container is not None else request_type(pod=pod)
        )
        fallback = api.StateChangeEvent(event=event, pod=pod, container=container)
        await self._call_each(event, method, request, api.Empty, lambda name, answer: None, fallback)

    # -- the lifecycle, as the CRI plugin drives it ---------------------------------------------------

    async def run_pod(self, pod: api.PodSandbox) -> None:
        self.pods[pod.id] = pod
        await self._event(api.Event.RUN_POD_SANDBOX, pod)

    async def stop_pod(self, pod_id: str) -> None:
        await self._event(api.Event.STOP_POD_SANDBOX, self.pods[pod_id])

    async def update_pod(
        self,
        pod_id: str,
        resources: api.LinuxResources | None = None,
        overhead: api.LinuxResources | None = None,
    ) -> None:
        """A pod-level resize (CRI UpdatePodSandboxResources), as containerd 2.3 drives it: UpdatePodSandbox
        (a plugin's error fails it; no StateChange fallback: NRI has none for it), the new resources
        recorded in the pod, then PostUpdatePodSandbox. Playing an NRI before 0.12: the runtime has no such
        events, so it only records the resources."""
        pod = self.pods[pod_id]
        if self.nri_0_12:
            request = api.UpdatePodSandboxRequest(
                pod=pod, overhead_linux_resources=overhead, linux_resources=resources
            )
            await self._call_each(
                api.Event.UPDATE_POD_SANDBOX,
                "UpdatePodSandbox",
                request,
                api.UpdatePodSandboxResponse,
                lambda name, answer: None,
            )
        if pod.linux is None:
            pod.linux = api.LinuxPodSandbox()
        pod.linux.pod_resources, pod.linux.pod_overhead = resources, overhead
        if self.nri_0_12:
            await self._event(api.Event.POST_UPDATE_POD_SANDBOX, pod)

    async def remove_pod(self, pod_id: str) -> None:
        pod = self.pods.pop(pod_id)
        await self._event(api.Event.REMOVE_POD_SANDBOX, pod)

    async def create_container(self, container: api.Container) -> api.Container:
        """Create ``container`` with every plugin's adjustments; returns it as created."""
        pod = self.pods[container.pod_sandbox_id]
        container.state = api.ContainerState.CONTAINER_UNKNOWN
        if container.linux is None:
            container.linux = api.LinuxContainer()
        if container.linux.resources is None:
            container.linux.resources = api.LinuxResources()
        owners: dict[str, str] = {}
        pending: list[api.ContainerUpdate] = []

        adjustments: list[bytes] = []
        original = api.Container.parse(bytes(container))

        def apply(plugin: str, answer: api.CreateContainerResponse) -> None:
            if answer.adjust is not None:
                adjust(container, answer.adjust, plugin, owners, nri_0_6=self.nri_0_6)
                adjustments.append(bytes(answer.adjust))
            pending.extend(answer.update)
            self._evicted(plugin, answer.evict)

        request = api.CreateContainerRequest(pod=pod, container=container)
        await self._call_each(
            api.Event.CREATE_CONTAINER, "CreateContainer", request, api.CreateContainerResponse, apply
        )
        if self.nri_0_12:
            # The adjustments of every plugin as one (protobuf merges concatenated messages, repeated
            # fields appended), shown to the validators with the container as it was asked for.
            merged = api.ContainerAdjustment.parse(b"".join(adjustments))
            await validate(self, pod, original, merged, pending)
        container.env = created_env(original.env, container.env, owners)
        container.state = api.ContainerState.CONTAINER_CREATED
        self.containers[container.id] = container
        self._apply_updates(pending)
        await self._event(api.Event.POST_CREATE_CONTAINER, pod, container)
        return container

    async def start_container(self, container_id: str) -> None:
        container, pod = self._container(container_id)
        await self._event(api.Event.START_CONTAINER, pod, container)
        container.state = api.ContainerState.CONTAINER_RUNNING
        await self._event(api.Event.POST_START_CONTAINER, pod, container)

    async def update_container(self, container_id: str, resources: api.LinuxResources) -> api.LinuxResources:
        """Update a container's resources with the plugins' changes; returns the resources applied."""
        container, pod = self._container(container_id)
        wanted = api.LinuxResources.parse(bytes(resources))
        owners: dict[str, str] = {}
        others: list[api.ContainerUpdate] = []

        def apply(plugin: str, answer: api.UpdateContainerResponse) -> None:
            for update in answer.update:
                if update.container_id == container_id:
                    if update.linux is not None and update.linux.resources is not None:
                        merge_resources(wanted, update.linux.resources, plugin, owners)
                else:
                    others.append(update)
            self._evicted(plugin, answer.evict)

        request = api.UpdateContainerRequest(pod=pod, container=container, linux_resources=resources)
        await self._call_each(
            api.Event.UPDATE_CONTAINER, "UpdateContainer", request, api.UpdateContainerResponse, apply
        )
        merge_resources(resources_of(container), wanted, "", {})
        self._apply_updates(others)
        await self._event(api.Event.POST_UPDATE_CONTAINER, pod, container)
        return wanted

    async def stop_container(self, container_id: str) -> None:
        container, pod = self._container(container_id)
        pending: list[api.ContainerUpdate] = []
        request = api.StopContainerRequest(pod=pod, container=container)
        await self._call_each(
            api.Event.STOP_CONTAINER,
            "StopContainer",
            request,
            api.StopContainerResponse,
            lambda plugin, answer: pending.extend(answer.update),
        )
        container.state = api.ContainerState.CONTAINER_STOPPED
        self._apply_updates(pending)

    async def remove_container(self, container_id: str) -> None:
        container = self.containers.pop(container_id)
        await self._event(api.Event.REMOVE_CONTAINER, self.pods[container.pod_sandbox_id], container)

    def _evicted(self, plugin: str, evictions: Iterable[api.ContainerEviction]) -> None:
        self.evictions += [(plugin, e.container_id, e.reason) for e in evictions]

    def _container(self, container_id: str) -> tuple[api.Container, api.PodSandbox]:
        """A known container and its pod."""
        container = self.containers[container_id]
        return container, self.pods[container.pod_sandbox_id]

    def _apply_updates(self, updates: Iterable[api.ContainerUpdate]) -> list[api.ContainerUpdate]:
        failed = []
        for update in updates:
            container = self.containers.get(update.container_id)
            if container is None:
                if not update.ignore_failure:
                    failed.append(update)
                continue
            if update.linux is not None and update.linux.resources is not None:
                merge_resources(resources_of(container), update.linux.resources, "", {})
        return failed


# --- adjustments (NRI's pkg/adaptation/result.go, the parts a hook bridge can produce and more) -------
