"""``krproxy demo``: the proxy in front of the bundled fake containerd, with one plugin.

Everything runs in one process and one ``trio.run``, on sockets in a fresh temp dir:

* the fake containerd (:mod:`krproxy.fakes.containerd`) as the backend runtime;
* a small hook plugin, ``demo-limits``, registered by a file in the hook directory: on
  PreCreateContainer it echoes the request (as koordlet does) with a CPU quota, a memory
  limit, a cpuset and an annotation set;
* ``krproxy serve`` in front of the fake.

A CRI client (:class:`krproxy.rpc.Channel`) then drives a whole pod lifecycle through the proxy
and the demo prints each step, and what the runtime finally received for CreateContainer. Exit
status 0 when every step behaved.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from krproxy import kubelet, rpc
from krproxy.config import MAX_SOCKET_PATH, ProxyConfig
from krproxy.daemon import serve
from krproxy.fakes.containerd import FakeContainerd, run_fake_containerd
from krproxy.grpcstatus import GRPCError
from krproxy.hooks.points import HookPoint
from krproxy.methods import cri_methods
from krproxy.proto.runtime import v1 as cri
from krproxy.proto.runtime import v1alpha1 as hookapi

#: What the demo plugin asks for; the demo checks the runtime received exactly this.
DEMO_LIMITS = {"cpu_quota": 50_000, "cpu_period": 100_000, "memory_limit_in_bytes": 256 << 20}
DEMO_CPUSET = "0-1"
DEMO_ANNOTATION = ("demo.krproxy.io/limited-by", "demo-limits")


class DemoLimitsPlugin:
    """Sets resources on every new container, echoing everything else (koordlet's convention).

    Serves PreCreateContainerHook only: ``await nursery.start(DemoLimitsPlugin().serve, path)``.
    """

    def __init__(self) -> None:
        self.calls = 0

    async def serve(self, path: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the hook protocol on the unix socket ``path`` until cancelled."""
        server = rpc.Server({HookPoint.PRE_CREATE_CONTAINER.rpc_path: rpc.unary(self._pre_create_container)})
        await server.serve(path, task_status=task_status)

    async def _pre_create_container(self, request: bytes) -> bytes:
        message = hookapi.ContainerResourceHookRequest.FromString(request)
        return bytes((await self.pre_create_container_hook(message)).SerializeToString())

    async def pre_create_container_hook(
        self, message: hookapi.ContainerResourceHookRequest
    ) -> hookapi.ContainerResourceHookResponse:
        self.calls += 1
        resources = message.container_resources or hookapi.LinuxContainerResources()
        for field, value in DEMO_LIMITS.items():
            setattr(resources, field, value)
        resources.cpuset_cpus = DEMO_CPUSET
        return hookapi.ContainerResourceHookResponse(
            container_annotations={**message.container_annotations, DEMO_ANNOTATION[0]: DEMO_ANNOTATION[1]},
            container_resources=resources,
            pod_cgroup_parent=message.pod_cgroup_parent,
            container_envs=message.container_envs,
        )


class Demo:
    """Runs the steps, printing one line each; remembers whether all went as expected."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.failures = 0

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    async def step(
        self, name: str, call: Callable[[], Awaitable[Any]], describe: Callable[[Any], str]
    ) -> Any:
        try:
            result = await call()
        except GRPCError as err:
            self.failures += 1
            self.say(f"  FAIL {name:<24} {err.status.name}: {err.message}")
            return None
        self.say(f"  ok   {name:<24} {describe(result)}")
        return result

    def check(self, what: str, ok: bool) -> None:
        if not ok:
            self.failures += 1
        self.say(f"  {'ok  ' if ok else 'FAIL'} {what}")


def _pod_config() -> cri.PodSandboxConfig:
    return cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name="demo", uid="demo-uid-1", namespace="default", attempt=0),
        labels={"app": "demo"},
        linux=cri.LinuxPodSandboxConfig(cgroup_parent="/kubepods/besteffort/poddemo-uid-1"),
    )


class _Runtime:
    """CRI calls on a channel, each found by its request's type: ``await runtime.call(cri.VersionRequest(), seconds=2)``."""

    def __init__(self, channel: rpc.Channel) -> None:
        self.channel = channel
        self._methods = {method.request: method for method in cri_methods().values()}

    async def call(self, request: Any, *, seconds: float) -> Any:
        """The reply, with a deadline ``seconds`` from now (sent as grpc-timeout, as kubelet does)."""
        method = self._methods[type(request)]
        reply = await self.channel.unary(method.path, bytes(request.SerializeToString()), timeout=seconds)
        return method.reply.FromString(reply)


async def _drive(demo: Demo, proxy_socket: str, fake: FakeContainerd) -> None:
    channel = rpc.Channel(proxy_socket)
    runtime = _Runtime(channel)
    timeout = kubelet.RUNTIME_REQUEST_TIMEOUT  # kubelet's deadlines, as a node has them

    async def step(request: Any, describe: Callable[[Any], str], seconds: float = timeout) -> Any:
        """One CRI call as a step of the demo, named by its method."""
        name = type(request).__name__.removesuffix("Request")
        return await demo.step(name, lambda: runtime.call(request, seconds=seconds), describe)

    try:
        await step(
            cri.VersionRequest(),
            lambda r: f"{r.runtime_name} {r.runtime_version} (CRI {r.runtime_api_version})",
        )
        pod_config = _pod_config()
        pod = await step(
            cri.RunPodSandboxRequest(config=pod_config),
            lambda r: f"pod default/demo -> sandbox {r.pod_sandbox_id[:12]}",
            kubelet.RUN_POD_SANDBOX_TIMEOUT,
        )
        if pod is None:
            return
        kubelet_resources = cri.LinuxContainerResources(cpu_shares=2)
        container_config = cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name="app"),
            image=cri.ImageSpec(image="docker.io/library/busybox:latest"),
            command=["sh", "-c", "sleep 3600"],
            linux=cri.LinuxContainerConfig(resources=kubelet_resources),
        )
        created = await step(
            cri.CreateContainerRequest(
                pod_sandbox_id=pod.pod_sandbox_id, config=container_config, sandbox_config=pod_config
            ),
            lambda r: f"container app -> {r.container_id[:12]}",
        )
        if created is None:
            return
        cid = created.container_id
        received = fake.requests("CreateContainer")[-1].message
        assert isinstance(received, cri.CreateContainerRequest)
        assert received.config is not None and received.config.linux is not None
        resources = received.config.linux.resources or cri.LinuxContainerResources()
        sent = kubelet_resources
        for line in _changes(sent, container_config.annotations, resources, received.config.annotations):
            demo.say(line)
        demo.check(
            "plugin demo-limits applied its limits and kept the rest",
            all(getattr(resources, k) == v for k, v in DEMO_LIMITS.items())
            and resources.cpuset_cpus == DEMO_CPUSET
            and resources.cpu_shares == 2
            and received.config.annotations.get(DEMO_ANNOTATION[0]) == DEMO_ANNOTATION[1],
        )
        await step(cri.StartContainerRequest(container_id=cid), lambda r: "started")
        await step(
            cri.ContainerStatusRequest(container_id=cid),
            lambda r: f"{r.status.state.name}, cpu_quota={r.status.resources.linux.cpu_quota}",
        )
        await step(
            cri.ExecSyncRequest(container_id=cid, cmd=["echo", "hello"], timeout=5),
            lambda r: f"exit {r.exit_code}, stdout {r.stdout!r}",
            kubelet.exec_sync_timeout(5),
        )
        await step(
            cri.StopContainerRequest(container_id=cid, timeout=1),
            lambda r: "done",
            kubelet.stop_container_timeout(1),
        )
        await step(cri.RemoveContainerRequest(container_id=cid), lambda r: "done")
        await step(cri.StopPodSandboxRequest(pod_sandbox_id=pod.pod_sandbox_id), lambda r: "done")
        await step(cri.RemovePodSandboxRequest(pod_sandbox_id=pod.pod_sandbox_id), lambda r: "done")
        listed = await step(cri.ListPodSandboxRequest(), lambda r: f"{len(r.items)} pods left")
        demo.check("nothing left behind", listed is not None and len(listed.items) == 0)
    finally:
        await channel.aclose()


#: The CreateContainer fields the demo compares, as CRI names them.
_SHOWN_FIELDS = ("cpu_quota", "cpu_period", "memory_limit_in_bytes", "cpuset_cpus", "cpu_shares")


def _changes(
    sent: cri.LinuxContainerResources,
    sent_annotations: dict[str, str],
    received: cri.LinuxContainerResources,
    received_annotations: dict[str, str],
) -> list[str]:
    """Lines showing, field by field, kubelet's CreateContainer against what the runtime received after
    the plugin: ``before -> after`` where the plugin changed it, ``(kept)`` where it did not."""
    rows = [
        (f"linux.resources.{name}", getattr(sent, name), getattr(received, name)) for name in _SHOWN_FIELDS
    ]
    for key in sorted(set(sent_annotations) | set(received_annotations)):
        rows.append((f"annotations[{key}]", sent_annotations.get(key), received_annotations.get(key)))
    lines = ["       what the plugin changed in CreateContainer (kubelet sent -> the runtime received):"]
    width = max(len(name) for name, _, _ in rows)
    for name, before, after in rows:
        shown = f"{before!r} (kept)" if before == after else f"{_unset(before)} -> {after!r}"
        lines.append(f"         {name:<{width}}  {shown}")
    return lines


def _unset(value: object) -> str:
    """A value kubelet left out shows as ``unset`` (proto3's zero: nothing was sent)."""
    return "unset" if value in (None, 0, "") else repr(value)


#: Printed after a demo that behaved: where to go next.
NEXT_STEPS = """next: write your own plugin, docs/plugin-authoring.md; run the SDK's built-in policies as a hook
      server with `krproxy hooks serve --help`; put krproxy in front of a real containerd with
      `krproxy serve --remote-runtime-service-endpoint=unix:///run/containerd/containerd.sock` (README.md)"""


def _register_plugin(hook_dir: str, endpoint: str) -> None:
    os.makedirs(hook_dir)
    registration = {
        "remote-endpoint": endpoint,
        "failure-policy": "Fail",
        "runtime-hooks": ["PreCreateContainer"],
    }
    with open(os.path.join(hook_dir, "demo-limits.json"), "w") as f:
        json.dump(registration, f)


#: The longest socket name the demo puts in its work directory (``containerd.sock``).
_LONGEST_SOCKET = "/containerd.sock"


def _workdir() -> str:
    """A new work directory for the demo's sockets: in ``$TMPDIR`` (Python's temporary directory), or in
    ``/tmp`` when the sockets' paths there would be too long for unix sockets (a deep ``TMPDIR``).

    Raises:
        OSError: no directory could be made (the message says where it was tried).
    """
    workdir = tempfile.mkdtemp(prefix="krproxy-demo-")
    if len(os.fsencode(workdir + _LONGEST_SOCKET)) <= MAX_SOCKET_PATH:
        return workdir
    os.rmdir(workdir)
    return tempfile.mkdtemp(prefix="krproxy-demo-", dir="/tmp")


async def run_demo(out: Any = None) -> int:
    """Run the demo; returns the process exit status (0: every step behaved, 1: one did not, or the demo
    could not make its work directory)."""
    demo = Demo(out or sys.stdout)
    try:
        workdir = _workdir()
    except OSError as err:
        print(
            f"krproxy demo: error: cannot make a work directory for its sockets ({err}); "
            "set TMPDIR to a writable directory",
            file=sys.stderr,
        )
        return 1
    paths = {name: os.path.join(workdir, f"{name}.sock") for name in ("containerd", "plugin", "krproxy")}
    hook_dir = os.path.join(workdir, "hooks")
    demo.say("krproxy demo: the proxy in front of the bundled fake containerd, with one hook plugin")
    demo.say(f"  sockets and hook dir in {workdir}")
    stopped_by: list[signal.Signals] = []
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_stop_on_signal, signals, nursery.cancel_scope, stopped_by)
                await _run_steps(demo, nursery, paths, hook_dir)
                nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if stopped_by:  # Ctrl-C or SIGTERM: the demo did not finish; 128 + the signal, as a shell reports it
        demo.say(f"demo stopped by {stopped_by[0].name} before it finished")
        return 128 + stopped_by[0]
    demo.say(
        "demo finished: " + ("all steps behaved" if demo.failures == 0 else f"{demo.failures} problem(s)")
    )
    if demo.failures == 0:
        demo.say(NEXT_STEPS)
    return 0 if demo.failures == 0 else 1


async def _stop_on_signal(signals: Any, scope: trio.CancelScope, stopped_by: list[signal.Signals]) -> None:
    async for signum in signals:
        stopped_by.append(signal.Signals(signum))
        scope.cancel()
        return


async def _run_steps(demo: Demo, nursery: trio.Nursery, paths: dict[str, str], hook_dir: str) -> None:
    """Start the fake, the plugin and the proxy in ``nursery``, drive the lifecycle, drain the proxy."""
    fake: FakeContainerd = await nursery.start(run_fake_containerd, paths["containerd"])
    plugin = DemoLimitsPlugin()
    await nursery.start(plugin.serve, paths["plugin"])
    _register_plugin(hook_dir, paths["plugin"])
    config = ProxyConfig(listen=paths["krproxy"], runtime_endpoint=paths["containerd"], hook_dir=hook_dir)
    daemon = await nursery.start(functools.partial(serve, config, handle_signals=False))
    demo.say(f"  krproxy listening on {config.listen}; plugin demo-limits registered (PreCreateContainer)")
    await _drive(demo, paths["krproxy"], fake)
    demo.check(f"plugin was called once (calls: {plugin.calls})", plugin.calls == 1)
    daemon.request_shutdown()
    with trio.fail_after(15):
        while daemon.relay.transport.in_flight:  # noqa: ASYNC110 - drain is brief; no event to wait on
            await trio.sleep(0.01)


def main() -> int:
    return trio.run(run_demo)
