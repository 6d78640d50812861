"""Tests of watched calls (issue 24): a runtime that compresses its answers.

A watched call goes upstream with the caller's header block, ``grpc-accept-encoding`` included, so a
runtime configured to compress (a grpcio server with ``compression=gzip`` or ``deflate`` does so for
every caller that accepts it) answers it compressed. The caller reads it; the store must learn the pod and the container
from it too. (An intercepted call cannot use such a runtime at all: the relay's own unary call reads
only an uncompressed answer and the caller gets UNAVAILABLE, on main as on createlat4.) The runtime here is a grpcio server answering the few CRI methods the proxy needs with fixed
messages; it runs in its own threads and is stopped at the end of each test.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.hooks.points import HookPoint
from tests.integration.hooks_support import Node, container_config, pod_config

SERVICE = "runtime.v1.RuntimeService"
#: Ids long and regular enough to shrink under gzip: gRPC core sends a message plain when compressing
#: would not make it smaller (grpc-go, containerd's, compresses whatever it is asked to).
POD_ID = "pod-" + "0" * 200
CONTAINER_ID = "ctr-" + "1" * 200


class CompressingRuntime:
    """Answers RunPodSandbox, CreateContainer, the lists recovery makes and Version; compressed."""

    def __init__(self) -> None:
        self.created: list[str] = []

    def handler(self) -> grpc.GenericRpcHandler:
        def run_pod(request: bytes, context: Any) -> bytes:
            return api_pb2.RunPodSandboxResponse(pod_sandbox_id=POD_ID).SerializeToString()

        def create(request: bytes, context: Any) -> bytes:
            name = api_pb2.CreateContainerRequest.FromString(request).config.metadata.name
            self.created.append(name)
            return api_pb2.CreateContainerResponse(container_id=CONTAINER_ID).SerializeToString()

        def empty(answer: Any) -> Any:
            return lambda request, context: answer.SerializeToString()

        methods = {
            "RunPodSandbox": run_pod,
            "CreateContainer": create,
            "ListPodSandbox": empty(api_pb2.ListPodSandboxResponse()),
            "ListContainers": empty(api_pb2.ListContainersResponse()),
            "Version": empty(api_pb2.VersionResponse(version="0.1.0", runtime_name="compressing")),
        }
        return grpc.method_handlers_generic_handler(
            SERVICE, {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in methods.items()}
        )


@pytest.fixture(params=[grpc.Compression.Gzip, grpc.Compression.Deflate], ids=["gzip", "deflate"])
def compressing(sockdir: str, request: pytest.FixtureRequest) -> Iterator[tuple[CompressingRuntime, str]]:
    runtime = CompressingRuntime()
    path = os.path.join(sockdir, "compressing-runtime.sock")
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2), compression=request.param)
    server.add_generic_rpc_handlers((runtime.handler(),))
    server.add_insecure_port("unix:" + path)
    server.start()
    try:
        yield runtime, path
    finally:
        server.stop(None).wait()


@pytest.fixture
async def node(
    nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any, compressing: Any
) -> Node:
    fake, _ = fake_containerd  # unused: the node's runtime is the compressing one
    return Node(nursery, sockdir, fake, compressing[1], cri_client)


async def create_pod_and_container(node: Node) -> tuple[str, str]:
    pod = await node.call(
        "RunPodSandbox", api_pb2.RunPodSandboxRequest(config=pod_config(), runtime_handler="runc")
    )
    request = api_pb2.CreateContainerRequest(
        pod_sandbox_id=pod.pod_sandbox_id, config=container_config(), sandbox_config=pod_config()
    )
    created = await node.call("CreateContainer", request)
    return pod.pod_sandbox_id, created.container_id


class TestCompressedAnswers:
    async def test_the_store_learns_compressed_pod_and_container(self, node: Node) -> None:
        """No plugin: both calls are watched."""
        await node.start_proxy()

        assert (POD_ID, CONTAINER_ID) == await create_pod_and_container(node)
        store = node.proxy.hooks.store
        pod = store.get_pod(POD_ID)
        container = store.get_container(CONTAINER_ID)
        assert pod is not None and (pod.namespace, pod.name) == ("prod", "web")
        assert container is not None and container.name == "app" and container.pod.name == "web"

    async def test_a_plugin_registered_later_gets_the_full_record(self, node: Node) -> None:
        """What PreStartContainer is told about a container whose create answer came compressed."""
        await node.start_proxy()
        await create_pod_and_container(node)
        plugin = await node.add_plugin("late", hooks=[HookPoint.PRE_START_CONTAINER])

        # The compressing runtime does not serve StartContainer: the plugin runs, then the forward fails.
        with pytest.raises(grpc.RpcError) as failed:
            await node.start(CONTAINER_ID)
        assert grpc.StatusCode.UNIMPLEMENTED == failed.value.code()
        [told] = plugin.requests(HookPoint.PRE_START_CONTAINER)
        assert ("app", "web") == (told.container_meta.name, told.pod_meta.name)
