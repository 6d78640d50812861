"""Tests of watched calls (issue 24): watched calls racing others on the same object.

A watched RemoveContainer completes while a hooked UpdateContainerResources or StartContainer of the same
container waits for its plugin: the hooked call must not bring the removed container back into the
store. Two watched creates of one name at once: the store keeps the one the runtime created.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.fakes.plugin import Misbehaviour
from krproxy.hooks.points import HookPoint
from tests.integration.hooks_support import Node, make_node
from tests.integration.support import wait_until


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


async def outcome(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.RpcError as err:
        code: grpc.StatusCode = err.code()
        return code
    return grpc.StatusCode.OK


class TestRemoveRacingAHookedCall:
    @pytest.mark.parametrize(
        "point", [HookPoint.PRE_UPDATE_CONTAINER_RESOURCES, HookPoint.PRE_START_CONTAINER]
    )
    async def test_the_removed_container_stays_removed(self, node: Node, point: HookPoint) -> None:
        plugin = await node.add_plugin("slow", hooks=[point], call_timeout=30)
        plugin.misbehave(Misbehaviour(delay=6.0), point)  # logged as it arrives; time for the Remove
        await node.start_proxy()
        _, container_id = await node.pod_with_container()
        if point is HookPoint.PRE_UPDATE_CONTAINER_RESOURCES:
            await node.call("StartContainer", api_pb2.StartContainerRequest(container_id=container_id))
            hooked = node.update(container_id, cpu_shares=512)
        else:
            hooked = node.start(container_id)
        codes: list[grpc.StatusCode] = []

        async def run_hooked() -> None:
            codes.append(await outcome(hooked))

        async with trio.open_nursery() as calls:
            calls.start_soon(run_hooked)
            await wait_until(lambda: len(plugin.calls) == 1)
            await node.call("RemoveContainer", api_pb2.RemoveContainerRequest(container_id=container_id))
            assert ([], None) == (codes, node.proxy.hooks.store.get_container(container_id))

        assert [grpc.StatusCode.NOT_FOUND] == codes  # the runtime no longer has it
        assert 1 == len(plugin.calls)
        assert None is node.proxy.hooks.store.get_container(container_id)


class TestTwoCreatesOfOneName:
    async def test_the_store_keeps_the_one_the_runtime_created(self, node: Node) -> None:
        await node.start_proxy()
        pod_id = await node.run_pod()
        request = node.create_request(pod_id)
        answers: list[Any] = []

        async def create() -> None:
            try:
                answers.append((await node.call("CreateContainer", request)).container_id)
            except grpc.RpcError as err:
                answers.append(err.code())

        async with trio.open_nursery() as calls:
            calls.start_soon(create)
            calls.start_soon(create)

        [created] = [a for a in answers if isinstance(a, str)]
        assert 1 == sum(isinstance(a, grpc.StatusCode) for a in answers)  # the name is reserved
        assert [created] == list(node.proxy.hooks.store.containers())
