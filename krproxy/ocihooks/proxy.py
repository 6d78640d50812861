"""OCI hooks at the proxy: interceptors that run hooks.d hooks around the container lifecycle calls.

=====================  ===================================================================
CRI method             what happens
=====================  ===================================================================
CreateContainer        forward → remember the container's annotations, command, bind mounts
StartContainer         prestart, createRuntime, createContainer hooks → forward → poststart
StopContainer          forward → poststop (once per container, only if the stop succeeded)
StopPodSandbox         forward → poststop for the pod's started containers not stopped yet
RemoveContainer / Pod  forward → forget
=====================  ===================================================================

A pre-start hook that fails (non-zero exit, timeout, cannot be run) fails StartContainer with
``UNKNOWN`` and a message naming the hook file, the stage and the cause; the runtime never sees
the call — as a failing hook in CRI-O fails the start. Post-stage failures are only logged.

What the hooks get on stdin is the OCI state document: ``ociVersion``, ``id``, ``status``
(``creating`` before the start, ``running`` after it, ``stopped`` after the stop), ``pid`` after
the start when the runtime reports it (containerd's verbose ContainerStatus), and
``annotations`` — those of the CreateContainer request. There is no ``bundle``: the proxy does
not know the runtime's bundle directory. (The runc wrapper, :mod:`.wrapper`, has both.)

The interceptors compose with the plugin ones (:func:`compose`): the plugins' interceptor is
the outer one, so OCI hooks see the request as the plugins left it and run closest to the
runtime — after PreStartContainer, before PostStartContainer.

Containers the proxy did not see created (created before it started) are looked up with a
verbose ContainerStatus when a hook could apply to them; so is the command when the request
left it to the image (empty ``command``) and a ``commands`` condition needs it.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from krproxy import log
from krproxy.forward import RUNTIME_PREFIX, Forward, Handler, Interceptor, Reply, runtime_interceptors
from krproxy.grpcstatus import GRPCError, Status
from krproxy.ocihooks.execute import HookRun, run_hook
from krproxy.ocihooks.model import PRE_START_STAGES, Container, HookFile, select, state_document
from krproxy.ocihooks.watch import watch_hook_dirs
from krproxy.proto.runtime import v1 as cri

LOGGER = logging.getLogger("krproxy.ocihooks")

#: Seconds a hook that sets no ``timeout`` may run at the proxy: kubelet's default
#: ``--runtime-request-timeout`` (2 min), after which the CRI call is abandoned anyway.
DEFAULT_TIMEOUT = 120.0

#: Deadline of the ContainerStatus look-ups, in seconds.
LOOKUP_TIMEOUT = 10.0


def compose(outer: Interceptor, inner: Interceptor) -> Interceptor:
    """One interceptor that runs ``outer`` with a ``forward`` going through ``inner``."""

    async def composed(path: str, request: bytes, forward: Forward) -> Reply:
        async def through_inner(data: bytes) -> Reply:
            return await inner(path, data, forward)

        return await outer(path, request, through_inner)

    return composed


@attrs.frozen
class Looked:
    """What a ContainerStatus look-up told about a container."""

    container: Container
    pod_id: str
    pid: int | None


#: ``lookup(container_id) -> Looked | None`` (None: unknown to the runtime, or the call failed).
Lookup = Callable[[str], Awaitable[Looked | None]]


@attrs.define
class _Tracked:
    pod_id: str
    container: Container
    started: bool = False
    stopped: bool = False


def container_from_create(request: cri.CreateContainerRequest) -> Container:
    """The ``when`` facts of a CreateContainer request.

    ``command`` is ``config.command[0]``; None when empty (the image's entrypoint then decides).
    Bind mounts are the request's mounts with a host path.
    """
    config = request.config or cri.ContainerConfig()
    return Container(
        annotations=dict(config.annotations),
        command=config.command[0] if config.command else None,
        has_bind_mounts=any(mount.host_path for mount in config.mounts),
    )


def looked_from_status(reply: cri.ContainerStatusResponse) -> Looked:
    """Facts from a (verbose) ContainerStatus reply; containerd's ``info`` adds command, pid, pod."""
    status = reply.status or cri.ContainerStatus()
    info: dict[str, Any] = {}
    try:
        decoded = json.loads(reply.info.get("info", "{}"))
        info = decoded if isinstance(decoded, dict) else {}
    except ValueError:
        pass
    args = ((info.get("runtimeSpec") or {}).get("process") or {}).get("args") or []
    pid = info.get("pid")
    return Looked(
        Container(
            annotations=dict(status.annotations),
            command=args[0] if args and isinstance(args[0], str) else None,
            has_bind_mounts=any(mount.host_path for mount in status.mounts),
        ),
        pod_id=str(info.get("sandboxID", "")),
        pid=pid if isinstance(pid, int) and pid > 0 else None,
    )


class StatusLookup:
    """:data:`Lookup` through a verbose ContainerStatus, made with ``call(path, request) -> reply``
    (the daemon's: the relay's runtime route)."""

    def __init__(self, call: Callable[[str, bytes], Awaitable[bytes]]) -> None:
        self._call = call

    async def __call__(self, container_id: str) -> Looked | None:
        request = cri.ContainerStatusRequest(container_id=container_id, verbose=True)
        try:
            with trio.fail_after(LOOKUP_TIMEOUT):
                data = await self._call(
                    RUNTIME_PREFIX + "ContainerStatus", bytes(request.SerializeToString())
                )
            reply = cri.ContainerStatusResponse.FromString(data)
        except Exception as err:
            log.warning(
                LOGGER, "oci_hook_lookup_failed", container=container_id, error=f"{type(err).__name__}: {err}"
            )
            return None
        return looked_from_status(reply)


async def _no_lookup(container_id: str) -> Looked | None:
    return None


def _decoded(message_type: type[Any], data: bytes) -> Any:
    try:
        return message_type.FromString(data)
    except Exception:  # malformed: the runtime will say so; OCI hooks just stay out of it
        return None


class OciHooks:
    """The hook files in force, what the proxy knows about containers, and the interceptors.

    Args:
        lookup: how to learn about a container the proxy did not see created, and its pid.
        default_timeout: seconds a hook without ``timeout`` may run.
    """

    def __init__(self, lookup: Lookup | None = None, default_timeout: float = DEFAULT_TIMEOUT) -> None:
        self.hooks: list[HookFile] = []
        self.lookup: Lookup = lookup or _no_lookup
        self.default_timeout = default_timeout
        self._containers: dict[str, _Tracked] = {}

    def publish(self, hooks: Sequence[HookFile]) -> None:
        """Put ``hooks`` (in run order) in force for the calls that start from now on."""
        self.hooks = list(hooks)

    def interceptors(self) -> dict[str, Interceptor]:
        handlers: dict[str, Handler] = {
            "CreateContainer": self.create_container,
            "StartContainer": self.start_container,
            "StopContainer": self.stop_container,
            "StopPodSandbox": self.stop_pod_sandbox,
            "RemoveContainer": self.remove_container,
            "RemovePodSandbox": self.remove_pod_sandbox,
        }
        return runtime_interceptors(handlers)

    def wrap(self, existing: Mapping[str, Interceptor]) -> dict[str, Interceptor]:
        """``existing`` interceptors with ours added; where both intercept a path, ours is the inner one."""
        combined = dict(existing)
        for path, ours in self.interceptors().items():
            combined[path] = compose(existing[path], ours) if path in existing else ours
        return combined

    # -- the calls -----------------------------------------------------------------------

    async def create_container(self, data: bytes, forward: Forward) -> Reply:
        reply = await forward(data)
        request = _decoded(cri.CreateContainerRequest, data)
        answer = _decoded(cri.CreateContainerResponse, reply.message)
        if request is not None and answer is not None and answer.container_id:
            self._containers[answer.container_id] = _Tracked(
                request.pod_sandbox_id, container_from_create(request)
            )
        return reply

    async def start_container(self, data: bytes, forward: Forward) -> Reply:
        request = _decoded(cri.StartContainerRequest, data)
        hooks = self.hooks
        if request is None or not hooks:
            return await forward(data)
        container_id = request.container_id
        tracked = await self._tracked(container_id, hooks)
        if tracked is None:
            return await forward(data)
        for stage in PRE_START_STAGES:
            for hook in select(hooks, stage, tracked.container):
                state = state_document(container_id, "creating", tracked.container.annotations)
                run = await self._run(hook, stage, container_id, state)
                if not run.ok:
                    raise GRPCError(
                        Status.UNKNOWN,
                        f"oci hook {hook.source} failed {stage} for container {container_id}: "
                        f"{run.describe()}",
                    )
        reply = await forward(data)
        tracked.started = True
        post = select(hooks, "poststart", tracked.container)
        if post:
            looked = await self.lookup(container_id)
            pid = looked.pid if looked is not None else None
            for hook in post:
                state = state_document(container_id, "running", tracked.container.annotations, pid=pid)
                await self._run(hook, "poststart", container_id, state)
        return reply

    async def stop_container(self, data: bytes, forward: Forward) -> Reply:
        reply = await forward(data)
        request = _decoded(cri.StopContainerRequest, data)
        if request is not None and self.hooks:
            tracked = self._containers.get(request.container_id)
            if tracked is None:
                tracked = await self._tracked(request.container_id, self.hooks)
                if tracked is not None:
                    tracked.started = True  # it existed before the proxy: assume it ran
            if tracked is not None:
                await self._poststop(request.container_id, tracked)
        return reply

    async def stop_pod_sandbox(self, data: bytes, forward: Forward) -> Reply:
        reply = await forward(data)
        request = _decoded(cri.StopPodSandboxRequest, data)
        if request is not None and self.hooks:
            for container_id, tracked in list(self._containers.items()):
                if tracked.pod_id == request.pod_sandbox_id:
                    await self._poststop(container_id, tracked)
        return reply

    async def remove_container(self, data: bytes, forward: Forward) -> Reply:
        reply = await forward(data)
        request = _decoded(cri.RemoveContainerRequest, data)
        if request is not None:
            self._containers.pop(request.container_id, None)
        return reply

    async def remove_pod_sandbox(self, data: bytes, forward: Forward) -> Reply:
        reply = await forward(data)
        request = _decoded(cri.RemovePodSandboxRequest, data)
        if request is not None:
            for container_id, tracked in list(self._containers.items()):
                if tracked.pod_id == request.pod_sandbox_id:
                    del self._containers[container_id]
        return reply

    # -- helpers -------------------------------------------------------------------------

    async def _tracked(self, container_id: str, hooks: Sequence[HookFile]) -> _Tracked | None:
        """What we know of the container, looked up if unknown or if a hook needs its command."""
        tracked = self._containers.get(container_id)
        needs_command = any(hook.when.needs_command for hook in hooks)
        if tracked is not None and (tracked.container.command is not None or not needs_command):
            return tracked
        looked = await self.lookup(container_id)
        if looked is None:
            if tracked is None:
                log.warning(
                    LOGGER,
                    "oci_hooks_skipped_unknown_container",
                    container=container_id,
                    reason="not seen at CreateContainer and the runtime could not tell",
                )
            return tracked
        if tracked is None:
            tracked = _Tracked(looked.pod_id, looked.container)
        else:
            tracked.container = tracked.container._replace(command=looked.container.command)
        self._containers[container_id] = tracked
        return tracked

    async def _poststop(self, container_id: str, tracked: _Tracked) -> None:
        if tracked.stopped or not tracked.started:
            return
        tracked.stopped = True
        for hook in select(self.hooks, "poststop", tracked.container):
            state = state_document(container_id, "stopped", tracked.container.annotations)
            await self._run(hook, "poststop", container_id, state)

    async def _run(self, hook: HookFile, stage: str, container_id: str, state: bytes) -> HookRun:
        # In a worker thread. A cancelled call still waits for the hook: its timeout bounds that.
        run: HookRun = await trio.to_thread.run_sync(
            functools.partial(run_hook, hook.command, state, timeout=self.default_timeout)
        )
        fields: dict[str, Any] = {
            "file": hook.source,
            "stage": stage,
            "container": container_id,
            "seconds": round(run.seconds, 3),
            "exit": run.returncode,
            "stdout": run.stdout.strip(),
            "stderr": run.stderr.strip(),
        }
        if run.ok:
            log.event(LOGGER, "oci_hook_ran", **fields)
        else:
            log.warning(LOGGER, "oci_hook_failed", error=run.describe(), **fields)
        # The thread's result arrives even if the call was cancelled meanwhile, with no checkpoint:
        # end here, or the caller would go on (forward a StartContainer kubelet gave up on).
        await trio.lowlevel.checkpoint_if_cancelled()
        return run


def for_daemon(call: Callable[[str, bytes], Awaitable[bytes]]) -> OciHooks:
    """The daemon's :class:`OciHooks`: look-ups are ContainerStatus calls made with ``call``."""
    return OciHooks(lookup=StatusLookup(call))


async def serve_hook_dirs(
    oci_hooks: OciHooks,
    directories: Sequence[str],
    *,
    task_status: trio.TaskStatus[list[HookFile]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The daemon's task: keep ``oci_hooks`` in step with ``directories``; started once loaded."""
    await watch_hook_dirs(directories, oci_hooks.publish, task_status=task_status)
