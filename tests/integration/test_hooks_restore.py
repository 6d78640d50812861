"""RestorePod through the proxy to the fake containerd: hooked as RunPodSandbox + CreateContainer, held by
required servers, stored; forwarded byte for byte where no hook wants it."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio

from krproxy.fakes.plugin import Changes, FakePlugin
from krproxy.hooks.points import HookPoint
from krproxy.hooks.required import Requirements, parse_required_server
from krproxy.proto.runtime import v1 as cri
from krproxy.relay.rpc import grpc_timeout
from tests.integration.hooks_support import Node, make_node

PATH = "/runtime.v1.RuntimeService/RestorePod"
RUN = HookPoint.PRE_RUN_POD_SANDBOX
CREATE = HookPoint.PRE_CREATE_CONTAINER


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


@pytest.fixture
def archive(tmp_path: Path) -> str:
    path = tmp_path / "checkpoint.tar"
    path.write_bytes(b"not read by the fake")
    return str(path)


def restore_request(archive: str, *names: str) -> cri.RestorePodRequest:
    return cri.RestorePodRequest(
        checkpoint_path=archive,
        config=cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name="restored", uid="uid-r", namespace="ns"),
            labels={"app": "r"},
            linux=cri.LinuxPodSandboxConfig(cgroup_parent="/kubepods/pod-r"),
        ),
        runtime_handler="runc",
        container_configs=[
            cri.ContainerConfig(metadata=cri.ContainerMetadata(name=n), image=cri.ImageSpec(image="busybox"))
            for n in names
        ],
    )


async def restore(node: Node, request: bytes) -> cri.RestorePodResponse:
    """RestorePod by path (the upstream grpcio stubs predate it), raw bytes in, our message out."""
    call = node.client.channel.unary_unary(PATH, request_serializer=None, response_deserializer=None)
    reply = await trio.to_thread.run_sync(functools.partial(call, request, timeout=10))
    return cri.RestorePodResponse.parse(reply)


async def refused_code(node: Node, request: bytes) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        await restore(node, request)
    return info.value.code(), info.value.details() or ""


def requiring(name: str) -> Requirements:
    return Requirements((parse_required_server(name),), startup_grace=0.0)


async def test_restore_runs_pod_and_container_hooks(node: Node, archive: str) -> None:
    """PreRunPodSandbox on the restored config, PreCreateContainer per container; their changes reach the
    runtime in the RestorePod request, and the store knows the restored pod and containers."""
    plugin = await node.add_plugin(
        "p",
        FakePlugin(Changes(cgroup_parent="/kubepods/hooked", annotations={"hooked": "yes"}, cpu_quota=5000)),
    )
    await node.start_proxy()

    reply = await restore(node, bytes(restore_request(archive, "a", "b")))

    assert [RUN, CREATE, CREATE] == [c.hook for c in plugin.calls]
    assert ["a", "b"] == [c.request.container_meta.name for c in plugin.calls[1:]]
    (sent,) = node.fake.requests("RestorePod")
    forwarded = cri.RestorePodRequest.parse(sent.raw)
    assert "/kubepods/hooked" == forwarded.config.linux.cgroup_parent
    assert "yes" == forwarded.config.annotations["hooked"]
    assert {"app": "r"} == forwarded.config.labels
    assert ["yes", "yes"] == [c.annotations["hooked"] for c in forwarded.container_configs]
    assert [5000, 5000] == [c.linux.resources.cpu_quota for c in forwarded.container_configs]
    store = node.proxy.hooks.store
    pod = store.get_pod(reply.pod_sandbox_id)
    assert pod is not None and "restored" == pod.name and "/kubepods/hooked" == pod.cgroup_parent
    ids = {c.name: c.container_id for c in reply.restored_containers}
    for name, container_id in ids.items():
        info = store.get_container(container_id)
        assert info is not None and name == info.name and reply.pod_sandbox_id == info.pod_sandbox_id
        assert "yes" == info.annotations["hooked"]


async def test_restored_container_start_is_hooked(node: Node, archive: str) -> None:
    """A restored container is a known container: its StartContainer runs PreStartContainer."""
    plugin = await node.add_plugin("p", hooks=[HookPoint.PRE_START_CONTAINER])
    await node.start_proxy()
    reply = await restore(node, bytes(restore_request(archive, "a")))

    await node.start(reply.restored_containers[0].container_id)

    assert [HookPoint.PRE_START_CONTAINER] == [c.hook for c in plugin.calls]


@pytest.mark.parametrize("point", ["PreRunPodSandbox", "PreCreateContainer"])
async def test_restore_refused_while_required_missing(node: Node, archive: str, point: str) -> None:
    """A required server of either point, missing: UNAVAILABLE, and the runtime gets no RestorePod."""
    await node.start_proxy(requirements=requiring(f"koordlet={point}"))

    code, details = await refused_code(node, bytes(restore_request(archive, "a")))

    assert grpc.StatusCode.UNAVAILABLE == code, details
    assert "required hook server koordlet" in details and point in details
    assert [] == node.fake.requests("RestorePod")


async def test_restore_held_then_hooked_once_required_is_back(node: Node, archive: str) -> None:
    await node.start_proxy(requirements=requiring("koordlet"))
    request = bytes(restore_request(archive, "a"))
    assert grpc.StatusCode.UNAVAILABLE == (await refused_code(node, request))[0]

    plugin = await node.add_plugin("koordlet", FakePlugin(Changes(annotations={"hooked": "yes"})))
    await restore(node, request)

    assert [RUN, CREATE] == [c.hook for c in plugin.calls]
    (sent,) = node.fake.requests("RestorePod")
    assert "yes" == cri.RestorePodRequest.parse(sent.raw).container_configs[0].annotations["hooked"]


async def test_restore_forwarded_unchanged_without_hooks(node: Node, archive: str) -> None:
    """With no hook server at its points (one at another point), the caller's bytes reach the runtime,
    an unknown field included; the runtime's answer comes back and is stored."""
    await node.add_plugin("p", hooks=[HookPoint.PRE_START_CONTAINER])
    await node.start_proxy()
    data = bytes(restore_request(archive, "a")) + b"\xa2\x06\x03odd"  # field 100, unknown to every reader

    reply = await restore(node, data)

    assert [data] == [r.raw for r in node.fake.requests("RestorePod")]
    assert node.proxy.hooks.store.get_pod(reply.pod_sandbox_id) is not None


async def test_restore_error_passes_through(node: Node, tmp_path: Path) -> None:
    """The fake checks the archive exists: its NOT_FOUND comes back unchanged and nothing is stored."""
    await node.start_proxy()
    code, details = await refused_code(node, bytes(restore_request(str(tmp_path / "gone.tar"), "a")))
    assert grpc.StatusCode.NOT_FOUND == code
    assert "failed to open checkpoint archive" in details
    assert [] == [p for p in node.proxy.hooks.store.pods() if p.name == "restored"]


async def test_checkpoint_pod_forwarded_with_deadline(node: Node, tmp_path: Path) -> None:
    """CheckpointPod is no hook point: forwarded, with the caller's deadline; the fake answers UNIMPLEMENTED."""
    await node.start_proxy(requirements=requiring("koordlet"))
    call = node.client.channel.unary_unary(
        "/runtime.v1.RuntimeService/CheckpointPod", request_serializer=None, response_deserializer=None
    )
    request = bytes(cri.CheckpointPodRequest(pod_sandbox_id="p", output_path=str(tmp_path / "out.tar")))
    with pytest.raises(grpc.RpcError) as info:
        await trio.to_thread.run_sync(functools.partial(call, request, timeout=7))
    assert grpc.StatusCode.UNIMPLEMENTED == info.value.code()
    assert 1 == len(node.fake.requests("CheckpointPod"))
    (headers,) = node.fake.headers("CheckpointPod")
    timeout = grpc_timeout(dict(headers)["grpc-timeout"].encode())
    # grpcio rounds the timeout it sends up (7.01 s was seen on 3.13 in CI); krproxy forwards what
    # is left of that, never more.
    assert timeout is not None and 5 < timeout <= 7.1, timeout
