"""Tests of watched calls (issue 24): watched calls and store recovery after a restart.

A call that arrives before the store is recovered is not watched: it waits for the recovery in its
interceptor, so the recovered list cannot bring back what it removed. After a restart, the objects
created watched by the first proxy are recovered, and watched calls on them update the store.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.fakes.containerd import FakeContainerd, run_fake_containerd
from krproxy.hooks.points import HookPoint
from tests.integration.hooks_support import Node, container_config, make_node
from tests.integration.support import LIVENESS_LIMIT


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


class TestRecovery:
    async def test_a_remove_before_recovery_is_not_undone_by_it(self, node: Node, sockdir: str) -> None:
        late = os.path.join(sockdir, "late.sock")
        fake = FakeContainerd()
        [container_id, kept_id] = fake.seed(1, 2)
        await node.start_proxy(runtime_endpoint=late, wait_recovered=False)
        done = trio.Event()

        async def remove() -> None:
            await node.call("RemoveContainer", api_pb2.RemoveContainerRequest(container_id=container_id))
            done.set()

        node.nursery.start_soon(remove)
        await trio.sleep(0.3)
        assert (False, False) == (node.proxy.hooks.recovered, done.is_set())

        await node.nursery.start(run_fake_containerd, late, fake)
        with trio.fail_after(LIVENESS_LIMIT):
            await done.wait()

        assert [kept_id] == list(node.proxy.hooks.store.containers())

    async def test_watched_objects_are_recovered_and_updated(self, node: Node) -> None:
        """Objects created watched are recovered and watched calls update them."""
        await node.start_proxy()
        pod_id, container_id = await node.pod_with_container()  # watched: no plugin
        second = await node.create_container(pod_id, container_config("side"))
        await node.stop_proxy()

        plugin = await node.add_plugin("p", hooks=[HookPoint.PRE_START_CONTAINER])
        await node.start_proxy(socket_name="proxy-2.sock")
        store = node.proxy.hooks.store
        assert {container_id, second} == set(store.containers())
        await node.call("RemoveContainer", api_pb2.RemoveContainerRequest(container_id=second))
        await node.start(container_id)

        assert [container_id] == list(store.containers())
        [told] = plugin.requests(HookPoint.PRE_START_CONTAINER)
        assert (container_id, "app", "web") == (
            told.container_meta.id,
            told.container_meta.name,
            told.pod_meta.name,
        )
