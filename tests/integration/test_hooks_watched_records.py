"""Tests of watched calls (issue 24): what later hooks are told about a watched create, against an
intercepted one, field for field.

A plugin registered at the later points only sees a pod and container created watched (no plugin at
PreRunPodSandbox or PreCreateContainer), then the same pod and container created again, intercepted (a
second plugin at those points answers with no change). Its PreStartContainer,
PreUpdateContainerResources, PostStopContainer and PostStopPodSandbox requests must be the same for
both but for the objects' ids.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.hooks.points import HookPoint
from tests.integration.hooks_support import Node, make_node

LATER = [
    HookPoint.PRE_START_CONTAINER,
    HookPoint.PRE_UPDATE_CONTAINER_RESOURCES,
    HookPoint.POST_STOP_CONTAINER,
    HookPoint.POST_STOP_POD_SANDBOX,
]


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


async def lifecycle(node: Node) -> tuple[str, str]:
    """Run the default pod, create, start, update and stop its container, remove it, stop and remove the pod."""
    pod_id, container_id = await node.pod_with_container()
    await node.start(container_id)
    await node.update(container_id, cpu_shares=512, memory_limit_in_bytes=1 << 30)
    await node.stop(container_id)
    await node.call("RemoveContainer", api_pb2.RemoveContainerRequest(container_id=container_id))
    await node.stop_pod(pod_id)
    await node.call("RemovePodSandbox", api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod_id))
    return pod_id, container_id


def without_ids(request: Any) -> Any:
    """A container hook's request less the container's id (pod hooks' carry no id)."""
    copy = deepcopy(request)
    if hasattr(copy, "container_meta"):
        copy.container_meta.id = ""
    return copy


def accepts_encodings(node: Node, method: str) -> list[bool]:
    """Per *method* call the runtime got, whether it carried grpcio's grpc-accept-encoding: a watched
    call carries the caller's header block, an intercepted one the relay's (which has none)."""
    return [any(name == "grpc-accept-encoding" for name, _ in block) for block in node.fake.headers(method)]


class TestLaterHooksOfAWatchedCreate:
    async def test_are_told_what_those_of_an_intercepted_create_are(self, node: Node) -> None:
        late = await node.add_plugin("late", hooks=LATER)
        await node.start_proxy()
        watched = await lifecycle(node)  # no plugin at PreRun or PreCreate: both creates watched
        await node.add_plugin("early", hooks=[HookPoint.PRE_RUN_POD_SANDBOX, HookPoint.PRE_CREATE_CONTAINER])
        intercepted = await lifecycle(node)

        if hasattr(node.proxy.hooks, "watches"):  # (on main f1593e7 every create is intercepted)
            assert [True, False] == accepts_encodings(node, "RunPodSandbox")
            assert [True, False] == accepts_encodings(node, "CreateContainer")
        assert watched != intercepted
        for point in LATER:
            first, second = late.requests(point)
            assert (point, without_ids(first)) == (point, without_ids(second))
