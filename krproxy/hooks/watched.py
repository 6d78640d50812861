"""Watched calls: the CRI calls with hook points that, where no hook would run, go upstream as the caller's bytes.

Where no plugin is registered at a call's points and no hook server is required there (the flags, the pod's
annotations), or the pod has the skip label, an interceptor of :mod:`krproxy.hooks.runtime` would only
forward the caller's request and then tell the store. Such a call needs none of it: its *watch*
(:data:`krproxy.forward.Watch`), shown the request, gives a watcher; the relay sends the call on as it came,
relays the answer frame by frame, and tells the watcher the status and the reply once the answer is out
(:class:`krproxy.relay.intercepted.LocalCall`). The watcher keeps the pod or container
(:meth:`HookRuntime.keep_created`), or drops it by :func:`forget_when_done`'s rule: the
store ends as the interceptor would have left it.

A watch says None, and the interceptor handles the call as before, before the store is recovered (and for a
Stop, while recovery left a record out: :mod:`krproxy.hooks.startup`), for a
request the interceptor would refuse (malformed; annotations that do not parse: it says why), for one of
at least :data:`~krproxy.hooks._reading.THREAD_DECODE_AT` bytes (decoded in a thread there), and for a Stop
of a stored object whose pod does not skip hooks (its PostStop hook runs for the plugins registered at
the answer, which a Stop waits for through the grace period). StartContainer
and the resource updates have no watch: they hold a container's or pod's lock across their forward, which
orders them against hooked calls.

Ids are read as containerd reads them (:mod:`krproxy.hooks.idprefix`), as the interceptors do: a unique
prefix of a stored id is that object's (whose record decides, and whose entry is dropped), an empty or
ambiguous id of a call with a hook point goes to the interceptor, which refuses it as containerd does; a
Remove's is watched all the same (no hook point) and drops nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from krproxy.forward import RUNTIME_PREFIX, Watch, Watcher
from krproxy.grpcstatus import Status
from krproxy.hooks import convert, rewrite, wire
from krproxy.hooks._reading import THREAD_DECODE_AT, decode, plain_id
from krproxy.hooks.idprefix import IdRefused
from krproxy.hooks.model import PodInfo
from krproxy.hooks.points import HookPoint
from krproxy.hooks.required import AnnotationError, needed
from krproxy.proto.runtime import v1 as cri

if TYPE_CHECKING:
    from krproxy.hooks.runtime import HookRuntime

__all__ = ["forget_when_done", "keeper", "watches"]


def watches(hooks: HookRuntime) -> dict[str, Watch]:
    """The watches of *hooks*' watched methods, by method path; each says None until the store is recovered."""
    watched = _Watches(hooks)
    table: dict[str, Watch] = {
        "RunPodSandbox": watched.run_pod_sandbox,
        "CreateContainer": watched.create_container,
        "StopContainer": watched.stop_container,
        "StopPodSandbox": watched.stop_pod_sandbox,
        "RemoveContainer": watched.remove_container,
        "RemovePodSandbox": watched.remove_pod_sandbox,
    }

    def bind(watch: Watch, stop: bool) -> Watch:
        def gated(data: bytes) -> Watcher | None:
            if not hooks.recovered or (stop and hooks.store_gate.left_out):
                return None  # a Stop of a record recovery left out may be refused (hooks/startup.py)
            return watch(data)

        return gated

    return {RUNTIME_PREFIX + name: bind(watch, name.startswith("Stop")) for name, watch in table.items()}


class _Watches:
    """The watch of each watched method, reading *hooks*' store, registry and required servers."""

    def __init__(self, hooks: HookRuntime) -> None:
        self.hooks = hooks

    def nothing_required(self, point: HookPoint, pod: PodInfo, container: str | None = None) -> bool:
        """Whether a call at *point* for *pod* (and *container*) needs no hook server: nothing is required there
        (the flags, the pod's annotations; annotations that do not parse: False, the interceptor refuses it).

        A call is watched if no plugin is registered at its point and nothing is required, or if its pod
        skips hooks. Each watch has already read the point's plugins, and reads the skip label only when the
        rest does not settle it (few pods carry the label)."""
        guard = self.hooks.guard
        if guard is None:
            return True
        try:
            need = needed(guard.requirements, point, pod.annotations, container)
        except AnnotationError:
            return False
        return not need.names and not need.hooked

    def run_pod_sandbox(self, data: bytes) -> Watcher | None:
        # With plugins at the point only a pod with the skip label would be watched: not worth decoding
        # every pod twice to find those (the interceptor skips their hooks just as well).
        point = HookPoint.PRE_RUN_POD_SANDBOX
        if len(data) >= THREAD_DECODE_AT or self.hooks.dispatcher.plugins_for(point):
            return None
        try:
            pod = _pod_of_run_request(data)
        except Exception:  # malformed: the interceptor refuses it
            return None
        if not (self.nothing_required(point, pod) or self.hooks.lifecycle.skips(pod)):
            return None
        return keeper(self.hooks, point, pod, cri.RunPodSandboxResponse, "pod_sandbox_id")

    def create_container(self, data: bytes) -> Watcher | None:
        if len(data) >= THREAD_DECODE_AT:
            return None
        hooks = self.hooks
        point = HookPoint.PRE_CREATE_CONTAINER
        plugins = hooks.dispatcher.plugins_for(point)
        if plugins:
            # Hooks run unless the pod skips them: none does, if no stored pod carries the skip label (a
            # pod the store lacks goes to the interceptor); else read only its id (the request is decoded
            # once, by the interceptor, for a call that runs hooks).
            if not hooks.store.labelled:
                return None
            sandbox_id = plain_id(cri.CreateContainerRequest, data, "pod_sandbox_id")
            try:
                full = hooks.store.resolve_pod(sandbox_id) if sandbox_id else None
            except IdRefused:  # the interceptor refuses it
                return None
            known = None if full is None else hooks.store.get_pod(full)
            if known is None or not hooks.lifecycle.skips(known):
                return None
        try:
            request = rewrite.CreateContainerRequest.FromString(data)
            size = request.ByteSize()
            request.DiscardUnknownFields()  # (this reading builds the record; the caller's bytes go on)
            if request.ByteSize() != size:  # unknown fields: read as the interceptor reads them, or refused
                request = decode(rewrite.CreateContainerRequest, data, "CreateContainerRequest")
            full = hooks.store.resolve_pod(request.pod_sandbox_id)
            if full is not None:  # the record names the pod by its full id (the caller's bytes go on)
                request.pod_sandbox_id = full
            pod = hooks.store.get_pod(request.pod_sandbox_id)
            stored = pod is not None
            if pod is None:
                pod = convert.pod_from_wire_config(request.sandbox_config)
            else:
                meta = request.sandbox_config.metadata
                if pod.named_otherwise(meta.name, meta.namespace, meta.uid):  # the interceptor refuses it
                    return None  # (hooks._reading.same_pod)
            name = request.config.metadata.name
        except Exception:  # malformed, or an empty or ambiguous pod id: the interceptor refuses it
            return None
        if not ((not plugins and self.nothing_required(point, pod, name)) or hooks.lifecycle.skips(pod)):
            return None
        if not stored:
            hooks.missing("pod", request.pod_sandbox_id, point)
        # The container's record is built once the answer is out (the watcher runs then), not between the
        # request's arrival and its forward: of a watched create's ~80 µs there (~320 µs on a cold process,
        # between other processes' calls), it took a third. It reads only *request* and *pod*, as they are now.
        return _lazy_keeper(
            hooks,
            point,
            lambda: convert.container_from_wire_create(request, pod),
            cri.CreateContainerResponse,
            "container_id",
        )

    def stop_container(self, data: bytes) -> Watcher | None:
        container_id = plain_id(cri.StopContainerRequest, data, "container_id")
        if container_id is None:  # the interceptor decodes it, or refuses it
            return None
        store = self.hooks.store
        point = HookPoint.POST_STOP_CONTAINER
        try:
            container_id = store.resolve_container(container_id) or container_id
        except IdRefused:  # the interceptor refuses it
            return None
        known = store.get_container(container_id)
        if known is None:
            self.hooks.missing("container", container_id, point)
        elif not self.hooks.lifecycle.skips(known.pod):
            return None  # (see stop_pod_sandbox)
        return _forgetter(lambda: store.delete_container(container_id))

    def stop_pod_sandbox(self, data: bytes) -> Watcher | None:
        sandbox_id = plain_id(cri.StopPodSandboxRequest, data, "pod_sandbox_id")
        if sandbox_id is None:
            return None
        store = self.hooks.store
        point = HookPoint.POST_STOP_POD_SANDBOX
        try:
            sandbox_id = store.resolve_pod(sandbox_id) or sandbox_id
        except IdRefused:  # the interceptor refuses it
            return None
        known = store.get_pod(sandbox_id)
        if known is None:
            self.hooks.missing("pod", sandbox_id, point)
        elif not self.hooks.lifecycle.skips(known):
            # A stored object that runs hooks goes to the interceptor even with no plugin at its PostStop
            # point now: a Stop waits for the grace period (kubelet's 30 s), and a plugin registered by
            # the answer gets its PostStop hook there; a watched call decided at the request would not.
            return None
        return _forgetter(lambda: store.delete_pod(sandbox_id), gone=lambda: store.remove_pod(sandbox_id))

    def remove_container(self, data: bytes) -> Watcher | None:
        container_id = plain_id(cri.RemoveContainerRequest, data, "container_id")
        if container_id is None:
            return None
        store = self.hooks.store
        removed = self.hooks.removed_id("container", container_id)
        return _forgetter(lambda: None if removed is None else store.delete_container(removed))

    def remove_pod_sandbox(self, data: bytes) -> Watcher | None:
        sandbox_id = plain_id(cri.RemovePodSandboxRequest, data, "pod_sandbox_id")
        if sandbox_id is None:
            return None
        store = self.hooks.store
        removed = self.hooks.removed_id("pod", sandbox_id)
        return _forgetter(lambda: None if removed is None else store.remove_pod(removed))


def keeper(hooks: HookRuntime, point: HookPoint, record: Any, answer: type[Any], field: str) -> Watcher:
    """The watcher of a watched RunPodSandbox or CreateContainer, or of one whose interceptor handed its
    forward over: keeps *record* under the id its answer's *field* names, as the interceptor does once it
    has the runtime's reply."""

    def keep(status: Status, reply: bytes | None) -> None:
        if reply is not None:
            hooks.keep_created(point, record, answer, field, reply)

    return keep


def _lazy_keeper(
    hooks: HookRuntime, point: HookPoint, build: Callable[[], Any], answer: type[Any], field: str
) -> Watcher:
    """:func:`keeper` of the record *build* makes, made when the answer is OK (after it went out)."""

    def keep(status: Status, reply: bytes | None) -> None:
        if reply is not None:
            hooks.keep_created(point, build(), answer, field, reply)

    return keep


def forget_when_done(status: Status, forget: Callable[[], object], gone: Callable[[], object] | None) -> None:
    """The rule of Stop and Remove calls, given the runtime's *status*: forget the store entry after OK, or
    (*gone* if given) after NOT_FOUND; keep it after anything else (:func:`krproxy.hooks.forwarding.forward_then_forget`
    says why)."""
    if status is Status.OK:
        forget()
    elif status is Status.NOT_FOUND:
        (gone or forget)()


def _forgetter(forget: Callable[[], object], *, gone: Callable[[], object] | None = None) -> Watcher:
    """The watcher of a watched Stop or Remove call: :func:`forget_when_done`'s rule (a watched call's
    NOT_FOUND is the runtime's: the relay answers none of its own)."""
    return lambda status, reply: forget_when_done(status, forget, gone)


_RUN_POD_SANDBOX = wire.message_class("RunPodSandboxRequest", writing=True)


def _pod_of_run_request(data: bytes) -> PodInfo:
    """The pod record of a RunPodSandbox request, as the interceptor reads it (its errors too).

    upb reads a kubelet's request some fifteen times faster than betterproto2 (20 µs against 0.32-0.35
    ms for 0.9 KB, the record built, at load 3). Its reading is taken when it dropped nothing: no field it does not know
    and none sent with a wrong wire type (upb keeps both as unknown fields, as Go does; the interceptor
    reads the second as Go does too, through :func:`._reading.as_go_reads`), told by the message's
    size without its unknown fields being the request's. Anything else (a newer kubelet's field, a
    key sent twice, a varint longer than it need be) is read by betterproto2, as the interceptor does.
    """
    request = _RUN_POD_SANDBOX.FromString(data)
    request.DiscardUnknownFields()
    if request.ByteSize() == len(data):
        return convert.pod_from_wire_config(request.config, request.runtime_handler)
    return convert.pod_from_run_request(decode(cri.RunPodSandboxRequest, data, "RunPodSandboxRequest"))
