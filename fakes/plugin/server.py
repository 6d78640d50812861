"""The fake hook plugin on the wire: a scriptable ``runtime.v1alpha1.RuntimeHookService``.

Every hook RPC is routed to :meth:`FakePlugin._handle` as raw bytes (via
:class:`krproxy._grpc.BytesCodec`), so a test can make the plugin answer bytes that do not
decode, as well as delay, fail, hang or drop the connection. Answers are computed per hook:
by default the request is echoed back the way koordlet's proxy server does, with the
plugin's :class:`Changes` applied on top.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import attrs
import grpclib.const
import grpclib.server
import trio
from grpclib.exceptions import GRPCError

from krproxy._grpc import BytesCodec, Raw, serve
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1alpha1 as hookapi

LOGGER = logging.getLogger("fakes.plugin")

HookRequest: TypeAlias = hookapi.PodSandboxHookRequest | hookapi.ContainerResourceHookRequest
HookResponse: TypeAlias = hookapi.PodSandboxHookResponse | hookapi.ContainerResourceHookResponse
#: A computed answer: the hook request in, the response (or raw bytes to send as is) out.
Answer: TypeAlias = Callable[[Any], HookResponse | bytes]

#: Bytes that do not decode as either response type (a varint field cut short).
GARBAGE = b"\x08"


def _copy(resources: hookapi.LinuxContainerResources | None) -> hookapi.LinuxContainerResources | None:
    """A separate copy, so changing an answer never changes the logged request."""
    if resources is None:
        return None
    return hookapi.LinuxContainerResources.FromString(bytes(resources.SerializeToString()))


def request_type(point: HookPoint) -> type[HookRequest]:
    """The request message of *point*: pod hooks speak PodSandboxHook*, the rest ContainerResourceHook*."""
    return hookapi.PodSandboxHookRequest if point.is_pod_level else hookapi.ContainerResourceHookRequest


def echo_pod(request: hookapi.PodSandboxHookRequest) -> hookapi.PodSandboxHookResponse:
    """koordlet's pre-filled pod answer: labels, annotations, cgroup parent and resources, unchanged."""
    return hookapi.PodSandboxHookResponse(
        labels=dict(request.labels),
        annotations=dict(request.annotations),
        cgroup_parent=request.cgroup_parent,
        resources=_copy(request.resources),
    )


def echo_container(request: hookapi.ContainerResourceHookRequest) -> hookapi.ContainerResourceHookResponse:
    """koordlet's pre-filled container answer: annotations, resources, pod cgroup parent and envs, unchanged."""
    return hookapi.ContainerResourceHookResponse(
        container_annotations=dict(request.container_annotations),
        container_resources=_copy(request.container_resources),
        pod_cgroup_parent=request.pod_cgroup_parent,
        container_envs=dict(request.container_envs),
    )


@attrs.frozen
class Changes:
    """What the plugin changes on top of echoing the request; the default changes nothing.

    Like koordlet's ``ProxyDone``: resource fields are set in the echoed ``container_resources``
    (created if the request had none), envs and annotations are added or overwritten.

    Attributes:
        cpu_quota / cpu_shares / memory_limit / cpuset_cpus: container resources to set (None: keep).
        annotations: added to the pod's (pod hooks) or container's (container hooks) annotations.
        labels: added to the pod's labels (pod hooks only).
        envs: added to the container's envs (container hooks only).
        cgroup_parent: the pod's cgroup parent (``cgroup_parent`` / ``pod_cgroup_parent``); None: keep.
    """

    cpu_quota: int | None = None
    cpu_shares: int | None = None
    memory_limit: int | None = None
    cpuset_cpus: str | None = None
    annotations: Mapping[str, str] = attrs.field(factory=dict)
    labels: Mapping[str, str] = attrs.field(factory=dict)
    envs: Mapping[str, str] = attrs.field(factory=dict)
    cgroup_parent: str | None = None

    def answer(self, request: HookRequest) -> HookResponse:
        """The echo of *request* with these changes applied."""
        if isinstance(request, hookapi.PodSandboxHookRequest):
            pod = echo_pod(request)
            pod.labels.update(self.labels)
            pod.annotations.update(self.annotations)
            if self.cgroup_parent is not None:
                pod.cgroup_parent = self.cgroup_parent
            return pod
        answer = echo_container(request)
        answer.container_annotations.update(self.annotations)
        answer.container_envs.update(self.envs)
        if self.cgroup_parent is not None:
            answer.pod_cgroup_parent = self.cgroup_parent
        fields = {
            "cpu_quota": self.cpu_quota,
            "cpu_shares": self.cpu_shares,
            "memory_limit_in_bytes": self.memory_limit,
            "cpuset_cpus": self.cpuset_cpus,
        }
        if any(value is not None for value in fields.values()):
            resources = answer.container_resources or hookapi.LinuxContainerResources()
            for name, value in fields.items():
                if value is not None:
                    setattr(resources, name, value)
            answer.container_resources = resources
        return answer


@attrs.frozen
class Misbehaviour:
    """Trouble to inject into hook calls; applied in field order, the first that ends the call wins.

    Attributes:
        delay: seconds to wait before answering (asyncio time: trio's MockClock drives it).
        hang: never answer (until the caller gives up or the plugin stops).
        drop: abort the proxy's connection mid-call, as a crashing plugin does.
        status: answer with this gRPC error status and ``message``.
        garbage: answer these bytes, which need not decode as the response type.
        times: how many calls it affects; None means every call until cleared.
    """

    delay: float = 0.0
    hang: bool = False
    drop: bool = False
    status: grpclib.const.Status | None = None
    message: str = ""
    garbage: bytes | None = None
    times: int | None = None


@attrs.frozen
class Call:
    """One hook call the plugin received."""

    hook: HookPoint
    request: HookRequest = attrs.field(eq=False)


@attrs.define(eq=False)
class FakePlugin:
    """A scriptable hook server with a call log.

    Attributes:
        changes: applied on top of the echo for every hook without its own answer.
        answers: per-hook computed answers, replacing the echo (see :meth:`answer`).
        calls: every call received, in arrival order (also those that misbehaved).
    """

    changes: Changes = attrs.field(factory=Changes)
    answers: dict[HookPoint, Answer] = attrs.field(factory=dict)
    calls: list[Call] = attrs.field(factory=list, init=False)
    _trouble: dict[HookPoint | None, tuple[Misbehaviour, int | None]] = attrs.field(init=False, factory=dict)

    # -- test-facing API ----------------------------------------------------------------------

    def answer(self, hook: HookPoint, answer: Answer | HookResponse | bytes) -> None:
        """Answer *hook* with a computed answer (a callable taking the request) or a canned message."""
        self.answers[hook] = answer if callable(answer) else (lambda request: answer)

    def misbehave(self, trouble: Misbehaviour, hook: HookPoint | None = None) -> None:
        """Make the next ``trouble.times`` calls of *hook* (of every hook if None) misbehave."""
        self._trouble[hook] = (trouble, trouble.times)

    def behave(self) -> None:
        """Remove every injected misbehaviour."""
        self._trouble.clear()

    def requests(self, hook: HookPoint) -> list[Any]:
        """The requests received for *hook*, in arrival order."""
        return [call.request for call in self.calls if call.hook is hook]

    def hooks_called(self) -> list[HookPoint]:
        """The hook of every call received, in arrival order."""
        return [call.hook for call in self.calls]

    def handlers(self) -> list[Any]:
        """The grpclib handler objects to serve (with :class:`krproxy._grpc.BytesCodec`)."""
        return [_Routes(self)]

    # -- machinery ----------------------------------------------------------------------------

    def _take_trouble(self, hook: HookPoint) -> Misbehaviour | None:
        key: HookPoint | None = hook if hook in self._trouble else None
        entry = self._trouble.get(key)
        if entry is None:
            return None
        trouble, left = entry
        if left is not None:
            if left <= 1:
                del self._trouble[key]
            else:
                self._trouble[key] = (trouble, left - 1)
        return trouble

    def _answer(self, hook: HookPoint, request: HookRequest) -> bytes:
        answer = self.answers.get(hook, self.changes.answer)(request)
        return answer if isinstance(answer, bytes) else bytes(answer.SerializeToString())

    async def _handle(self, hook: HookPoint, stream: grpclib.server.Stream[bytes, bytes]) -> None:
        raw = await stream.recv_message()
        assert raw is not None
        request = request_type(hook).FromString(raw)
        self.calls.append(Call(hook, request))
        LOGGER.debug("event=hook_call hook=%s bytes=%d", hook.value, len(raw))
        trouble = self._take_trouble(hook)
        if trouble is not None:
            if trouble.delay:
                await asyncio.sleep(trouble.delay)
            if trouble.hang:
                await asyncio.Event().wait()
            if trouble.drop:
                # grpclib has no public way to cut a connection: abort the transport it holds.
                stream._stream._transport.abort()
                await asyncio.Event().wait()
            if trouble.status is not None:
                raise GRPCError(trouble.status, trouble.message or None)
            if trouble.garbage is not None:
                await stream.send_message(trouble.garbage)
                return
        await stream.send_message(self._answer(hook, request))


class _Routes:
    """A grpclib handler whose route table has every hook RPC, requests and replies as bytes."""

    def __init__(self, plugin: FakePlugin) -> None:
        self._plugin = plugin

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            point.rpc_path: grpclib.const.Handler(
                functools.partial(self._plugin._handle, point),
                grpclib.const.Cardinality.UNARY_UNARY,
                Raw,
                Raw,
            )
            for point in HookPoint
        }


async def run_fake_plugin(
    path: str,
    plugin: FakePlugin | None = None,
    *,
    task_status: trio.TaskStatus[FakePlugin] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a fake plugin on the unix socket *path* until cancelled.

    Must run inside ``trio_asyncio.open_loop()``. Reports the :class:`FakePlugin` through
    ``task_status`` once the socket accepts connections; on cancellation the socket file is removed.
    """
    plugin = FakePlugin() if plugin is None else plugin
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(serve, plugin.handlers(), path, codec=BytesCodec()))
        LOGGER.info("event=listening path=%s", path)
        task_status.started(plugin)
