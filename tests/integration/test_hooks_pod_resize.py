"""PreUpdatePodSandboxResources through the real proxy: pod-level resize (CRI UpdatePodSandboxResources).

A kubelet-like grpcio client drives the proxy in front of a fake containerd that answers the call as
containerd 2.3 does (or UNIMPLEMENTED, as 1.6 to 2.1); fake plugins registered for the point answer.
"""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.fakes.containerd import (
    Fault,
)
from krproxy.fakes.plugin import FakePlugin, Misbehaviour
from krproxy.grpcstatus import Status
from krproxy.hooks.points import HookPoint
from krproxy.hookserver import HookServer, PodContext, ServeOptions, Stage, serve
from krproxy.hookserver.testing import FakeNode
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.conftest import serve_fake_containerd
from tests.integration.hooks_support import (
    POD_LABELS,
    Node,
    make_node,
    pod_config,
    pod_hook_request,
    refused,
    rejection,
)
from tests.integration.support import wait_until
from tests.records import RESIZED_CPU

RESIZE = HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES
RESIZE_CALL = "UpdatePodSandboxResources"
#: What kubelet sends for a pod resized to 1.5 CPUs and 1 GiB, with a RuntimeClass overhead.
RESOURCES = {**RESIZED_CPU, "memory_limit_in_bytes": 1 << 30}
OVERHEAD = {"cpu_shares": 25, "memory_limit_in_bytes": 64 << 20}


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


@pytest.fixture
async def old_node(nursery: trio.Nursery, sockdir: str, cri_client: Any) -> AsyncIterator[Node]:
    """A node whose runtime lacks UpdatePodSandboxResources, as containerd 1.6 to 2.1."""
    path = f"{sockdir}/containerd-old.sock"
    fake = await serve_fake_containerd(nursery, path, pod_resize=False)
    yield await make_node(nursery, sockdir, (fake, path), cri_client)


def resize_request(pod_id: str, **resources: int) -> api_pb2.UpdatePodSandboxResourcesRequest:
    return api_pb2.UpdatePodSandboxResourcesRequest(
        pod_sandbox_id=pod_id,
        overhead=api_pb2.LinuxContainerResources(**OVERHEAD),
        resources=api_pb2.LinuxContainerResources(**{**RESOURCES, **resources}),
    )


async def resize(node: Node, request: api_pb2.UpdatePodSandboxResourcesRequest | bytes) -> None:
    await node.update_pod(request)


def set_resources(**fields: int) -> Any:
    """A plugin answer: the requested resources, echoed, with *fields* changed."""

    def answer(request: hookapi.PodSandboxHookRequest) -> hookapi.PodSandboxHookResponse:
        resources = hookapi.LinuxContainerResources.FromString(bytes(request.resources))
        for name, value in fields.items():
            setattr(resources, name, value)
        return hookapi.PodSandboxHookResponse(resources=resources)

    return answer


class TestResizeHook:
    async def test_plugin_told_the_pod_and_the_requested_resources(self, node: Node) -> None:
        """The hook gets the stored pod (meta, handler, labels, annotations, cgroup parent) with the
        requested resources and overhead; an echo forwards kubelet's request unchanged."""
        plugin = await node.add_plugin("p", hooks=[RESIZE])
        await node.start_proxy()
        pod_id = await node.run_pod()

        await resize(node, resize_request(pod_id))

        assert [
            pod_hook_request(
                overhead=hookapi.LinuxContainerResources(**OVERHEAD),
                resources=hookapi.LinuxContainerResources(**RESOURCES),
            )
        ] == plugin.requests(RESIZE)
        assert [resize_request(pod_id)] == node.received("UpdatePodSandboxResources")

    async def test_adjusting_answer_reaches_the_runtime_and_the_store(self, node: Node) -> None:
        """The answer's resources replace the requested ones in what the runtime gets; the store keeps the
        result, and a later container hook gets it as pod_resources."""
        plugin = FakePlugin()
        plugin.answer(RESIZE, set_resources(cpu_quota=120_000))
        await node.add_plugin("p", plugin, hooks=[RESIZE, HookPoint.PRE_START_CONTAINER])
        await node.start_proxy()
        pod_id = await node.run_pod()
        container_id = await node.create_container(pod_id)

        await resize(node, resize_request(pod_id))
        await node.start(container_id)

        assert [resize_request(pod_id, cpu_quota=120_000)] == node.received("UpdatePodSandboxResources")
        sandbox = node.fake.state.sandboxes[pod_id]
        assert sandbox.resources is not None and 120_000 == sandbox.resources.cpu_quota
        adjusted = hookapi.LinuxContainerResources(**{**RESOURCES, "cpu_quota": 120_000})
        [start] = plugin.requests(HookPoint.PRE_START_CONTAINER)
        assert adjusted == start.pod_resources
        pod = node.proxy.hooks.store.get_pod(pod_id)
        assert pod is not None and pod.resources is not None and 120_000 == pod.resources.cpu_quota

    async def test_a_resized_pod_carries_its_resources_at_post_stop(self, node: Node) -> None:
        """After a resize the stored pod has resources and overhead, so PostStopPodSandbox is told them
        too (a pod never resized has none there)."""
        plugin = await node.add_plugin("p", hooks=[RESIZE, HookPoint.POST_STOP_POD_SANDBOX])
        await node.start_proxy()
        resized = await node.run_pod()
        other = await node.run_pod(pod_config("other"))

        await resize(node, resize_request(resized))
        await node.stop_pod(resized)
        await node.stop_pod(other)

        first, second = plugin.requests(HookPoint.POST_STOP_POD_SANDBOX)
        assert (
            hookapi.LinuxContainerResources(**RESOURCES),
            hookapi.LinuxContainerResources(**OVERHEAD),
        ) == (
            first.resources,
            first.overhead,
        )
        assert (None, None) == (second.resources, second.overhead)

    async def test_fail_refuses_the_resize(self, node: Node) -> None:
        """A rejecting answer under Fail: kubelet gets UNKNOWN "hook server err: ...", the runtime nothing,
        and the store keeps the pod's old resources."""
        plugin = FakePlugin()
        plugin.misbehave(Misbehaviour(status=Status.PERMISSION_DENIED, message="no more cpu", times=None))
        await node.add_plugin("guard", plugin, hooks=[RESIZE], failure_policy="Fail")
        await node.start_proxy()
        pod_id = await node.run_pod()

        details = await refused(node, RESIZE_CALL, resize_request(pod_id), grpc.StatusCode.UNKNOWN)

        assert (
            "hook server err: hook server guard failed PreUpdatePodSandboxResources: "
            "PERMISSION_DENIED: no more cpu"
        ) == details
        pod = node.proxy.hooks.store.get_pod(pod_id)
        assert pod is not None and pod.resources is None

    async def test_invalid_answer_under_fail_refuses_the_resize(self, node: Node) -> None:
        """Answered resources are checked before they are applied: cpu_shares 1 is refused."""
        plugin = FakePlugin()
        plugin.answer(RESIZE, set_resources(cpu_shares=1))
        await node.add_plugin("guard", plugin, hooks=[RESIZE], failure_policy="Fail")
        await node.start_proxy()
        pod_id = await node.run_pod()

        details = await refused(node, RESIZE_CALL, resize_request(pod_id), grpc.StatusCode.UNKNOWN)

        assert "invalid answer: resources.cpu_shares=1 is not 0 or 2..262144" in details

    async def test_ignore_goes_on(self, node: Node) -> None:
        """A failing plugin under Ignore: the resize reaches the runtime as kubelet sent it, and is stored."""
        plugin = FakePlugin()
        plugin.misbehave(Misbehaviour(status=Status.INTERNAL, message="boom", times=None))
        await node.add_plugin("p", plugin, hooks=[RESIZE])
        await node.start_proxy()
        pod_id = await node.run_pod()

        await resize(node, resize_request(pod_id))

        assert [resize_request(pod_id)] == node.received("UpdatePodSandboxResources")
        pod = node.proxy.hooks.store.get_pod(pod_id)
        assert pod is not None and pod.resources is not None and 150_000 == pod.resources.cpu_quota

    async def test_unregistered_point_forwards_byte_for_byte(self, node: Node) -> None:
        """A plugin registered for every other hook is not called, and the runtime gets the very bytes
        kubelet sent: here fields in reverse order, which any re-encoding would put back in order."""
        others = [p for p in HookPoint if p is not RESIZE]
        plugin = await node.add_plugin("p", FakePlugin(), hooks=others)
        await node.start_proxy()
        pod_id = await node.run_pod()
        request = resize_request(pod_id)
        data = (
            bytes([0x1A, request.resources.ByteSize()])
            + request.resources.SerializeToString()
            + bytes([0x12, request.overhead.ByteSize()])
            + request.overhead.SerializeToString()
            + bytes([0x0A, len(pod_id)])
            + pod_id.encode()
        )
        assert data != request.SerializeToString()  # the test's premise: the order differs

        await resize(node, data)

        assert [data] == [r.raw for r in node.fake.requests("UpdatePodSandboxResources")]
        assert RESIZE not in plugin.hooks_called()
        pod = node.proxy.hooks.store.get_pod(pod_id)
        assert pod is not None and pod.resources is not None and 150_000 == pod.resources.cpu_quota

    async def test_skip_label_runs_no_hook(self, node: Node) -> None:
        """A pod labelled skip-hookserver=true is resized without hooks (and still stored)."""
        plugin = await node.add_plugin("p", FakePlugin(), hooks=[RESIZE])
        await node.start_proxy()
        labels = {**POD_LABELS, "runtimeproxy.koordinator.sh/skip-hookserver": "true"}
        pod_id = await node.run_pod(pod_config(labels=labels))

        await resize(node, resize_request(pod_id))

        assert [] == plugin.requests(RESIZE)
        assert [resize_request(pod_id)] == node.received("UpdatePodSandboxResources")


class TestRuntimeAnswers:
    async def test_unimplemented_reaches_the_caller_unchanged(self, old_node: Node) -> None:
        """containerd 1.6 to 2.1 answer UNIMPLEMENTED: kubelet gets that status and message (and falls
        back), and the store does not change."""
        node = old_node
        await node.add_plugin("p", hooks=[RESIZE])
        await node.start_proxy()
        pod_id = await node.run_pod()

        error = await rejection(node, RESIZE_CALL, resize_request(pod_id))

        assert grpc.StatusCode.UNIMPLEMENTED == error.code()
        assert "unknown method UpdatePodSandboxResources for service runtime.v1.RuntimeService" == (
            error.details()
        )
        pod = node.proxy.hooks.store.get_pod(pod_id)
        assert pod is not None and pod.resources is None

    @pytest.mark.parametrize(
        ("fault", "code"),
        [
            (Fault(status=Status.UNAVAILABLE, message="shutting down"), grpc.StatusCode.UNAVAILABLE),
            (Fault(status=Status.DEADLINE_EXCEEDED, message="nri plugin"), grpc.StatusCode.DEADLINE_EXCEEDED),
            (Fault(status=Status.UNKNOWN, message="NRI sandbox update failed"), grpc.StatusCode.UNKNOWN),
            (Fault(drop=True), grpc.StatusCode.UNAVAILABLE),
        ],
    )
    async def test_runtime_errors_reach_the_caller_and_leave_the_store(
        self, node: Node, fault: Fault, code: grpc.StatusCode
    ) -> None:
        """A runtime error comes back with its status (and message); a runtime that drops the connection
        is UNAVAILABLE. The store keeps the old resources, also when a plugin had changed the resize."""
        plugin = FakePlugin()
        plugin.answer(RESIZE, set_resources(cpu_quota=120_000))
        await node.add_plugin("p", plugin, hooks=[RESIZE])
        await node.start_proxy()
        pod_id = await node.run_pod()
        node.fake.inject("UpdatePodSandboxResources", fault)

        error = await rejection(node, RESIZE_CALL, resize_request(pod_id))

        assert code == error.code()
        if fault.message:
            assert fault.message == error.details()
        pod = node.proxy.hooks.store.get_pod(pod_id)
        assert pod is not None and pod.resources is None

    async def test_unknown_pod_is_forwarded(self, node: Node) -> None:
        """A sandbox the store does not know: no hook, the runtime's NOT_FOUND comes back."""
        plugin = await node.add_plugin("p", hooks=[RESIZE])
        await node.start_proxy()

        error = await rejection(node, RESIZE_CALL, resize_request("no-such-pod"))

        assert grpc.StatusCode.NOT_FOUND == error.code()
        assert [] == plugin.requests(RESIZE)


class TestSdkHookServer:
    async def test_sdk_handler_caps_the_resize(self, node: Node, nursery: trio.Nursery, sockdir: str) -> None:
        """An SDK server with a PreUpdatePodSandboxResources handler registers for the point, is told the
        pod's labels and requested resources, and its capped quota reaches the runtime."""
        app = HookServer(executor=FakeNode(pathlib.Path(sockdir) / "node").create().executor())
        seen: list[tuple[str, int]] = []

        @app.hook(Stage.PRE_UPDATE_POD_SANDBOX_RESOURCES)
        def cap(ctx: PodContext) -> None:
            assert ctx.request.resources is not None
            seen.append((ctx.request.labels["app"], ctx.request.resources.cpu_quota))
            ctx.response.resources.cfs_quota = min(ctx.request.resources.cpu_quota, 100_000)

        await node.start_proxy()
        options = ServeOptions(socket=f"{sockdir}/sdk.sock", hook_dir=node.hook_dir, name="sdk")
        await nursery.start(serve, app, options)
        await wait_until(lambda: "sdk.json" in node.registered())
        pod_id = await node.run_pod()

        await resize(node, resize_request(pod_id))

        assert [("web", 150_000)] == seen
        assert [resize_request(pod_id, cpu_quota=100_000)] == node.received("UpdatePodSandboxResources")
