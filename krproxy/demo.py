"""``krproxy demo``: the proxy in front of the bundled fake containerd, with one plugin.

Everything runs in one process and one ``trio.run``, on sockets in a fresh temp dir:

* the fake containerd (:mod:`fakes.containerd`) as the backend runtime;
* a small hook plugin, ``demo-limits``, registered by a file in the hook directory: on
  PreCreateContainer it echoes the request (as koordlet does) with a CPU quota, a memory
  limit, a cpuset and an annotation set;
* ``krproxy serve`` in front of the fake.

An independent CRI client (grpcio with the upstream stubs) then drives a whole pod
lifecycle through the proxy and the demo prints each step, and what the runtime finally
received for CreateContainer. Exit status 0 when every step behaved.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import grpc
import trio
import trio_asyncio
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pb_grpc

from fakes.containerd import FakeContainerd, run_fake_containerd
from krproxy import _grpc, kubelet
from krproxy.config import ProxyConfig
from krproxy.daemon import serve
from krproxy.proto.runtime import v1 as cri
from krproxy.proto.runtime import v1alpha1 as hookapi

#: What the demo plugin asks for; the demo checks the runtime received exactly this.
DEMO_LIMITS = {"cpu_quota": 50_000, "cpu_period": 100_000, "memory_limit_in_bytes": 256 << 20}
DEMO_CPUSET = "0-1"
DEMO_ANNOTATION = ("demo.krproxy.io/limited-by", "demo-limits")


class DemoLimitsPlugin(hookapi.RuntimeHookServiceBase):
    """Sets resources on every new container, echoing everything else (koordlet's convention)."""

    def __init__(self) -> None:
        self.calls = 0

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

    async def step(self, name: str, call: Callable[[], Any], describe: Callable[[Any], str]) -> Any:
        try:
            result = await trio.to_thread.run_sync(call)
        except grpc.RpcError as err:
            self.failures += 1
            self.say(f"  FAIL {name:<24} {err.code().name}: {err.details()}")
            return None
        self.say(f"  ok   {name:<24} {describe(result)}")
        return result

    def check(self, what: str, ok: bool) -> None:
        if not ok:
            self.failures += 1
        self.say(f"  {'ok  ' if ok else 'FAIL'} {what}")


def _pod_config() -> pb.PodSandboxConfig:
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="demo", uid="demo-uid-1", namespace="default", attempt=0),
        labels={"app": "demo"},
        linux=pb.LinuxPodSandboxConfig(cgroup_parent="/kubepods/besteffort/poddemo-uid-1"),
    )


async def _drive(demo: Demo, proxy_socket: str, fake: FakeContainerd) -> None:
    channel = grpc.insecure_channel(f"unix://{proxy_socket}")
    runtime = pb_grpc.RuntimeServiceStub(channel)  # type: ignore[no-untyped-call]
    timeout = kubelet.RUNTIME_REQUEST_TIMEOUT  # kubelet's deadlines, as a node has them
    try:
        await demo.step(
            "Version",
            lambda: runtime.Version(pb.VersionRequest(), timeout=timeout),
            lambda r: f"{r.runtime_name} {r.runtime_version} (CRI {r.runtime_api_version})",
        )
        pod_config = _pod_config()
        pod = await demo.step(
            "RunPodSandbox",
            lambda: runtime.RunPodSandbox(
                pb.RunPodSandboxRequest(config=pod_config), timeout=kubelet.RUN_POD_SANDBOX_TIMEOUT
            ),
            lambda r: f"pod default/demo -> sandbox {r.pod_sandbox_id[:12]}",
        )
        if pod is None:
            return
        container_config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="app"),
            image=pb.ImageSpec(image="docker.io/library/busybox:latest"),
            command=["sh", "-c", "sleep 3600"],
            linux=pb.LinuxContainerConfig(resources=pb.LinuxContainerResources(cpu_shares=2)),
        )
        created = await demo.step(
            "CreateContainer",
            lambda: runtime.CreateContainer(
                pb.CreateContainerRequest(
                    pod_sandbox_id=pod.pod_sandbox_id, config=container_config, sandbox_config=pod_config
                ),
                timeout=timeout,
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
        demo.say("       what the runtime received for CreateContainer, after the plugin:")
        demo.say(
            f"         cpu_quota={resources.cpu_quota} cpu_period={resources.cpu_period} "
            f"memory_limit={resources.memory_limit_in_bytes} cpuset_cpus={resources.cpuset_cpus!r} "
            f"cpu_shares={resources.cpu_shares} (kept from kubelet's request)"
        )
        demo.check(
            "plugin demo-limits applied its limits and kept the rest",
            all(getattr(resources, k) == v for k, v in DEMO_LIMITS.items())
            and resources.cpuset_cpus == DEMO_CPUSET
            and resources.cpu_shares == 2
            and received.config.annotations.get(DEMO_ANNOTATION[0]) == DEMO_ANNOTATION[1],
        )
        await demo.step(
            "StartContainer",
            lambda: runtime.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=timeout),
            lambda r: "started",
        )
        await demo.step(
            "ContainerStatus",
            lambda: runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=timeout),
            lambda r: (
                f"{pb.ContainerState.Name(r.status.state)}, cpu_quota={r.status.resources.linux.cpu_quota}"
            ),
        )
        await demo.step(
            "ExecSync",
            lambda: runtime.ExecSync(
                pb.ExecSyncRequest(container_id=cid, cmd=["echo", "hello"], timeout=5),
                timeout=kubelet.exec_sync_timeout(5),
            ),
            lambda r: f"exit {r.exit_code}, stdout {r.stdout!r}",
        )
        for name, call in (
            (
                "StopContainer",
                lambda: runtime.StopContainer(
                    pb.StopContainerRequest(container_id=cid, timeout=1),
                    timeout=kubelet.stop_container_timeout(1),
                ),
            ),
            (
                "RemoveContainer",
                lambda: runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=timeout),
            ),
            (
                "StopPodSandbox",
                lambda: runtime.StopPodSandbox(
                    pb.StopPodSandboxRequest(pod_sandbox_id=pod.pod_sandbox_id), timeout=timeout
                ),
            ),
            (
                "RemovePodSandbox",
                lambda: runtime.RemovePodSandbox(
                    pb.RemovePodSandboxRequest(pod_sandbox_id=pod.pod_sandbox_id), timeout=timeout
                ),
            ),
        ):
            await demo.step(name, call, lambda r: "done")
        listed = await demo.step(
            "ListPodSandbox",
            lambda: runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=timeout),
            lambda r: f"{len(r.items)} pods left",
        )
        demo.check("nothing left behind", listed is not None and len(listed.items) == 0)
    finally:
        channel.close()


def _register_plugin(hook_dir: str, endpoint: str) -> None:
    os.makedirs(hook_dir)
    registration = {
        "remote-endpoint": endpoint,
        "failure-policy": "Fail",
        "runtime-hooks": ["PreCreateContainer"],
    }
    with open(os.path.join(hook_dir, "demo-limits.json"), "w") as f:
        json.dump(registration, f)


async def run_demo(out: Any = None) -> int:
    """Run the demo; returns the process exit status (0: every step behaved)."""
    demo = Demo(out or sys.stdout)
    workdir = tempfile.mkdtemp(prefix="krproxy-demo-")
    paths = {name: os.path.join(workdir, f"{name}.sock") for name in ("containerd", "plugin", "krproxy")}
    hook_dir = os.path.join(workdir, "hooks")
    demo.say("krproxy demo: the proxy in front of the bundled fake containerd, with one hook plugin")
    demo.say(f"  sockets and hook dir in {workdir}")
    try:
        async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
            fake: FakeContainerd = await nursery.start(run_fake_containerd, paths["containerd"])
            plugin = DemoLimitsPlugin()
            await nursery.start(_grpc.serve, [plugin], paths["plugin"])
            _register_plugin(hook_dir, paths["plugin"])
            config = ProxyConfig(
                listen=paths["krproxy"], runtime_endpoint=paths["containerd"], hook_dir=hook_dir
            )
            daemon = await nursery.start(functools.partial(serve, config, handle_signals=False))
            demo.say(
                f"  krproxy listening on {config.listen}; plugin demo-limits registered (PreCreateContainer)"
            )
            await _drive(demo, paths["krproxy"], fake)
            demo.check(f"plugin was called once (calls: {plugin.calls})", plugin.calls == 1)
            daemon.request_shutdown()
            with trio.fail_after(15):
                while daemon.relay.in_flight:  # noqa: ASYNC110 - drain is brief; no event to wait on
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    demo.say(
        "demo finished: " + ("all steps behaved" if demo.failures == 0 else f"{demo.failures} problem(s)")
    )
    return 0 if demo.failures == 0 else 1


def main() -> int:
    return trio.run(run_demo)
