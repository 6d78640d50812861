"""The transparent proxy in front of a real containerd: ``krproxy serve`` as a subprocess, no hook plugins.

Clients are grpcio with the upstream CRI stubs, so nothing of krproxy's own is on the client side.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as pb

from krproxy import kubelet
from tests.e2e.support import (
    TIMEOUT,
    VOLATILE,
    Containerd,
    Cri,
    Proxy,
    container_config,
    normalised,
    outcome,
    pod_config,
    running_pod,
    wait_until,
)

RUNTIME = "/runtime.v1.RuntimeService/"
IMAGE = "/runtime.v1.ImageService/"
WANTED_EVENTS = {pb.CONTAINER_CREATED_EVENT, pb.CONTAINER_STARTED_EVENT}


#: What changes between two ListPodSandboxMetrics answers: each metric's sample and its time.
METRICS_VOLATILE = frozenset({"timestamp", "value"})


def status_calls(
    path: str, request: Any, field: str, known: Any, unknown: Any
) -> list[tuple[str, Any, frozenset[str]]]:
    """``path``'s call for the object ``known`` (its ``field``), verbose too, and for one that does not exist."""
    stable: frozenset[str] = frozenset()
    return [
        (path, request(**{field: known}), stable),
        (path, request(**{field: known}, verbose=True), stable),
        (path, request(**{field: unknown}), stable),
    ]


def read_calls(pod_id: str, container_id: str, image: str) -> list[tuple[str, Any, frozenset[str]]]:
    """(method path, request, fields to ignore) for every read-only CRI call, errors included."""
    stable: frozenset[str] = frozenset()
    return [
        (RUNTIME + "Version", pb.VersionRequest(version="v1"), stable),
        (RUNTIME + "Status", pb.StatusRequest(), stable),
        (RUNTIME + "Status", pb.StatusRequest(verbose=True), stable),
        (RUNTIME + "RuntimeConfig", pb.RuntimeConfigRequest(), stable),
        (RUNTIME + "ListPodSandbox", pb.ListPodSandboxRequest(), stable),
        (
            RUNTIME + "ListPodSandbox",
            pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(id=pod_id)),
            stable,
        ),
        *status_calls(
            RUNTIME + "PodSandboxStatus", pb.PodSandboxStatusRequest, "pod_sandbox_id", pod_id, "no-such-pod"
        ),
        (RUNTIME + "ListContainers", pb.ListContainersRequest(), stable),
        (
            RUNTIME + "ListContainers",
            pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod_id)),
            stable,
        ),
        *status_calls(
            RUNTIME + "ContainerStatus",
            pb.ContainerStatusRequest,
            "container_id",
            container_id,
            "no-such-container",
        ),
        (RUNTIME + "ContainerStats", pb.ContainerStatsRequest(container_id=container_id), VOLATILE),
        (RUNTIME + "ContainerStats", pb.ContainerStatsRequest(container_id="no-such-container"), stable),
        (RUNTIME + "ListContainerStats", pb.ListContainerStatsRequest(), VOLATILE),
        (RUNTIME + "PodSandboxStats", pb.PodSandboxStatsRequest(pod_sandbox_id=pod_id), VOLATILE),
        (RUNTIME + "ListPodSandboxStats", pb.ListPodSandboxStatsRequest(), VOLATILE),
        (RUNTIME + "ListMetricDescriptors", pb.ListMetricDescriptorsRequest(), stable),
        # containerd 2.3 and later answer with each metric's current value, which moves between two calls.
        (RUNTIME + "ListPodSandboxMetrics", pb.ListPodSandboxMetricsRequest(), METRICS_VOLATILE),
        (IMAGE + "ListImages", pb.ListImagesRequest(), stable),
        *status_calls(
            IMAGE + "ImageStatus",
            pb.ImageStatusRequest,
            "image",
            pb.ImageSpec(image=image),
            pb.ImageSpec(image="no/such:image"),
        ),
        (IMAGE + "ImageFsInfo", pb.ImageFsInfoRequest(), VOLATILE),
    ]


def answer(cri: Cri, path: str, request: Any, volatile: frozenset[str]) -> Any:
    """The normalised reply to ``request``, or ``(code, details)`` if the call failed."""
    reply_type = getattr(pb, path.rsplit("/", 1)[1] + "Response")
    result = outcome(lambda: reply_type.FromString(cri.raw(path, request.SerializeToString())))
    return result if isinstance(result, tuple) else normalised(result, volatile)


def pod_status(cri: Cri, pod_id: str) -> Any:
    return cri.runtime.PodSandboxStatus(
        pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT
    ).status


def container_status(cri: Cri, container_id: str) -> Any:
    return cri.runtime.ContainerStatus(
        pb.ContainerStatusRequest(container_id=container_id), timeout=TIMEOUT
    ).status


def running(marker: str) -> bool:
    """True if some process's command line contains ``marker``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


class TestPodLifecycle:
    def test_full_lifecycle_through_proxy(self, containerd: Containerd, via_proxy: Cri) -> None:
        """A pod and its container go through their whole life with every call made through the proxy."""
        rt = via_proxy.runtime
        config = pod_config(containerd.cgroup_parent, "lifecycle")
        request = pb.RunPodSandboxRequest(config=config)
        pod_id = rt.RunPodSandbox(request, timeout=kubelet.RUN_POD_SANDBOX_TIMEOUT).pod_sandbox_id
        assert pb.SANDBOX_READY == pod_status(via_proxy, pod_id).state

        request = pb.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=container_config(containerd.busybox), sandbox_config=config
        )
        cid = rt.CreateContainer(request, timeout=TIMEOUT).container_id
        status = container_status(via_proxy, cid)
        assert (pb.CONTAINER_CREATED, "loop") == (status.state, status.metadata.name)

        rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=TIMEOUT)
        assert pb.CONTAINER_RUNNING == container_status(via_proxy, cid).state

        exec_ok = rt.ExecSync(
            pb.ExecSyncRequest(container_id=cid, cmd=["echo", "hello"], timeout=10),
            timeout=kubelet.exec_sync_timeout(10),
        )
        assert (0, b"hello\n", b"") == (exec_ok.exit_code, exec_ok.stdout, exec_ok.stderr)
        exec_failing = rt.ExecSync(
            pb.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "echo oops >&2; exit 3"], timeout=10),
            timeout=kubelet.exec_sync_timeout(10),
        )
        assert (3, b"", b"oops\n") == (exec_failing.exit_code, exec_failing.stdout, exec_failing.stderr)

        started = time.monotonic()
        rt.StopContainer(
            pb.StopContainerRequest(container_id=cid, timeout=10), timeout=kubelet.stop_container_timeout(10)
        )
        assert time.monotonic() - started < 5, "StopContainer waited out its timeout"
        assert pb.CONTAINER_EXITED == container_status(via_proxy, cid).state

        rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=TIMEOUT)
        listed = rt.ListContainers(
            pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod_id)), timeout=TIMEOUT
        )
        assert [] == list(listed.containers)

        rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT)
        assert pb.SANDBOX_NOTREADY == pod_status(via_proxy, pod_id).state
        rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT)
        assert grpc.StatusCode.NOT_FOUND == outcome(lambda: pod_status(via_proxy, pod_id))[0]


class TestReadOnlyCalls:
    def test_answers_identical_to_direct(self, containerd: Containerd, direct: Cri, via_proxy: Cri) -> None:
        """Every read-only RuntimeService and ImageService call answers the same through the proxy as directly."""
        with running_pod(direct, containerd) as pod:
            differing = {}
            for path, request, volatile in read_calls(pod.id, pod.container_id, containerd.busybox):
                expected = answer(direct, path, request, volatile)
                actual = answer(via_proxy, path, request, volatile)
                if expected != actual:
                    differing[f"{path} {request}"] = (expected, actual)
        assert {} == differing

    def test_unknown_methods_unimplemented(self, direct: Cri, via_proxy: Cri) -> None:
        """A method or service containerd does not know comes back UNIMPLEMENTED, as it does directly."""
        for path in (RUNTIME + "NoSuchMethod", "/no.such.Service/Method"):
            expected = outcome(lambda p=path: direct.raw(p, b"\x08\x01"))
            assert grpc.StatusCode.UNIMPLEMENTED == expected[0]
            assert expected == outcome(lambda p=path: via_proxy.raw(p, b"\x08\x01"))


class TestNewerMethods:
    """Methods and fields newer containerds added reach the client unchanged through the proxy."""

    def test_new_methods_answer_as_direct(self, containerd: Containerd, direct: Cri, via_proxy: Cri) -> None:
        """RuntimeConfig, ListMetricDescriptors, UpdatePodSandboxResources: the same answer or error both ways.

        What they answer depends on the version (docs/testing.md, "The end-to-end matrix"): 1.6
        knows none of them, 1.7 answers RuntimeConfig and ListMetricDescriptors "not implemented",
        2.1.9 answers RuntimeConfig with its cgroup driver; none knows UpdatePodSandboxResources.
        The test pins RuntimeConfig's answer per major version and requires the proxy to give
        exactly what containerd gives for each.
        """
        with running_pod(direct, containerd) as pod:
            update = pb.UpdatePodSandboxResourcesRequest(
                pod_sandbox_id=pod.id,
                resources=pb.LinuxContainerResources(cpu_shares=2, cpu_period=100_000),
            )
            calls = [
                (RUNTIME + "RuntimeConfig", pb.RuntimeConfigRequest()),
                (RUNTIME + "ListMetricDescriptors", pb.ListMetricDescriptorsRequest()),
                (RUNTIME + "UpdatePodSandboxResources", update),
            ]
            answers = {
                path.rsplit("/", 1)[1]: (
                    answer(direct, path, request, frozenset()),
                    answer(via_proxy, path, request, frozenset()),
                )
                for path, request in calls
            }
        assert {name: pair[0] for name, pair in answers.items()} == {
            name: pair[1] for name, pair in answers.items()
        }
        config = answers["RuntimeConfig"][1]
        if containerd.major >= 2:
            assert pb.CGROUPFS == config.linux.cgroup_driver
        else:
            assert grpc.StatusCode.UNIMPLEMENTED == config[0]

    def test_status_fields_of_the_version(self, containerd: Containerd, direct: Cri, via_proxy: Cri) -> None:
        """Status through the proxy carries what this containerd puts there (2.x: runtime handlers, features)."""
        expected = direct.runtime.Status(pb.StatusRequest(), timeout=TIMEOUT)
        actual = via_proxy.runtime.Status(pb.StatusRequest(), timeout=TIMEOUT)
        assert normalised(expected) == normalised(actual)
        if containerd.major >= 2:
            assert {"runc", "krproxy-oci"} <= {h.name for h in actual.runtime_handlers}


class TestContainerEvents:
    def test_events_streamed_or_unimplemented_as_direct(
        self, containerd: Containerd, direct: Cri, via_proxy: Cri
    ) -> None:
        """GetContainerEvents through the proxy streams a new container's events, or fails exactly as directly."""
        stream = via_proxy.runtime.GetContainerEvents(pb.GetEventsRequest(), timeout=60)
        events: list[Any] = []

        def consume() -> Any:
            return outcome(lambda: events.extend(stream))

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            consumer = pool.submit(consume)
            with running_pod(direct, containerd) as pod:

                def seen() -> set[int]:
                    return {e.container_event_type for e in events if e.container_id == pod.container_id}

                wait_until(
                    lambda: consumer.done() or WANTED_EVENTS <= seen(), what="container events or an error"
                )
            stream.cancel()
            error = consumer.result()

        if error[0] == grpc.StatusCode.UNIMPLEMENTED:  # containerd < 1.7
            expected = outcome(
                lambda: list(direct.runtime.GetContainerEvents(pb.GetEventsRequest(), timeout=10))
            )
            assert expected == error
        else:
            assert grpc.StatusCode.CANCELLED == error[0]
            assert WANTED_EVENTS <= seen()


class TestContainerdRestart:
    def test_unavailable_while_down_then_recovers(
        self, containerd: Containerd, proxy: Proxy, via_proxy: Cri, direct: Cri
    ) -> None:
        """While containerd is down calls fail UNAVAILABLE naming its socket; once it is back they work again."""
        containerd.crash()
        for call in (
            lambda: via_proxy.runtime.Version(pb.VersionRequest(), timeout=TIMEOUT),
            lambda: via_proxy.image.ListImages(pb.ListImagesRequest(), timeout=TIMEOUT),
        ):
            code, details = outcome(call)
            assert grpc.StatusCode.UNAVAILABLE == code
            assert containerd.socket in details

        containerd.start()  # same DIR, so the same socket path; the stale state is cleaned first
        expected = direct.runtime.Version(pb.VersionRequest(), timeout=TIMEOUT)
        assert expected == via_proxy.runtime.Version(pb.VersionRequest(), timeout=TIMEOUT)
        with running_pod(via_proxy, containerd) as pod:
            request = pb.ExecSyncRequest(container_id=pod.container_id, cmd=["true"], timeout=10)
            assert 0 == via_proxy.runtime.ExecSync(request, timeout=kubelet.exec_sync_timeout(10)).exit_code


class TestShutdown:
    def test_sigterm_lets_in_flight_exec_finish(
        self, containerd: Containerd, proxy: Proxy, direct: Cri
    ) -> None:
        """SIGTERM while an ExecSync runs: the call completes OK, the proxy exits 0 and removes its socket."""
        marker = f"done-{uuid.uuid4().hex[:8]}"
        with running_pod(direct, containerd) as pod, Cri.connect(proxy.socket) as cri:
            request = pb.ExecSyncRequest(
                container_id=pod.container_id, cmd=["sh", "-c", f"sleep 2; echo {marker}"], timeout=30
            )
            started = time.monotonic()
            future = cri.runtime.ExecSync.future(request, timeout=kubelet.exec_sync_timeout(30))
            wait_until(lambda: running(marker), what="exec process running in the container")
            proxy.process.send_signal(signal.SIGTERM)
            reply = future.result()

        assert (0, f"{marker}\n".encode()) == (reply.exit_code, reply.stdout)
        assert time.monotonic() - started >= 2
        assert 0 == proxy.process.wait(TIMEOUT)
        assert not os.path.exists(proxy.socket)
        assert "in_flight=1" in proxy.log
