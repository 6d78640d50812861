"""A required hook server in front of a real containerd: absent, nothing is created; back, the retry is hooked.

``krproxy serve --required-hook-server limits=PreRunPodSandbox,PreCreateContainer`` with kubelet's deadlines:
while the ``limits`` plugin is not running, RunPodSandbox through krproxy fails UNAVAILABLE and containerd
lists no pod; other calls are unaffected; once the plugin runs, the same calls succeed and its limits are in
the container's cgroup files.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import grpc
import pytest
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pb_grpc

from krproxy.kubelet import RUN_POD_SANDBOX_TIMEOUT as RUN_TIMEOUT
from tests.e2e import test_containerd_pod_resize as resize_e2e
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
    serving_proxy,
    start_plugin,
    start_proxy,
    wait_until,
)
from tests.e2e.test_containerd_hooks import LIMITS, cleanup, create_container, run_pod, start
from tests.e2e.test_nri_containerd import hooks_in_effect, krproxy_nri

REQUIRED = (
    "--required-hook-server",
    "limits=PreRunPodSandbox,PreCreateContainer",
    "--required-startup-grace",
    "0",
)
#: The ``limits`` plugin: called at both points, it sets the container's CPU quota (30000) and memory.
HOOKS: dict[str, Any] = {
    "hooks": ["PreRunPodSandbox", "PreCreateContainer"],
    "resources": {"PreCreateContainer": LIMITS},
}


@pytest.fixture
def required_proxy(containerd: Containerd, short_tmp: Path) -> Iterator[Proxy]:
    with serving_proxy(short_tmp, containerd.socket, REQUIRED) as daemon:
        yield daemon


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

        plugin = start_plugin(required_proxy, "limits", **HOOKS)
        try:
            pod_id = run_pod(via_proxy, pod, pods)  # kubelet's retry
            assert ["PreRunPodSandbox"] == plugin.hooks_called()
        finally:
            assert 0 == plugin.stop()  # gone again (its registration file stays): now CreateContainer

        with pytest.raises(grpc.RpcError) as info:
            create_container(via_proxy, pod_id, pod, container_config(containerd.busybox))
        assert grpc.StatusCode.UNAVAILABLE == info.value.code()
        # Seen up a moment ago, the server is called and found gone (or, once probed, unreachable):
        # either way the message names it and the point, and nothing reaches containerd.
        details = info.value.details() or ""
        assert "required hook server limits" in details and "PreCreateContainer" in details, details
        assert "unreachable" in details, details
        request = pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod_id))
        assert [] == list(direct.runtime.ListContainers(request, timeout=TIMEOUT).containers)

        plugin.forget()  # the calls file is the next process's too
        plugin = start_plugin(required_proxy, "limits", **HOOKS)  # its file is there: returns at once
        wait_until(lambda: os.path.exists(plugin.socket), what="plugin socket")
        try:
            cid = create_container(via_proxy, pod_id, pod, container_config(containerd.busybox))  # retry
            start(via_proxy, cid)

            assert ["PreCreateContainer"] == plugin.hooks_called()
            cgroup = cgroups_of(container_pid(direct, cid))["cpu"]
            assert "30000" == cgroup_file("cpu", cgroup, "cpu.cfs_quota_us")
        finally:
            assert 0 == plugin.stop()


@attrs.define
class Caller:
    """kubelet, calling on through a krproxy restart: RunPodSandbox of one pod and CreateContainer of one
    container in another, each again and again until it succeeds, with kubelet's deadlines and its
    reconnect backoff (100 ms to 3 s); every outcome is kept, in order."""

    socket: str
    run: tuple[Any, list[str]]  # the pod's config, the cleanup list
    create: tuple[str, Any, Any]  # pod id, pod config, container config
    pod_id: str = ""
    container_id: str = ""
    outcomes: list[tuple[str, grpc.StatusCode]] = attrs.field(factory=list)
    stop: threading.Event = attrs.field(factory=threading.Event)

    def loop(self) -> None:
        options = [
            ("grpc.enable_retries", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 3000),
        ]
        with grpc.insecure_channel(f"unix://{self.socket}", options=options) as channel:
            runtime = pb_grpc.RuntimeServiceStub(channel)
            while not self.stop.is_set() and not (self.pod_id and self.container_id):
                if not self.pod_id:
                    config, pods = self.run
                    request = pb.RunPodSandboxRequest(config=config)
                    answer = self._call("RunPodSandbox", runtime.RunPodSandbox, request, RUN_TIMEOUT)
                    if answer is not None:
                        self.pod_id = answer.pod_sandbox_id
                        pods.append(self.pod_id)
                if not self.container_id:
                    pod_id, pod, config = self.create
                    create = pb.CreateContainerRequest(
                        pod_sandbox_id=pod_id, config=config, sandbox_config=pod
                    )
                    answer = self._call("CreateContainer", runtime.CreateContainer, create, TIMEOUT)
                    if answer is not None:
                        self.container_id = answer.container_id
                time.sleep(0.05)

    def _call(self, name: str, method: Any, request: Any, timeout: float) -> Any:
        try:
            answer = method(request, timeout=timeout)
        except grpc.RpcError as err:
            self.outcomes.append((name, err.code()))
            return None
        self.outcomes.append((name, grpc.StatusCode.OK))
        return answer


def test_kill_9_and_restart_under_kubelet_lets_nothing_through(
    containerd: Containerd, short_tmp: Path, direct: Cri
) -> None:
    """The required server and then krproxy are killed (-9) and krproxy restarted, while a caller keeps
    calling RunPodSandbox and CreateContainer through krproxy's socket: containerd creates no pod and no
    container until the server answers again; then the retried calls go through it, its limits in the
    container's cgroup files."""
    first = start_proxy(short_tmp, containerd.socket, extra=REQUIRED)
    plugin = start_plugin(first, "limits", **HOOKS)
    before = pod_config(containerd.cgroup_parent, "before")
    after = pod_config(containerd.cgroup_parent, "after")
    second: Proxy | None = None
    with cleanup(direct) as pods:
        try:
            with Cri.connect(first.socket) as cri:
                pod_id = run_pod(cri, before, pods)
            plugin.process.kill()  # its registration file stays, its socket file too: nothing listens
            plugin.process.wait()
            caller = Caller(
                first.socket, (after, pods), (pod_id, before, container_config(containerd.busybox))
            )
            calling = threading.Thread(target=caller.loop)
            calling.start()
            try:
                wait_until(lambda: len(caller.outcomes) >= 4, what="refused calls before the kill")
                first.process.kill()
                first.process.wait()
                second = start_proxy(short_tmp, containerd.socket, extra=REQUIRED, log_name="krproxy-2.log")
                seen = len(caller.outcomes)
                wait_until(lambda: len(caller.outcomes) >= seen + 4, what="refused calls after the restart")

                listed = direct.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=TIMEOUT).items
                assert [before.metadata.name] == [p.metadata.name for p in listed]
                request = pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod_id))
                assert [] == list(direct.runtime.ListContainers(request, timeout=TIMEOUT).containers)
                assert not caller.pod_id and not caller.container_id

                plugin.forget()  # the calls file is the first process's too
                plugin = start_plugin(second, "limits", **HOOKS)
                wait_until(lambda: bool(caller.pod_id and caller.container_id), 30, "the retries through")
            finally:
                caller.stop.set()
                calling.join()
            start(direct, caller.container_id)

            assert sorted(["PreRunPodSandbox", "PreCreateContainer"]) == sorted(plugin.hooks_called())
            cgroup = cgroups_of(container_pid(direct, caller.container_id))["cpu"]
            assert "30000" == cgroup_file("cpu", cgroup, "cpu.cfs_quota_us")
            refused = [code for _, code in caller.outcomes if code is not grpc.StatusCode.OK]
            assert {grpc.StatusCode.UNAVAILABLE} == set(refused), caller.outcomes
            assert 2 == len(caller.outcomes) - len(refused)  # one success each, nothing created twice
        finally:
            plugin.stop()
            first.terminate()
            code = second.terminate() if second is not None else 0
        assert 0 == code, f"krproxy exited with {code}; log:\n{second.log if second else ''}"


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
    proxy = start_proxy(short_tmp, containerd.socket, extra=("--required-startup-grace", "0"))
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


def test_required_server_holds_the_pod_resize_through_nri(
    containerd: Containerd, direct: Cri, short_tmp: Path
) -> None:
    """``krproxy nri`` on containerd 2.3 or later (NRI 0.12): a server required at PreUpdatePodSandboxResources
    holds UpdatePodSandboxResources (containerd fails it with krproxy's answer) until it runs; then the
    retried resize goes through it."""
    if containerd.release < (2, 3):
        pytest.skip(
            f"containerd {containerd.version} raises no NRI UpdatePodSandbox (NRI 0.12, containerd 2.3 and "
            "later; test_nri_required.py covers it against the fake runtime)"
        )
    hook = resize_e2e.HOOK
    flags = ("--required-hook-server", f"quota={hook}", "--required-startup-grace", "0")
    with krproxy_nri(containerd, short_tmp, extra=flags) as daemon, cleanup(direct) as pods:
        pod_id = run_pod(direct, pod_config(containerd.cgroup_parent, "nri-resize"), pods)
        with pytest.raises(grpc.RpcError) as info:
            direct.runtime.UpdatePodSandboxResources(resize_e2e.resize_request(pod_id), timeout=TIMEOUT)
        assert "required hook server quota is not registered" in (info.value.details() or "")

        plugin = start_plugin(daemon, "quota", hooks=[hook])
        try:
            hooks_in_effect(daemon)
            direct.runtime.UpdatePodSandboxResources(resize_e2e.resize_request(pod_id), timeout=TIMEOUT)
            assert [hook] == plugin.hooks_called()
        finally:
            assert 0 == plugin.stop()


VALIDATOR = """\
[plugins.'io.containerd.nri.v1.nri'.default_validator]
  enable = true
  required_plugins = ['krproxy']
  tolerate_missing_plugins_annotation = 'tolerate-missing-nri-plugins.noderesource.dev'
"""


@contextlib.contextmanager
def requiring_krproxy(containerd: Containerd, workdir: Path) -> Iterator[None]:
    """containerd restarted with its NRI default validator requiring the plugin ``krproxy``; restarted
    without it afterwards (the session's other tests must not need krproxy nri)."""
    validator = workdir / "validator.toml"
    validator.write_text(VALIDATOR)
    containerd.crash()
    containerd.config_imports = [str(validator)]
    containerd.start()
    try:
        yield
    finally:
        containerd.crash()
        containerd.config_imports = []
        containerd.start()


def test_containerd_s_validator_requiring_krproxy_nri(containerd: Containerd, short_tmp: Path) -> None:
    """containerd 2.2 or later with ``required_plugins = ['krproxy']``: while krproxy nri is not registered no container
    is created (pods are: the validator sees containers only), except for a pod with the tolerate annotation
    (krproxy's own pods must carry it); krproxy nri says at start that containerd requires it, reading
    containerd's configuration with its imports; once it runs, containers are created."""
    if containerd.release < (2, 2):
        pytest.skip(
            f"containerd {containerd.version}: the default validator is 2.2 and later "
            "(test_nri_validator.py covers krproxy's side)"
        )
    flags = ("--containerd-config", str(containerd.dir / "config.toml"), "--required-plugins-annotation", "")
    with (
        requiring_krproxy(containerd, short_tmp),
        Cri.connect(containerd.socket) as direct,
        cleanup(direct) as pods,
    ):
        pod = pod_config(containerd.cgroup_parent, "validated")
        pod_id = run_pod(direct, pod, pods)
        with pytest.raises(grpc.RpcError) as info:
            create_container(direct, pod_id, pod, container_config(containerd.busybox))
        assert 'required plugin "krproxy" not present' in (info.value.details() or "")
        request = pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod_id))
        assert [] == list(direct.runtime.ListContainers(request, timeout=TIMEOUT).containers)

        own = pod_config(containerd.cgroup_parent, "krproxy-own")
        own.annotations["tolerate-missing-nri-plugins.noderesource.dev"] = "true"
        own_id = run_pod(direct, own, pods)
        assert create_container(direct, own_id, own, container_config(containerd.busybox))

        with krproxy_nri(containerd, short_tmp, extra=flags) as daemon:
            assert "event=nri_runtime_validator required=yes" in daemon.log
            cid = create_container(direct, pod_id, pod, container_config(containerd.busybox))
            assert [cid] == [c.id for c in direct.runtime.ListContainers(request, timeout=TIMEOUT).containers]
