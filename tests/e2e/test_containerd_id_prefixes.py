"""Id prefixes through krproxy in front of a real containerd: the prefix names the object for the hooks too.

containerd resolves a unique pod or container id prefix (crictl's 12-character short ids). With
``--required-hook-server limits=…`` and ``limits`` absent, no call by such a prefix may reach containerd
(before: the prefix found no store record, needed no hook server, and StartContainer started the container);
with ``limits`` present, the hooks run for a prefix as for the full id, naming the full id; Stop and Remove by
prefix drop the store entry. An empty or ambiguous id gets containerd's own answer.
"""

from __future__ import annotations

import contextlib
import functools
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from tests.e2e.support import (
    TIMEOUT,
    Containerd,
    Cri,
    Proxy,
    container_config,
    outcome,
    pod_config,
    serving_proxy,
    start_plugin,
    wait_until,
)
from tests.e2e.test_containerd_hooks import cleanup, create_container, run_pod, start
from tests.e2e.test_nri_containerd import EVERY_HOOK

PREFIX = 12
#: Every hook point a call naming an existing pod or container reaches (all but PreRunPodSandbox), in the
#: order one container's life calls them.
POINTS = [hook for hook in EVERY_HOOK if hook != "PreRunPodSandbox"]
REQUIRED = ("--required-hook-server", "limits=" + ",".join(POINTS), "--required-startup-grace", "0")
METRICS = ("--metrics-address", "127.0.0.1:0")


@contextlib.contextmanager
def daemon(short_tmp: Path, containerd: Containerd) -> Iterator[Proxy]:
    with serving_proxy(short_tmp, containerd.socket, REQUIRED + METRICS) as proxy:
        yield proxy


def store_sizes(proxy: Proxy) -> tuple[float, float]:
    """(pods, containers) in the proxy's hook store, from its metrics."""
    found = re.findall(r"event=admin_listening address=(\S+)", proxy.log)
    assert found, proxy.log
    text = urllib.request.urlopen(f"http://{found[0]}/metrics", timeout=TIMEOUT).read().decode()
    sizes = {m[0]: float(m[1]) for m in re.findall(r"^krproxy_store_(pods|containers) (\S+)$", text, re.M)}
    return sizes["pods"], sizes["containers"]


def container_state(direct: Cri, container_id: str) -> Any:
    request = pb.ContainerStatusRequest(container_id=container_id)
    return direct.runtime.ContainerStatus(request, timeout=TIMEOUT).status


def pod_state(direct: Cri, pod_id: str) -> int:
    request = pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id)
    return int(direct.runtime.PodSandboxStatus(request, timeout=TIMEOUT).status.state)


def update_request(container_id: str) -> Any:
    return pb.UpdateContainerResourcesRequest(
        container_id=container_id, linux=pb.LinuxContainerResources(cpu_shares=512)
    )


# --------------------------------------------------------------------------- the required server absent


CASES = ["StartContainer", "StopContainer", "UpdateContainerResources", "StopPodSandbox", "CreateContainer"]


@pytest.mark.parametrize("method", CASES)
def test_prefix_held_while_the_required_server_is_absent(
    containerd: Containerd, direct: Cri, short_tmp: Path, method: str
) -> None:
    """A call by a 12-character prefix of a pod or container krproxy recovered at start is refused UNAVAILABLE
    naming ``limits``, and containerd shows it never got it: the container is not started, not stopped, not
    updated, the pod not stopped, no container created in it."""
    pod = pod_config(containerd.cgroup_parent, "prefix-held")
    with cleanup(direct) as pods:
        pod_id = run_pod(direct, pod, pods)
        container_id = create_container(direct, pod_id, pod, container_config(containerd.busybox))
        if method == "StopContainer":
            start(direct, container_id)
        before = container_state(direct, container_id)
        with daemon(short_tmp, containerd) as proxy, Cri.connect(proxy.socket) as via_proxy:
            rt = via_proxy.runtime
            calls = {
                "StartContainer": lambda: rt.StartContainer(
                    pb.StartContainerRequest(container_id=container_id[:PREFIX]), timeout=TIMEOUT
                ),
                "StopContainer": lambda: rt.StopContainer(
                    pb.StopContainerRequest(container_id=container_id[:PREFIX], timeout=1), timeout=TIMEOUT
                ),
                "UpdateContainerResources": lambda: rt.UpdateContainerResources(
                    update_request(container_id[:PREFIX]), timeout=TIMEOUT
                ),
                "StopPodSandbox": lambda: rt.StopPodSandbox(
                    pb.StopPodSandboxRequest(pod_sandbox_id=pod_id[:PREFIX]), timeout=TIMEOUT
                ),
                "CreateContainer": lambda: rt.CreateContainer(
                    pb.CreateContainerRequest(
                        pod_sandbox_id=pod_id[:PREFIX],
                        config=container_config(containerd.busybox, "second"),
                        sandbox_config=pod,
                    ),
                    timeout=TIMEOUT,
                ),
            }

            result = outcome(calls[method])
            assert isinstance(result, tuple), f"{method} by prefix reached containerd and did its work"
            code, details = result

            assert grpc.StatusCode.UNAVAILABLE == code, (code, details)
            assert "required hook server limits" in details, details
        after = container_state(direct, container_id)
        assert (before.state, before.started_at, before.finished_at) == (
            after.state,
            after.started_at,
            after.finished_at,
        )
        assert before.resources.linux.cpu_shares == after.resources.linux.cpu_shares != 512
        assert pb.SANDBOX_READY == pod_state(direct, pod_id)
        listed = direct.runtime.ListContainers(
            pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod_id)), timeout=TIMEOUT
        ).containers
        assert [container_id] == [c.id for c in listed]


# --------------------------------------------------------------------------- the required server present


def test_prefix_runs_the_hooks_of_the_full_id(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """Container ``a`` named by prefixes (its pod's, then its own), ``b`` by full ids: the hook server gets the
    same hooks for both, each naming the full container id, and containerd acted on both; Stop and Remove by
    prefix, then RemovePodSandbox by prefix, empty the store as full ids do."""
    pod = pod_config(containerd.cgroup_parent, "prefix-hooked")
    with cleanup(direct) as pods, daemon(short_tmp, containerd) as proxy, Cri.connect(proxy.socket) as via:
        plugin = start_plugin(proxy, "limits", hooks=POINTS)
        try:
            pod_id = run_pod(via, pod, pods)
            rt = via.runtime
            ids = {}
            hooks: dict[str, list[tuple[str, str]]] = {}
            for name, short in (("a", True), ("b", False)):
                plugin.forget()
                pod_ref = pod_id[:PREFIX] if short else pod_id
                cid = create_container(via, pod_ref, pod, container_config(containerd.busybox, name))
                ids[name] = cid
                ref = cid[:PREFIX] if short else cid
                rt.StartContainer(pb.StartContainerRequest(container_id=ref), timeout=TIMEOUT)
                rt.UpdateContainerResources(update_request(ref), timeout=TIMEOUT)
                assert (1.0, 1.0) == store_sizes(proxy)
                rt.StopContainer(pb.StopContainerRequest(container_id=ref, timeout=1), timeout=TIMEOUT)
                wait_until(lambda: (1.0, 0.0) == store_sizes(proxy), what=f"{name} dropped")
                hooks[name] = [
                    (call["hook"], call["request"].get("container_meta", {}).get("id", ""))
                    for call in plugin.calls()
                ]
                status = container_state(direct, cid)
                assert (pb.CONTAINER_EXITED, 512) == (status.state, status.resources.linux.cpu_shares)
            assert [(hook, ident.replace(ids["a"], ids["b"])) for hook, ident in hooks["a"]] == hooks["b"]
            assert [h for h, _ in hooks["a"]] == POINTS[:5]
            assert {ids["a"]} == {ident for hook, ident in hooks["a"] if hook != "PreCreateContainer"}

            rt.RemoveContainer(pb.RemoveContainerRequest(container_id=ids["b"][:PREFIX]), timeout=TIMEOUT)
            plugin.forget()
            rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod_id[:PREFIX]), timeout=TIMEOUT)
            assert ["PostStopPodSandbox"] == plugin.hooks_called()
            rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id[:PREFIX]), timeout=TIMEOUT)
            wait_until(lambda: (0.0, 0.0) == store_sizes(proxy), what="store emptied")
            assert [] == list(
                direct.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=TIMEOUT).items
            )
        finally:
            assert 0 == plugin.stop()


# --------------------------------------------------------------------------- empty and ambiguous ids


def shared_prefix(ids: list[str]) -> str | None:
    """The longest prefix two of *ids* share, if any two share a first character."""
    for i, a in enumerate(ids):
        for b in ids[i + 1 :]:
            if a[0] == b[0]:
                return a[: next(n for n in range(len(a)) if a[n] != b[n])]
    return None


def test_empty_and_ambiguous_ids_answered_as_containerd(
    containerd: Containerd, direct: Cri, short_tmp: Path
) -> None:
    """krproxy refuses an empty id and a prefix two objects share itself (with ``limits`` present, so that the
    calls would run hooks), with the status and message containerd gives the same request sent directly;
    containerd 1.6 writes ``Prefix`` where 1.7 and 2.x (and krproxy) write ``prefix``. No hook runs."""
    with cleanup(direct) as pods, daemon(short_tmp, containerd) as proxy, Cri.connect(proxy.socket) as via:
        plugin = start_plugin(proxy, "limits", hooks=POINTS)
        try:
            configs = {}
            while (pod_prefix := shared_prefix(pods)) is None:
                config = pod_config(containerd.cgroup_parent, f"shared{len(pods)}")
                configs[run_pod(via, config, pods)] = config
            first = pods[0]
            containers: list[str] = []
            while (container_prefix := shared_prefix(containers)) is None:
                config = container_config(containerd.busybox, f"c{len(containers)}")
                containers.append(create_container(via, first, configs[first], config))
            plugin.forget()

            def requests(container: str, pod: str) -> dict[str, tuple[str, Any]]:
                return {
                    "StartContainer": ("StartContainer", pb.StartContainerRequest(container_id=container)),
                    "StopContainer": ("StopContainer", pb.StopContainerRequest(container_id=container)),
                    "UpdateContainerResources": ("UpdateContainerResources", update_request(container)),
                    "StopPodSandbox": ("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=pod)),
                    "CreateContainer": (
                        "CreateContainer",
                        pb.CreateContainerRequest(
                            pod_sandbox_id=pod,
                            config=container_config(containerd.busybox, "never"),
                            sandbox_config=configs[first],
                        ),
                    ),
                }

            for label, (container, pod_ref) in {
                "empty": ("", ""),
                "ambiguous": (container_prefix, pod_prefix),
            }.items():
                for method, request in requests(container, pod_ref).values():
                    proxied = outcome(
                        functools.partial(getattr(via.runtime, method), request, timeout=TIMEOUT)
                    )
                    straight = outcome(
                        functools.partial(getattr(direct.runtime, method), request, timeout=TIMEOUT)
                    )
                    assert straight[0] == grpc.StatusCode.UNKNOWN, (label, method, straight)
                    assert (straight[0], straight[1].replace("Prefix can't", "prefix can't")) == proxied, (
                        label,
                        method,
                    )
            assert [] == plugin.hooks_called()
        finally:
            assert 0 == plugin.stop()
