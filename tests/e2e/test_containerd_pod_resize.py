"""Pod-level resize (CRI UpdatePodSandboxResources, KEP-5419) through ``krproxy serve`` to a real containerd.

containerd 2.3 and later answer the call and reports what it was sent in the verbose PodSandboxStatus
(``info["info"]``: ``resources.linux`` and ``overhead.linux``), which is where these tests look for what
reached it. Older containerd (1.6 to 2.1) lacks the method: the UNIMPLEMENTED answer must reach the
caller unchanged (kubelet then falls back). Each test runs on the containerd versions it is about and
skips with the reason on the others. The matrix's containerd (Debian's 1.6, 1.7, 2.1) has no 2.3, so the
resize tests run against the fake containerd only (tests/integration/test_hooks_pod_resize.py) until
Debian's sid (the ``2.x`` row) moves to 2.3.

The requests carry kubelet's deadline for the call (``--runtime-request-timeout``, krproxy/kubelet.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from krproxy import kubelet
from krproxy.trace.format import read_records
from tests.e2e.support import (
    Containerd,
    Cri,
    Plugin,
    Proxy,
    container_config,
    outcome,
    pod_config,
    start_plugin,
    start_proxy,
    verbose_info,
)
from tests.records import RESIZED_CPU

METHOD = "/runtime.v1.RuntimeService/UpdatePodSandboxResources"
HOOK = "PreUpdatePodSandboxResources"
LABELS = {"app": "resize", "koordinator.sh/qosClass": "LS"}
ANNOTATIONS = {"example.com/owner": "e2e"}
#: What kubelet sends for a pod resized to 1.5 CPUs and 256 MiB, with a RuntimeClass overhead.
RESOURCES = {**RESIZED_CPU, "memory_limit_in_bytes": 256 << 20}
OVERHEAD = {"cpu_shares": 25, "memory_limit_in_bytes": 32 << 20}


@pytest.fixture
def resizing(containerd: Containerd) -> Containerd:
    """containerd 2.3 or later: it answers UpdatePodSandboxResources."""
    if containerd.release < (2, 3):
        pytest.skip(
            f"containerd {containerd.version} lacks UpdatePodSandboxResources (answers UNIMPLEMENTED); "
            "the resize hook needs containerd 2.3 or later (test_hooks_pod_resize.py covers it against the fake)"
        )
    return containerd


@pytest.fixture
def older(containerd: Containerd) -> Containerd:
    """containerd before 2.3: UpdatePodSandboxResources is UNIMPLEMENTED."""
    if containerd.release >= (2, 3):
        pytest.skip(f"containerd {containerd.version} implements UpdatePodSandboxResources")
    return containerd


def resize_request(pod_id: str) -> pb.UpdatePodSandboxResourcesRequest:
    return pb.UpdatePodSandboxResourcesRequest(
        pod_sandbox_id=pod_id,
        overhead=pb.LinuxContainerResources(**OVERHEAD),
        resources=pb.LinuxContainerResources(**RESOURCES),
    )


def resize(cri: Cri, request: pb.UpdatePodSandboxResourcesRequest | bytes) -> None:
    """Call UpdatePodSandboxResources with kubelet's deadline (the upstream stubs predate the method)."""
    data = request if isinstance(request, bytes) else request.SerializeToString()
    call = cri.channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
    call(data, timeout=kubelet.RUNTIME_REQUEST_TIMEOUT)


@contextlib.contextmanager
def labelled_pod(via: Cri, direct: Cri, containerd: Containerd) -> Iterator[str]:
    """A pod (sandbox only) with labels and annotations, run through ``via``, removed directly."""
    config = pod_config(containerd.cgroup_parent, name="resize")
    config.labels.update(LABELS)
    config.annotations.update(ANNOTATIONS)
    request = pb.RunPodSandboxRequest(config=config)
    pod_id = via.runtime.RunPodSandbox(request, timeout=kubelet.RUN_POD_SANDBOX_TIMEOUT).pod_sandbox_id
    try:
        yield pod_id
    finally:
        with contextlib.suppress(grpc.RpcError):
            direct.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=60)
        with contextlib.suppress(grpc.RpcError):
            direct.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=60)


def containerd_sees(direct: Cri, pod_id: str) -> tuple[Any, Any]:
    """The ``resources.linux`` and ``overhead.linux`` containerd 2.3 reports for the sandbox (None if absent)."""
    reply = direct.runtime.PodSandboxStatus(
        pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True), timeout=60
    )
    info = verbose_info(reply)
    return (info.get("resources") or {}).get("linux"), (info.get("overhead") or {}).get("linux")


def test_hook_adjusts_the_resize_containerd_receives(
    resizing: Containerd, proxy: Proxy, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
) -> None:
    """The hook server is told the pod's labels, annotations, requested resources and overhead; its
    lower CFS quota is what containerd records."""
    plugin = plugins("resizer", hooks=[HOOK], resources={HOOK: {"cpu_quota": 100_000}})
    with labelled_pod(via_proxy, direct, resizing) as pod_id:
        resize(via_proxy, resize_request(pod_id))

        [request] = plugin.requests(HOOK)
        assert LABELS.items() <= request["labels"].items()
        assert ANNOTATIONS.items() <= request["annotations"].items()
        assert RESOURCES.items() <= request["resources"].items()
        assert OVERHEAD.items() <= request["overhead"].items()
        resources, overhead = containerd_sees(direct, pod_id)
        assert {**RESOURCES, "cpu_quota": 100_000} == resources
        assert OVERHEAD == overhead


def test_restarted_proxy_recovers_the_resize(
    resizing: Containerd, proxy: Proxy, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
) -> None:
    """After a proxy restart the store is rebuilt from containerd, whose verbose status reports the last
    resize: a later container hook still gets the pod's resources."""
    plugin = plugins("watcher", hooks=["PreCreateContainer"])
    with labelled_pod(via_proxy, direct, resizing) as pod_id:
        resize(via_proxy, resize_request(pod_id))
        assert 0 == proxy.restart()

        config = container_config(resizing.busybox)
        sandbox = direct.runtime.PodSandboxStatus(
            pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id), timeout=60
        )
        request = pb.CreateContainerRequest(
            pod_sandbox_id=pod_id,
            config=config,
            sandbox_config=pod_config(resizing.cgroup_parent, name=sandbox.status.metadata.name),
        )
        via_proxy.runtime.CreateContainer(request, timeout=kubelet.RUNTIME_REQUEST_TIMEOUT)

        [created] = plugin.requests("PreCreateContainer")
        assert RESOURCES.items() <= created["pod_resources"].items()


def test_fail_refuses_the_resize(
    resizing: Containerd, proxy: Proxy, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
) -> None:
    """A refusing hook server under Fail: the caller gets UNKNOWN "hook server err: ...", containerd
    is never asked."""
    plugins("guard", hooks=[HOOK], failure_policy="Fail", error={HOOK: "no room on this node"})
    with labelled_pod(via_proxy, direct, resizing) as pod_id:
        code, details = outcome(lambda: resize(via_proxy, resize_request(pod_id)))

        assert grpc.StatusCode.UNKNOWN == code
        assert details.startswith(f"hook server err: hook server guard failed {HOOK}: INTERNAL"), details
        assert (None, None) == containerd_sees(direct, pod_id)


def test_unhooked_resize_is_forwarded_as_sent(resizing: Containerd, direct: Cri, short_tmp: Path) -> None:
    """With hook servers registered for other points only, the proxy forwards kubelet's bytes: the trace
    records no rewritten request (the relay sends the very request object it received), and containerd
    got the requested values. (The byte-for-byte comparison at the runtime is in the integration test.)"""
    trace = short_tmp / "resize.krt"
    proxy = start_proxy(short_tmp, resizing.socket, extra=("--record", str(trace)))
    try:
        plugin = start_plugin(proxy, "other", hooks=["PreRunPodSandbox", "PreCreateContainer"])
        try:
            with Cri.connect(proxy.socket) as via_proxy, labelled_pod(via_proxy, direct, resizing) as pod_id:
                data = resize_request(pod_id).SerializeToString()
                resize(via_proxy, data)

                assert (RESOURCES, OVERHEAD) == containerd_sees(direct, pod_id)
                assert HOOK not in plugin.hooks_called()
        finally:
            assert 0 == plugin.stop()
    finally:
        assert 0 == proxy.terminate(), proxy.log
    [record] = [r for r in read_records(trace.read_bytes()).records if r.path == METHOD]
    assert (data, None) == (record.request, record.forwarded)


def test_unimplemented_reaches_the_caller_unchanged(
    older: Containerd, proxy: Proxy, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
) -> None:
    """containerd before 2.3 lacks the method: through the proxy (with a hook server registered for it)
    the caller gets the same status and message as from containerd directly, so kubelet falls back."""
    plugins("resizer", hooks=[HOOK])
    with labelled_pod(via_proxy, direct, older) as pod_id:
        expected = outcome(lambda: resize(direct, resize_request(pod_id)))
        got = outcome(lambda: resize(via_proxy, resize_request(pod_id)))

        assert grpc.StatusCode.UNIMPLEMENTED == expected[0]
        assert expected == got
