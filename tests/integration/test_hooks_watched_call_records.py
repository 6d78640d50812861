"""Tests of watched calls (issue 24): the call record (what metrics, traces and the call log read) of a
watched call has the fields an intercepted call's had on main f1593e7, where no plugin meant an
intercepted call with no hook outcome.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.calls import CallRecord
from krproxy.fakes.containerd import Fault
from krproxy.grpcstatus import Status
from tests.integration.hooks_support import Node, make_node
from tests.integration.support import wait_until


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


async def recorded(node: Node, method: str, records: list[CallRecord], count: int = 1) -> list[CallRecord]:
    await wait_until(lambda: sum(r.path.endswith("/" + method) for r in records) == count)
    return [r for r in records if r.path.endswith("/" + method)]


class TestWatchedCallRecords:
    async def test_a_create_that_worked(self, node: Node) -> None:
        await node.start_proxy()
        records: list[CallRecord] = []
        node.proxy.relay.transport.observers.append(records.append)
        pod_id = await node.run_pod()
        node.fake.inject("CreateContainer", Fault(delay=0.3))
        request = node.create_request(pod_id)
        container_id = (await node.call("CreateContainer", request)).container_id

        [record] = await recorded(node, "CreateContainer", records)
        assert (request.SerializeToString(), None, 1, (), Status.OK) == (
            record.request,
            record.forwarded,
            record.replies,
            record.hooks,
            record.status,
        )
        assert record.reply is not None
        assert container_id == api_pb2.CreateContainerResponse.FromString(record.reply).container_id
        assert 0.3 <= record.backend_seconds <= record.seconds

    async def test_a_remove_the_runtime_failed(self, node: Node) -> None:
        await node.start_proxy()
        records: list[CallRecord] = []
        node.proxy.relay.transport.observers.append(records.append)
        _, container_id = await node.pod_with_container()
        node.fake.inject("RemoveContainer", Fault(status=Status.FAILED_PRECONDITION, message="still running"))
        request = api_pb2.RemoveContainerRequest(container_id=container_id)

        with pytest.raises(grpc.RpcError) as failed:
            await node.call("RemoveContainer", request)

        assert grpc.StatusCode.FAILED_PRECONDITION == failed.value.code()
        [record] = await recorded(node, "RemoveContainer", records)
        assert (
            request.SerializeToString(),
            None,
            None,
            0,
            (),
            Status.FAILED_PRECONDITION,
            "still running",
        ) == (
            record.request,
            record.forwarded,
            record.reply,
            record.replies,
            record.hooks,
            record.status,
            record.message,
        )
