"""Plugins changing requests: chains of plugins in order, a koordlet-style plugin, and resource merges,
checked on the exact requests the fake containerd finally receives."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.fakes.plugin import Changes, FakePlugin
from krproxy.hooks.points import HookPoint
from krproxy.hookserver.testing import logged_events
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.integration.hooks_support import RESOURCES, Node, hook_resources, make_node

CREATE = HookPoint.PRE_CREATE_CONTAINER


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


def tagging(tag: str, log: list[str], **changes: Any) -> FakePlugin:
    """A plugin that appends *tag* to *log* when called and adds annotation ``by-<tag>`` plus *changes*."""
    changed = Changes(annotations={f"by-{tag}": "1"}, **changes)

    def answer(request: Any) -> Any:
        log.append(tag)
        return changed.answer(request)

    return FakePlugin(answers={point: answer for point in HookPoint})


class TestChain:
    async def test_second_plugin_sees_the_first_ones_changes(self, node: Node) -> None:
        """Two plugins on one hook run in file-name order; the second gets the request as the first left
        it, and the runtime gets both changes, the later one winning on conflicts."""
        log: list[str] = []
        first = await node.add_plugin(
            "10-first", tagging("first", log, cpu_quota=111, cpu_shares=7), [CREATE]
        )
        second = await node.add_plugin("20-second", tagging("second", log, cpu_quota=222), [CREATE])
        await node.start_proxy()
        pod_id = await node.run_pod()

        await node.create_container(pod_id)

        assert ["first", "second"] == log
        [seen_by_first] = first.requests(CREATE)
        [seen_by_second] = second.requests(CREATE)
        assert "by-first" not in seen_by_first.container_annotations
        assert "1" == seen_by_second.container_annotations["by-first"]
        assert hook_resources(cpu_quota=111, cpu_shares=7) == seen_by_second.container_resources
        [received] = node.received("CreateContainer")
        assert {"io.kubernetes.container.hash": "abc", "by-first": "1", "by-second": "1"} == dict(
            received.config.annotations
        )
        assert 222 == received.config.linux.resources.cpu_quota
        assert 7 == received.config.linux.resources.cpu_shares

    async def test_echoing_plugins_all_get_the_same_request(self, node: Node) -> None:
        """Plugins that change nothing pass the request on as it was: the later ones get the very bytes the
        first one got, and the runtime gets kubelet's request."""
        plugins = [await node.add_plugin(name, FakePlugin(), [CREATE]) for name in ("a", "b", "c")]
        await node.start_proxy()
        pod_id = await node.run_pod()

        await node.create_container(pod_id)

        [first], [second], [third] = ([c.message for c in p.calls] for p in plugins)
        assert first == second == third
        assert [node.create_request(pod_id)] == node.received("CreateContainer")

    async def test_order_key_before_file_name(self, node: Node) -> None:
        """A lower "order" runs first whatever the file names; equal orders fall back to file names."""
        log: list[str] = []
        await node.add_plugin("a", tagging("a", log), [CREATE], order=10)
        await node.add_plugin("b", tagging("b", log), [CREATE], order=-1)
        await node.add_plugin("c", tagging("c", log), [CREATE], order=10)
        await node.start_proxy()
        pod_id = await node.run_pod()

        await node.create_container(pod_id)

        assert ["b", "a", "c"] == log
        assert ["b.json", "a.json", "c.json"] == node.registered()

    async def test_pod_hooks_chain_too(self, node: Node) -> None:
        """PreRunPodSandbox answers chain: labels of both plugins, the later cgroup parent."""
        log: list[str] = []
        await node.add_plugin("a", tagging("a", log, labels={"a": "1"}, cgroup_parent="/a"))
        await node.add_plugin("b", tagging("b", log, labels={"b": "1"}, cgroup_parent="/b"))
        await node.start_proxy()

        await node.run_pod()

        [received] = node.received("RunPodSandbox")
        assert {"a": "1", "b": "1"}.items() <= dict(received.config.labels).items()
        assert "/b" == received.config.linux.cgroup_parent

    async def test_every_plugin_is_called_on_every_hook(self, node: Node) -> None:
        """Unlike the reference (one random plugin per hook), both plugins get all eight hooks."""
        first = await node.add_plugin("a")
        second = await node.add_plugin("b")
        await node.start_proxy()
        pod_id, container_id = await node.pod_with_container()
        await node.start(container_id)
        await node.update(container_id, cpu_shares=10)
        resources = api_pb2.LinuxContainerResources(cpu_shares=20)
        await node.update_pod(
            api_pb2.UpdatePodSandboxResourcesRequest(pod_sandbox_id=pod_id, resources=resources)
        )
        await node.stop(container_id)
        await node.stop_pod(pod_id)

        assert set(HookPoint) == set(first.hooks_called()) == set(second.hooks_called())
        assert 8 == len(first.calls) == len(second.calls)


class TestKoordletStyle:
    async def test_echo_plus_cpuset_quota_and_env(self, node: Node) -> None:
        """A plugin that echoes the request and sets cpuset, cfs quota −1 and an env, as koordlet's cpuset
        and GPU hooks do, yields exactly this CreateContainer request at the runtime."""
        await node.add_plugin(
            "koordlet", FakePlugin(Changes(cpuset_cpus="2-3", cpu_quota=-1, envs={"GPU": "0"}))
        )
        await node.start_proxy()
        pod_id = await node.run_pod()

        await node.create_container(pod_id)

        expected = node.create_request(pod_id)
        expected.config.linux.resources.cpuset_cpus = "2-3"
        expected.config.linux.resources.cpu_quota = -1
        del expected.config.envs[:]
        # Envs are rebuilt from the map: the duplicated MODE collapses to its last value, added names follow.
        expected.config.envs.extend(
            [
                api_pb2.KeyValue(key="PATH", value="/bin"),
                api_pb2.KeyValue(key="MODE", value="b"),
                api_pb2.KeyValue(key="GPU", value="0"),
            ]
        )
        assert [expected] == node.received("CreateContainer")

    async def test_answer_without_echo_clears_cpusets_and_oom_score_adj(self, node: Node) -> None:
        """Koordinator's always-overwrite rule: empty resources in the answer reset cpusets and
        oom_score_adj, while zero quota/shares/limits keep the request's values."""
        plugin = FakePlugin()
        plugin.answer(
            CREATE,
            hookapi.ContainerResourceHookResponse(container_resources=hookapi.LinuxContainerResources()),
        )
        await node.add_plugin("bare", plugin, [CREATE])
        await node.start_proxy()
        pod_id = await node.run_pod()

        await node.create_container(pod_id)

        [received] = node.received("CreateContainer")
        expected = api_pb2.LinuxContainerResources(
            **{**RESOURCES, "cpuset_cpus": "", "cpuset_mems": "", "oom_score_adj": 0}
        )
        assert expected == received.config.linux.resources


class TestUpdateContainerResources:
    async def test_plugin_answer_merged_into_the_update(self, node: Node) -> None:
        """kubelet's update is merged into the stored resources, the plugin's answer on top; the runtime
        gets the whole merged set, and the store keeps it for the next update's hook."""
        plugin = FakePlugin()
        plugin.answer(HookPoint.PRE_UPDATE_CONTAINER_RESOURCES, Changes(cpu_quota=-1, cpuset_cpus="1").answer)
        await node.add_plugin("p", plugin, [HookPoint.PRE_UPDATE_CONTAINER_RESOURCES])
        await node.start_proxy()
        _, container_id = await node.pod_with_container()

        await node.update(container_id, cpu_shares=4096, memory_limit_in_bytes=2 << 30)
        await node.update(container_id, cpu_period=50_000)

        first, second = node.received("UpdateContainerResources")
        merged = {**RESOURCES, "cpu_shares": 4096, "memory_limit_in_bytes": 2 << 30}
        assert (
            api_pb2.LinuxContainerResources(**{**merged, "cpu_quota": -1, "cpuset_cpus": "1"}) == first.linux
        )
        assert {"io.kubernetes.container.hash": "abc"} == dict(first.annotations)
        [_, seen] = plugin.requests(HookPoint.PRE_UPDATE_CONTAINER_RESOURCES)
        assert (
            hook_resources(**{**merged, "cpu_quota": -1, "cpuset_cpus": "1", "cpu_period": 50_000})
            == seen.container_resources
        )
        # The plugin's answer equals the stored record it was sent, so nothing changed: kubelet's own
        # request is forwarded (containerd ignores zero fields, so its resources stay as merged).
        assert api_pb2.LinuxContainerResources(cpu_period=50_000) == second.linux


class TestDebugLog:
    async def test_a_line_per_call_and_per_plugin_call(
        self, node: Node, caplog: pytest.LogCaptureFixture
    ) -> None:
        """At debug level (``krproxy serve --log-level debug``) the proxy logs each CRI call it relayed
        and each plugin call with its result and the fields it changed; at info level neither."""
        await node.add_plugin("10-first", tagging("first", [], cpu_quota=111), [CREATE])
        await node.start_proxy()
        with caplog.at_level(logging.INFO):
            pod_id = await node.run_pod()
        assert [] == logged_events(caplog.records, "call")
        with caplog.at_level(logging.DEBUG):
            await node.create_container(pod_id)
        [hook] = logged_events(caplog.records, "hook_call")
        assert ("10-first", "PreCreateContainer", "ok") == (hook["plugin"], hook["hook"], hook["result"])
        assert "resources.cpu_quota" in hook["changes"].split(",")
        [call] = [
            c for c in logged_events(caplog.records, "call") if c["method"].endswith("/CreateContainer")
        ]
        assert ("OK", 1) == (call["code"], call["hooks"])
