"""Tests of watched calls (issue 24): a PostStop hook point gains a plugin while the Stop is at the runtime.

kubelet's StopContainer waits for the container's grace period (30 s by default), and StopPodSandbox
for all of the pod's: a hook server that registers meanwhile (koordlet restarting during a drain)
is registered when the runtime answers. The intercepted Stop runs the PostStop hooks of the plugins
registered at the answer (on main, and on createlat4 where a plugin was there from the start); a
watched one, decided at the request, must not lose them.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio

from krproxy.fakes.containerd import Fault
from krproxy.hooks.points import HookPoint
from tests.integration.hooks_support import Node, make_node
from tests.integration.support import wait_until

#: The runtime takes this long to stop: time enough to register a plugin under any load.
STOPPING = 8.0


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


async def stop_while_registering(node: Node, method: str, stop: Any, point: HookPoint) -> Any:
    """Call *stop* (a Stop of *method*); once the runtime holds it, register a plugin at *point*; return
    the plugin once the Stop answered (which must come after the registration took effect)."""
    node.fake.inject(method, Fault(delay=STOPPING))
    answered = math.inf
    async with trio.open_nursery() as calls:

        async def stopping() -> None:
            nonlocal answered
            await stop
            answered = trio.current_time()

        calls.start_soon(stopping)
        await wait_until(lambda: len(node.fake.requests(method)) == 1)
        plugin = await node.add_plugin("late", hooks=[point])
        registered = trio.current_time()
    assert registered < answered, "the plugin registered only after the Stop was answered: rerun"
    return plugin


class TestPostStopOfAPluginRegisteredDuringTheStop:
    async def test_stop_container(self, node: Node) -> None:
        await node.start_proxy()
        _, container_id = await node.pod_with_container()
        await node.start(container_id)
        point = HookPoint.POST_STOP_CONTAINER

        plugin = await stop_while_registering(node, "StopContainer", node.stop(container_id), point)

        [told] = plugin.requests(point)
        assert (container_id, "app") == (told.container_meta.id, told.container_meta.name)
        assert None is node.proxy.hooks.store.get_container(container_id)

    async def test_stop_pod_sandbox(self, node: Node) -> None:
        await node.start_proxy()
        pod_id = await node.run_pod()
        point = HookPoint.POST_STOP_POD_SANDBOX

        plugin = await stop_while_registering(node, "StopPodSandbox", node.stop_pod(pod_id), point)

        [told] = plugin.requests(point)
        assert "web" == told.pod_meta.name
        assert None is node.proxy.hooks.store.get_pod(pod_id)
