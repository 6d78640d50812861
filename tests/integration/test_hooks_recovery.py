"""Store recovery after a proxy restart: pods and containers already running in the runtime get their hooks
with what the proxy could recover from it (ListPodSandbox/ListContainers + status calls).

What the fake containerd reports, and so what can be recovered from it: metadata, labels, annotations and
runtime handler of pods; metadata, annotations and ``ContainerStatus.resources.linux`` (the resources of
the last create/update) of containers. It sends no verbose ``info``, so the pod cgroup parent and the
container envs are not recoverable from it (real containerd reports both in verbose info).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import attrs
import grpc
import pytest
import trio

from krproxy import rpc
from krproxy.fakes.containerd import FakeContainerd, run_fake_containerd
from krproxy.fakes.plugin import Changes, FakePlugin
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks import convert, wire
from krproxy.hooks.model import ContainerInfo, PodInfo, Resources
from krproxy.hooks.points import HookPoint
from krproxy.hooks.recovery import CALL_TIMEOUT, Recovered, recover
from krproxy.hooks.writeback import resources_to_cri
from krproxy.hookserver.testing import logged_events
from krproxy.proto.runtime import v1 as cri
from krproxy.proto.runtime import v1alpha1 as hookapi
from krproxy.relay import Relay
from tests.integration.hooks_support import (
    CGROUP_PARENT,
    POD_ANNOTATIONS,
    POD_LABELS,
    Node,
    hook_resources,
    make_node,
    pod_config,
)
from tests.integration.support import LIVENESS_LIMIT, Behaviour, ScriptedBackend, start_scripted_backend
from tests.records import FULL_RESOURCES


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


class TestRestart:
    async def test_recovery_is_logged_and_shown(self, node: Node, caplog: pytest.LogCaptureFixture) -> None:
        """Once the store is recovered, the ``krproxy_store_recovered`` gauge is 1 and krproxy.daemon logs
        ``store_recovered``: the counts, the fallbacks, the orphans and the seconds, in that order."""
        await node.start_proxy()
        await node.pod_with_container()
        await node.stop_proxy()
        caplog.set_level(logging.INFO, logger="krproxy.daemon")
        caplog.clear()

        await node.start_proxy(socket_name="proxy-2.sock")

        [logged] = logged_events(caplog.records, "store_recovered")
        assert ["pods", "containers", "fallbacks", "left_out", "orphans", "seconds"] == list(logged)
        assert (1, 1, 0, 0) == (logged["pods"], logged["containers"], logged["fallbacks"], logged["orphans"])
        assert "krproxy.daemon" == next(r.name for r in caplog.records if r.getMessage() == "store_recovered")
        assert 1.0 == node.proxy.metrics.registry.get_sample_value("krproxy_store_recovered")

    async def test_ready_is_logged_with_its_sockets(
        self, node: Node, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Once its socket accepts calls, krproxy.daemon logs ``ready``: the proxy socket, the runtime's, the
        image service's, the hook directory and how many plugins are registered, in that order."""
        await node.add_plugin("p", hooks=[HookPoint.PRE_CREATE_CONTAINER])
        caplog.set_level(logging.INFO, logger="krproxy.daemon")
        config = (await node.start_proxy()).config
        [logged] = logged_events(caplog.records, "ready")
        assert [
            ("listen", config.listen),
            ("runtime", config.runtime_endpoint),
            ("image", config.image_socket),
            ("hook_dir", config.hook_dir),
            ("plugins", 1),
        ] == list(logged.items())

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
            # From the fake's verbose info, as from containerd's: the pod's cgroup parent and the envs the
            # runtime got (kubelet's, a key sent twice keeping the later value, and the plugin's GPU=0).
            pod_cgroup_parent=CGROUP_PARENT,
            container_envs={"PATH": "/bin", "MODE": "b", "GPU": "0"},
        )
        assert [expected] == plugin.requests(HookPoint.PRE_START_CONTAINER)
        # PreStartContainer's answer (the plugin adds GPU=0) is stored: the later hooks see it.
        after_start = hookapi.ContainerResourceHookRequest.FromString(bytes(expected.SerializeToString()))
        after_start.container_envs = {"PATH": "/bin", "MODE": "b", "GPU": "0"}
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
                cgroup_parent=CGROUP_PARENT,
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
        with trio.fail_after(LIVENESS_LIMIT):
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


# -- recover() itself ------------------------------------------------------------------------------


async def _recover(nursery: trio.Nursery, path: str) -> Recovered:
    """recover() through a relay of its own, as the daemon runs it."""
    relay = Relay()
    await nursery.start(relay.run)
    return await recover(
        functools.partial(relay.transport.call, relay.route_to(path, "runtime"), within=CALL_TIMEOUT)
    )


def _recover_one_by_one(path: str) -> tuple[dict[str, PodInfo], dict[str, ContainerInfo]]:
    """The same calls as recovery, one after another through grpcio's client (not the relay), each answer
    converted on its own (no failures expected). Blocking: run it in a thread."""
    with grpc.insecure_channel(f"unix://{path}") as channel:

        def call(method: str, request: Any, reply_type: Any) -> Any:
            answer = channel.unary_unary(f"/runtime.v1.RuntimeService/{method}")(
                bytes(request.SerializeToString()), timeout=LIVENESS_LIMIT
            )
            return reply_type.FromString(answer)

        pods = {}
        for sandbox in call("ListPodSandbox", cri.ListPodSandboxRequest(), cri.ListPodSandboxResponse).items:
            answer = call(
                "PodSandboxStatus",
                cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox.id, verbose=True),
                cri.PodSandboxStatusResponse,
            )
            assert answer.status is not None
            pods[sandbox.id] = convert.pod_from_wire_status(_wire(answer.status), answer.info)
        containers = {}
        for item in call(
            "ListContainers", cri.ListContainersRequest(), cri.ListContainersResponse
        ).containers:
            status = call(
                "ContainerStatus",
                cri.ContainerStatusRequest(container_id=item.id, verbose=True),
                cri.ContainerStatusResponse,
            )
            assert status.status is not None
            owner = pods[item.pod_sandbox_id]
            containers[item.id] = convert.container_from_wire_status(
                _wire(status.status), item.pod_sandbox_id, owner, status.info
            )
        return pods, containers


def _wire(message: Any) -> Any:
    """A betterproto2 message as recovery reads it: its bytes decoded by the upb class of the same name."""
    return wire.message_class(type(message).__name__).FromString(bytes(message))


def _ordered(records: dict[str, Any]) -> list[tuple[str, list[Any]]]:
    """Each record's maps as item lists, by ID (records compare equal in any map order; the order of
    the records is the runtime's list order, which containerd, and the fake, leave undefined)."""
    maps = ("labels", "annotations", "envs")
    return [
        (key, [list(getattr(r, m).items()) for m in maps if hasattr(r, m)])
        for key, r in sorted(records.items())
    ]


class TestRecover:
    async def test_same_records_as_one_call_at_a_time(
        self, fake_containerd: Any, nursery: trio.Nursery
    ) -> None:
        """Against a fake with seeded pods and containers in every state and with all kinds of resources,
        recovery (concurrent calls through the relay) rebuilds exactly the records that the same calls made
        one at a time give, their maps in the same order."""
        fake, path = fake_containerd
        state = fake.state
        seeded = fake.seed(4, 3)
        pod_id = state.run_pod_sandbox(
            cri.RunPodSandboxRequest(
                config=cri.PodSandboxConfig(
                    metadata=cri.PodSandboxMetadata(name="web", uid="u1", namespace="prod", attempt=3),
                    labels={"z": "1", "a": "2", "m": "3"},
                    annotations={"k": "v"},
                ),
                runtime_handler="kata",
            )
        ).pod_sandbox_id
        created = []
        for name, linux in [
            (
                "full",
                # Two cgroup v2 settings: recovery keeps their order.
                resources_to_cri(
                    attrs.evolve(FULL_RESOURCES, unified={"memory.high": "max", "cpu.weight": "100"})
                ),
            ),
            ("none", None),
        ]:
            created.append(
                state.create_container(
                    cri.CreateContainerRequest(
                        pod_sandbox_id=pod_id,
                        config=cri.ContainerConfig(
                            metadata=cri.ContainerMetadata(name=name, attempt=1),
                            image=cri.ImageSpec(image="busybox"),
                            annotations={"b": "1", "a": "2"},
                            linux=cri.LinuxContainerConfig(resources=linux),
                        ),
                    )
                ).container_id
            )
        state.start_container(cri.StartContainerRequest(container_id=created[0]))
        state.update_container_resources(
            cri.UpdateContainerResourcesRequest(
                container_id=seeded[0], linux=cri.LinuxContainerResources(cpu_shares=99, unified={"x": "y"})
            )
        )
        state.stop_container(cri.StopContainerRequest(container_id=seeded[1], timeout=0))
        state.exit_container(seeded[2], 137, "OOMKilled")
        state.stop_pod_sandbox(
            cri.StopPodSandboxRequest(pod_sandbox_id=state.containers[seeded[3]].pod_sandbox_id)
        )
        fake.flush_events()

        recovered: Recovered = await _recover(nursery, path)
        pods, containers = await trio.to_thread.run_sync(_recover_one_by_one, path)

        assert (5, 14, 0, 0) == (
            len(recovered.pods),
            len(recovered.containers),
            recovered.fallbacks,
            recovered.orphans,
        )
        assert (pods, containers) == (recovered.pods, recovered.containers)
        assert (_ordered(pods), _ordered(containers)) == (
            _ordered(recovered.pods),
            _ordered(recovered.containers),
        )

    async def test_verbose_info_failures_and_orphans(self, nursery: trio.Nursery, sockdir: str) -> None:
        """Verbose info gives the cgroup parent, resources and envs; a failed or status-less answer falls back
        to the list item; a container of an unlisted pod is skipped."""
        answers: dict[str, bytes | GRPCError] = {}

        def pod(sandbox_id: str, name: str, **status: Any) -> cri.PodSandbox:
            meta = cri.PodSandboxMetadata(name=name, uid=f"uid-{name}", namespace="ns", attempt=1)
            answers[sandbox_id] = bytes(
                cri.PodSandboxStatusResponse(
                    status=cri.PodSandboxStatus(id=sandbox_id, metadata=meta, labels={"from": "status"}),
                    **status,
                )
            )
            return cri.PodSandbox(
                id=sandbox_id, metadata=meta, labels={"from": "list"}, runtime_handler="runc"
            )

        verbose_pod = {"config": {"linux": {"cgroup_parent": "/kubepods/burstable/pod-a"}}}
        sandboxes = [
            pod("sb-a", "a", info={"info": json.dumps(verbose_pod)}),
            pod("sb-b", "b"),
            pod("sb-c", "c"),
        ]
        answers["sb-b"] = GRPCError(Status.NOT_FOUND, "gone")
        answers["sb-c"] = bytes(cri.PodSandboxStatusResponse())  # no status: fall back too

        verbose_container = {
            "config": {
                "envs": [{"key": "B", "value": "1"}, {"key": "A", "value": "2"}],
                "linux": {"resources": {"cpu_shares": 2, "memory_swap_limit_in_bytes": 7}},
            }
        }
        answers["c-1"] = bytes(
            cri.ContainerStatusResponse(
                status=cri.ContainerStatus(
                    id="c-1",
                    metadata=cri.ContainerMetadata(name="app", attempt=2),
                    annotations={"from": "status"},
                    resources=cri.ContainerResources(linux=cri.LinuxContainerResources(cpu_shares=512)),
                ),
                info={"info": json.dumps(verbose_container)},
            )
        )
        answers["c-2"] = GRPCError(Status.UNKNOWN, "broken")
        containers = [
            cri.Container(
                id=container_id,
                pod_sandbox_id=sandbox_id,
                metadata=cri.ContainerMetadata(name=name, attempt=2),
                annotations={"from": "list"},
            )
            for container_id, sandbox_id, name in [
                ("c-1", "sb-a", "app"),
                ("c-2", "sb-b", "side"),
                ("c-3", "sb-gone", "orphan"),
            ]
        ]

        answers["list-pods"] = bytes(cri.ListPodSandboxResponse(items=sandboxes))
        answers["list-containers"] = bytes(cri.ListContainersResponse(containers=containers))

        def answer(key: Callable[[bytes], str]) -> Behaviour:
            async def behaviour(stream: rpc.Stream, messages: list[bytes]) -> None:
                [request] = messages
                reply = answers[key(request)]
                if isinstance(reply, GRPCError):
                    raise reply
                await stream.send_message(reply)

            return behaviour

        backend = ScriptedBackend()
        backend.behaviours.update(
            {
                "/runtime.v1.RuntimeService/ListPodSandbox": answer(lambda _: "list-pods"),
                "/runtime.v1.RuntimeService/ListContainers": answer(lambda _: "list-containers"),
                "/runtime.v1.RuntimeService/PodSandboxStatus": answer(
                    lambda request: cri.PodSandboxStatusRequest.FromString(request).pod_sandbox_id
                ),
                "/runtime.v1.RuntimeService/ContainerStatus": answer(
                    lambda request: cri.ContainerStatusRequest.FromString(request).container_id
                ),
            }
        )
        path = os.path.join(sockdir, "backend.sock")
        await start_scripted_backend(nursery, path, backend)

        recovered: Recovered = await _recover(nursery, path)

        pod_a = PodInfo(
            name="a",
            uid="uid-a",
            namespace="ns",
            attempt=1,
            labels={"from": "status"},
            cgroup_parent="/kubepods/burstable/pod-a",
        )
        pod_b = PodInfo(
            name="b", uid="uid-b", namespace="ns", attempt=1, runtime_handler="runc", labels={"from": "list"}
        )
        pod_c = attrs.evolve(pod_b, name="c", uid="uid-c")
        assert {"sb-a": pod_a, "sb-b": pod_b, "sb-c": pod_c} == recovered.pods

        def listed(container_id: str, sandbox_id: str, pod: PodInfo, name: str) -> ContainerInfo:
            """The record of a container's list item alone (what a failed status falls back to)."""
            return ContainerInfo(
                pod_sandbox_id=sandbox_id,
                pod=pod,
                name=name,
                attempt=2,
                id=container_id,
                annotations={"from": "list"},
            )

        assert {
            "c-1": attrs.evolve(
                listed("c-1", "sb-a", pod_a, "app"),
                annotations={"from": "status"},
                resources=Resources(cpu_shares=512, memory_swap_limit_in_bytes=7),
                envs={"B": "1", "A": "2"},
                pod_cgroup_parent="/kubepods/burstable/pod-a",
            ),
            "c-2": listed("c-2", "sb-b", pod_b, "side"),
        } == recovered.containers
        assert ["B", "A"] == list(recovered.containers["c-1"].envs)
        assert (3, 1) == (recovered.fallbacks, recovered.orphans)

    async def test_a_failed_list_raises(self, nursery: trio.Nursery, sockdir: str) -> None:
        """Without the lists nothing can be recovered: recover() raises and the daemon retries it."""

        async def unavailable(stream: rpc.Stream, messages: list[bytes]) -> None:
            raise GRPCError(Status.UNAVAILABLE, "starting")  # the backend's

        backend = ScriptedBackend()
        backend.behaviours["/runtime.v1.RuntimeService/ListPodSandbox"] = unavailable
        path = os.path.join(sockdir, "backend.sock")
        await start_scripted_backend(nursery, path, backend)

        with pytest.raises(GRPCError) as raised:
            await _recover(nursery, path)

        assert Status.UNAVAILABLE == raised.value.status
