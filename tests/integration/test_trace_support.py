"""Shared harness of the ``test_trace_*`` tests and ``scripts/record-golden-traces`` (no tests here).

- :func:`drive_lifecycle`: what a kubelet does for one pod, start to end, as blocking grpcio
  calls (one expected NOT_FOUND included, so traces hold an error status too).
- :func:`start_node`: the proxy daemon in front of a fake containerd with the demo limits
  plugin (or another) on PreCreateContainer, optionally recording.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import grpc
import trio
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pb_grpc

from krproxy.daemon import Daemon
from krproxy.demo import DemoLimitsPlugin
from krproxy.fakes.containerd import (
    FakeContainerd,
    RuntimeState,
    run_fake_containerd,
    sequential_ids,
    stepping_clock,
)
from tests.integration.support import start_proxy

#: The committed golden traces (regenerate with scripts/record-golden-traces).
TRACES = Path(__file__).resolve().parent.parent / "data" / "traces"
FAKE_GOLDEN = TRACES / "fake-lifecycle.krt"
CONTAINERD_GOLDEN = TRACES / "containerd-lifecycle.krt"

BUSYBOX = "docker.io/library/busybox:latest"


def drive_lifecycle(
    channel: grpc.Channel,
    *,
    image: str = BUSYBOX,
    cgroup_parent: str = "/kubepods/besteffort/podtrace-uid-1",
    command: tuple[str, ...] = ("sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.1; done"),
    host_network: bool = False,
    timeout: float = 30,
) -> list[str]:
    """One pod's life through ``channel``, as kubelet calls it; returns the methods called.

    ``host_network``: the pod shares the node's network (and gets no hostname), as a real
    containerd without CNI needs.
    """
    runtime = pb_grpc.RuntimeServiceStub(channel)  # type: ignore[no-untyped-call]
    images = pb_grpc.ImageServiceStub(channel)  # type: ignore[no-untyped-call]
    called: list[str] = []

    def call(stub: Any, method: str, request: Any, *, expect: grpc.StatusCode | None = None) -> Any:
        called.append(method)
        try:
            return getattr(stub, method)(request, timeout=timeout)
        except grpc.RpcError as err:
            if expect is None or err.code() != expect:
                raise
            return None

    call(runtime, "Version", pb.VersionRequest(version="v1"))
    call(runtime, "Status", pb.StatusRequest())
    call(images, "ImageStatus", pb.ImageStatusRequest(image=pb.ImageSpec(image=image)))
    pod_config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="trace", uid="trace-uid-1", namespace="default", attempt=0),
        labels={"app": "trace"},
        log_directory="/tmp/krproxy-trace-logs",
        linux=pb.LinuxPodSandboxConfig(cgroup_parent=cgroup_parent),
    )
    if host_network:
        pod_config.hostname = ""
        pod_config.linux.security_context.namespace_options.network = pb.NODE
    pod = call(runtime, "RunPodSandbox", pb.RunPodSandboxRequest(config=pod_config))
    pod_id = pod.pod_sandbox_id
    call(runtime, "PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id))
    container_config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="app"),
        image=pb.ImageSpec(image=image),
        command=list(command),
        labels={"app": "trace"},
        log_path="app.log",
        envs=[pb.KeyValue(key="MODE", value="trace")],
        linux=pb.LinuxContainerConfig(resources=pb.LinuxContainerResources(cpu_shares=2)),
    )
    created = call(
        runtime,
        "CreateContainer",
        pb.CreateContainerRequest(pod_sandbox_id=pod_id, config=container_config, sandbox_config=pod_config),
    )
    cid = created.container_id
    call(runtime, "StartContainer", pb.StartContainerRequest(container_id=cid))
    call(runtime, "ContainerStatus", pb.ContainerStatusRequest(container_id=cid))
    call(
        runtime,
        "ListContainers",
        pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod_id)),
    )
    call(runtime, "ListPodSandbox", pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(id=pod_id)))
    call(
        runtime,
        "UpdateContainerResources",
        pb.UpdateContainerResourcesRequest(
            container_id=cid, linux=pb.LinuxContainerResources(cpu_shares=4, memory_limit_in_bytes=128 << 20)
        ),
    )
    call(runtime, "ContainerStatus", pb.ContainerStatusRequest(container_id=cid))
    call(runtime, "StopContainer", pb.StopContainerRequest(container_id=cid, timeout=1))
    call(runtime, "RemoveContainer", pb.RemoveContainerRequest(container_id=cid))
    call(
        runtime,
        "ContainerStatus",
        pb.ContainerStatusRequest(container_id=cid),
        expect=grpc.StatusCode.NOT_FOUND,
    )
    call(runtime, "StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=pod_id))
    call(runtime, "RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id))
    call(runtime, "ListPodSandbox", pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(id=pod_id)))
    return called


class OtherLimitsPlugin(DemoLimitsPlugin):
    """The demo plugin, deliberately changed: a different cpuset and annotation value."""

    async def pre_create_container_hook(self, message: Any) -> Any:
        answer = await super().pre_create_container_hook(message)
        answer.container_resources.cpuset_cpus = "2-3"
        answer.container_annotations["demo.krproxy.io/limited-by"] = "other-limits"
        return answer


def new_fake(id_namespace: str = "fake-containerd") -> FakeContainerd:
    """A fake containerd with a deterministic clock and IDs from ``id_namespace``."""
    return FakeContainerd(RuntimeState(clock=stepping_clock(), new_id=sequential_ids(id_namespace)))


@attrs.frozen
class Node:
    """A proxy in front of a fake containerd (or a trace backend), with a plugin on PreCreateContainer."""

    daemon: Daemon
    fake: FakeContainerd | None
    proxy_socket: str
    backend_socket: str


async def start_node(
    nursery: trio.Nursery,
    sockdir: str,
    *,
    plugin: Any = None,
    fake: FakeContainerd | None = None,
    backend_socket: str | None = None,
    **config: Any,
) -> Node:
    """Start the fake (unless ``backend_socket`` names another backend), the plugin and the proxy.

    ``plugin=None`` uses :class:`DemoLimitsPlugin`; ``config`` goes to ``ProxyConfig``.
    """
    if backend_socket is None:
        backend_socket = os.path.join(sockdir, "containerd.sock")
        fake = fake or new_fake()
        await nursery.start(run_fake_containerd, backend_socket, fake)
    plugin_socket = os.path.join(sockdir, "plugin.sock")
    await nursery.start((plugin or DemoLimitsPlugin()).serve, plugin_socket)
    hook_dir = os.path.join(sockdir, "hooks")
    os.makedirs(hook_dir, exist_ok=True)
    with open(os.path.join(hook_dir, "limits.json"), "w") as f:  # noqa: ASYNC230 - tiny local file
        json.dump(
            {
                "remote-endpoint": plugin_socket,
                "failure-policy": "Fail",
                "runtime-hooks": ["PreCreateContainer"],
            },
            f,
        )
    daemon = await start_proxy(nursery, sockdir, runtime_endpoint=backend_socket, hook_dir=hook_dir, **config)
    return Node(daemon, fake, daemon.config.listen, backend_socket)


async def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))
