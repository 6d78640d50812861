"""Docker mode store recovery: a restarted proxy rebuilds its store from dockerd, and waits for a dockerd
that is not up yet instead of crashing."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest
import trio

from krproxy.docker.client import request
from krproxy.fakes.plugin import FakePlugin
from krproxy.hooks.model import Resources
from krproxy.hooks.points import HookPoint
from krproxy.hookserver.testing import logged_events
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.integration.support import LIVENESS_LIMIT, STARTUP_LIMIT, wait_until
from tests.integration.test_docker_support import (
    CGROUP_PARENT,
    POD_ANNOTATIONS,
    DockerNode,
    make_node,
)


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str) -> DockerNode:
    return await make_node(nursery, sockdir)


class TestRecovery:
    async def test_restarted_proxy_recovers_pods_and_containers(self, node: DockerNode) -> None:
        """After a restart the store holds the pod and the container as dockerd reports them: meta from
        the dockershim names, labels/annotations split, cgroup parent, current resources and envs."""
        await node.start_proxy()
        sandbox, container = await node.create_pod()
        await node.call("POST", f"/containers/{container}/update", {"CpuShares": 512})
        before = node.proxy.hooks.store.get_container(container)
        await node.stop_proxy()
        await node.start_proxy()
        store = node.proxy.hooks.store
        pod = store.get_pod(sandbox)
        assert pod is not None
        assert ("web", "prod", "uid-web", 1) == (pod.name, pod.namespace, pod.uid, pod.attempt)
        assert POD_ANNOTATIONS == pod.annotations
        assert CGROUP_PARENT == pod.cgroup_parent
        recovered = store.get_container(container)
        assert recovered is not None and before is not None
        assert before.resources == recovered.resources
        assert isinstance(recovered.resources, Resources) and 512 == recovered.resources.cpu_shares
        assert (before.envs, before.annotations, before.pod_cgroup_parent) == (
            recovered.envs,
            recovered.annotations,
            recovered.pod_cgroup_parent,
        )
        assert (sandbox, "app", 2) == (recovered.pod_sandbox_id, recovered.name, recovered.attempt)

    async def test_recovery_is_logged_and_shown_as_in_cri_mode(
        self, node: DockerNode, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Once the store is recovered, the ``krproxy_store_recovered`` gauge is 1 and krproxy.docker logs
        ``store_recovered``: the counts, dockerd's cgroup driver, the containers that vanished before
        inspect, then the orphans and the seconds (the fields and order of Docker mode's line)."""
        await node.start_proxy()
        await node.create_pod()
        await node.stop_proxy()
        caplog.set_level(logging.INFO, logger="krproxy.docker")
        caplog.clear()
        await node.start_proxy()
        [logged] = logged_events(caplog.records, "store_recovered")
        assert ["pods", "containers", "cgroup_driver", "vanished", "orphans", "seconds"] == list(logged)
        assert (1, 1, "cgroupfs", 0, 0) == (
            logged["pods"],
            logged["containers"],
            logged["cgroup_driver"],
            logged["vanished"],
            logged["orphans"],
        )
        assert "krproxy.docker" == next(r.name for r in caplog.records if r.getMessage() == "store_recovered")
        assert 1.0 == node.proxy.metrics.registry.get_sample_value("krproxy_store_recovered")

    async def test_ready_is_logged_with_its_sockets(
        self, node: DockerNode, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Once its socket accepts calls, krproxy.docker logs ``ready``: Docker mode, the proxy socket,
        dockerd's, the hook directory and how many plugins are registered, in that order."""
        await node.add_plugin("p", FakePlugin(), [HookPoint.PRE_START_CONTAINER])
        caplog.set_level(logging.INFO, logger="krproxy.docker")
        config = (await node.start_proxy()).config
        [logged] = logged_events(caplog.records, "ready")
        assert [
            ("mode", "Docker"),
            ("listen", config.listen),
            ("runtime", config.runtime_endpoint),
            ("hook_dir", config.hook_dir),
            ("plugins", 1),
        ] == list(logged.items())

    async def test_hooks_after_restart_get_the_full_record(self, node: DockerNode) -> None:
        """PreStartContainer after a restart carries the recovered pod meta, resources and envs."""
        plugin = await node.add_plugin("p", FakePlugin(), [HookPoint.PRE_START_CONTAINER])
        await node.start_proxy()
        _, container = await node.create_pod()
        await node.stop_proxy()
        await node.start_proxy()
        await node.call("POST", f"/containers/{container}/start")
        [sent] = plugin.requests(HookPoint.PRE_START_CONTAINER)
        assert (
            hookapi.PodSandboxMetadata(name="web", uid="uid-web", namespace="prod", attempt=1)
            == sent.pod_meta
        )
        assert {"PATH": "/bin", "MODE": "b"} == sent.container_envs
        assert 2048 == sent.container_resources.cpu_shares

    async def test_containers_not_made_by_kubelet_are_left_out(self, node: DockerNode) -> None:
        """Recovery keeps only containers with dockershim's labels."""
        await node.start_proxy()
        await node.create("plain", {"Image": "busybox"})
        await node.stop_proxy()
        await node.start_proxy()
        assert (0, 0) == (
            node.proxy.hooks.store.statistics().pods,
            node.proxy.hooks.store.statistics().containers,
        )

    async def test_proxy_waits_for_dockerd(self, nursery: trio.Nursery, sockdir: str) -> None:
        """Started before dockerd, the proxy serves (502 meanwhile), retries recovery, and intercepted
        requests wait until the store is recovered."""
        node = await make_node(nursery, sockdir, dockerd=False)
        await node.start_proxy(wait_recovered=False)
        assert 502 == (await node.call("GET", "/_ping")).status
        assert not node.proxy.hooks.recovered
        await node.start_dockerd()
        sandbox, _ = await node.create_pod()
        assert node.proxy.hooks.recovered
        assert node.proxy.hooks.store.get_pod(sandbox) is not None


class TestDaemonProcess:
    async def test_cli_serves_docker_mode_and_stops_on_sigterm(self, node: DockerNode) -> None:
        """``krproxy serve --backend-runtime-mode=Docker`` proxies to dockerd and exits 0 on SIGTERM."""
        args = [
            sys.executable,
            "-m",
            "krproxy",
            "serve",
            "--backend-runtime-mode=Docker",
            f"--koord-runtimeproxy-endpoint={node.proxy_socket}",
            f"--remote-runtime-service-endpoint=unix://{node.docker_socket}",
            f"--hook-dir={node.hook_dir}",
        ]
        process = await trio.lowlevel.open_process(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            await wait_until(lambda: os.path.exists(node.proxy_socket), STARTUP_LIMIT)
            with trio.fail_after(LIVENESS_LIMIT):
                reply = await request(node.proxy_socket, "GET", "/_ping")
            assert (200, b"OK") == (reply.status, reply.body)
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(LIVENESS_LIMIT):
                assert 0 == await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            assert process.stderr is not None
            await process.stderr.aclose()
