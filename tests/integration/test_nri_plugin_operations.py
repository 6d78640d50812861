"""``krproxy nri`` against the fake NRI runtime: its command line, restarts of either side, the admin
endpoint, and a pod resize (containerd 2.3's UpdatePodSandbox) through the hook servers.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
import trio

from krproxy import admin
from krproxy.fakes.nri import FakeNriRuntime, NriError, event_mask
from krproxy.fakes.plugin import Misbehaviour, write_registration
from krproxy.grpcstatus import Status
from krproxy.hooks.points import HookPoint
from krproxy.nri import plugin as nri_plugin
from krproxy.nri.plugin import NriConfig
from krproxy.proto.nri.pkg.api import v1alpha1 as api
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.integration.nri_support import (
    LIMIT,
    Node,
    container,
    nri_resources,
    pod,
    start_node,
)
from tests.integration.support import STARTUP_LIMIT, wait_until
from tests.records import RESIZED_CPU


@pytest.fixture
async def node(nursery: trio.Nursery, short_tmp: object) -> Node:
    return await start_node(nursery, short_tmp)


class TestCommand:
    async def test_krproxy_nri_process(self, node: Node) -> None:
        """``krproxy nri`` as a process registers with the runtime, and exits 0 on SIGTERM."""
        os.makedirs(node.hook_dir, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "krproxy",
            "nri",
            "--nri-socket",
            f"unix://{node.runtime.socket_path}",
        ]
        command += ["--plugin-index", "07", "--hook-dir", node.hook_dir, "--insecure-registration-files"]
        with trio.fail_after(STARTUP_LIMIT):  # a process's start, then its registration and stop
            process = await trio.lowlevel.open_process(command, stderr=subprocess.DEVNULL)
            try:
                await node.runtime.wait_for_plugins(1)
                assert "07" == node.runtime.plugins[0].index
                process.send_signal(signal.SIGTERM)
                assert 0 == await process.wait()
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()


class TestRestarts:
    async def test_krproxy_restart_loses_no_hook(self, node: Node) -> None:
        """krproxy stopped mid-lifecycle and started again: the pod run meanwhile is in its store from
        Synchronize, and the next event reaches the hook server with the pod's labels and annotations."""
        fake = await node.hook_server("h", [HookPoint.PRE_CREATE_CONTAINER, HookPoint.PRE_START_CONTAINER])
        os.makedirs(node.hook_dir, exist_ok=True)
        config = NriConfig(
            socket=node.runtime.socket_path, hook_dir=node.hook_dir, insecure_registration_files=True
        )
        with trio.fail_after(LIMIT):
            with trio.CancelScope() as first:
                async with trio.open_nursery() as n:
                    await n.start(nri_plugin.serve, config)
                    await node.runtime.wait_for_plugins(1)
                    first.cancel()
            await node.runtime.wait_for_plugins(0)
            await node.runtime.run_pod(pod())  # while krproxy is away
            plugin = await node.nursery.start(nri_plugin.serve, config)
            await node.runtime.wait_for_plugins(1)
            await plugin.synchronized.wait()
            assert "web" == plugin.store.pods()["pod-web"].name
            await node.runtime.create_container(container())
        [request] = fake.requests(HookPoint.PRE_CREATE_CONTAINER)
        assert {"app": "web"} == request.pod_labels
        assert {"kubernetes.io/config.source": "api"} == request.pod_annotations

    async def test_runtime_restart(self, node: Node, nursery: trio.Nursery) -> None:
        """The runtime going away and coming back on the same path: krproxy registers with the new one,
        which synchronizes it, and hooks run again."""
        fake = await node.hook_server("h", [HookPoint.PRE_CREATE_CONTAINER, HookPoint.PRE_START_CONTAINER])
        path = os.path.join(node.sockdir, "restart.sock")
        config = NriConfig(socket=path, hook_dir=node.hook_dir, insecure_registration_files=True)
        with trio.fail_after(LIMIT):
            with trio.CancelScope() as first_life:
                async with trio.open_nursery() as n:
                    first = await n.start(FakeNriRuntime(path).serve)
                    plugin = await nursery.start(nri_plugin.serve, config)
                    await first.wait_for_plugins(1)
                    first_life.cancel()
            second = FakeNriRuntime(path)
            second.pods["pod-web"] = pod()
            await nursery.start(second.serve)
            await second.wait_for_plugins(1)
            await wait_until(lambda: "pod-web" in plugin.store.pods())
            await second.create_container(container())
        assert 1 == len(fake.requests(HookPoint.PRE_CREATE_CONTAINER))


class TestAdmin:
    async def test_readyz_and_status(self, nursery: trio.Nursery, short_tmp: object) -> None:
        """/readyz says why krproxy is not ready until it is registered and synchronized; /status and
        ``krproxy status`` describe the NRI connection and the hook servers."""
        sockdir = str(short_tmp)
        socket_path = os.path.join(sockdir, "nri.sock")
        hook_dir = os.path.join(sockdir, "hooks")
        write_registration(hook_dir, "h", os.path.join(sockdir, "h.sock"), [HookPoint.PRE_CREATE_CONTAINER])
        config = NriConfig(
            socket=socket_path,
            hook_dir=hook_dir,
            insecure_registration_files=True,
            metrics_address="127.0.0.1:0",
        )
        with trio.fail_after(LIMIT):
            plugin = await nursery.start(nri_plugin.serve, config)
            await wait_until(lambda: "cannot connect" in plugin.last_error)
            address = plugin.admin_address
            code, text = await trio.to_thread.run_sync(get, address, "/readyz")
            assert 503 == code and f"not registered with the runtime's NRI at {socket_path}" in text
            # No socket there: the reason says what to check (NRI off in containerd, or a wrong flag).
            assert "is NRI enabled in the runtime (docs/nri.md, Enabling NRI;" in text
            assert "--nri-socket" in text
            runtime = FakeNriRuntime(socket_path)
            await nursery.start(runtime.serve)
            await runtime.wait_for_plugins(1)
            await plugin.synchronized.wait()
            assert (200, "ready") == await trio.to_thread.run_sync(get, address, "/readyz")
            status = await trio.to_thread.run_sync(admin.fetch_status, address)
        assert "50-krproxy" == status["nri"]["plugin"] and status["nri"]["registered"]
        assert ["h"] == [p["name"] for p in status["plugins"]]
        report = admin.render_status(status)
        assert (
            f"nri: {socket_path} — registered as 50-krproxy, runtime fake-containerd 2.3.4 (NRI v0.12.2), "
            in report
        )
        assert "ready: yes" in report


def get(address: str, path: str) -> tuple[int, str]:
    connection = http.client.HTTPConnection(address, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode().strip()
    finally:
        connection.close()


RESIZE = HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES
#: A pod resized to 1.5 CPUs and 1 GiB, with a RuntimeClass overhead, as containerd 2.3 tells NRI.
RESIZED = nri_resources(**RESIZED_CPU, memory_limit_in_bytes=1 << 30)
OVERHEAD = api.LinuxResources(cpu=api.LinuxCpu(shares=api.OptionalUInt64(value=25)))


class TestPodResize:
    async def test_hook_server_told_the_pod_and_the_requested_resources(self, node: Node) -> None:
        """At NRI 0.12's UpdatePodSandbox the PreUpdatePodSandboxResources server gets the pod's labels,
        annotations and the requested resources and overhead; an echo lets the resize through."""
        fake = await node.hook_server("resize", [RESIZE])
        with trio.fail_after(LIMIT):
            await node.start_krproxy()
            await node.runtime.run_pod(pod())
            await node.runtime.update_pod("pod-web", RESIZED, OVERHEAD)
        [connected] = node.runtime.plugins
        assert connected.subscribed(api.Event.UPDATE_POD_SANDBOX)
        [request] = fake.requests(RESIZE)
        assert ({"app": "web"}, "api") == (
            request.labels,
            request.annotations["kubernetes.io/config.source"],
        )
        assert (150_000, 100_000, 1536, 1 << 30) == (
            request.resources.cpu_quota,
            request.resources.cpu_period,
            request.resources.cpu_shares,
            request.resources.memory_limit_in_bytes,
        )
        assert 25 == request.overhead.cpu_shares
        assert RESIZED == node.runtime.pods["pod-web"].linux.pod_resources  # type: ignore[union-attr]

    async def test_fail_refuses_the_resize(self, node: Node) -> None:
        """A Fail server's refusal is krproxy's error to NRI, which fails the resize."""
        fake = await node.hook_server("guard", [RESIZE], policy="Fail")
        fake.misbehave(Misbehaviour(status=Status.PERMISSION_DENIED, message="no more cpu", times=None))
        with trio.fail_after(LIMIT):
            await node.start_krproxy()
            await node.runtime.run_pod(pod())
            with pytest.raises(NriError, match="hook server guard failed PreUpdatePodSandboxResources"):
                await node.runtime.update_pod("pod-web", RESIZED, OVERHEAD)
        assert node.runtime.pods["pod-web"].linux.pod_resources is None  # type: ignore[union-attr]

    async def test_changed_resources_are_said_not_applied(self, node: Node) -> None:
        """NRI cannot change a resize: a server's changed resources are logged and counted, the resize goes
        on as kubelet asked."""

        def halve(request: Any) -> Any:
            answer = hookapi.PodSandboxHookResponse(resources=request.resources)
            answer.resources.cpu_quota = 75_000  # type: ignore[union-attr]
            return answer

        fake = await node.hook_server("halve", [RESIZE])
        fake.answer(RESIZE, halve)
        with trio.fail_after(LIMIT):
            plugin = await node.start_krproxy()
            await node.runtime.run_pod(pod())
            await node.runtime.update_pod("pod-web", RESIZED, OVERHEAD)
        counter = plugin.metrics.nri_not_applied
        assert 1 == counter.labels("PreUpdatePodSandboxResources", "resources")._value.get()
        assert RESIZED == node.runtime.pods["pod-web"].linux.pod_resources  # type: ignore[union-attr]

    async def test_a_runtime_before_nri_0_12_has_no_such_event(self, node: Node) -> None:
        """An older runtime would refuse a subscription to UPDATE_POD_SANDBOX (and drop krproxy): krproxy
        leaves it out, says the point is unavailable, and serves its other points."""
        node.runtime.nri_version = ""
        fake = await node.hook_server("both", [RESIZE, HookPoint.PRE_CREATE_CONTAINER])
        with trio.fail_after(LIMIT):
            await node.start_krproxy()
            await node.runtime.run_pod(pod())
            await node.runtime.update_pod("pod-web", RESIZED)
            await node.runtime.create_container(container())
        [connected] = node.runtime.plugins
        assert event_mask({api.Event.CREATE_CONTAINER}) == connected.events
        assert [] == node.runtime.dropped
        assert [HookPoint.PRE_CREATE_CONTAINER] == fake.hooks_called()
