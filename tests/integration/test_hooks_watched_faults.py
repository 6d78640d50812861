"""Tests of watched calls (issue 24): the store after a watched call the runtime fails, drops, refuses or
answers late, and requests the relay sends upstream as they came (large, unknown fields).

The rules are the interceptors' (and on main f1593e7 every one of these calls was intercepted): a
created pod or container is kept only when the runtime answered OK; a Stop or Remove drops the entry
after OK or the runtime's NOT_FOUND, and keeps it after anything else (kubelet retries, and the retry
needs the record). No plugin is registered, so on createlat4 every call here is watched.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.fakes.containerd import Fault
from krproxy.grpcstatus import Status
from tests.integration.hooks_support import FAILED_WORK, Node, make_node
from tests.integration.support import in_thread

#: Faults under which the runtime did not do the work, or the caller cannot know it did.
FAILURES = {**FAILED_WORK, "unavailable": Fault(status=Status.UNAVAILABLE, message="restarting")}


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


def remove_container(container_id: str) -> api_pb2.RemoveContainerRequest:
    return api_pb2.RemoveContainerRequest(container_id=container_id)


async def fails(
    node: Node,
    method: str,
    request: Any,
    timeout: float | None = None,  # noqa: ASYNC109 - the call's deadline, sent as grpc-timeout
) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as failed:
        await in_thread(getattr(node.client.runtime, method), request, timeout=timeout)
    code: grpc.StatusCode = failed.value.code()
    return code


class TestFailedForwards:
    @pytest.mark.parametrize("fault", FAILURES.values(), ids=FAILURES.keys())
    async def test_a_failed_create_is_not_stored(self, node: Node, fault: Fault) -> None:
        await node.start_proxy()
        pod_id = await node.run_pod()
        node.fake.inject("CreateContainer", fault)

        await fails(node, "CreateContainer", node.create_request(pod_id))

        assert {} == node.proxy.hooks.store.containers()
        assert [pod_id] == list(node.proxy.hooks.store.pods())

    @pytest.mark.parametrize("fault", FAILURES.values(), ids=FAILURES.keys())
    async def test_a_failed_remove_keeps_the_container(self, node: Node, fault: Fault) -> None:
        await node.start_proxy()
        _, container_id = await node.pod_with_container()
        node.fake.inject("RemoveContainer", fault)

        await fails(node, "RemoveContainer", remove_container(container_id))

        assert [container_id] == list(node.proxy.hooks.store.containers())

    async def test_a_remove_past_the_callers_deadline_keeps_the_container(self, node: Node) -> None:
        await node.start_proxy()
        _, container_id = await node.pod_with_container()
        node.fake.inject("RemoveContainer", Fault(delay=4.0))

        code = await fails(node, "RemoveContainer", remove_container(container_id), timeout=1.0)

        assert grpc.StatusCode.DEADLINE_EXCEEDED == code
        assert [container_id] == list(node.proxy.hooks.store.containers())

    async def test_a_create_past_the_callers_deadline_is_not_stored(self, node: Node) -> None:
        await node.start_proxy()
        pod_id = await node.run_pod()
        node.fake.inject("CreateContainer", Fault(delay=4.0))

        code = await fails(node, "CreateContainer", node.create_request(pod_id), timeout=1.0)

        assert grpc.StatusCode.DEADLINE_EXCEEDED == code
        assert {} == node.proxy.hooks.store.containers()

    async def test_not_found_drops_a_pod_and_its_containers(self, node: Node) -> None:
        await node.start_proxy()
        pod_id, _ = await node.pod_with_container()
        node.fake.inject("RemovePodSandbox", Fault(status=Status.NOT_FOUND, message="gone"))

        code = await fails(node, "RemovePodSandbox", api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod_id))

        assert grpc.StatusCode.NOT_FOUND == code
        assert ({}, {}) == (node.proxy.hooks.store.pods(), node.proxy.hooks.store.containers())


class TestRequestsAsTheyCame:
    async def test_a_large_remove_with_unknown_fields_arrives_whole(self, node: Node) -> None:
        """1 MiB of an unknown field (many DATA frames, more than a stream's first window)."""
        await node.start_proxy()
        _, container_id = await node.pod_with_container()
        unknown = b"\x7a" + bytes([0x80, 0x80, 0x40]) + b"x" * (1 << 20)  # field 15, bytes, 1 MiB
        assert len(unknown) - 4 == 1 << 20
        request = remove_container(container_id).SerializeToString() + unknown
        call = node.client.channel.unary_unary(
            "/runtime.v1.RuntimeService/RemoveContainer",
            request_serializer=lambda data: data,
            response_deserializer=api_pb2.RemoveContainerResponse.FromString,
        )

        await in_thread(call, request, timeout=30)

        assert [request] == [r.raw for r in node.fake.requests("RemoveContainer")]
        assert {} == node.proxy.hooks.store.containers()
