"""The fake hook plugin on the wire: a scriptable ``runtime.v1alpha1.RuntimeHookService``.

Every hook RPC reaches :class:`FakePlugin` as raw bytes (served by krproxy's own gRPC server,
:class:`krproxy.rpc.Server`), so a test can make the plugin answer bytes that do not
decode, as well as delay, fail, hang or drop the connection. Answers are computed per hook: by default
the request is echoed back the way koordlet's proxy server does, with the plugin's
:class:`Changes` applied on top.

The plugin is as strict as a grpc-go hook server (koordlet) about request headers
(:mod:`krproxy.fakes.strict`, applied by :func:`krproxy.fakes.grpc_go.header_check`): a malformed ``grpc-timeout``
(more than 8 digits) or a missing ``:method`` is refused the way the chosen grpc-go version does
(RST_STREAM PROTOCOL_ERROR by default), and every accepted request's header block is logged
(:attr:`FakePlugin.headers`). Like koordlet's grpc-go server it advertises no stream limit and
takes request messages up to 4 MiB.

The plain echo (no changes, no canned answer, no trouble) is built from the request's wire
form (:func:`echo_bytes`), without decoding and re-encoding it: the benchmark's plugins echo,
and their CPU counts in the proxy's measured latency. The call log keeps each request's bytes
and decodes them when read.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import attrs
import trio

from krproxy import rpc
from krproxy.fakes import _armed, strict
from krproxy.fakes.grpc_go import header_check
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1alpha1 as hookapi
from krproxy.unixsock import bind_unix_socket, unlink_if_ours

LOGGER = logging.getLogger("krproxy.fakes.plugin")

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
        cpu_quota / cpu_shares / memory_limit / cpuset_cpus / oom_score_adj: container resources to set
            (None: keep).
        annotations: added to the pod's (pod hooks) or container's (container hooks) annotations.
        labels: added to the pod's labels (pod hooks only).
        envs: added to the container's envs (container hooks only).
        cgroup_parent: the pod's cgroup parent (``cgroup_parent`` / ``pod_cgroup_parent``); None: keep.
    """

    cpu_quota: int | None = None
    cpu_shares: int | None = None
    memory_limit: int | None = None
    cpuset_cpus: str | None = None
    oom_score_adj: int | None = None
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
            "oom_score_adj": self.oom_score_adj,
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
        delay: seconds to wait before answering (trio time: a MockClock drives it).
        hang: never answer (until the caller gives up or the plugin stops).
        drop: abort the proxy's connection mid-call, as a crashing plugin does.
        status: answer with this gRPC error status and ``message``.
        garbage: answer these bytes, which need not decode as the response type.
        times: how many calls it affects; None means every call until cleared.
    """

    delay: float = 0.0
    hang: bool = False
    drop: bool = False
    status: Status | None = None
    message: str = ""
    garbage: bytes | None = None
    times: int | None = None


#: The echo answer's fields: request field number -> answer field number, for container hooks
#: (annotations, resources, pod cgroup parent, envs) and pod hooks (labels, annotations, cgroup
#: parent, resources). All are length-delimited (maps, messages, strings).
_ECHO_FIELDS: dict[bool, dict[int, bytes]] = {
    False: {3: b"\x0a", 4: b"\x12", 8: b"\x1a", 9: b"\x22"},
    True: {3: b"\x0a", 4: b"\x12", 5: b"\x1a", 7: b"\x22"},
}


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def echo_bytes(hook: HookPoint, request: bytes) -> bytes | None:
    """The plain echo answer to *request* (:func:`echo_pod` / :func:`echo_container`, serialized),
    built from its wire form: each echoed field is copied under the answer's field number.

    Decoding the result gives what the decoded echo gives (repeated keys and fields resolve the
    same way on the receiving side). None when only a decode can judge the request: a field
    that is cut short, of a wire type the echo does not expect, or a group.
    """
    fields = _ECHO_FIELDS[hook.is_pod_level]
    out = bytearray()
    pos, end = 0, len(request)
    try:
        while pos < end:
            key, pos = _varint(request, pos)
            wire = key & 7
            if wire == 2:
                body = pos
                size, pos = _varint(request, pos)
                pos += size
                tag = fields.get(key >> 3)
                if tag is not None and pos <= end:
                    out += tag
                    out += request[body:pos]
            elif wire == 0:
                _, pos = _varint(request, pos)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                return None
            if wire != 2 and (key >> 3) in fields:
                return None
    except (IndexError, ValueError):
        return None
    return bytes(out) if pos == end else None


@attrs.frozen
class Call:
    """One hook call the plugin received: the hook and the request's bytes."""

    hook: HookPoint
    message: bytes = attrs.field(eq=False, repr=False)

    @property
    def request(self) -> HookRequest:
        """The request, decoded (anew on each read, so nothing can change the logged one)."""
        return request_type(self.hook).FromString(self.message)


_NO_CHANGES = Changes()


@attrs.define(eq=False)
class FakePlugin:
    """A scriptable hook server with a call log.

    Attributes:
        changes: applied on top of the echo for every hook without its own answer.
        answers: per-hook computed answers, replacing the echo (see :meth:`answer`).
        calls: every call received, in arrival order (also those that misbehaved).
        grpc_go: how a request grpc-go refuses is answered (:class:`krproxy.fakes.strict.GrpcGo`).
        headers: the header block of every request accepted, in arrival order (``grpc-timeout``
            included).
        rejected: every request refused for its headers, with why.
    """

    changes: Changes = attrs.field(factory=Changes)
    answers: dict[HookPoint, Answer] = attrs.field(factory=dict)
    grpc_go: strict.GrpcGo = strict.GrpcGo.V1_6
    calls: list[Call] = attrs.field(factory=list, init=False)
    headers: list[strict.Headers] = attrs.field(factory=list, init=False)
    rejected: list[tuple[strict.Headers, strict.Rejection]] = attrs.field(factory=list, init=False)
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

    def server(self) -> rpc.Server:
        """A :class:`krproxy.rpc.Server` serving this plugin, as strict as koordlet's grpc-go:
        header checks, no stream limit advertised, grpc-go's default 4 MiB receive limit, and the
        caller's ``grpc-timeout`` checked but not enforced (a hanging plugin hangs until the
        caller gives up)."""
        return rpc.Server(
            {point.rpc_path: functools.partial(self._serve, point) for point in HookPoint},
            check_headers=header_check(self.grpc_go, accepted=self.headers.append, rejected=self._rejected),
            max_request=strict.MAX_PLUGIN_REQUEST,
            max_streams=None,
            enforce_deadlines=False,
        )

    # -- machinery ----------------------------------------------------------------------------

    async def _serve(self, hook: HookPoint, stream: rpc.Stream) -> None:
        raw = await stream.recv_message()
        if raw is None:
            raise GRPCError(Status.INTERNAL, "the request ended without a message")
        await stream.send_message(await self._reply(hook, raw, stream))

    async def _reply(self, hook: HookPoint, raw: bytes, stream: rpc.Stream) -> bytes:
        """The answer to one call of *hook* with the request *raw* (GRPCError for a status)."""
        echo = None
        if not self._trouble and hook not in self.answers and self.changes == _NO_CHANGES:
            echo = echo_bytes(hook, raw)
        self.calls.append(Call(hook, raw))
        LOGGER.debug("event=hook_call hook=%s bytes=%d", hook.value, len(raw))
        request = None
        if echo is None:
            try:
                request = request_type(hook).FromString(raw)
            except Exception as err:
                raise GRPCError(Status.INTERNAL, f"cannot decode the request: {err}") from None
        trouble = self._take_trouble(hook)
        if trouble is not None:
            return await self._misbehave(hook, request, trouble, stream)
        return echo if echo is not None else self._answer(hook, request)

    def _take_trouble(self, hook: HookPoint) -> Misbehaviour | None:
        key: HookPoint | None = hook if hook in self._trouble else None
        return _armed.take(self._trouble, key)

    def _answer(self, hook: HookPoint, request: Any) -> bytes:
        answer = self.answers.get(hook, self.changes.answer)(request)
        return answer if isinstance(answer, bytes) else bytes(answer.SerializeToString())

    def _rejected(self, headers: strict.Headers, rejection: strict.Rejection) -> None:
        self.rejected.append((headers, rejection))

    async def _misbehave(
        self, hook: HookPoint, request: Any, trouble: Misbehaviour, stream: rpc.Stream
    ) -> bytes:
        if trouble.delay:
            await trio.sleep(trouble.delay)
        if trouble.hang:
            await trio.sleep_forever()
        if trouble.drop:
            stream.close_connection()
            await trio.sleep_forever()  # the connection is gone: the server cancels this call
        if trouble.status is not None:
            raise GRPCError(trouble.status, trouble.message or None)
        if trouble.garbage is not None:
            return trouble.garbage
        return self._answer(hook, request)


async def run_fake_plugin(
    path: str,
    plugin: FakePlugin | None = None,
    *,
    answer_after: float | trio.Event = 0.0,
    task_status: trio.TaskStatus[FakePlugin] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a fake plugin on the unix socket *path* until cancelled.

    Reports the :class:`FakePlugin` through ``task_status`` once the socket accepts connections;
    on cancellation connections are closed and the socket file is removed (if still ours). See
    :meth:`FakePlugin.server` for what it refuses.

    ``answer_after`` plays a hook server that is registered but not answering: the socket is bound
    and listening at once (a connect succeeds, into the kernel's backlog), but nothing is read or
    answered for that many seconds (trio time; ``math.inf``: never), or until that event is set, as
    a server that is still starting or whose serve loop is wedged. After it, the connections waiting
    in the backlog are served as usual.
    """
    plugin = FakePlugin() if plugin is None else plugin
    if not isinstance(answer_after, trio.Event) and not answer_after >= 0:
        raise ValueError(f"answer_after must be >= 0 (math.inf: never), not {answer_after}")
    sock = bind_unix_socket(path)
    inode = os.stat(path).st_ino
    try:
        async with trio.open_nursery() as nursery:
            if isinstance(answer_after, trio.Event) or answer_after:
                LOGGER.info("event=listening_not_answering path=%s answer_after=%s", path, answer_after)
                task_status.started(plugin)
                if isinstance(answer_after, trio.Event):
                    await answer_after.wait()
                else:
                    await trio.sleep(answer_after)
                await nursery.start(plugin.server().serve_socket, sock)
                LOGGER.info("event=answering path=%s", path)
            else:
                await nursery.start(plugin.server().serve_socket, sock)
                LOGGER.info("event=listening path=%s", path)
                task_status.started(plugin)
    finally:
        sock.close()
        unlink_if_ours(path, inode)
