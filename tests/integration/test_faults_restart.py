"""The proxy SIGKILLed and restarted with pods live: ``krproxy serve`` and the fake containerd as processes.

A killed proxy leaves a stale socket and an empty memory; the new one must take the socket over, rebuild
its store from the runtime (every live pod and container, once), and drive Stop hooks with the records of
objects created through the old one.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from cri_api.v1 import api_pb2, api_pb2_grpc

from krproxy.fakes.plugin import FakePlugin, run_fake_plugin, write_registration
from krproxy.hooks.points import HookPoint
from tests.integration.faults_support import Processes, channel, processes, version_ok, wait_for_log
from tests.integration.hooks_support import container_config, pod_config
from tests.integration.support import in_thread

SEEDED_PODS, SEEDED_CONTAINERS_PER_POD = 3, 2


@pytest.fixture
def procs(sockdir: str) -> Iterator[Processes]:
    with processes(sockdir) as started:
        yield started


def counts(runtime: str) -> tuple[int, int]:
    """Live pods and containers, asked of the runtime directly."""
    with channel(runtime) as ch:
        stub = api_pb2_grpc.RuntimeServiceStub(ch)
        pods = stub.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=5).items
        containers = stub.ListContainers(api_pb2.ListContainersRequest(), timeout=5).containers
    return len(pods), len(containers)


def identity(request: Any) -> tuple[Any, ...]:
    """What a container hook request says about whose it is."""
    return (
        request.container_meta.id,
        request.container_meta.name,
        request.pod_meta.name,
        request.pod_meta.uid,
        request.pod_meta.namespace,
        dict(request.container_annotations),
    )


class TestProxyKilled:
    async def test_restart_recovers_every_entry_once(
        self, nursery: trio.Nursery, sockdir: str, procs: Processes
    ) -> None:
        """SIGKILL the proxy with seeded and proxy-created pods live; the restarted one recovers exactly the
        runtime's pods and containers, and Stop/StopPodSandbox of objects created through the old proxy run
        their post hooks with the same identity as before the kill (no hook skipped for an unknown id)."""
        runtime = os.path.join(sockdir, "containerd.sock")
        listen = os.path.join(sockdir, "proxy.sock")
        hook_dir = os.path.join(sockdir, "hooks")
        procs.containerd(runtime, seed_pods=SEEDED_PODS, containers_per_pod=SEEDED_CONTAINERS_PER_POD)
        plugin = await nursery.start(run_fake_plugin, os.path.join(sockdir, "p.sock"), FakePlugin())
        write_registration(hook_dir, "p", os.path.join(sockdir, "p.sock"), timeout="5s")
        start_proxy = functools.partial(trio.to_thread.run_sync, procs.proxy, listen, runtime, hook_dir)

        first = await start_proxy()
        [recovered] = await wait_for_log(first, "store_recovered")
        assert (str(SEEDED_PODS), str(SEEDED_PODS * SEEDED_CONTAINERS_PER_POD)) == (
            recovered["pods"],
            recovered["containers"],
        )
        with channel(listen) as ch:
            stub = api_pb2_grpc.RuntimeServiceStub(ch)
            created = []
            for name in ("web", "db"):
                config = pod_config(name)
                pod = await in_thread(
                    stub.RunPodSandbox, api_pb2.RunPodSandboxRequest(config=config), timeout=10
                )
                request = api_pb2.CreateContainerRequest(
                    pod_sandbox_id=pod.pod_sandbox_id, config=container_config("app"), sandbox_config=config
                )
                container = await in_thread(stub.CreateContainer, request, timeout=10)
                await in_thread(
                    stub.StartContainer,
                    api_pb2.StartContainerRequest(container_id=container.container_id),
                    timeout=10,
                )
                created.append((pod.pod_sandbox_id, container.container_id))
        started = {r.container_meta.id: identity(r) for r in plugin.requests(HookPoint.POST_START_CONTAINER)}
        assert {c for _, c in created} == set(started)

        first.kill()
        assert await trio.Path(listen).exists()  # a stale socket: nobody cleaned up
        second = await start_proxy()
        [recovered] = await wait_for_log(second, "store_recovered")
        pods, containers = await in_thread(counts, runtime)
        assert (SEEDED_PODS + 2, SEEDED_PODS * SEEDED_CONTAINERS_PER_POD + 2) == (pods, containers)
        assert (str(pods), str(containers)) == (recovered["pods"], recovered["containers"])

        plugin.calls.clear()
        with channel(listen) as ch:
            stub = api_pb2_grpc.RuntimeServiceStub(ch)
            for pod_id, container_id in created:
                await in_thread(
                    stub.StopContainer, api_pb2.StopContainerRequest(container_id=container_id), timeout=10
                )
                await in_thread(
                    stub.RemoveContainer,
                    api_pb2.RemoveContainerRequest(container_id=container_id),
                    timeout=10,
                )
                await in_thread(
                    stub.StopPodSandbox, api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=10
                )
                await in_thread(
                    stub.RemovePodSandbox, api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=10
                )

        stopped = {r.container_meta.id: identity(r) for r in plugin.requests(HookPoint.POST_STOP_CONTAINER)}
        assert started == stopped
        assert [config.metadata.uid for config in (pod_config("web"), pod_config("db"))] == [
            r.pod_meta.uid for r in plugin.requests(HookPoint.POST_STOP_POD_SANDBOX)
        ]
        assert [] == second.events("hook_skipped_unknown_container") + second.events(
            "hook_skipped_unknown_pod"
        )
        assert (SEEDED_PODS, SEEDED_PODS * SEEDED_CONTAINERS_PER_POD) == await in_thread(counts, runtime)
        assert await in_thread(version_ok, listen)
