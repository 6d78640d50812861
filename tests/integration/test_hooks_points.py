"""The seven hook points through the real proxy: what each plugin call carries, and what reaches the runtime.

A kubelet-like grpcio client drives the proxy in front of a fake containerd; a fake plugin registered
for every hook echoes (or changes) what it is sent and logs every call.
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
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.integration.hooks_support import (
    CGROUP_PARENT,
    POD_ANNOTATIONS,
    POD_LABELS,
    POD_META,
    Node,
    hook_resources,
    make_node,
    pod_config,
    pod_hook_request,
)
from tests.integration.support import in_thread

SKIP_LABEL = {"runtimeproxy.koordinator.sh/skip-hookserver": "true"}
#: The envs of container_config() as a map: the later MODE wins.
ENVS = {"PATH": "/bin", "MODE": "b"}


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


def container_request(container_id: str = "", **changes: Any) -> hookapi.ContainerResourceHookRequest:
    """What container hooks get for container_config() in pod_config(), before any plugin change."""
    fields: dict[str, Any] = {
        "pod_meta": POD_META,
        "container_meta": hookapi.ContainerMetadata(name="app", attempt=2, id=container_id),
        "container_annotations": {"io.kubernetes.container.hash": "abc"},
        "container_resources": hook_resources(),
        "pod_annotations": POD_ANNOTATIONS,
        "pod_labels": POD_LABELS,
        "pod_cgroup_parent": CGROUP_PARENT,
        "container_envs": ENVS,
    }
    return hookapi.ContainerResourceHookRequest(**{**fields, **changes})


#: The pod's labels after :func:`labelling_plugin_and_pod`'s PreRunPodSandbox.
LABELLED = {**POD_LABELS, "added": "l"}


async def labelling_plugin_and_pod(node: Node) -> tuple[FakePlugin, str]:
    """A plugin at every hook point that adds the label added=l, the proxy, and the default pod run
    through it (so stored with :data:`LABELLED`): the plugin and the pod's id."""
    plugin = await node.add_plugin("p", FakePlugin(Changes(labels={"added": "l"})))
    await node.start_proxy()
    return plugin, await node.run_pod()


class TestPodHooks:
    async def test_pre_run_pod_sandbox(self, node: Node) -> None:
        """PreRunPodSandbox gets the pod's meta, handler, labels, annotations and cgroup parent; its answer
        is merged into the RunPodSandbox request the runtime receives."""
        plugin = await node.add_plugin(
            "p",
            FakePlugin(Changes(labels={"added": "l"}, annotations={"added": "a"}, cgroup_parent="/moved")),
            [HookPoint.PRE_RUN_POD_SANDBOX],
        )
        await node.start_proxy()

        await node.run_pod()

        assert [pod_hook_request()] == plugin.requests(HookPoint.PRE_RUN_POD_SANDBOX)
        expected = api_pb2.RunPodSandboxRequest(config=pod_config(), runtime_handler="runc")
        expected.config.labels["added"] = "l"
        expected.config.annotations["added"] = "a"
        expected.config.linux.cgroup_parent = "/moved"
        assert [expected] == node.received("RunPodSandbox")

    async def test_post_stop_pod_sandbox(self, node: Node) -> None:
        """PostStopPodSandbox gets the stored pod as the pre hook left it; the pod is then dropped."""
        plugin, pod_id = await labelling_plugin_and_pod(node)

        await node.stop_pod(pod_id)

        assert [pod_hook_request(labels=LABELLED)] == plugin.requests(HookPoint.POST_STOP_POD_SANDBOX)
        assert [HookPoint.PRE_RUN_POD_SANDBOX, HookPoint.POST_STOP_POD_SANDBOX] == plugin.hooks_called()
        assert None is node.proxy.hooks.store.get_pod(pod_id)
        assert [pod_id] == [r.pod_sandbox_id for r in node.received("StopPodSandbox")]


class TestContainerHooks:
    async def test_pre_create_container(self, node: Node) -> None:
        """PreCreateContainer gets the container (no id yet), its resources, envs as a map, the sandbox's
        cgroup parent and the stored pod's labels (as PreRunPodSandbox changed them)."""
        plugin, pod_id = await labelling_plugin_and_pod(node)

        await node.create_container(pod_id)

        assert [container_request(pod_labels=LABELLED)] == plugin.requests(HookPoint.PRE_CREATE_CONTAINER)
        # An echo changes nothing: the runtime gets kubelet's request as sent (duplicate env included).
        assert [node.create_request(pod_id)] == node.received("CreateContainer")

    async def test_start_container(self, node: Node) -> None:
        """PreStartContainer then PostStartContainer get the stored container, now with its id and the
        PreCreateContainer changes; the runtime gets the StartContainer request unchanged."""
        plugin = await node.add_plugin("p", FakePlugin(Changes(envs={"ADDED": "1"}, cpu_quota=50_000)))
        await node.start_proxy()
        _, container_id = await node.pod_with_container()

        await node.start(container_id)

        expected = container_request(
            container_id,
            container_resources=hook_resources(cpu_quota=50_000),
            container_envs={**ENVS, "ADDED": "1"},
        )
        assert [expected] == plugin.requests(HookPoint.PRE_START_CONTAINER)
        assert [expected] == plugin.requests(HookPoint.POST_START_CONTAINER)
        assert [
            HookPoint.PRE_RUN_POD_SANDBOX,
            HookPoint.PRE_CREATE_CONTAINER,
            HookPoint.PRE_START_CONTAINER,
            HookPoint.POST_START_CONTAINER,
        ] == plugin.hooks_called()
        assert [api_pb2.StartContainerRequest(container_id=container_id)] == node.received("StartContainer")

    async def test_pre_start_answer_updates_the_store(self, node: Node) -> None:
        """What PreStartContainer answers is what later hooks of the container see."""
        plugin = FakePlugin()
        plugin.answer(HookPoint.PRE_START_CONTAINER, Changes(annotations={"started": "yes"}).answer)
        await node.add_plugin("p", plugin)
        await node.start_proxy()
        _, container_id = await node.pod_with_container()
        await node.start(container_id)

        await node.stop(container_id)

        [request] = plugin.requests(HookPoint.POST_STOP_CONTAINER)
        assert {"io.kubernetes.container.hash": "abc", "started": "yes"} == request.container_annotations

    async def test_post_stop_container(self, node: Node) -> None:
        """PostStopContainer gets the stored container; then it is dropped from the store."""
        plugin = await node.add_plugin("p", hooks=[HookPoint.POST_STOP_CONTAINER])
        await node.start_proxy()
        _, container_id = await node.pod_with_container()
        await node.start(container_id)

        await node.stop(container_id)

        assert [container_request(container_id)] == plugin.requests(HookPoint.POST_STOP_CONTAINER)
        assert None is node.proxy.hooks.store.get_container(container_id)
        assert [container_id] == [r.container_id for r in node.received("StopContainer")]

    async def test_pre_update_container_resources(self, node: Node) -> None:
        """PreUpdateContainerResources gets the stored resources with the request's merged in (positive
        values and non-empty cpusets win; oom_score_adj is not taken from the request)."""
        plugin = await node.add_plugin("p", hooks=[HookPoint.PRE_UPDATE_CONTAINER_RESOURCES])
        await node.start_proxy()
        _, container_id = await node.pod_with_container()

        await node.update(container_id, cpu_quota=300_000, cpu_shares=0, oom_score_adj=-5, cpuset_mems="")

        assert [container_request(container_id, container_resources=hook_resources(cpu_quota=300_000))] == (
            plugin.requests(HookPoint.PRE_UPDATE_CONTAINER_RESOURCES)
        )
        # The echo changed nothing: the request goes to the runtime as kubelet sent it.
        [received] = node.received("UpdateContainerResources")
        assert api_pb2.LinuxContainerResources(cpu_quota=300_000, oom_score_adj=-5) == received.linux


class TestSkipLabel:
    async def test_skip_label_bypasses_every_hook(self, node: Node) -> None:
        """A pod labelled skip-hookserver=true gets no hook at all, its requests reach the runtime
        unchanged, and the store still tracks the pod and its container."""
        plugin = await node.add_plugin("p", FakePlugin(Changes(labels={"x": "y"}, cpu_quota=1)))
        await node.start_proxy()
        config = pod_config(labels={**POD_LABELS, **SKIP_LABEL})
        pod_id = await node.run_pod(config)
        container_id = await node.create_container(pod_id)

        assert None is not node.proxy.hooks.store.get_pod(pod_id)
        assert container_id == node.proxy.hooks.store.containers()[container_id].id
        await node.start(container_id)
        await node.update(container_id, cpu_quota=5)
        await node.stop(container_id)
        await node.stop_pod(pod_id)

        assert [] == plugin.calls
        assert [api_pb2.RunPodSandboxRequest(config=config, runtime_handler="runc")] == node.received(
            "RunPodSandbox"
        )
        assert [node.create_request(pod_id)] == node.received("CreateContainer")
        assert None is node.proxy.hooks.store.get_pod(pod_id)

    async def test_skip_label_needs_the_exact_value(self, node: Node) -> None:
        """skip-hookserver=false does not opt out."""
        plugin = await node.add_plugin("p", hooks=[HookPoint.PRE_RUN_POD_SANDBOX])
        await node.start_proxy()

        await node.run_pod(pod_config(labels={"runtimeproxy.koordinator.sh/skip-hookserver": "false"}))

        assert [HookPoint.PRE_RUN_POD_SANDBOX] == plugin.hooks_called()

    async def test_configured_skip_label(self, node: Node) -> None:
        """The skip label's key and value come from the proxy's configuration."""
        plugin = await node.add_plugin("p")
        await node.start_proxy(skip_label=("example.com/no-hooks", "yes"))

        pod_id = await node.run_pod(pod_config(labels={"example.com/no-hooks": "yes"}))
        await node.create_container(pod_id)

        assert [] == plugin.calls


class TestRetriedStop:
    """A Stop the runtime failed keeps its store entry, so kubelet's retry still reaches the PostStop hooks;
    a Stop or Remove of an object the runtime no longer has (NOT_FOUND) drops it."""

    async def test_retried_stop_container_post_stop_has_full_record(self, node: Node) -> None:
        """Retried stop container runs post stop with the full record."""
        plugin = await node.add_plugin("p", hooks=[HookPoint.POST_STOP_CONTAINER])
        await node.start_proxy()
        _, container_id = await node.pod_with_container()
        await node.start(container_id)
        node.fake.inject("StopContainer", Fault(status=Status.INTERNAL, message="shim busy"))

        with pytest.raises(grpc.RpcError) as failed:
            await node.stop(container_id)
        assert grpc.StatusCode.INTERNAL == failed.value.code()
        assert None is not node.proxy.hooks.store.get_container(container_id)

        await node.stop(container_id)  # kubelet's retry; the runtime now succeeds

        assert [container_request(container_id)] * 2 == plugin.requests(HookPoint.POST_STOP_CONTAINER)
        assert None is node.proxy.hooks.store.get_container(container_id)
        assert 2 == len(node.received("StopContainer"))

    async def test_retried_stop_pod_sandbox_post_stop_has_full_record(self, node: Node) -> None:
        """Retried stop pod sandbox runs post stop with the full record."""
        plugin = await node.add_plugin("p", hooks=[HookPoint.POST_STOP_POD_SANDBOX])
        await node.start_proxy()
        pod_id = await node.run_pod()
        node.fake.inject("StopPodSandbox", Fault(status=Status.UNAVAILABLE, message="network teardown"))

        with pytest.raises(grpc.RpcError):
            await node.stop_pod(pod_id)
        assert None is not node.proxy.hooks.store.get_pod(pod_id)

        await node.stop_pod(pod_id)

        expected = pod_hook_request()
        assert [expected] * 2 == plugin.requests(HookPoint.POST_STOP_POD_SANDBOX)
        assert None is node.proxy.hooks.store.get_pod(pod_id)

    async def test_abandoned_stop_runs_post_stop_once_at_the_retry(self, node: Node) -> None:
        """kubelet's deadline passes while the runtime stops the container: no PostStop then (nobody waits
        for it), the entry stays, and the retry that works runs PostStopContainer once and drops it."""
        plugin = await node.add_plugin("p", hooks=[HookPoint.POST_STOP_CONTAINER])
        await node.start_proxy()
        _, container_id = await node.pod_with_container()
        await node.start(container_id)
        node.fake.inject("StopContainer", Fault(delay=1.0))

        with pytest.raises(grpc.RpcError) as failed:
            await in_thread(
                node.client.runtime.StopContainer,
                api_pb2.StopContainerRequest(container_id=container_id, timeout=0),
                timeout=0.2,
            )
        assert grpc.StatusCode.DEADLINE_EXCEEDED == failed.value.code()
        await trio.sleep(0.3)
        assert ([], True) == (
            plugin.requests(HookPoint.POST_STOP_CONTAINER),
            node.proxy.hooks.store.get_container(container_id) is not None,
        )

        await node.stop(container_id)

        assert [container_request(container_id)] == plugin.requests(HookPoint.POST_STOP_CONTAINER)
        assert None is node.proxy.hooks.store.get_container(container_id)

    async def test_stop_of_a_container_the_runtime_lost_drops_it(self, node: Node) -> None:
        """NOT_FOUND: the object is gone, no retry will need its record."""
        plugin = await node.add_plugin("p", hooks=[HookPoint.POST_STOP_CONTAINER])
        await node.start_proxy()
        pod_id, container_id = await node.pod_with_container()
        node.fake.inject("StopContainer", Fault(status=Status.NOT_FOUND, message="not found"))
        node.fake.inject("StopPodSandbox", Fault(status=Status.NOT_FOUND, message="not found"))

        for stop in (node.stop(container_id), node.stop_pod(pod_id)):
            with pytest.raises(grpc.RpcError) as failed:
                await stop
            assert grpc.StatusCode.NOT_FOUND == failed.value.code()

        assert [container_request(container_id)] == plugin.requests(HookPoint.POST_STOP_CONTAINER)
        assert None is node.proxy.hooks.store.get_container(container_id)
        assert None is node.proxy.hooks.store.get_pod(pod_id)

    async def test_stop_pod_sandbox_not_found_drops_its_containers(self, node: Node) -> None:
        """A sandbox the runtime no longer has took its containers with it (RemovePodSandbox removes them
        first), and kubelet will send no RemoveContainer for containers the runtime does not list: their
        records go with the pod's, as after RemovePodSandbox. A successful Stop keeps them (the containers
        still exist until the pod is removed)."""
        await node.start_proxy()
        store = node.proxy.hooks.store
        stopped_pod = await node.run_pod(pod_config("db"))
        stopped_container = await node.create_container(stopped_pod)
        await node.stop_pod(stopped_pod)
        assert store.get_container(stopped_container) is not None
        pod_id, container_id = await node.pod_with_container()
        node.fake.inject("StopPodSandbox", Fault(status=Status.NOT_FOUND, message="not found"))

        with pytest.raises(grpc.RpcError) as failed:
            await node.stop_pod(pod_id)

        assert grpc.StatusCode.NOT_FOUND == failed.value.code()
        assert (None, None) == (store.get_pod(pod_id), store.get_container(container_id))
        assert store.get_container(stopped_container) is not None

    async def test_failed_remove_keeps_and_not_found_remove_drops(self, node: Node) -> None:
        """Remove*: the same rule. A failed RemoveContainer/RemovePodSandbox keeps the entries (a later
        Stop of them still runs its hooks); NOT_FOUND drops them."""
        await node.start_proxy()
        pod_id, container_id = await node.pod_with_container()
        store = node.proxy.hooks.store
        remove_container = api_pb2.RemoveContainerRequest(container_id=container_id)
        remove_pod = api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod_id)
        node.fake.inject("RemoveContainer", Fault(status=Status.INTERNAL, message="busy"))
        node.fake.inject("RemovePodSandbox", Fault(status=Status.INTERNAL, message="busy"))

        for method, request in (("RemoveContainer", remove_container), ("RemovePodSandbox", remove_pod)):
            with pytest.raises(grpc.RpcError):
                await node.call(method, request)
        assert (True, True) == (
            store.get_container(container_id) is not None,
            store.get_pod(pod_id) is not None,
        )

        node.fake.inject("RemoveContainer", Fault(status=Status.NOT_FOUND, message="gone"))
        node.fake.inject("RemovePodSandbox", Fault(status=Status.NOT_FOUND, message="gone"))
        for method, request in (("RemoveContainer", remove_container), ("RemovePodSandbox", remove_pod)):
            with pytest.raises(grpc.RpcError):
                await node.call(method, request)
        assert (None, None) == (store.get_container(container_id), store.get_pod(pod_id))
