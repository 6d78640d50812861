"""Hooks on the request path: the interceptors for the CRI methods that carry hook points.

=============================  =====================================================
CRI method                     what happens
=============================  =====================================================
RunPodSandbox                  PreRunPodSandbox chain → forward → store the pod
CreateContainer                PreCreateContainer chain → forward → store the container
StartContainer                 PreStartContainer → forward → PostStartContainer
StopContainer                  forward → PostStopContainer → drop the container
StopPodSandbox                 forward → PostStopPodSandbox → drop the pod (NOT_FOUND: and its containers)
UpdateContainerResources       PreUpdateContainerResources chain → forward → store
UpdatePodSandboxResources      PreUpdatePodSandboxResources chain → forward → store the pod's resources
RemoveContainer / RemovePod…   forward → drop from the store (no hooks)
RestorePod                     PreRunPodSandbox, PreCreateContainer per container → forward → store all
=============================  =====================================================

Post hooks run whether or not the runtime call succeeded, and the runtime's answer or
error goes back to kubelet unchanged. Stop and Remove drop the store entry only when the
runtime succeeded or answered NOT_FOUND (the object is gone); after any other failure the
entry stays, so kubelet's retry still runs PostStop hooks with the full record
(:func:`~krproxy.hooks.forwarding.forward_then_forget`). Pods labelled with the skip label (by default
``runtimeproxy.koordinator.sh/skip-hookserver=true``) get no hooks, but are still stored.

When no plugin changed anything, the original request bytes are forwarded, so a proxy with
plugins that only observe is byte-for-byte transparent too. A call that would run no hook at all
(no plugin at its points, no required server, or a pod with the skip label) and only forward and
then tell the store is not intercepted: its watch (:mod:`krproxy.hooks.watched`) lets it go to the
runtime as the caller sent it (header block and message, as a passthrough call) and the store learns
from its request and answer once the answer is out. RunPodSandbox, CreateContainer and the Removes
are watched so, and the Stops of objects the store lacks or whose pod skips hooks (a PostStop hook is
run at the answer, by the plugins registered then); StartContainer and the resource updates always
go through their interceptor.

Intercepted calls wait until the store has been recovered from the runtime after a
restart (:meth:`HookRuntime.mark_recovered`), but no longer than the start-up grace
(:mod:`krproxy.hooks.startup`); a call on a pod or container whose record recovery left out, or has not
recovered when the grace is over, is refused where a required server or a Fail plugin needs the record
(:meth:`HookRuntime._refuse_missing`), and otherwise forwarded without hooks.

The sequence at each hook point (records → hook request → chain → merge → store) is
:class:`~krproxy.hooks.lifecycle.Lifecycle`'s, shared with Docker and NRI mode; this module only reads
CRI requests into records and writes merged records back into them.

Required hook servers (:mod:`krproxy.hooks.required`): before a hooked call does anything at a
point where the flags or the pod's annotations require a server, :meth:`HookRuntime._require` asks
the :class:`~krproxy.hooks.guard.Guard`, which refuses it (UNAVAILABLE, nothing forwarded) while
that server is not registered and answering; Stop calls are checked before forwarding, for their
Post points. Pods with the skip label, and ids the store does not know, run no hooks and need none.

Which object (:mod:`krproxy.hooks.idprefix`): every interceptor reads its pod or container id as containerd
does before hooks and store see it (:meth:`HookRuntime._named`): a unique prefix of a stored id names that
object, whose full id the hooks see, the store keys and the runtime is sent (so the runtime acts on the
object the hooks saw, or answers NOT_FOUND); an empty id, or a prefix of two stored ids, is refused as
containerd refuses it (UNKNOWN, its message), before any hook or forward. The Removes, which have no hook
point, forward the caller's request as it came and drop the entry the id names (none if it names none or
is refused: the runtime answers as it does to anyone).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import trio

from krproxy import log, protowire
from krproxy.forward import CallForward, Forward, Handler, Interceptor, Reply, Watch, runtime_interceptors
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks import convert, idprefix, merge, restore, rewrite, watched, writeback
from krproxy.hooks._reading import (
    decode,
    decode_id,
    decode_request,
    malformed,
    reply_field,
    same_pod,
    with_id,
)
from krproxy.hooks.dispatch import Dispatcher
from krproxy.hooks.forwarding import forward_then, forward_then_forget
from krproxy.hooks.guard import Guard
from krproxy.hooks.idprefix import IdRefused
from krproxy.hooks.lifecycle import Lifecycle
from krproxy.hooks.model import ContainerInfo, PodInfo
from krproxy.hooks.points import HookPoint
from krproxy.hooks.required import NOTHING_NEEDED, AnnotationError, Needed
from krproxy.hooks.startup import StoreGate, refusal
from krproxy.hooks.store import HookStore
from krproxy.proto.runtime import v1 as cri

LOGGER = logging.getLogger("krproxy.hooks")

R = TypeVar("R")


@attrs.define(eq=False)
class HookRuntime:
    """Store + dispatcher, exposed to the forwarder as :meth:`interceptors`."""

    store: HookStore
    dispatcher: Dispatcher
    skip_label: tuple[str, str]
    guard: Guard | None = None
    lifecycle: Lifecycle = attrs.field(init=False)
    _recovered: StoreGate = attrs.field(factory=StoreGate, init=False)
    _locks: weakref.WeakValueDictionary[str, trio.Lock] = attrs.field(
        factory=weakref.WeakValueDictionary, init=False
    )

    def __attrs_post_init__(self) -> None:
        self.lifecycle = Lifecycle(self.store, self.dispatcher.run, self.skip_label)
        self.store.count_label(*self.skip_label)  # (a watch asks whether any stored pod skips hooks)

    def interceptors(self) -> dict[str, Interceptor]:
        handlers: dict[str, Handler] = {
            "RunPodSandbox": self.run_pod_sandbox,
            "CreateContainer": self.create_container,
            "StartContainer": self.start_container,
            "StopContainer": self.stop_container,
            "StopPodSandbox": self.stop_pod_sandbox,
            "UpdateContainerResources": self.update_container_resources,
            "UpdatePodSandboxResources": self.update_pod_sandbox_resources,
            "RemoveContainer": self.remove_container,
            "RemovePodSandbox": self.remove_pod_sandbox,
            "RestorePod": self.restore_pod,
        }
        return runtime_interceptors(handlers, gate=self._recovered)

    def watches(self) -> dict[str, Watch]:
        """The watches of the calls that go upstream as the caller's bytes where no hook would run
        (:mod:`krproxy.hooks.watched`)."""
        return watched.watches(self)

    def mark_recovered(self) -> None:
        """Let intercepted calls through: the store now reflects the runtime (but for the records
        :attr:`store_gate` says recovery left out)."""
        self._recovered.set()

    @property
    def store_gate(self) -> StoreGate:
        """What intercepted calls wait on until the store is recovered (the daemon starts its grace)."""
        return self._recovered

    def _refuse_missing(self, kind: str, ident: str, *points: HookPoint) -> None:
        """Raise, before anything is forwarded, for a call at *points* on *ident*, which the store lacks,
        where recovery is why and a required server or a Fail plugin needs the record
        (:func:`krproxy.hooks.startup.refusal`)."""
        stored = self.store.get_pod(ident) if kind == "pod" else self.store.get_container(ident)
        missing = None if stored is not None else self._recovered.missing(ident)
        if missing is not None:
            requirements = self.guard.requirements if self.guard is not None else None
            err = refusal(
                missing,
                kind,
                ident,
                points,
                requirements=requirements,
                plugins_for=self.dispatcher.plugins_for,
            )
            if err is not None:
                raise err

    @property
    def recovered(self) -> bool:
        return self._recovered.recovered

    def _skips(self, pod: PodInfo) -> bool:
        return self.lifecycle.skips(pod)

    async def _require(self, point: HookPoint, pod: PodInfo, container: str | None = None) -> Needed:
        """The required hook servers of a hooked call at *point*, once all are up and registered where
        they must be (:meth:`~krproxy.hooks.guard.Guard.require`); raises UNAVAILABLE, before anything is
        forwarded, if one is not."""
        if self.guard is None:
            return NOTHING_NEEDED
        try:
            return await self.guard.require(point, pod.annotations, container)
        except AnnotationError as err:
            raise GRPCError(Status.INVALID_ARGUMENT, str(err)) from None

    # -- pods --------------------------------------------------------------------------

    async def run_pod_sandbox(self, data: bytes, forward: Forward) -> Reply:
        request = await decode_request(cri.RunPodSandboxRequest, data, "RunPodSandboxRequest")
        with malformed("RunPodSandboxRequest"):
            pod = convert.pod_from_run_request(request)
        point = HookPoint.PRE_RUN_POD_SANDBOX
        pod, data = await self.pre_hooks(
            point,
            pod,
            pod=pod,
            target=f"pod {pod.namespace}/{pod.name}",
            data=data,
            rebuild=lambda merged: writeback.apply_run_pod(request, merged).SerializeToString(),
            what="RunPodSandboxRequest",
        )
        return await self._forward_created(
            point, pod, forward, data, cri.RunPodSandboxResponse, "pod_sandbox_id"
        )

    async def restore_pod(self, data: bytes, forward: Forward) -> Reply:
        """RestorePod: PreRunPodSandbox and PreCreateContainer on what it restores (:mod:`krproxy.hooks.restore`)."""
        return await restore.restore_pod(self, data, forward)

    async def stop_pod_sandbox(self, data: bytes, forward: Forward) -> Reply:
        sandbox_id = decode_id(cri.StopPodSandboxRequest, data, "pod_sandbox_id")
        sandbox_id, data = self._named("StopPodSandbox", cri.StopPodSandboxRequest, sandbox_id, data)
        known = self.store.get_pod(sandbox_id)
        if known is None:
            self._refuse_missing("pod", sandbox_id, HookPoint.POST_STOP_POD_SANDBOX)
        elif not self._skips(known):
            await self._require(HookPoint.POST_STOP_POD_SANDBOX, known)

        async def post() -> None:
            pod = self.store.get_pod(sandbox_id)
            if pod is None:
                self.missing("pod", sandbox_id, HookPoint.POST_STOP_POD_SANDBOX)
            elif not self._skips(pod):
                await self.lifecycle.post(HookPoint.POST_STOP_POD_SANDBOX, pod, target=sandbox_id)

        return await forward_then_forget(
            forward_then(forward, data, post),
            lambda: self.store.delete_pod(sandbox_id),
            gone=lambda: self.store.remove_pod(sandbox_id),
        )

    async def update_pod_sandbox_resources(self, data: bytes, forward: Forward) -> Reply:
        """Pod-level resize (KEP-5419): kubelet calls this before it writes the pod's cgroup and fails the
        resize on any error but UNIMPLEMENTED, which runtimes without the call (containerd before 2.3)
        answer; that answer, like every runtime error, goes back unchanged and leaves the store as it was.
        """
        request = await decode_request(
            cri.UpdatePodSandboxResourcesRequest, data, "UpdatePodSandboxResourcesRequest"
        )
        with malformed("UpdatePodSandboxResourcesRequest"):
            sandbox_id = request.pod_sandbox_id
            if not isinstance(sandbox_id, str):
                raise TypeError("pod_sandbox_id is not a string")
        request.pod_sandbox_id, data = self._named(
            "UpdatePodSandboxResources", cri.UpdatePodSandboxResourcesRequest, sandbox_id, data
        )
        sandbox_id = request.pod_sandbox_id
        point = HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES
        # Held across read -> hooks -> forward -> store, as for UpdateContainerResources: a resize and
        # kubelet's revert of it must reach the runtime and the store in the same order.
        async with self._lock("pod/" + sandbox_id):
            with malformed("UpdatePodSandboxResourcesRequest"):
                stored = self.store.get_pod(sandbox_id)
                if stored is None:
                    self.missing("pod", sandbox_id, point)
                    self._refuse_missing("pod", sandbox_id, point)
                    return await forward(data)
                resize = convert.pod_resize_from_request(request, stored)
            resize, data = await self.pre_hooks(
                point,
                resize,
                pod=stored,
                target=f"pod {stored.namespace}/{stored.name}",
                data=data,
                rebuild=lambda merged: writeback.apply_pod_resize(request, merged).SerializeToString(),
                what="UpdatePodSandboxResourcesRequest",
            )
            reply = await forward(data)
            self.lifecycle.keep(point, sandbox_id, resize)
            return reply

    async def remove_pod_sandbox(self, data: bytes, forward: Forward) -> Reply:
        sandbox_id = self.removed_id("pod", decode_id(cri.RemovePodSandboxRequest, data, "pod_sandbox_id"))
        if sandbox_id is None:
            return await forward(data)
        return await forward_then_forget(forward(data), lambda: self.store.remove_pod(sandbox_id))

    # -- containers --------------------------------------------------------------------

    async def create_container(self, data: bytes, forward: Forward) -> Reply:
        # upb, not betterproto2: ~1.5 ms less to decode a request of kubelet's size (hooks/rewrite.py).
        request = await decode_request(rewrite.CreateContainerRequest, data, "CreateContainerRequest")
        with malformed("CreateContainerRequest"):
            request.pod_sandbox_id, data = self._named(
                "CreateContainer", cri.CreateContainerRequest, request.pod_sandbox_id, data
            )
            pod = self.store.get_pod(request.pod_sandbox_id)
            if pod is None:
                # Better than the reference (which skips hooks): the request carries the pod's config.
                self.missing("pod", request.pod_sandbox_id, HookPoint.PRE_CREATE_CONTAINER)
                pod = convert.pod_from_wire_config(request.sandbox_config)
            else:
                same_pod(request.pod_sandbox_id, pod, request.sandbox_config.metadata)
            info = convert.container_from_wire_create(request, pod)
        point = HookPoint.PRE_CREATE_CONTAINER
        info, data = await self.pre_hooks(
            point,
            info,
            pod=pod,
            container=info.name,
            target=f"pod {pod.namespace}/{pod.name} container {info.name}",
            data=data,
            rebuild=lambda merged: rewrite.create_request(request, merged),
            what="CreateContainerRequest",
        )
        return await self._forward_created(
            point, info, forward, data, cri.CreateContainerResponse, "container_id"
        )

    async def start_container(self, data: bytes, forward: Forward) -> Reply:
        container_id = decode_id(cri.StartContainerRequest, data, "container_id")
        container_id, data = self._named("StartContainer", cri.StartContainerRequest, container_id, data)
        async with self._lock(container_id):
            info = self._hooked_container(container_id, HookPoint.PRE_START_CONTAINER)
            if info is None:
                self._refuse_missing(
                    "container", container_id, HookPoint.PRE_START_CONTAINER, HookPoint.POST_START_CONTAINER
                )
                return await forward(data)
            required = await self._require(HookPoint.PRE_START_CONTAINER, info.pod, info.name)
            await self._require(HookPoint.POST_START_CONTAINER, info.pod, info.name)
            started = await self.lifecycle.pre(
                HookPoint.PRE_START_CONTAINER, info, target=container_id, required=required
            )
            if started is not info:
                self.lifecycle.keep(HookPoint.PRE_START_CONTAINER, container_id, started)

            async def post() -> None:
                await self.lifecycle.post(HookPoint.POST_START_CONTAINER, started, target=container_id)

            return await forward_then(forward, data, post)

    async def stop_container(self, data: bytes, forward: Forward) -> Reply:
        container_id = decode_id(cri.StopContainerRequest, data, "container_id")
        container_id, data = self._named("StopContainer", cri.StopContainerRequest, container_id, data)
        known = self.store.get_container(container_id)
        if known is None:
            self._refuse_missing("container", container_id, HookPoint.POST_STOP_CONTAINER)
        elif not self._skips(known.pod):
            await self._require(HookPoint.POST_STOP_CONTAINER, known.pod, known.name)

        async def post() -> None:
            info = self._hooked_container(container_id, HookPoint.POST_STOP_CONTAINER)
            if info is not None:
                await self.lifecycle.post(HookPoint.POST_STOP_CONTAINER, info, target=container_id)

        return await forward_then_forget(
            forward_then(forward, data, post), lambda: self.store.delete_container(container_id)
        )

    async def update_container_resources(self, data: bytes, forward: Forward) -> Reply:
        request = await decode_request(
            cri.UpdateContainerResourcesRequest, data, "UpdateContainerResourcesRequest"
        )
        with malformed("UpdateContainerResourcesRequest"):
            container_id = request.container_id
            if not isinstance(container_id, str):
                raise TypeError("container_id is not a string")
        request.container_id, data = self._named(
            "UpdateContainerResources", cri.UpdateContainerResourcesRequest, container_id, data
        )
        container_id = request.container_id
        # Held across read -> hooks -> forward -> store, so that two updates of one container
        # (kubelet's CPU manager and a resize, say) cannot undo each other in the runtime.
        async with self._lock(container_id):
            with malformed("UpdateContainerResourcesRequest"):
                stored = self._hooked_container(container_id, HookPoint.PRE_UPDATE_CONTAINER_RESOURCES)
                if stored is None:
                    self._refuse_missing("container", container_id, HookPoint.PRE_UPDATE_CONTAINER_RESOURCES)
                    return await forward(data)
                prepared = merge.prepare_update(stored, convert.update_request_resources(request))
            updated, data = await self.pre_hooks(
                HookPoint.PRE_UPDATE_CONTAINER_RESOURCES,
                prepared,
                pod=stored.pod,
                container=stored.name,
                target=container_id,
                data=data,
                rebuild=lambda merged: writeback.apply_update(request, merged).SerializeToString(),
                what="UpdateContainerResourcesRequest",
            )
            reply = await forward(data)
            self.lifecycle.keep(HookPoint.PRE_UPDATE_CONTAINER_RESOURCES, container_id, updated)
            return reply

    async def remove_container(self, data: bytes, forward: Forward) -> Reply:
        container_id = self.removed_id(
            "container", decode_id(cri.RemoveContainerRequest, data, "container_id")
        )
        if container_id is None:
            return await forward(data)
        return await forward_then_forget(forward(data), lambda: self.store.delete_container(container_id))

    def _named(self, method: str, message_type: type[Any], key: str, data: bytes) -> tuple[str, bytes]:
        """The id the request *data* of *method* names (its field 1, *key* as read), as containerd reads it, and
        the request to forward: the stored object's full id and *data* naming it, or *key* and *data* as they
        came when the store has no object *key* names (:mod:`krproxy.hooks.idprefix`).

        Raises:
            GRPCError: UNKNOWN as containerd words it, for an empty *key* or a prefix of two stored ids.
        """
        field = message_type._betterproto.field_name_by_number[1]
        resolve = self.store.resolve_pod if field == "pod_sandbox_id" else self.store.resolve_container
        try:
            full = resolve(key)
        except IdRefused as refused:
            raise idprefix.refusal(method, refused) from None
        if full is None or full == key:
            return key, data
        try:
            return full, with_id(data, 1, full)
        except protowire.DecodeError:  # read by betterproto2 (decode_id's fallback): written by it
            message = decode(message_type, data, message_type.__name__)
            setattr(message, field, full)
            return full, bytes(message)

    def removed_id(self, kind: str, key: str) -> str | None:
        """The id of the entry a Remove of *key* drops (no hook point: the request goes on as it came, here
        and in its watch): the stored *kind* (``pod`` or ``container``) *key* names, *key* itself when the
        store has none (nothing to drop), None when containerd refuses *key* (nothing dropped: the runtime
        answers it as it does to anyone)."""
        resolve = self.store.resolve_pod if kind == "pod" else self.store.resolve_container
        try:
            full = resolve(key)
        except IdRefused:
            return None
        return key if full is None else full

    async def pre_hooks(
        self,
        point: HookPoint,
        record: R,
        *,
        pod: PodInfo,
        container: str | None = None,
        target: str,
        data: bytes,
        rebuild: Callable[[R], bytes],
        what: str,
    ) -> tuple[R, bytes]:
        """Run the pre hooks of *point* on *record* (unless *pod* skips them; once its required servers are
        up); return the record as the plugins left it and the request to forward: kubelet's *data* itself
        when no plugin changed anything, else the bytes ``rebuild(record)`` makes. The seam every verb
        that creates or changes a workload goes through, this module's and :mod:`krproxy.hooks.restore`'s."""
        if self._skips(pod):
            return record, data
        required = await self._require(point, pod, container)
        merged = await self.lifecycle.pre(point, record, target=target, required=required)
        if merged is record:
            return record, data
        with malformed(what):
            return merged, bytes(rebuild(merged))

    async def _forward_created(
        self, point: HookPoint, record: Any, forward: Forward, data: bytes, answer: type[Any], field: str
    ) -> Reply:
        """Forward a RunPodSandbox or CreateContainer request *data*; keep *record* under the id its
        answer's *field* names. Nothing else is left to do: where *forward* is an intercepted call's
        (:class:`krproxy.forward.CallForward`, not an OCI hook's wrapping), the forward and the keeping
        are handed over to the call, which answers as it does a watched one."""
        if isinstance(forward, CallForward):
            return forward.hand_over(data, watched.keeper(self, point, record, answer, field))
        reply = await forward(data)
        self.keep_created(point, record, answer, field, reply.message)
        return reply

    def keep_created(
        self, point: HookPoint, record: Any, answer: type[Any], field: str, reply: bytes
    ) -> None:
        ident = reply_field(answer, reply, field)
        if ident:
            self.lifecycle.keep(point, ident, record)

    def missing(self, kind: str, ident: str, point: HookPoint) -> None:
        """An id the store does not know: hooks skipped. Worth a warning only if a plugin wanted
        this hook (kubelet stops a pod twice before removing it, so the second time is normal)."""
        log.event(
            LOGGER,
            "hook_skipped_unknown_" + kind,
            level=logging.WARNING if self.dispatcher.plugins_for(point) else logging.DEBUG,
            id=ident,
            hook=point.value,
            reason=f"{kind} not in the store (created before the proxy, or already stopped)",
        )

    def _lock(self, key: str) -> trio.Lock:
        """The lock serialising hooked calls on one container (key: its id) or pod (``pod/<sandbox id>``);
        dropped with its last user."""
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = trio.Lock()
        return lock

    def _hooked_container(self, container_id: str, point: HookPoint) -> ContainerInfo | None:
        """The stored container if hooks should run for it, else None (unknown or skipped)."""
        info = self.store.get_container(container_id)
        if info is None:
            self.missing("container", container_id, point)
            return None
        return None if self._skips(info.pod) else info
