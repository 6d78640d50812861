"""Hooks on the Docker request path: create/start/stop/update/remove of containers.

================================  ================================================================
request                           what happens
================================  ================================================================
create, sandbox                   PreRunPodSandbox chain → forward → store the pod by Docker id
create, app container             PreCreateContainer chain → forward → store the container
start                             PreStartContainer → forward → PostStartContainer
stop                              forward → PostStopContainer / PostStopPodSandbox → drop the entry
update                            PreUpdateContainerResources chain → forward → store
remove (``DELETE``)               forward → drop the container, or the pod and its containers
================================  ================================================================

stop and remove drop the entry only when dockerd is done with the object (:func:`_finished`: 2xx,
304 already stopped, 404 no such container); after another answer, or none, the entry stays so a
retried stop still runs its PostStop hook with the full record (as in CRI mode).

The same hook points, plugins, store and merge rules as CRI mode (:mod:`krproxy.hooks`), and the same
sequence at each point (:class:`~krproxy.hooks.lifecycle.Lifecycle`); only the wire format differs
(:mod:`krproxy.docker.convert`). A pre hook of a ``Fail`` plugin that fails
turns the request into HTTP 500 with the error text, and nothing is forwarded; ``Ignore`` goes on
with the request as it was. Post hook failures are logged only (the reference writes a second
status line after the real response, which clients never see).

Deviations from koord-runtime-proxy, each on purpose:

* a create whose ``name`` is not a dockershim name (``k8s_..._<attempt>``) is forwarded unchanged
  (the reference answers 500), so the socket also serves ordinary Docker clients;
* an app container whose sandbox is not stored gets hooks with the pod meta from its name (the
  reference refuses the create with 500 "Failed to get pod info");
* a stop of an id the store does not know is forwarded (the reference answers 500 "No such
  container" without asking dockerd), so containers made elsewhere still stop;
* ``DELETE /containers/{id}`` drops store entries, which the reference never does.

Intercepted requests wait until the store has been recovered from dockerd after a restart.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from krproxy import gojson, log
from krproxy.docker import convert
from krproxy.docker._http import Reply, error_reply
from krproxy.docker.routes import Action, Route, query_value
from krproxy.hooks import merge
from krproxy.hooks.lifecycle import Chain, Lifecycle
from krproxy.hooks.model import ContainerInfo, PodInfo, Resources
from krproxy.hooks.outcomes import HookRejected
from krproxy.hooks.points import HookPoint
from krproxy.hooks.store import HookStore

__all__ = ["BadRequest", "Chain", "DockerHooks", "Forward", "Lookup", "Request"]

LOGGER = logging.getLogger("krproxy.docker.hooks")


#: Ask dockerd which container a reference names: its full id, or ``""`` if none or unknown.
Lookup = Callable[[str], Awaitable[str]]

#: Send the request to dockerd, with this body instead of the original when not None; the reply.
Forward = Callable[[bytes | None], Awaitable[Reply]]


@attrs.frozen
class Request:
    """An intercepted request as the client sent it (body read whole)."""

    method: bytes
    target: bytes
    body: bytes
    #: Sent with ``Transfer-Encoding: chunked`` (Go's ``ContentLength`` is then -1).
    chunked: bool = False


class BadRequest(Exception):
    """The request body cannot be what dockerd expects; the client gets 400 and nothing is forwarded."""


class _Repeated(ValueError):
    pass


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members as a dict; :class:`_Repeated` for a key sent twice. dockerd's Go decoder
    decodes a repeated key's value into the first's (an object's fields and a map's entries merged),
    where Python's keeps the last value alone: hooks would be shown a request dockerd reads otherwise."""
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise _Repeated(f"the key {key!r} is sent twice in one object")
        document[key] = value
    return document


def _json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        document = gojson.loads(body, _once_each)
    except _Repeated as err:
        raise BadRequest(
            f"{err} of the {what} request: dockerd merges the two, krproxy does not; send it once"
        ) from None
    except (ValueError, RecursionError) as err:
        raise BadRequest(f"invalid JSON in {what} request: {err}") from None
    if not isinstance(document, dict):
        raise BadRequest(f"{what} request body must be a JSON object")
    return document


def _no_start_config(request: Request) -> None:
    """:class:`BadRequest` for a start whose body dockerd reads: one over 7 bytes, or chunked. Below API
    1.24 dockerd applies it as the container's HostConfig (its resources included) at start, which no
    hook is shown; from 1.24 dockerd refuses it itself."""
    if len(request.body) > 7 or request.chunked:
        raise BadRequest(
            "a start request with a body sets the container's HostConfig, which krproxy's hooks are not"
            " shown: start without a body and change resources with /containers/{id}/update"
        )


def _no_top_level_host_config(body: dict[str, Any]) -> None:
    """:class:`BadRequest` for a create body with HostConfig fields the hooks read at its top level:
    dockerd's ContainerConfigWrapper embeds a HostConfig there (taken whole when ``HostConfig`` is
    absent or null, else its Memory, MemorySwap, CpuShares and CpusetCpus fill the inner one's zeros, and
    ``Cpuset`` is CpusetCpus), while the hooks are shown ``HostConfig`` alone."""
    found = [key for key in body if gojson.fold_name(key) in _TOP_LEVEL_HOST_CONFIG]
    if found:
        raise BadRequest(
            f"{', '.join(map(repr, found))} at the top level of the create request: dockerd reads it as"
            " a HostConfig field, krproxy's hooks do not; put it in HostConfig"
        )


#: HostConfig fields the hooks read, plus the deprecated ``Cpuset``, as Go folds their names.
_TOP_LEVEL_HOST_CONFIG = frozenset(
    gojson.fold_name(key) for key in (*(k for _, k in convert.RESOURCE_FIELDS), "CgroupParent", "Cpuset")
)


def _encode(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


def _finished(reply: Reply) -> bool:
    """Whether dockerd is done with the object of a stop or remove: success, 304 (already stopped) or
    404 (no such container). After any other answer kubelet retries, and the retry needs the record."""
    return reply.ok or reply.status in (304, 404)


def _created_id(reply: Reply) -> str:
    try:
        document = json.loads(reply.body)
    except (ValueError, RecursionError):
        document = None
    ident = document.get("Id") if isinstance(document, dict) else None
    if not isinstance(ident, str) or not ident:
        log.warning(LOGGER, "create_reply_undecodable", status=reply.status)
        return ""
    return ident


#: Stopped containers' records :class:`DockerHooks` keeps for a later start (the oldest forgotten first):
#: kubelet removes through krproxy what it stopped, so only containers removed straight on dockerd stay, and
#: a node keeps far fewer stopped containers than this.
MAX_STOPPED = 10_000


@attrs.define(eq=False)
class DockerHooks:
    """Store + hook chain for Docker requests; :meth:`handle` runs one intercepted request.

    Attributes:
        cgroup_driver: dockerd's cgroup driver (``cgroupfs`` or ``systemd``), learnt by recovery.
    """

    store: HookStore
    chain: Chain
    skip_label: tuple[str, str]
    cgroup_driver: str = "cgroupfs"
    #: The id of the container dockerd finds for a reference (an id, a unique id prefix or a name), or
    #: ``""``; None: unique stored id prefixes only.
    lookup: Lookup | None = None
    lifecycle: Lifecycle = attrs.field(init=False)
    #: Containers stopped through krproxy, dropped from the store but not removed from dockerd: a start or
    #: restart of one is hooked with its record again (recovery stores such containers too). At most
    #: :data:`MAX_STOPPED`.
    _stopped: dict[str, ContainerInfo] = attrs.field(factory=dict, init=False)
    _recovered: trio.Event = attrs.field(factory=trio.Event, init=False)

    def __attrs_post_init__(self) -> None:
        self.lifecycle = Lifecycle(self.store, self.chain, self.skip_label)

    def mark_recovered(self) -> None:
        """Let intercepted requests through: the store now reflects dockerd."""
        self._recovered.set()

    @property
    def recovered(self) -> bool:
        return self._recovered.is_set()

    async def handle(self, route: Route, request: Request, forward: Forward) -> Reply:
        """Run the hooks of *route* around *forward*; the reply to send the client."""
        await self._recovered.wait()
        try:
            if route.action is Action.CREATE:
                return await self._create(request, forward)
            if route.action is Action.START:
                _no_start_config(request)
                return await self._start(await self._resolve(route.container), forward)
            if route.action is Action.RESTART:  # (dockerd reads no body): the container starts again
                return await self._start(await self._resolve(route.container), forward)
            if route.action is Action.STOP:
                return await self._stop(await self._resolve(route.container), forward)
            if route.action is Action.UPDATE:
                return await self._update(await self._resolve(route.container), request, forward)
            return await self._remove(await self._resolve(route.container), forward)
        except HookRejected as err:
            return error_reply(500, err.message or "hook server err")
        except BadRequest as err:
            return error_reply(400, str(err))
        except convert.AmbiguousKey as err:
            return error_reply(400, f"{err} ({route.action.value} request)")

    def _skips(self, pod: PodInfo) -> bool:
        return self.lifecycle.skips(pod)

    async def _resolve(self, ident: str) -> str:
        """The stored id a container reference names, decided as dockerd decides: a full id first, then
        (asking dockerd through :attr:`lookup`) a name, with or without its ``/``, before a unique id
        prefix; else *ident* unchanged. Without a lookup, a unique stored prefix of 4 or more."""
        if (
            self.store.get_container(ident) is not None
            or self.store.get_pod(ident) is not None
            or ident in self._stopped
        ):
            return ident
        if self.lookup is not None:
            return await self.lookup(ident) or ident
        if len(ident) >= 4:
            known = {*self.store.containers(), *self.store.pods(), *self._stopped}
            matches = [i for i in known if i.startswith(ident)]
            if len(matches) == 1:
                return matches[0]
        return ident

    # -- create ------------------------------------------------------------------------------

    async def _create(self, request: Request, forward: Forward) -> Reply:
        name = convert.parse_k8s_name(query_value(request.target, "name"))
        if name is None:
            return await forward(None)  # not made by kubelet: no hooks, not stored
        body = _json_object(request.body, "create")
        _no_top_level_host_config(body)
        if convert.is_sandbox(convert.labels_of(body)):
            return await self._create_sandbox(name, body, forward)
        return await self._create_container(name, body, forward)

    async def _create_sandbox(self, name: convert.K8sName, body: dict[str, Any], forward: Forward) -> Reply:
        pod = merged = convert.pod_from_create(name, body, self.cgroup_driver)
        if not self._skips(pod):
            merged = await self.lifecycle.pre(
                HookPoint.PRE_RUN_POD_SANDBOX,
                pod,
                target=f"pod {pod.namespace}/{pod.name}",
                fold=convert.merge_docker_pod,
            )
        new_body = (
            None if merged is pod else _encode(convert.apply_pod(body, pod, merged, self.cgroup_driver))
        )
        reply = await forward(new_body)
        if reply.ok and (ident := _created_id(reply)):
            self.lifecycle.keep(HookPoint.PRE_RUN_POD_SANDBOX, ident, merged)
        return reply

    async def _create_container(self, name: convert.K8sName, body: dict[str, Any], forward: Forward) -> Reply:
        sandbox_id = convert.labels_of(body).get(convert.SANDBOX_ID_LABEL, "")
        pod = self.store.get_pod(sandbox_id)
        if pod is None:
            log.warning(
                LOGGER,
                "pod_not_stored",
                sandbox=sandbox_id,
                container=name.container,
                reason="pod meta taken from the container name",
            )
            pod = convert.pod_from_name(name)
        info = merged = convert.container_from_create(name, body, pod)
        if not self._skips(pod):
            merged = await self.lifecycle.pre(
                HookPoint.PRE_CREATE_CONTAINER,
                info,
                target=f"pod {pod.namespace}/{pod.name} container {info.name}",
            )
        new_body = (
            None
            if merged is info
            else _encode(convert.apply_container(body, info, merged, self.cgroup_driver))
        )
        reply = await forward(new_body)
        if reply.ok and (ident := _created_id(reply)):
            self.lifecycle.keep(HookPoint.PRE_CREATE_CONTAINER, ident, merged)
        return reply

    # -- start / stop / update / remove ------------------------------------------------------

    def _hooked_container(self, ident: str) -> ContainerInfo | None:
        info = self.store.get_container(ident)
        return None if info is None or self._skips(info.pod) else info

    async def _start(self, ident: str, forward: Forward) -> Reply:
        stopped = self._stopped.pop(ident, None)
        if stopped is not None and self.store.get_container(ident) is None:
            self.store.put_container(ident, stopped)  # started again: its record back, its hooks run
        info = self._hooked_container(ident)
        if info is None:
            return await forward(None)
        started = await self.lifecycle.pre(HookPoint.PRE_START_CONTAINER, info, target=ident)
        if started is not info:
            self.lifecycle.keep(HookPoint.PRE_START_CONTAINER, ident, started)
        try:
            return await forward(None)
        finally:
            with trio.CancelScope(shield=True):
                await self.lifecycle.post(HookPoint.POST_START_CONTAINER, started, target=ident)

    async def _stop(self, ident: str, forward: Forward) -> Reply:
        reply: Reply | None = None
        try:
            reply = await forward(None)
            return reply
        finally:
            with trio.CancelScope(shield=True):
                await self._after_stop(ident, forget=reply is not None and _finished(reply))

    async def _after_stop(self, ident: str, *, forget: bool) -> None:
        info = self.store.get_container(ident)
        if info is not None:
            if forget:
                self.store.delete_container(ident)
                self._stopped[ident] = info
                if len(self._stopped) > MAX_STOPPED:  # the oldest first (only ones removed behind our back)
                    del self._stopped[next(iter(self._stopped))]
            if not self._skips(info.pod):
                await self.lifecycle.post(HookPoint.POST_STOP_CONTAINER, info, target=ident)
            return
        pod = self.store.get_pod(ident)
        if pod is not None and forget:
            self.store.delete_pod(ident)
        if pod is not None and not self._skips(pod):
            await self.lifecycle.post(HookPoint.POST_STOP_POD_SANDBOX, pod, target=ident)

    async def _update(self, ident: str, request: Request, forward: Forward) -> Reply:
        stored = self._hooked_container(ident)
        if stored is None:
            return await forward(None)
        body = _json_object(request.body, "update")
        requested = convert.update_from_docker(body)
        before = merge.update_resource_by_update_request(stored.resources or Resources(), requested)
        prepared = attrs.evolve(stored, resources=before)
        updated = await self.lifecycle.pre(HookPoint.PRE_UPDATE_CONTAINER_RESOURCES, prepared, target=ident)
        after = updated.resources or Resources()
        new_body = None if after == before else _encode(convert.apply_update(body, before, after))
        reply = await forward(new_body)
        if reply.ok:
            self.lifecycle.keep(HookPoint.PRE_UPDATE_CONTAINER_RESOURCES, ident, updated)
        return reply

    async def _remove(self, ident: str, forward: Forward) -> Reply:
        reply = await forward(None)
        if _finished(reply):
            self.store.delete_container(ident)
            self.store.remove_pod(ident)
            self._stopped.pop(ident, None)
            for cid in [cid for cid, info in self._stopped.items() if info.pod_sandbox_id == ident]:
                del self._stopped[cid]
        return reply
