"""Watched calls: a CRI call with hook points whose point has no plugin and needs no hook server goes to the
runtime as the caller sent it, and the store learns what it needs from the request and the answer
(:mod:`krproxy.hooks.watched`).

The header block the fake containerd receives tells the two ways apart: a watched call carries the
caller's own (as a passthrough call does), an intercepted one the relay's (``:authority localhost``, no
``grpc-accept-encoding``).
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.fakes.containerd import Fault
from krproxy.fakes.plugin import Changes, FakePlugin
from krproxy.grpcstatus import Status
from krproxy.hooks import convert
from krproxy.hooks.points import HookPoint
from tests.integration.hooks_support import Node, container_config, make_node, pod_config
from tests.integration.test_hooks_points import container_request

#: Fields a call's header block has of its own: its method, and its deadline (what is left of it).
OWN = ("grpc-timeout", ":path")


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


def caller_fields(node: Node, method: str) -> list[tuple[str, str]]:
    """The header block of the last *method* call the runtime received, less :data:`OWN`."""
    return [field for field in node.fake.headers(method)[-1] if field[0] not in OWN]


async def passthrough_fields(node: Node) -> list[tuple[str, str]]:
    """What a passthrough call (ListContainers, no hook point) of the same client carries, less :data:`OWN`."""
    await node.call("ListContainers", api_pb2.ListContainersRequest())
    return caller_fields(node, "ListContainers")


class TestUpstreamAsSent:
    async def test_calls_without_plugins_carry_the_callers_headers(self, node: Node) -> None:
        """Every watched method (a plugin registered for PreStartContainer only does not count)."""
        await node.add_plugin("p", hooks=[HookPoint.PRE_START_CONTAINER])
        await node.start_proxy()
        pod_id, container_id = await node.pod_with_container()
        await node.stop(container_id)
        await node.call("RemoveContainer", api_pb2.RemoveContainerRequest(container_id=container_id))
        await node.stop_pod(pod_id)
        await node.call("RemovePodSandbox", api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod_id))
        caller = await passthrough_fields(node)
        assert "grpc-accept-encoding" in dict(caller)  # grpcio's, which the relay drops from its own calls

        # (The Stops of stored objects are not watched: test_hooks_watched_post_stop.)
        for method in ["RunPodSandbox", "CreateContainer", "RemoveContainer", "RemovePodSandbox"]:
            assert (method, caller) == (method, caller_fields(node, method))
        assert [node.create_request(pod_id)] == node.received("CreateContainer")

    async def test_a_plugin_at_the_point_takes_the_call(self, node: Node) -> None:
        plugin = await node.add_plugin("p", hooks=[HookPoint.PRE_CREATE_CONTAINER])
        await node.start_proxy()
        await node.pod_with_container()

        assert [container_request()] == plugin.requests(HookPoint.PRE_CREATE_CONTAINER)
        assert await passthrough_fields(node) != caller_fields(node, "CreateContainer")
        assert ("RunPodSandbox", await passthrough_fields(node)) == (
            "RunPodSandbox",
            caller_fields(node, "RunPodSandbox"),
        )

    async def test_a_call_that_runs_hooks_reads_its_request_once(
        self, node: Node, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The watch does not read a request into a record only to hand the call to the interceptor."""
        read: list[str] = []
        original = convert.container_from_wire_create

        def counted(request: Any, pod: Any) -> Any:
            read.append(request.config.metadata.name)
            return original(request, pod)

        monkeypatch.setattr(convert, "container_from_wire_create", counted)
        await node.add_plugin("p", hooks=[HookPoint.PRE_CREATE_CONTAINER])
        await node.start_proxy()
        await node.pod_with_container()

        assert ["app"] == read

    async def test_a_pod_that_skips_hooks_is_watched_despite_plugins(self, node: Node) -> None:
        await node.add_plugin("p", FakePlugin(Changes(annotations={"added": "a"})))
        await node.start_proxy()
        config = pod_config()
        config.labels["runtimeproxy.koordinator.sh/skip-hookserver"] = "true"
        pod_id = await node.run_pod(config)
        request = api_pb2.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=container_config(), sandbox_config=config
        )
        container_id = (await node.call("CreateContainer", request)).container_id

        assert await passthrough_fields(node) == caller_fields(node, "CreateContainer")
        assert [request] == node.received("CreateContainer")
        stored = node.proxy.hooks.store.get_container(container_id)
        assert stored is not None and stored.pod.has_label(
            "runtimeproxy.koordinator.sh/skip-hookserver", "true"
        )


class TestStoreLearns:
    async def test_a_watched_container_and_pod_are_stored_for_later_hooks(self, node: Node) -> None:
        """Created with no plugin registered; a plugin registered later gets the container's full record."""
        await node.start_proxy()
        pod_id, container_id = await node.pod_with_container()
        store = node.proxy.hooks.store
        assert store.get_pod(pod_id) is not None
        stored = store.get_container(container_id)
        assert stored is not None and (stored.id, stored.name, stored.pod.name) == (
            container_id,
            "app",
            "web",
        )

        plugin = await node.add_plugin("p", hooks=[HookPoint.PRE_START_CONTAINER])
        await node.start(container_id)

        assert [container_request(container_id)] == plugin.requests(HookPoint.PRE_START_CONTAINER)

    async def test_a_failed_create_stores_nothing(self, node: Node) -> None:
        await node.start_proxy()
        pod_id = await node.run_pod()
        node.fake.inject("CreateContainer", Fault(status=Status.INTERNAL, message="no space"))

        with pytest.raises(grpc.RpcError) as failed:
            await node.create_container(pod_id)

        assert (grpc.StatusCode.INTERNAL, "no space") == (failed.value.code(), failed.value.details())
        assert {} == node.proxy.hooks.store.containers()

    async def test_the_record_is_built_after_the_forward(
        self, node: Node, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A watched create's container record is read from its request once the runtime has answered, not
        between the request's arrival and its forward; a failed create reads none."""
        seen: list[int] = []  # the creates the runtime had received, at each reading
        original = convert.container_from_wire_create

        def counted(request: Any, pod: Any) -> Any:
            seen.append(len(node.received("CreateContainer")))
            return original(request, pod)

        monkeypatch.setattr(convert, "container_from_wire_create", counted)
        await node.start_proxy()
        pod_id = await node.run_pod()
        node.fake.inject("CreateContainer", Fault(status=Status.INTERNAL, message="no space"))
        with pytest.raises(grpc.RpcError):
            await node.create_container(pod_id)
        assert [] == seen

        container_id = await node.create_container(pod_id)

        assert [2] == seen
        assert node.proxy.hooks.store.get_container(container_id) is not None

    async def test_remove_forgets_the_container_once_the_runtime_did(self, node: Node) -> None:
        """Remove forgets the container only once the runtime removed it."""
        await node.start_proxy()
        _, container_id = await node.pod_with_container()
        store = node.proxy.hooks.store
        remove = api_pb2.RemoveContainerRequest(container_id=container_id)
        node.fake.inject("RemoveContainer", Fault(status=Status.INTERNAL, message="shim busy"))

        with pytest.raises(grpc.RpcError) as failed:
            await node.call("RemoveContainer", remove)
        assert grpc.StatusCode.INTERNAL == failed.value.code()
        assert store.get_container(container_id) is not None

        await node.call("RemoveContainer", remove)

        assert store.get_container(container_id) is None

    async def test_remove_pod_sandbox_forgets_the_pod_and_its_containers(self, node: Node) -> None:
        await node.start_proxy()
        pod_id, container_id = await node.pod_with_container()
        store = node.proxy.hooks.store
        assert None not in (store.get_pod(pod_id), store.get_container(container_id))

        await node.call("RemovePodSandbox", api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod_id))

        assert (None, None) == (store.get_pod(pod_id), store.get_container(container_id))


class TestStillIntercepted:
    """(A required server refusing a create where no plugin is registered at all:
    test_hooks_required.py's test_container_scoped_requirement.)"""

    async def test_a_malformed_request_is_refused_not_forwarded(self, node: Node) -> None:
        await node.start_proxy()
        call = node.client.channel.unary_unary(
            "/runtime.v1.RuntimeService/CreateContainer",
            request_serializer=lambda data: data,
            response_deserializer=api_pb2.CreateContainerResponse.FromString,
        )

        with pytest.raises(grpc.RpcError) as failed:
            await node.client.call(call, b"\x0a\x05ab")  # field 1 announces 5 bytes, 2 follow

        assert grpc.StatusCode.INTERNAL == failed.value.code()  # as grpc-go answers what Go refuses
        assert (failed.value.details() or "").startswith("grpc: error unmarshalling request:")
        assert [] == node.received("CreateContainer")
