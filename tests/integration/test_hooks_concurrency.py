"""Hooked calls on one container are serialised: overlapping updates cannot undo each other."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from krproxy.fakes.plugin import Changes, FakePlugin, Misbehaviour
from krproxy.hooks.points import HookPoint
from tests.integration.hooks_support import Node, make_node
from tests.integration.support import wait_until

UPDATE = HookPoint.PRE_UPDATE_CONTAINER_RESOURCES


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


class TestOverlappingUpdates:
    async def test_second_update_sees_the_first(self, node: Node) -> None:
        """Two updates of one container sent at once: the second's hooks see the first's result."""
        # Slow, so the calls overlap.
        plugin = FakePlugin(Changes(cpu_shares=7))
        plugin.misbehave(Misbehaviour(delay=1.0, times=None), UPDATE)
        await node.add_plugin("slow", plugin, [UPDATE])
        await node.start_proxy()
        _, container_id = await node.pod_with_container()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: node.update(container_id, cpu_quota=30_000))
            # The first is at the plugin before the second is sent (a fixed 50 ms did not always do
            # that on a loaded machine, and the second then came first).
            await wait_until(lambda: 1 == len(plugin.calls))
            nursery.start_soon(lambda: node.update(container_id, memory_limit_in_bytes=64 << 20))

        first, second = plugin.requests(UPDATE)
        assert 30_000 == first.container_resources.cpu_quota
        assert (30_000, 64 << 20) == (
            second.container_resources.cpu_quota,
            second.container_resources.memory_limit_in_bytes,
        )
