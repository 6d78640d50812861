"""Ids through the proxy as containerd reads them: a unique prefix is the object, an empty or ambiguous id refused.

containerd (and the fake, for a unique prefix) resolves a pod or container id prefix; the proxy must do the same
before hooks, required servers and the store look at the id: a 12-character prefix of a stored container runs
its hooks (with the full id), is held by a required server that is absent, is sent on as the full id, and a
Stop or Remove by prefix drops the store entry. An empty id, or a prefix two stored ids share, is refused with
containerd's UNKNOWN before any hook or forward.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.fakes.plugin import FakePlugin
from krproxy.hooks.points import HookPoint
from krproxy.hooks.required import Requirements, parse_required_server
from tests.integration.hooks_support import Node, container_config, make_node, pod_config, refused

#: Every hook point a call by an existing object's id reaches (CreateContainer's is by its pod's id).
BY_ID = (
    "PreStartContainer,PostStartContainer,PreUpdateContainerResources,PostStopContainer,"
    "PostStopPodSandbox,PreUpdatePodSandboxResources,PreCreateContainer"
)
PREFIX = 12


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


def required(points: str = BY_ID) -> Requirements:
    return Requirements((parse_required_server(f"limits={points}"),), startup_grace=0.0)


def by_id(node: Node, method: str, ident: str) -> Any:
    """The request of *method* naming *ident* (a container's, or for the pod methods and CreateContainer a pod's)."""
    if method == "StartContainer":
        return api_pb2.StartContainerRequest(container_id=ident)
    if method == "StopContainer":
        return api_pb2.StopContainerRequest(container_id=ident, timeout=0)
    if method == "UpdateContainerResources":
        return api_pb2.UpdateContainerResourcesRequest(
            container_id=ident, linux=api_pb2.LinuxContainerResources(cpu_shares=512)
        )
    if method == "StopPodSandbox":
        return api_pb2.StopPodSandboxRequest(pod_sandbox_id=ident)
    if method == "UpdatePodSandboxResources":
        return api_pb2.UpdatePodSandboxResourcesRequest(
            pod_sandbox_id=ident, resources=api_pb2.LinuxContainerResources(cpu_shares=512)
        )
    if method == "CreateContainer":  # with its pod's own config, as kubelet sends it (the pod named in full)
        request = node.create_request(ident, container_config("by-pod-id"))
        named = [p for i, p in node.fake.state.sandboxes.items() if ident and i.startswith(ident)]
        if len(named) == 1:  # (an empty or ambiguous id names none)
            pod = named[0]
            request.sandbox_config.metadata.CopyFrom(
                api_pb2.PodSandboxMetadata(name=pod.name, uid=pod.uid, namespace=pod.namespace)
            )
        return request
    raise AssertionError(method)


CONTAINER_METHODS = ["StartContainer", "StopContainer", "UpdateContainerResources"]
POD_METHODS = ["StopPodSandbox", "UpdatePodSandboxResources", "CreateContainer"]
HOOKED_METHODS = CONTAINER_METHODS + POD_METHODS


async def send(node: Node, method: str, request: Any) -> None:
    if method == "UpdatePodSandboxResources":
        await node.update_pod(request)
    else:
        await node.call(method, request)


def target(method: str, pod_id: str, container_id: str) -> str:
    return container_id if method in CONTAINER_METHODS else pod_id


def sent_id(node: Node, method: str) -> list[str]:
    """The id field of every *method* request the fake containerd got."""
    field = "container_id" if method in CONTAINER_METHODS else "pod_sandbox_id"
    return [getattr(request, field) for request in node.received(method)]


@pytest.mark.parametrize("method", HOOKED_METHODS)
async def test_prefix_is_held_by_an_absent_required_server(node: Node, method: str) -> None:
    """With the required server ``limits`` absent, a call naming a stored object by a 12-character prefix is
    refused UNAVAILABLE as its full id is, and nothing reaches the runtime (before: the prefix found no
    record, so no hook was needed, and the runtime started the container)."""
    [container_id] = node.fake.seed(1, 1)  # recovered into the store as the proxy starts
    pod_id = node.fake.state.containers[container_id].pod_sandbox_id
    await node.start_proxy(requirements=required())
    ident = target(method, pod_id, container_id)

    details = await refused(node, method, by_id(node, method, ident[:PREFIX]), grpc.StatusCode.UNAVAILABLE)

    assert "required hook server limits" in details, details
    await refused(node, method, by_id(node, method, ident), grpc.StatusCode.UNAVAILABLE)


@pytest.mark.parametrize("method", HOOKED_METHODS)
async def test_prefix_runs_the_hooks_of_the_full_id(node: Node, method: str) -> None:
    """With a plugin at every point, a call by prefix runs the same hooks as by full id, on the stored record
    (the hook request names the full id), and the runtime is sent the full id."""
    plugin = await node.add_plugin("limits", FakePlugin())
    await node.start_proxy(requirements=required())
    pod_id, container_id = await node.pod_with_container()
    if method == "StopPodSandbox":  # the full id's hooks, for comparison, on a pod of their own
        other = await node.run_pod(pod_config("other"))
    ident = target(method, pod_id, container_id)
    node.fake.clear_requests()
    plugin.calls.clear()

    if method == "StopPodSandbox":
        await send(node, method, by_id(node, method, other))
        by_full = plugin.hooks_called()
        plugin.calls.clear()
    else:
        by_full = None
    await send(node, method, by_id(node, method, ident[:PREFIX]))

    hooks = plugin.hooks_called()
    assert hooks, f"no hook ran for {method} by prefix"
    if by_full is not None:
        assert by_full == hooks
    if method in ("StartContainer", "UpdateContainerResources", "StopContainer"):
        [request, *_] = plugin.calls
        assert container_id == request.request.container_meta.id
    assert [ident] == sent_id(node, method)[-1:]


@pytest.mark.parametrize("hooked", [True, False], ids=["interceptor", "watched"])
async def test_stop_and_remove_by_prefix_drop_the_entry(node: Node, hooked: bool) -> None:
    """StopContainer, RemoveContainer and RemovePodSandbox by prefix drop what the full id would, with a plugin
    (the interceptors) and without (the watches): no entry stays until restart."""
    if hooked:
        await node.add_plugin("limits", FakePlugin())
    await node.start_proxy()
    store = node.proxy.hooks.store
    pod_id, container_id = await node.pod_with_container()
    second = await node.create_container(pod_id, container_config("second"))

    await node.stop(container_id[:PREFIX])
    assert store.get_container(container_id) is None
    await node.call("RemoveContainer", api_pb2.RemoveContainerRequest(container_id=container_id[:PREFIX]))
    assert second in store.containers()

    await node.call("RemovePodSandbox", api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod_id[:PREFIX]))
    assert ({}, {}) == (store.pods(), store.containers())


@pytest.mark.parametrize("hooked", [True, False], ids=["interceptor", "watched"])
async def test_create_by_pod_prefix_stores_the_full_pod_id(node: Node, hooked: bool) -> None:
    """A container created with its pod's id prefix is stored under that pod's full id, so that removing the
    pod drops it; the pod's stored record (its labels) is the one its hooks get."""
    plugin = (
        await node.add_plugin("limits", FakePlugin(), hooks=[HookPoint.PRE_CREATE_CONTAINER])
        if hooked
        else None
    )
    await node.start_proxy()
    store = node.proxy.hooks.store
    pod_id = await node.run_pod()

    container_id = await node.create_container(pod_id[:PREFIX])

    stored = store.get_container(container_id)
    assert stored is not None and pod_id == stored.pod_sandbox_id
    if plugin is not None:
        [request] = plugin.requests(HookPoint.PRE_CREATE_CONTAINER)
        assert store.get_pod(pod_id) is not None
        assert dict(store.get_pod(pod_id).labels) == dict(request.pod_labels)  # type: ignore[union-attr]
    await node.call("RemovePodSandbox", api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod_id))
    assert store.get_container(container_id) is None


async def containers_sharing_a_prefix(node: Node, pod_id: str) -> tuple[str, list[str]]:
    """Create containers in *pod_id* until two share a first character; that shared prefix and every id."""
    ids: list[str] = []
    while True:
        ids.append(await node.create_container(pod_id, container_config(f"c{len(ids)}")))
        firsts = [i[0] for i in ids]
        shared = next((c for c in firsts if firsts.count(c) > 1), None)
        if shared is not None:
            pair = [i for i in ids if i[0] == shared]
            length = next(n for n in range(64) if pair[0][n] != pair[1][n])
            return pair[0][:length], ids


async def pods_sharing_a_prefix(node: Node) -> str:
    ids: list[str] = []
    while True:
        ids.append(await node.run_pod(pod_config(f"p{len(ids)}")))
        firsts = [i[0] for i in ids]
        shared = next((c for c in firsts if firsts.count(c) > 1), None)
        if shared is not None:
            pair = [i for i in ids if i[0] == shared]
            length = next(n for n in range(64) if pair[0][n] != pair[1][n])
            return pair[0][:length]


EMPTY = "prefix can't be empty"


@pytest.mark.parametrize("method", HOOKED_METHODS)
@pytest.mark.parametrize("case", ["empty", "ambiguous"])
async def test_empty_or_ambiguous_id_is_refused_as_containerd(node: Node, method: str, case: str) -> None:
    """An empty id, or a prefix of two stored ids, is refused UNKNOWN with containerd's message (the fake
    answers NOT_FOUND), before any hook and with nothing forwarded."""
    plugin = await node.add_plugin("limits", FakePlugin())
    await node.start_proxy()
    pod_id = await node.run_pod()
    if case == "empty":
        ident = ""
    elif method in CONTAINER_METHODS:
        ident, _ = await containers_sharing_a_prefix(node, pod_id)
    else:
        ident = await pods_sharing_a_prefix(node)
    plugin.calls.clear()

    details = await refused(node, method, by_id(node, method, ident), grpc.StatusCode.UNKNOWN)

    reason = EMPTY if case == "empty" else f"Multiple IDs found with provided prefix: {ident}"
    assert details.endswith(f": {reason}"), details
    assert [] == plugin.hooks_called()


async def test_remove_of_an_ambiguous_id_is_the_runtimes_to_answer(node: Node) -> None:
    """A Remove has no hook point: an ambiguous id goes to the runtime as sent, its answer comes back, and the
    store drops none of the containers it might have named."""
    await node.start_proxy()
    store = node.proxy.hooks.store
    pod_id = await node.run_pod()
    ident, ids = await containers_sharing_a_prefix(node, pod_id)

    # The fake, as containerd, answers UNKNOWN "Multiple IDs found with provided prefix".
    with pytest.raises(grpc.RpcError) as caught:
        await node.call("RemoveContainer", api_pb2.RemoveContainerRequest(container_id=ident))
    assert grpc.StatusCode.UNKNOWN == caught.value.code()
    assert "Multiple IDs found" in caught.value.details()

    assert [ident] == [r.container_id for r in node.received("RemoveContainer")]
    assert set(ids) <= set(store.containers())
