"""Hook plugins in front of a real containerd: what they ask for lands in the real cgroup v1 files.

The plugin is ``tests/e2e/plugin_process.py`` in its own process (started by the ``plugins``
fixture); it logs every request it receives, so the tests assert what the proxy sent it.
Pods are always removed directly through containerd at the end, whatever the hooks did.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from krproxy import kubelet
from tests.e2e.plugin_process import ALL_HOOKS, register
from tests.e2e.support import (
    CGROUP_ROOT,
    TIMEOUT,
    Containerd,
    Cri,
    Plugin,
    Proxy,
    cgroup_file,
    cgroups_of,
    container_config,
    container_pid,
    outcome,
    pod_config,
    sandbox_pid,
    wait_registered,
)

SKIP_LABEL = ("runtimeproxy.koordinator.sh/skip-hookserver", "true")
MiB = 1 << 20

#: What the limits plugin sets on PreCreateContainer (cpuset "0": every machine has a CPU 0 and node 0).
LIMITS = {
    "cpu_quota": 30_000,
    "cpu_period": 100_000,
    "memory_limit_in_bytes": 64 * MiB,
    "cpuset_cpus": "0",
    "cpuset_mems": "0",
}
#: The cgroup v1 files of a container created with :data:`LIMITS` and kubelet's cpu_shares 256.
LIMITED_CGROUP = {
    "cpu.cfs_quota_us": "30000",
    "cpu.cfs_period_us": "100000",
    "cpu.shares": "256",
    "memory.limit_in_bytes": str(64 * MiB),
    "cpuset.cpus": "0",
    "cpuset.mems": "0",
}


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def cleanup(direct: Cri) -> Iterator[list[str]]:
    """Yield a list to append pod ids to; each is stopped and removed directly through containerd."""
    pods: list[str] = []
    try:
        yield pods
    finally:
        for pod_id in pods:
            with contextlib.suppress(grpc.RpcError):
                direct.runtime.StopPodSandbox(
                    pb.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT
                )
            with contextlib.suppress(grpc.RpcError):
                direct.runtime.RemovePodSandbox(
                    pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT
                )


def run_pod(cri: Cri, config: Any, pods: list[str]) -> str:
    pod_id: str = cri.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=config), timeout=kubelet.RUN_POD_SANDBOX_TIMEOUT
    ).pod_sandbox_id
    pods.append(pod_id)
    return pod_id


def create_container(cri: Cri, pod_id: str, pod: Any, config: Any) -> str:
    request = pb.CreateContainerRequest(pod_sandbox_id=pod_id, config=config, sandbox_config=pod)
    container_id: str = cri.runtime.CreateContainer(request, timeout=TIMEOUT).container_id
    return container_id


def start(cri: Cri, container_id: str) -> None:
    cri.runtime.StartContainer(pb.StartContainerRequest(container_id=container_id), timeout=TIMEOUT)


def update(cri: Cri, container_id: str, **resources: Any) -> None:
    request = pb.UpdateContainerResourcesRequest(
        container_id=container_id, linux=pb.LinuxContainerResources(**resources)
    )
    cri.runtime.UpdateContainerResources(request, timeout=TIMEOUT)


def cgroup_values(pid: int) -> dict[str, str]:
    """The resource files of ``pid``'s cgroups that the tests set."""
    paths = cgroups_of(pid)
    return {
        "cpu.cfs_quota_us": cgroup_file("cpu", paths["cpu"], "cpu.cfs_quota_us"),
        "cpu.cfs_period_us": cgroup_file("cpu", paths["cpu"], "cpu.cfs_period_us"),
        "cpu.shares": cgroup_file("cpu", paths["cpu"], "cpu.shares"),
        "memory.limit_in_bytes": cgroup_file("memory", paths["memory"], "memory.limit_in_bytes"),
        "cpuset.cpus": cgroup_file("cpuset", paths["cpuset"], "cpuset.cpus"),
        "cpuset.mems": cgroup_file("cpuset", paths["cpuset"], "cpuset.mems"),
    }


def status_resources(cri: Cri, container_id: str) -> dict[str, Any]:
    """ContainerStatus's ``resources.linux`` (containerd 1.6.20 fills it) as a dict of the fields we set."""
    linux = cri.runtime.ContainerStatus(
        pb.ContainerStatusRequest(container_id=container_id), timeout=TIMEOUT
    ).status.resources.linux
    return {field: getattr(linux, field) for field in (*LIMITS, "cpu_shares")}


def resources(**fields: Any) -> dict[str, Any]:
    """A hook-protocol LinuxContainerResources as the plugin logs it (defaults included)."""
    base: dict[str, Any] = {
        "cpu_period": 0,
        "cpu_quota": 0,
        "cpu_shares": 0,
        "memory_limit_in_bytes": 0,
        "oom_score_adj": 0,
        "cpuset_cpus": "",
        "cpuset_mems": "",
        "hugepage_limits": [],
        "unified": {},
        "memory_swap_limit_in_bytes": 0,
    }
    return {**base, **fields}


def pod_meta(config: Any) -> dict[str, Any]:
    meta = config.metadata
    return {"name": meta.name, "uid": meta.uid, "namespace": meta.namespace, "attempt": meta.attempt}


def containers_in(direct: Cri, pod_id: str) -> list[Any]:
    request = pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod_id))
    return list(direct.runtime.ListContainers(request, timeout=TIMEOUT).containers)


def ctr_containers(containerd: Containerd) -> set[str] | None:
    """Container ids containerd itself holds in the CRI namespace (None if ``ctr`` is missing)."""
    if shutil.which(containerd.ctr) is None:
        return None
    listed = subprocess.run(
        [containerd.ctr, "-a", containerd.socket, "-n", "k8s.io", "containers", "ls", "-q"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    )
    return set(listed.stdout.split())


# --------------------------------------------------------------------------- tests


class TestResources:
    def test_pre_create_and_pre_update_reach_the_cgroup_files(
        self, containerd: Containerd, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
    ) -> None:
        """PreCreateContainer's quota, period, memory limit and cpuset are in the container's cgroup v1 files
        and ContainerStatus; PreUpdateContainerResources overrides the quota kubelet asks for."""
        plugin = plugins(
            "limits",
            hooks=["PreCreateContainer", "PreUpdateContainerResources"],
            failure_policy="Fail",
            resources={"PreCreateContainer": LIMITS, "PreUpdateContainerResources": {"cpu_quota": 20_000}},
        )
        pod = pod_config(containerd.cgroup_parent, "limits")
        container = container_config(containerd.busybox)
        container.linux.resources.cpu_shares = 256  # kubelet's value: the plugin echoes it back
        with cleanup(direct) as pods:
            pod_id = run_pod(via_proxy, pod, pods)
            cid = create_container(via_proxy, pod_id, pod, container)
            start(via_proxy, cid)

            [request] = plugin.requests("PreCreateContainer")
            assert pod_meta(pod) == request["pod_meta"]
            assert {"name": "loop", "attempt": 0, "id": ""} == request["container_meta"]
            assert resources(cpu_shares=256) == request["container_resources"]
            assert pod.linux.cgroup_parent == request["pod_cgroup_parent"]

            pid = container_pid(direct, cid)
            expected_cgroup = f"/{containerd.cgroup_parent}/pod-{pod.metadata.uid}/{cid}"
            assert {"cpu": expected_cgroup, "memory": expected_cgroup, "cpuset": expected_cgroup} == {
                c: cgroups_of(pid)[c] for c in ("cpu", "memory", "cpuset")
            }
            assert LIMITED_CGROUP == cgroup_values(pid)
            assert {**LIMITS, "cpu_shares": 256} == status_resources(via_proxy, cid)

            # kubelet's update asks for quota 50000 and 512 shares; the plugin cuts the quota to 20000.
            update(
                via_proxy,
                cid,
                cpu_period=100_000,
                cpu_quota=50_000,
                cpu_shares=512,
                memory_limit_in_bytes=64 * MiB,
            )
            [request] = plugin.requests("PreUpdateContainerResources")
            assert {"name": "loop", "attempt": 0, "id": cid} == request["container_meta"]
            assert (
                resources(**{**LIMITS, "cpu_quota": 50_000, "cpu_shares": 512})
                == request["container_resources"]
            )
            values = cgroup_values(pid)
            assert ("20000", "512", "0") == (
                values["cpu.cfs_quota_us"],
                values["cpu.shares"],
                values["cpuset.cpus"],
            )
            assert {**LIMITS, "cpu_quota": 20_000, "cpu_shares": 512} == status_resources(via_proxy, cid)

    def test_pre_run_pod_sandbox_moves_the_pod_cgroup(
        self, containerd: Containerd, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
    ) -> None:
        """PreRunPodSandbox moves the pod's cgroup parent (and PreCreateContainer its container's) on disk."""
        moved_prefix = f"/{containerd.cgroup_parent}/moved"
        plugin = plugins(
            "mover",
            hooks=["PreRunPodSandbox", "PreCreateContainer"],
            failure_policy="Fail",
            move_pods_to=moved_prefix,
        )
        pod = pod_config(containerd.cgroup_parent, "moved")
        moved = f"{moved_prefix}-{pod.metadata.uid}"
        with cleanup(direct) as pods:
            pod_id = run_pod(via_proxy, pod, pods)
            cid = create_container(via_proxy, pod_id, pod, container_config(containerd.busybox))
            start(via_proxy, cid)

            [pod_request] = plugin.requests("PreRunPodSandbox")
            assert pod.linux.cgroup_parent == pod_request["cgroup_parent"]
            [container_request] = plugin.requests("PreCreateContainer")
            assert pod.linux.cgroup_parent == container_request["pod_cgroup_parent"]

            pause = cgroups_of(sandbox_pid(direct, pod_id))
            assert (f"{moved}/{pod_id}", f"{moved}/{pod_id}") == (pause["cpu"], pause["memory"])
            pid = container_pid(direct, cid)
            container = cgroups_of(pid)
            assert (f"{moved}/{cid}", f"{moved}/{cid}") == (container["cpu"], container["memory"])
            procs = CGROUP_ROOT / "cpu" / moved.lstrip("/") / cid / "cgroup.procs"
            assert str(pid) in procs.read_text().split()
            assert not (CGROUP_ROOT / "cpu" / pod.linux.cgroup_parent.lstrip("/")).exists()


class TestFailurePolicy:
    def test_failing_plugin_rejects_create_container(
        self, containerd: Containerd, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
    ) -> None:
        """A Fail plugin answering an error: CreateContainer fails naming plugin and hook; containerd has nothing."""
        plugin = plugins(
            "strict",
            hooks=["PreCreateContainer"],
            failure_policy="Fail",
            error={"PreCreateContainer": "no capacity on this node"},
        )
        pod = pod_config(containerd.cgroup_parent, "rejected")
        before = ctr_containers(containerd)
        with cleanup(direct) as pods:
            pod_id = run_pod(via_proxy, pod, pods)
            code, details = outcome(
                lambda: create_container(via_proxy, pod_id, pod, container_config(containerd.busybox))
            )
            assert grpc.StatusCode.UNKNOWN == code
            assert (
                "hook server err: hook server strict failed PreCreateContainer: INTERNAL: no capacity on this node"
                == details
            )
            assert 1 == len(plugin.requests("PreCreateContainer"))
            assert [] == containers_in(direct, pod_id)
            if before is not None:  # containerd holds the pod's sandbox container and nothing more
                assert before | {pod_id} == ctr_containers(containerd)

    @pytest.mark.parametrize("policy", ["Fail", "Ignore"])
    def test_unreachable_plugin(
        self, policy: str, containerd: Containerd, proxy: Proxy, via_proxy: Cri, direct: Cri
    ) -> None:
        """A plugin whose socket is gone: Fail rejects CreateContainer (nothing created), Ignore goes on."""
        endpoint = str(proxy.hook_dir.parent / "gone.sock")  # nothing ever listens there
        register(proxy.hook_dir, "gone", endpoint, ["PreCreateContainer"], policy)
        wait_registered(proxy, "gone")
        pod = pod_config(containerd.cgroup_parent, "unreachable")
        with cleanup(direct) as pods:
            pod_id = run_pod(via_proxy, pod, pods)
            result = outcome(
                lambda: create_container(via_proxy, pod_id, pod, container_config(containerd.busybox))
            )
            if policy == "Fail":
                code, details = result
                assert grpc.StatusCode.UNKNOWN == code
                assert details.startswith(
                    f"hook server err: hook server gone failed PreCreateContainer: unreachable at {endpoint}"
                )
                assert [] == containers_in(direct, pod_id)
            else:
                assert [result] == [c.id for c in containers_in(direct, pod_id)]


class TestProxyRestart:
    def test_recovered_store_drives_hooks_after_restart(
        self,
        containerd: Containerd,
        proxy: Proxy,
        via_proxy: Cri,
        direct: Cri,
        plugins: Callable[..., Plugin],
    ) -> None:
        """Pods run while the proxy restarts; the new proxy's hooks see the pod and container as they were."""
        moved_prefix = f"/{containerd.cgroup_parent}/moved"
        plugin = plugins(
            "recorder",
            hooks=ALL_HOOKS,
            failure_policy="Fail",
            move_pods_to=moved_prefix,
            resources={"PreCreateContainer": LIMITS, "PreUpdateContainerResources": {"cpu_quota": 15_000}},
        )
        pod = pod_config(containerd.cgroup_parent, "restart")
        pod.metadata.attempt = 1
        pod.labels.update({"app": "e2e", "tier": "restart"})
        pod.annotations.update({"krproxy.io/pod-note": "kept across restarts"})
        container = container_config(containerd.busybox)
        container.metadata.attempt = 2
        container.annotations.update({"krproxy.io/container-note": "also kept"})
        container.envs.extend([pb.KeyValue(key="E2E_A", value="1"), pb.KeyValue(key="E2E_B", value="two")])
        container.linux.resources.cpu_shares = 256
        moved = f"{moved_prefix}-{pod.metadata.uid}"
        with cleanup(direct) as pods:
            pod_id = run_pod(via_proxy, pod, pods)
            cid = create_container(via_proxy, pod_id, pod, container)
            start(via_proxy, cid)
            [before] = plugin.requests("PreStartContainer")  # the stored container, as the proxy knew it
            assert moved == before["pod_cgroup_parent"]
            assert resources(**LIMITS, cpu_shares=256) == before["container_resources"]

            assert 0 == proxy.restart()
            plugin.forget()
            with Cri.connect(proxy.socket) as cri:
                update(
                    cri,
                    cid,
                    cpu_period=100_000,
                    cpu_quota=40_000,
                    cpu_shares=512,
                    memory_limit_in_bytes=64 * MiB,
                )
                pid = container_pid(direct, cid)
                assert ("15000", "512") == (
                    cgroup_file("cpu", cgroups_of(pid)["cpu"], "cpu.cfs_quota_us"),
                    cgroup_file("cpu", cgroups_of(pid)["cpu"], "cpu.shares"),
                )
                cri.runtime.StopContainer(
                    pb.StopContainerRequest(container_id=cid, timeout=10),
                    timeout=kubelet.stop_container_timeout(10),
                )
                cri.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT)

        assert [
            "PreUpdateContainerResources",
            "PostStopContainer",
            "PostStopPodSandbox",
        ] == plugin.hooks_called()
        [update_request] = plugin.requests("PreUpdateContainerResources")
        [stop_container] = plugin.requests("PostStopContainer")
        [stop_pod] = plugin.requests("PostStopPodSandbox")

        # Everything but the resources is what the proxy knew before the restart.
        def identity(request: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in request.items() if k != "container_resources"}

        assert identity(before) == identity(update_request)
        assert identity(before) == identity(stop_container)
        assert {
            "pod_meta": pod_meta(pod),
            "container_meta": {"name": "loop", "attempt": 2, "id": cid},
            "container_annotations": {"krproxy.io/container-note": "also kept"},
            "pod_labels": {"app": "e2e", "tier": "restart"},
            "pod_annotations": {"krproxy.io/pod-note": "kept across restarts"},
            "pod_cgroup_parent": moved,
            "container_envs": {"E2E_A": "1", "E2E_B": "two"},
            "pod_resources": None,
        } == identity(update_request)

        # Resources: recovered from containerd's ContainerStatus, merged with kubelet's update. containerd
        # reports swap = memory limit (derived, nobody asked for it); recovery keeps the requested 0.
        recovered = resources(**LIMITS, cpu_shares=256, memory_swap_limit_in_bytes=0)
        assert {**recovered, "cpu_quota": 40_000, "cpu_shares": 512} == update_request["container_resources"]
        assert {**recovered, "cpu_quota": 15_000, "cpu_shares": 512} == stop_container["container_resources"]

        assert {
            "pod_meta": pod_meta(pod),
            "runtime_handler": "",
            "labels": {"app": "e2e", "tier": "restart"},
            "annotations": {"krproxy.io/pod-note": "kept across restarts"},
            "cgroup_parent": moved,
            "overhead": None,
            "resources": None,
        } == stop_pod


class TestSkipLabel:
    def test_skip_label_pod_gets_no_hooks(
        self, containerd: Containerd, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
    ) -> None:
        """A pod labelled skip-hookserver=true goes through its whole life without a single hook call."""
        plugin = plugins(
            "everything",
            hooks=ALL_HOOKS,
            failure_policy="Fail",
            error={hook: "must not be called" for hook in ALL_HOOKS},
        )
        pod = pod_config(containerd.cgroup_parent, "skipped")
        pod.labels[SKIP_LABEL[0]] = SKIP_LABEL[1]
        with cleanup(direct) as pods:
            pod_id = run_pod(via_proxy, pod, pods)
            cid = create_container(via_proxy, pod_id, pod, container_config(containerd.busybox))
            start(via_proxy, cid)
            update(via_proxy, cid, cpu_period=100_000, cpu_quota=50_000)
            via_proxy.runtime.StopContainer(
                pb.StopContainerRequest(container_id=cid, timeout=10),
                timeout=kubelet.stop_container_timeout(10),
            )
            via_proxy.runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=TIMEOUT)
            via_proxy.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT)
            via_proxy.runtime.RemovePodSandbox(
                pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT
            )
            assert [] == plugin.hooks_called()

            # The same plugin is live: a pod without the label is refused by it.
            code, details = outcome(
                lambda: run_pod(via_proxy, pod_config(containerd.cgroup_parent, "hooked"), pods)
            )
            assert (grpc.StatusCode.UNKNOWN, ["PreRunPodSandbox"]) == (code, plugin.hooks_called())
            assert "hook server everything failed PreRunPodSandbox: INTERNAL: must not be called" in details


class TestReading:
    def test_a_varint_past_64_bits_is_read_as_containerd_reads_it(
        self, containerd: Containerd, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
    ) -> None:
        """A RunPodSandbox whose pod attempt is a varint of more than 64 bits: google.golang.org/protobuf
        refuses it (tests/godecode; test_hooks_reading_go.py's xfail), but containerd 1.6, 1.7 and 2.1
        read it cut to 64 bits, as upb does. So does krproxy: a
        plugin that moves the pod sees the attempt containerd records, straight or through krproxy's
        rewrite of the request."""
        plugin = plugins(
            "mover",
            hooks=["PreRunPodSandbox"],
            failure_policy="Fail",
            move_pods_to=f"/{containerd.cgroup_parent}/varint",
        )
        path = "/runtime.v1.RuntimeService/RunPodSandbox"
        # config (1) sent twice: the second part's metadata (1) attempt (4) is ten bytes whose last is 2
        past = b"\x0a\x0d\x0a\x0b\x20" + b"\xff" * 9 + b"\x02"
        attempts = {}
        with cleanup(direct) as pods:
            for way, cri in (("direct", direct), ("krproxy", via_proxy)):
                pod = pod_config(containerd.cgroup_parent, f"varint-{way}")
                answer = cri.raw(path, pb.RunPodSandboxRequest(config=pod).SerializeToString() + past)
                pod_id = pb.RunPodSandboxResponse.FromString(answer).pod_sandbox_id
                pods.append(pod_id)
                status = direct.runtime.PodSandboxStatus(
                    pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT
                )
                attempts[way] = status.status.metadata.attempt
            [hooked] = plugin.requests("PreRunPodSandbox")
            assert {"direct": 2**32 - 1, "krproxy": 2**32 - 1} == attempts
            assert 2**32 - 1 == hooked["pod_meta"]["attempt"], hooked
