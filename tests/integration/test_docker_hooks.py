"""Docker mode hook points through the real proxy: what plugins get, and what reaches dockerd.

A dockershim-like client drives the proxy (Docker mode) in front of the fake dockerd; fake plugins
registered for every hook echo (or change) what they are sent.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from krproxy.docker import hooks as docker_hooks
from krproxy.fakes.plugin import Changes, FakePlugin, Misbehaviour
from krproxy.grpcstatus import Status
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.integration.hooks_support import HANG_TIMEOUT, POD_META, hook_resources
from tests.integration.test_docker_support import (
    CGROUP_PARENT,
    CONTAINER_NAME,
    HOST_RESOURCES,
    POD_ANNOTATIONS,
    POD_LABELS,
    SANDBOX_NAME,
    DockerNode,
    container_body,
    make_node,
    sandbox_body,
)

UPDATE = HookPoint.PRE_UPDATE_CONTAINER_RESOURCES

#: HOST_RESOURCES in the hook protocol: the same values as hooks_support.RESOURCES.
RESOURCES = hook_resources()
SKIP = {"runtimeproxy.koordinator.sh/skip-hookserver": "true"}


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str) -> DockerNode:
    return await make_node(nursery, sockdir)


def forwarded(node: DockerNode, path: str) -> list[Any]:
    """The JSON bodies dockerd received on POST requests to *path* (a regex on the unversioned path)."""
    return [r.json() for r in node.fake.requests_to("POST", path)]


class TestCreate:
    async def test_sandbox_runs_pre_run_pod_sandbox(self, node: DockerNode) -> None:
        """PreRunPodSandbox gets pod meta from the container name, labels and annotations split by the
        ``annotation.`` prefix, the cgroup parent and resources; its answer reaches dockerd's HostConfig."""
        plugin = await node.add_plugin(
            "p", FakePlugin(Changes(cgroup_parent="/kubepods/besteffort/poduid-web", annotations={"a": "1"}))
        )
        await node.start_proxy()
        sandbox = await node.create(SANDBOX_NAME, sandbox_body())
        [request] = plugin.requests(HookPoint.PRE_RUN_POD_SANDBOX)
        assert POD_META == request.pod_meta
        assert {"io.kubernetes.docker.type": "podsandbox", **POD_LABELS} == request.labels
        assert POD_ANNOTATIONS == request.annotations
        assert CGROUP_PARENT == request.cgroup_parent
        assert "docker" == request.runtime_handler
        assert 2 == request.resources.cpu_shares
        [sent] = forwarded(node, "/containers/create$")
        assert "/kubepods/besteffort/poduid-web" == sent["HostConfig"]["CgroupParent"]
        assert "1" == sent["Labels"]["annotation.a"]
        assert "none" == sent["HostConfig"]["NetworkMode"]
        pod = node.proxy.hooks.store.get_pod(sandbox)
        assert pod is not None and "/kubepods/besteffort/poduid-web" == pod.cgroup_parent

    async def test_container_runs_pre_create_container(self, node: DockerNode) -> None:
        """PreCreateContainer gets the stored pod, the container's annotations, resources and envs; its
        resources, envs and cgroup parent are written into the create body dockerd receives."""
        plugin = await node.add_plugin(
            "p",
            FakePlugin(
                Changes(
                    cpu_quota=50_000, cpuset_cpus="2-3", envs={"NEW": "x"}, cgroup_parent=f"{CGROUP_PARENT}/x"
                )
            ),
            [HookPoint.PRE_CREATE_CONTAINER],
        )
        await node.start_proxy()
        sandbox, container = await node.create_pod()
        [request] = plugin.requests(HookPoint.PRE_CREATE_CONTAINER)
        assert POD_META == request.pod_meta
        assert hookapi.ContainerMetadata(name="app", attempt=2) == request.container_meta
        assert {"io.kubernetes.container.hash": "abc"} == request.container_annotations
        assert RESOURCES == request.container_resources
        assert {"PATH": "/bin", "MODE": "b"} == request.container_envs
        assert CGROUP_PARENT == request.pod_cgroup_parent
        assert {"io.kubernetes.docker.type": "podsandbox", **POD_LABELS} == request.pod_labels
        sent = forwarded(node, "/containers/create$")[1]
        assert {**HOST_RESOURCES, "CpuQuota": 50_000, "CpusetCpus": "2-3"} == {
            k: sent["HostConfig"][k] for k in HOST_RESOURCES
        }
        assert f"{CGROUP_PARENT}/x" == sent["HostConfig"]["CgroupParent"]
        assert ["PATH=/bin", "MODE=b", "NEW=x"] == sent["Env"]
        stored = node.proxy.hooks.store.get_container(container)
        assert stored is not None and (sandbox, container, 50_000) == (
            stored.pod_sandbox_id,
            stored.id,
            stored.resources.cpu_quota if stored.resources else None,
        )

    async def test_unchanged_body_is_forwarded_byte_for_byte(self, node: DockerNode) -> None:
        """With plugins that change nothing, dockerd receives the client's exact bytes."""
        await node.add_plugin("p")
        await node.start_proxy()
        raw = b'{"Image":"x",  "Labels":{"io.kubernetes.docker.type":"podsandbox"},"HostConfig":{"Memory":1.5e9}}'
        reply = await node.call("POST", f"/containers/create?name={SANDBOX_NAME}", raw)
        assert 201 == reply.status
        assert [raw] == [r.body for r in node.fake.requests_to("POST", "/containers/create$")]

    async def test_fail_policy_rejects_create_with_500(self, node: DockerNode) -> None:
        """A Fail plugin that fails PreCreateContainer turns the create into HTTP 500 naming the plugin,
        and dockerd never sees it."""
        plugin = await node.add_plugin("strict", failure_policy="Fail")
        await node.start_proxy()
        sandbox = await node.create(SANDBOX_NAME, sandbox_body())
        plugin.misbehave(Misbehaviour(status=Status.INTERNAL, message="no cpus"))
        reply = await node.call("POST", f"/containers/create?name={CONTAINER_NAME}", container_body(sandbox))
        assert 500 == reply.status
        message = json.loads(reply.body)["message"]
        assert "strict" in message and "PreCreateContainer" in message and "no cpus" in message
        assert 1 == len(node.fake.requests_to("POST", "/containers/create$"))

    async def test_ignore_policy_forwards_the_unchanged_request(self, node: DockerNode) -> None:
        """An Ignore plugin that fails is logged; dockerd gets the request as the client sent it."""
        plugin = await node.add_plugin("lax", FakePlugin(Changes(cpu_quota=1)))
        await node.start_proxy()
        plugin.misbehave(Misbehaviour(status=Status.UNAVAILABLE))
        body = sandbox_body()
        reply = await node.call("POST", f"/containers/create?name={SANDBOX_NAME}", body)
        assert 201 == reply.status
        assert [body] == forwarded(node, "/containers/create$")

    async def test_non_kubelet_create_is_forwarded_without_hooks(self, node: DockerNode) -> None:
        """A container whose name is not dockershim's is created unchanged, with no hook call."""
        plugin = await node.add_plugin("p", FakePlugin(Changes(cpu_quota=1)))
        await node.start_proxy()
        await node.create("my-container", {"Image": "busybox", "HostConfig": {}})
        assert [] == plugin.calls
        assert [{"Image": "busybox", "HostConfig": {}}] == forwarded(node, "/containers/create$")

    async def test_skip_label_bypasses_hooks(self, node: DockerNode) -> None:
        """A pod labelled skip-hookserver=true gets no hooks, for the sandbox nor its containers."""
        plugin = await node.add_plugin("p", FakePlugin(Changes(cpu_quota=1)))
        await node.start_proxy()
        sandbox = await node.create(SANDBOX_NAME, sandbox_body(labels=SKIP))
        container = await node.create(CONTAINER_NAME, container_body(sandbox))
        await node.call("POST", f"/containers/{container}/start")
        assert [] == plugin.calls


class TestStartStop:
    async def test_start_runs_pre_and_post_start(self, node: DockerNode) -> None:
        """start runs PreStartContainer before dockerd starts the container and PostStartContainer after."""
        plugin = await node.add_plugin("p")
        await node.start_proxy()
        _, container = await node.create_pod()
        reply = await node.call("POST", f"/v1.41/containers/{container}/start")
        assert 204 == reply.status
        assert node.fake.state.containers[container].running
        assert [HookPoint.PRE_START_CONTAINER, HookPoint.POST_START_CONTAINER] == plugin.hooks_called()[2:]
        assert container == plugin.requests(HookPoint.POST_START_CONTAINER)[0].container_meta.id

    async def test_start_by_short_id(self, node: DockerNode) -> None:
        """An id prefix names the stored container, as dockerd accepts it."""
        plugin = await node.add_plugin("p")
        await node.start_proxy()
        _, container = await node.create_pod()
        await node.call("POST", f"/containers/{container[:12]}/start")
        assert container == plugin.requests(HookPoint.PRE_START_CONTAINER)[0].container_meta.id

    async def test_fail_policy_rejects_start(self, node: DockerNode) -> None:
        """A Fail plugin failing PreStartContainer answers 500 and the container is not started."""
        plugin = await node.add_plugin("strict", failure_policy="Fail")
        await node.start_proxy()
        _, container = await node.create_pod()
        plugin.misbehave(Misbehaviour(status=Status.INTERNAL, message="nope"), HookPoint.PRE_START_CONTAINER)
        reply = await node.call("POST", f"/containers/{container}/start")
        assert 500 == reply.status
        assert not node.fake.state.containers[container].running
        assert [] == node.fake.requests_to("POST", "/start$")

    async def test_post_start_failure_keeps_dockerd_answer(self, node: DockerNode) -> None:
        """A failing PostStartContainer (even with Fail policy) does not change dockerd's answer."""
        plugin = await node.add_plugin("strict", failure_policy="Fail")
        await node.start_proxy()
        _, container = await node.create_pod()
        plugin.misbehave(Misbehaviour(status=Status.INTERNAL), HookPoint.POST_START_CONTAINER)
        assert 204 == (await node.call("POST", f"/containers/{container}/start")).status

    async def test_stop_container_runs_post_stop_and_forgets_it(self, node: DockerNode) -> None:
        """stop is forwarded, then PostStopContainer runs and the store drops the container."""
        plugin = await node.add_plugin("p")
        await node.start_proxy()
        _, container = await node.create_pod()
        await node.call("POST", f"/containers/{container}/start")
        reply = await node.call("POST", f"/containers/{container}/stop?t=10")
        assert 204 == reply.status
        assert container == plugin.requests(HookPoint.POST_STOP_CONTAINER)[0].container_meta.id
        assert node.proxy.hooks.store.get_container(container) is None

    @pytest.mark.parametrize("again", ["start", "restart"])
    async def test_a_stopped_container_started_again_is_hooked(self, node: DockerNode, again: str) -> None:
        """A container stopped (its entry dropped) and then started or restarted runs again: the start
        hooks run with its record, and a later stop runs PostStopContainer; once removed, it is forgotten."""
        plugin = await node.add_plugin("p")
        await node.start_proxy()
        _, container = await node.create_pod()
        for action in ("start", "stop", again, "stop"):
            assert (await node.call("POST", f"/containers/{container}/{action}")).status in (204, 304)
        starts = plugin.requests(HookPoint.PRE_START_CONTAINER)
        assert [container, container] == [r.container_meta.id for r in starts]
        assert 2 == len(plugin.requests(HookPoint.POST_STOP_CONTAINER))
        await node.call("DELETE", f"/containers/{container}")
        assert {} == node.proxy.hooks._stopped

    async def test_stopped_records_are_bounded(
        self, node: DockerNode, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """At most MAX_STOPPED stopped containers' records are kept (the oldest forgotten first): one
        removed straight on dockerd is never removed through krproxy."""
        monkeypatch.setattr(docker_hooks, "MAX_STOPPED", 1)
        await node.start_proxy()
        sandbox, first = await node.create_pod()
        stopped = []
        for container in (
            first,
            await node.create(CONTAINER_NAME.replace("app", "app2"), container_body(sandbox)),
        ):
            await node.call("POST", f"/containers/{container}/start")
            await node.call("POST", f"/containers/{container}/stop")
            stopped.append(container)
        assert [stopped[1]] == list(node.proxy.hooks._stopped)

    async def test_stop_sandbox_runs_post_stop_pod_sandbox(self, node: DockerNode) -> None:
        """Stopping the sandbox container runs PostStopPodSandbox with the stored pod."""
        plugin = await node.add_plugin("p")
        await node.start_proxy()
        sandbox, _ = await node.create_pod()
        await node.call("POST", f"/containers/{sandbox}/start")
        await node.call("POST", f"/containers/{sandbox}/stop")
        [request] = plugin.requests(HookPoint.POST_STOP_POD_SANDBOX)
        assert POD_META == request.pod_meta
        assert node.proxy.hooks.store.get_pod(sandbox) is None

    async def test_failed_stop_keeps_the_entry_for_the_retry(self, node: DockerNode) -> None:
        """A stop dockerd fails (500) keeps the container stored: the retry runs PostStopContainer with the
        full record again, and its success drops the entry."""
        plugin = await node.add_plugin("p")
        await node.start_proxy()
        _, container = await node.create_pod()
        await node.call("POST", f"/containers/{container}/start")
        node.fake.inject("POST", "/stop$", 500, "cannot kill container: permission denied")

        assert 500 == (await node.call("POST", f"/containers/{container}/stop")).status
        assert node.proxy.hooks.store.get_container(container) is not None
        assert 204 == (await node.call("POST", f"/containers/{container}/stop")).status

        first, second = plugin.requests(HookPoint.POST_STOP_CONTAINER)
        assert first == second and container == second.container_meta.id and second.container_resources
        assert node.proxy.hooks.store.get_container(container) is None

    async def test_failed_sandbox_stop_keeps_the_pod_and_404_drops_it(self, node: DockerNode) -> None:
        """The same for a sandbox; a stop answered 404 (dockerd lost it) drops the pod."""
        plugin = await node.add_plugin("p")
        await node.start_proxy()
        sandbox, _ = await node.create_pod()
        node.fake.inject("POST", "/stop$", 500)
        assert 500 == (await node.call("POST", f"/containers/{sandbox}/stop")).status
        assert node.proxy.hooks.store.get_pod(sandbox) is not None
        node.fake.inject("POST", "/stop$", 404, f"No such container: {sandbox}")
        assert 404 == (await node.call("POST", f"/containers/{sandbox}/stop")).status
        assert 2 == len(plugin.requests(HookPoint.POST_STOP_POD_SANDBOX))
        assert node.proxy.hooks.store.get_pod(sandbox) is None

    async def test_failed_remove_keeps_and_404_drops(self, node: DockerNode) -> None:
        """DELETE answered 409/500 keeps the entries; 404 (already gone) drops them."""
        await node.start_proxy()
        sandbox, container = await node.create_pod()
        node.fake.inject("DELETE", "^/containers/", 409, "You cannot remove a running container")
        assert 409 == (await node.call("DELETE", f"/containers/{container}")).status
        assert node.proxy.hooks.store.get_container(container) is not None
        node.fake.inject("DELETE", "^/containers/", 404, "No such container", times=2)
        assert 404 == (await node.call("DELETE", f"/containers/{container}")).status
        assert 404 == (await node.call("DELETE", f"/containers/{sandbox}")).status
        assert (0, 0) == (
            node.proxy.hooks.store.statistics().pods,
            node.proxy.hooks.store.statistics().containers,
        )

    async def test_stop_of_unknown_container_reaches_dockerd(self, node: DockerNode) -> None:
        """A stop of an id nobody stored is forwarded, and dockerd's 404 comes back unchanged."""
        await node.start_proxy()
        reply = await node.call("POST", "/containers/nosuch/stop")
        assert (404, {"message": "No such container: nosuch"}) == (reply.status, json.loads(reply.body))

    async def test_remove_forgets_pod_and_containers(self, node: DockerNode) -> None:
        """DELETE of a sandbox drops the pod and its containers from the store."""
        await node.start_proxy()
        sandbox, container = await node.create_pod()
        assert 204 == (await node.call("DELETE", f"/containers/{container}")).status
        assert 204 == (await node.call("DELETE", f"/containers/{sandbox}?v=1")).status
        assert (0, 0) == (
            node.proxy.hooks.store.statistics().pods,
            node.proxy.hooks.store.statistics().containers,
        )


class TestUpdate:
    async def test_update_runs_pre_update_with_merged_resources(self, node: DockerNode) -> None:
        """PreUpdateContainerResources sees the stored resources updated by the request; its answer is
        written into the update body dockerd receives, and stored."""
        plugin = await node.add_plugin("p", FakePlugin(Changes(cpu_shares=4096)))
        await node.start_proxy()
        _, container = await node.create_pod()
        plugin.answer(HookPoint.PRE_CREATE_CONTAINER, lambda request: hookapi.ContainerResourceHookResponse())
        reply = await node.call(
            "POST", f"/v1.41/containers/{container}/update", {"Memory": 2 << 30, "CpuQuota": 0}
        )
        assert 200 == reply.status
        [request] = plugin.requests(HookPoint.PRE_UPDATE_CONTAINER_RESOURCES)
        assert 2 << 30 == request.container_resources.memory_limit_in_bytes
        assert 4096 == request.container_resources.cpu_shares  # stored after PreCreateContainer's change
        [sent] = forwarded(node, "/update$")
        assert {"Memory": 2 << 30, "CpuQuota": 0} == sent  # 4096 was already there: nothing to change
        assert 2 << 30 == node.fake.state.containers[container].host_config["Memory"]

    async def test_update_answer_changes_body(self, node: DockerNode) -> None:
        """A plugin's resources in the PreUpdateContainerResources answer reach dockerd."""
        plugin = await node.add_plugin("p")
        await node.start_proxy()
        _, container = await node.create_pod()
        plugin.changes = Changes(cpu_quota=300_000)
        await node.call("POST", f"/containers/{container}/update", {"CpuShares": 512})
        [sent] = forwarded(node, "/update$")
        assert {"CpuShares": 512, "CpuQuota": 300_000} == sent
        stored = node.proxy.hooks.store.get_container(container)
        assert stored is not None and stored.resources is not None
        assert (512, 300_000) == (stored.resources.cpu_shares, stored.resources.cpu_quota)

    async def test_fail_policy_rejects_update(self, node: DockerNode) -> None:
        """A Fail plugin failing PreUpdateContainerResources answers 500 and dockerd gets no update."""
        # On this hook only, so the short timeout (meant to fire) meets the hang alone.
        plugin = await node.add_plugin(
            "strict", hooks=[UPDATE], failure_policy="Fail", call_timeout=HANG_TIMEOUT
        )
        await node.start_proxy()
        _, container = await node.create_pod()
        plugin.misbehave(Misbehaviour(hang=True))
        reply = await node.call("POST", f"/containers/{container}/update", {"CpuShares": 512})
        assert 500 == reply.status
        assert "no answer within" in json.loads(reply.body)["message"]
        assert [] == forwarded(node, "/update$")


class TestIntegersBeyondTheWire:
    async def test_cpu_shares_beyond_64_bits_is_not_sent_wrapped(self, node: DockerNode) -> None:
        """Docker's JSON carries integers of any size; one the hook protocol's 64-bit fields cannot hold
        (here CpuShares 2^64 + 2048) is not sent to the hook server wrapped (as 2048): the hook call fails
        with the reason (Ignore: dockerd gets the body as the client sent it, and answers it)."""
        plugin = await node.add_plugin("p", FakePlugin(Changes(cpu_quota=1)), [HookPoint.PRE_RUN_POD_SANDBOX])
        await node.start_proxy()
        body = sandbox_body()
        body["HostConfig"]["CpuShares"] = (1 << 64) + 2048
        await node.call("POST", f"/containers/create?name={SANDBOX_NAME}", body)
        assert [] == [r.resources.cpu_shares for r in plugin.requests(HookPoint.PRE_RUN_POD_SANDBOX)]
        assert [body] == forwarded(node, "/containers/create$")

    async def test_under_fail_the_create_is_refused_with_the_reason(self, node: DockerNode) -> None:
        """The same under a Fail server: HTTP 500 naming the value, and dockerd never sees the create."""
        plugin = await node.add_plugin("strict", failure_policy="Fail")
        await node.start_proxy()
        sandbox = await node.create(SANDBOX_NAME, sandbox_body())
        body = container_body(sandbox)
        body["HostConfig"]["Memory"] = -(1 << 63) - 1
        reply = await node.call("POST", f"/containers/create?name={CONTAINER_NAME}", body)
        assert 500 == reply.status
        assert f"{-(1 << 63) - 1} does not fit" in json.loads(reply.body)["message"]
        assert [] == plugin.requests(HookPoint.PRE_CREATE_CONTAINER)
        assert 1 == len(node.fake.requests_to("POST", "/containers/create$"))
