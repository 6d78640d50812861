"""Store recovery after a proxy restart: pods and containers already running in the runtime get their hooks
with what the proxy could recover from it (ListPodSandbox/ListContainers + status calls).

What the fake containerd reports, and so what can be recovered from it: metadata, labels, annotations and
runtime handler of pods; metadata, annotations and ``ContainerStatus.resources.linux`` (the resources of
the last create/update) of containers. It sends no verbose ``info``, so the pod cgroup parent and the
container envs are not recoverable from it (real containerd reports both in verbose info).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import trio

from fakes.containerd import FakeContainerd, run_fake_containerd
from fakes.plugin import Changes, FakePlugin
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.integration.hooks_support import (
    POD_ANNOTATIONS,
    POD_LABELS,
    Node,
    hook_resources,
    make_node,
    pod_config,
)

pytestmark = pytest.mark.usefixtures("aio_loop")


@pytest.fixture
async def node(
    aio_loop: Any, nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any
) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


class TestRestart:
    async def test_hooks_after_restart_use_recovered_records(self, node: Node) -> None:
        """A pod and container created through a first proxy (with plugin changes) are recovered by a
        second one; Start/Update/Stop on them drive hooks with the recovered labels, annotations and
        resources as the runtime got them."""
        plugin = await node.add_plugin(
            "p",
            FakePlugin(Changes(labels={"added": "l"}, cpu_quota=-1, cpuset_cpus="2-3", envs={"GPU": "0"})),
        )
        await node.start_proxy()
        pod_id, container_id = await node.pod_with_container()
        await node.stop_proxy()
        plugin.calls.clear()

        # A new socket path: see TestRestartOnTheSameSocket for why not the same one.
        await node.start_proxy(socket_name="proxy-2.sock")
        await node.start(container_id)
        await node.update(container_id, cpu_shares=4096)
        await node.stop(container_id)
        await node.stop_pod(pod_id)

        assert 1.0 == node.proxy.metrics.registry.get_sample_value("krproxy_store_recovered")
        expected = hookapi.ContainerResourceHookRequest(
            pod_meta=hookapi.PodSandboxMetadata(name="web", uid="uid-web", namespace="prod", attempt=1),
            container_meta=hookapi.ContainerMetadata(name="app", attempt=2, id=container_id),
            container_annotations={"io.kubernetes.container.hash": "abc"},
            container_resources=hook_resources(cpu_quota=-1, cpuset_cpus="2-3"),
            pod_annotations=POD_ANNOTATIONS,
            pod_labels={**POD_LABELS, "added": "l"},
            # Not recoverable from the fake (no verbose info): the pod cgroup parent and the envs.
            pod_cgroup_parent="",
            container_envs={},
        )
        assert [expected] == plugin.requests(HookPoint.PRE_START_CONTAINER)
        # PreStartContainer's answer (the plugin adds GPU=0) is stored: the later hooks see it.
        after_start = hookapi.ContainerResourceHookRequest.FromString(bytes(expected.SerializeToString()))
        after_start.container_envs = {"GPU": "0"}
        assert [after_start] == plugin.requests(HookPoint.POST_START_CONTAINER)
        [update] = plugin.requests(HookPoint.PRE_UPDATE_CONTAINER_RESOURCES)
        assert hook_resources(cpu_quota=-1, cpuset_cpus="2-3", cpu_shares=4096) == update.container_resources
        [stopped] = plugin.requests(HookPoint.POST_STOP_CONTAINER)
        assert container_id == stopped.container_meta.id
        [pod] = plugin.requests(HookPoint.POST_STOP_POD_SANDBOX)
        assert (
            hookapi.PodSandboxHookRequest(
                pod_meta=expected.pod_meta,
                runtime_handler="runc",
                labels={**POD_LABELS, "added": "l"},
                annotations=POD_ANNOTATIONS,
            )
            == pod
        )

    async def test_seeded_containers_are_recovered(self, node: Node) -> None:
        """Containers the proxy never saw (seeded into the runtime) get hooks with the runtime's view."""
        [first, _] = node.fake.seed(2, 1)
        plugin = await node.add_plugin("p", hooks=[HookPoint.PRE_UPDATE_CONTAINER_RESOURCES])
        await node.start_proxy()

        await node.update(first, cpu_shares=1024)

        assert 2 == len(node.proxy.hooks.store.containers())
        assert 2 == len(node.proxy.hooks.store.pods())
        [request] = plugin.requests(HookPoint.PRE_UPDATE_CONTAINER_RESOURCES)
        assert (
            hookapi.LinuxContainerResources(
                cpu_period=100_000, cpu_quota=50_000, cpu_shares=1024, memory_limit_in_bytes=256 << 20
            )
            == request.container_resources
        )
        assert "seed-pod-00000" == request.pod_meta.name
        assert "app-0" == request.container_meta.name
        assert "seed-app-00" == request.pod_labels["app"]

    async def test_runtime_down_delays_recovery(self, node: Node, sockdir: str) -> None:
        """A proxy started before its runtime serves: a hook-carrying call waits, recovery retries, and
        once the runtime is up the store is rebuilt and the waiting call goes through with its hook."""
        late = os.path.join(sockdir, "late.sock")
        fake = FakeContainerd()
        [container_id] = fake.seed(1, 1)
        plugin = await node.add_plugin("p", hooks=[HookPoint.POST_STOP_CONTAINER])
        await node.start_proxy(runtime_endpoint=late, wait_recovered=False)
        done = trio.Event()

        async def stop() -> None:
            await node.stop(container_id)
            done.set()

        node.nursery.start_soon(stop)
        await trio.sleep(0.3)
        assert not node.proxy.hooks.recovered
        assert not done.is_set()

        await node.nursery.start(run_fake_containerd, late, fake)
        with trio.fail_after(3):
            await done.wait()

        assert node.proxy.hooks.recovered
        assert [HookPoint.POST_STOP_CONTAINER] == plugin.hooks_called()
        assert container_id == plugin.calls[0].request.container_meta.id


class TestRestartOnTheSameSocket:
    async def test_client_reaches_the_restarted_proxy(self, node: Node) -> None:
        """After a graceful stop and a restart on the same socket, a new client reaches the new proxy."""
        await node.start_proxy()
        await node.run_pod()
        await node.stop_proxy()
        await node.start_proxy()

        await node.run_pod(pod_config("second"))
