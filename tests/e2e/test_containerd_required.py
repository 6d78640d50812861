"""A required hook server in front of a real containerd: absent, nothing is created; back, the retry is hooked.

``krproxy serve --required-hook-server limits=PreRunPodSandbox,PreCreateContainer`` with kubelet's deadlines:
while the ``limits`` plugin is not running, RunPodSandbox through krproxy fails UNAVAILABLE and containerd
lists no pod; other calls are unaffected; once the plugin runs, the same calls succeed and its limits are in
the container's cgroup files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from tests.e2e.support import (
    TIMEOUT,
    Containerd,
    Cri,
    Proxy,
    cgroup_file,
    cgroups_of,
    container_config,
    container_pid,
    pod_config,
    start_plugin,
    start_proxy,
    wait_until,
)
from tests.e2e.test_containerd_hooks import LIMITS, cleanup, create_container, run_pod, start
from tests.e2e.test_nri_containerd import krproxy_nri

REQUIRED = (
    "--required-hook-server",
    "limits=PreRunPodSandbox,PreCreateContainer",
    "--required-startup-grace",
    "0",
)


@pytest.fixture
def required_proxy(containerd: Containerd, short_tmp: Path) -> Iterator[Proxy]:
    daemon = start_proxy(short_tmp, containerd.socket, extra=REQUIRED)
    try:
        yield daemon
    finally:
        code = daemon.terminate()
    assert 0 == code, f"krproxy exited with {code}; log:\n{daemon.log}"


def test_absent_server_holds_the_pod_until_it_is_back(
    containerd: Containerd, required_proxy: Proxy, direct: Cri
) -> None:
    pod = pod_config(containerd.cgroup_parent, "required")
    with Cri.connect(required_proxy.socket) as via_proxy, cleanup(direct) as pods:
        with pytest.raises(grpc.RpcError) as info:
            run_pod(via_proxy, pod, pods)

        assert grpc.StatusCode.UNAVAILABLE == info.value.code()
        assert "required hook server limits is not registered" in (info.value.details() or "")
        assert [] == list(direct.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=TIMEOUT).items)
        assert via_proxy.runtime.Version(pb.VersionRequest(), timeout=TIMEOUT).runtime_name
        via_proxy.runtime.ListContainers(pb.ListContainersRequest(), timeout=TIMEOUT)
        via_proxy.runtime.Status(pb.StatusRequest(), timeout=TIMEOUT)
        via_proxy.image.ImageStatus(
            pb.ImageStatusRequest(image=pb.ImageSpec(image=containerd.busybox)), timeout=TIMEOUT
        )
        assert "event=required_server_missing" in required_proxy.log

        plugin = start_plugin(
            required_proxy,
            "limits",
            hooks=["PreRunPodSandbox", "PreCreateContainer"],
            resources={"PreCreateContainer": LIMITS},
        )
        try:
            pod_id = run_pod(via_proxy, pod, pods)  # kubelet's retry
            cid = create_container(via_proxy, pod_id, pod, container_config(containerd.busybox))
            start(via_proxy, cid)

            assert ["PreRunPodSandbox", "PreCreateContainer"] == plugin.hooks_called()
            cgroup = cgroups_of(container_pid(direct, cid))["cpu"]
            assert "30000" == cgroup_file("cpu", cgroup, "cpu.cfs_quota_us")
        finally:
            plugin.stop()


def test_kill_9_and_restart_with_the_server_gone_lets_nothing_through(
    containerd: Containerd, short_tmp: Path, direct: Cri
) -> None:
    """krproxy killed (-9) with its required server, restarted without it: no pod is created in containerd
    until the server answers again, and then the retry is hooked."""
    hooks = {"hooks": ["PreRunPodSandbox", "PreCreateContainer"], "resources": {"PreCreateContainer": LIMITS}}
    first = start_proxy(short_tmp, containerd.socket, extra=REQUIRED)
    plugin = start_plugin(first, "limits", **hooks)
    before = pod_config(containerd.cgroup_parent, "before")
    with cleanup(direct) as pods:
        try:
            with Cri.connect(first.socket) as cri:
                run_pod(cri, before, pods)
        finally:
            first.process.kill()
            first.process.wait()
            plugin.stop()

        second = start_proxy(short_tmp, containerd.socket, extra=REQUIRED, log_name="krproxy-2.log")
        try:
            pod = pod_config(containerd.cgroup_parent, "after")
            with Cri.connect(second.socket) as cri:
                for _ in range(3):  # kubelet keeps calling
                    with pytest.raises(grpc.RpcError) as info:
                        run_pod(cri, pod, pods)
                    assert grpc.StatusCode.UNAVAILABLE == info.value.code()
                listed = direct.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=TIMEOUT).items
                assert [before.metadata.name] == [p.metadata.name for p in listed]

                # Its registration file outlived it (kill -9 leaves it): wait for the new process's socket.
                plugin = start_plugin(second, "limits", **hooks)
                wait_until(lambda: os.path.exists(plugin.socket), what="plugin socket")
                plugin.forget()  # the calls file is the first process's too
                run_pod(cri, pod, pods)
                assert ["PreRunPodSandbox"] == plugin.hooks_called()
        finally:
            plugin.stop()
            code = second.terminate()
        assert 0 == code, f"krproxy exited with {code}; log:\n{second.log}"


def test_annotated_container_through_nri(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """``krproxy nri``: a container whose pod names a hook server in NRI's annotation is not created while
    that server is missing (containerd fails CreateContainer with krproxy's answer), and is created with its
    changes once it runs."""
    pod = pod_config(containerd.cgroup_parent, "nri-required")
    pod.annotations["required-plugins.noderesource.dev/container.loop"] = '["limits"]'
    with krproxy_nri(containerd, short_tmp) as daemon, cleanup(direct) as pods:
        pod_id = run_pod(direct, pod, pods)  # NRI cannot hold a sandbox: only its containers
        with pytest.raises(grpc.RpcError) as info:
            create_container(direct, pod_id, pod, container_config(containerd.busybox))

        assert "required hook server limits is not registered" in (info.value.details() or "")
        request = pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod_id))
        assert [] == list(direct.runtime.ListContainers(request, timeout=TIMEOUT).containers)

        plugin = start_plugin(
            daemon, "limits", hooks=["PreCreateContainer"], resources={"PreCreateContainer": LIMITS}
        )
        try:
            cid = create_container(
                direct, pod_id, pod, container_config(containerd.busybox)
            )  # kubelet's retry
            start(direct, cid)
            cgroup = cgroups_of(container_pid(direct, cid))["cpu"]
            assert "30000" == cgroup_file("cpu", cgroup, "cpu.cfs_quota_us")
            assert ["PreCreateContainer"] == plugin.hooks_called()
        finally:
            assert 0 == plugin.stop()


def test_annotated_container_through_the_proxy(containerd: Containerd, short_tmp: Path, direct: Cri) -> None:
    """``krproxy serve`` (no flag): NRI's container-scoped annotation holds that container's CreateContainer,
    and nothing is created in containerd, until the named hook server runs."""
    proxy = start_proxy(short_tmp, containerd.socket)
    pod = pod_config(containerd.cgroup_parent, "annotated")
    pod.annotations["required-plugins.noderesource.dev/container.loop"] = '["limits"]'
    plugin = None
    try:
        with Cri.connect(proxy.socket) as via_proxy, cleanup(direct) as pods:
            pod_id = run_pod(via_proxy, pod, pods)  # the pod itself requires nothing
            with pytest.raises(grpc.RpcError) as info:
                create_container(via_proxy, pod_id, pod, container_config(containerd.busybox))

            assert grpc.StatusCode.UNAVAILABLE == info.value.code()
            assert "required hook server limits is not registered" in (info.value.details() or "")
            request = pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod_id))
            assert [] == list(direct.runtime.ListContainers(request, timeout=TIMEOUT).containers)

            plugin = start_plugin(
                proxy, "limits", hooks=["PreCreateContainer"], resources={"PreCreateContainer": LIMITS}
            )
            cid = create_container(via_proxy, pod_id, pod, container_config(containerd.busybox))
            start(via_proxy, cid)
            cgroup = cgroups_of(container_pid(direct, cid))["cpu"]
            assert "30000" == cgroup_file("cpu", cgroup, "cpu.cfs_quota_us")
    finally:
        if plugin is not None:
            plugin.stop()
        code = proxy.terminate()
    assert 0 == code, f"krproxy exited with {code}; log:\n{proxy.log}"
