"""Every ``:path`` spelling of the workload verbs, through krproxy to a real containerd, with a required server.

grpc-go before 1.79.3 (containerd 1.6.20, 1.7.24) routes ``runtime.v1.RuntimeService/RunPodSandbox``
(no leading slash) to RunPodSandbox (CVE-2026-33186); 2.1.9 refuses it; other spellings are
UNIMPLEMENTED on all. With ``--required-hook-server limits`` and that server absent, no spelling of
RunPodSandbox, CreateContainer or StartContainer may reach containerd: krproxy answers each itself
(the slash-less one as grpc-go 1.79.3 does, the others as methods it does not know); with the server
present, only the canonical spelling is accepted, and it ran the hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2 as pb

from krproxy.grpcstatus import Status
from tests.e2e.support import (
    TIMEOUT,
    Containerd,
    Cri,
    Proxy,
    container_config,
    pod_config,
    serving_proxy,
    start_plugin,
)
from tests.e2e.test_containerd_hooks import LIMITS, cleanup, create_container, run_pod
from tests.integration.h2_client import H2Answer, framed, grpc_request, request

SERVICE = "runtime.v1.RuntimeService"
POINTS = "PreRunPodSandbox,PreCreateContainer,PreStartContainer"
REQUIRED = ("--required-hook-server", f"limits={POINTS}", "--required-startup-grace", "0")
HOOKS: dict[str, Any] = {"hooks": POINTS.split(","), "resources": {"PreCreateContainer": LIMITS}}
#: Each spelling of ``/runtime.v1.RuntimeService/<verb>`` but the canonical one, by test id.
SPELLINGS = {
    "slashless": "{service}/{verb}",
    "double-slash": "//{service}/{verb}",
    "trailing-slash": "/{service}/{verb}/",
    "query": "/{service}/{verb}?x=1",
    "percent": "/{service}/%{hex}{rest}",
    "case": "/{service}/{lower}",
    "v1alpha2": "/runtime.v1alpha2.RuntimeService/{verb}",
}


def spelt(spelling: str, verb: str) -> str:
    return spelling.format(
        service=SERVICE, verb=verb, hex=f"{ord(verb[0]):02X}", rest=verb[1:], lower=verb.lower()
    )


def raw_call(socket: str, path: str, message: Any) -> H2Answer:
    """One unary call of *message* to *path*, with the header block exactly as given (h2, not grpcio)."""

    async def go() -> H2Answer:
        with trio.fail_after(TIMEOUT):
            return await request(
                socket, grpc_request(path, timeout=TIMEOUT), framed(message.SerializeToString())
            )

    return trio.run(go)


@pytest.fixture
def required_proxy(containerd: Containerd, short_tmp: Path) -> Iterator[Proxy]:
    with serving_proxy(short_tmp, containerd.socket, REQUIRED) as daemon:
        yield daemon


@contextlib.contextmanager
def created(direct: Cri, containerd: Containerd) -> Iterator[tuple[str, Any, str]]:
    """A pod made straight through containerd, with one created (not started) container: id, config, id."""
    pod = pod_config(containerd.cgroup_parent, "routing")
    with cleanup(direct) as pods:
        pod_id = run_pod(direct, pod, pods)
        yield pod_id, pod, create_container(direct, pod_id, pod, container_config(containerd.busybox))


def pods_named(direct: Cri, name: str) -> list[str]:
    items = direct.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=TIMEOUT).items
    return [p.id for p in items if p.metadata.name == name]


def containers_of(direct: Cri, pod_id: str) -> list[str]:
    request = pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod_id))
    return [c.id for c in direct.runtime.ListContainers(request, timeout=TIMEOUT).containers]


def state_of(direct: Cri, container_id: str) -> int:
    request = pb.ContainerStatusRequest(container_id=container_id)
    return int(direct.runtime.ContainerStatus(request, timeout=TIMEOUT).status.state)


def verb_requests(containerd: Containerd, pod_id: str, pod: Any, container_id: str) -> dict[str, Any]:
    """A request of each workload verb that containerd would carry out: a new pod, a new container in
    *pod_id*, the start of *container_id*."""
    new_pod = pod_config(containerd.cgroup_parent, "smuggled")
    return {
        "RunPodSandbox": pb.RunPodSandboxRequest(config=new_pod),
        "CreateContainer": pb.CreateContainerRequest(
            pod_sandbox_id=pod_id,
            config=container_config(containerd.busybox, "smuggled"),
            sandbox_config=pod,
        ),
        "StartContainer": pb.StartContainerRequest(container_id=container_id),
    }


def assert_nothing_done(direct: Cri, requests: dict[str, Any], pod_id: str, container_id: str) -> None:
    smuggled = requests["RunPodSandbox"].config.metadata.name
    assert [] == pods_named(direct, smuggled), "a pod was created"
    assert [container_id] == containers_of(direct, pod_id), "a container was created"
    assert pb.CONTAINER_CREATED == state_of(direct, container_id), "the container was started"


@pytest.mark.parametrize("spelling", list(SPELLINGS.values()), ids=list(SPELLINGS))
def test_absent_server_no_spelling_reaches_runtime(
    containerd: Containerd, required_proxy: Proxy, direct: Cri, spelling: str
) -> None:
    """With the required server absent, RunPodSandbox, CreateContainer and StartContainer under this
    spelling are answered UNIMPLEMENTED by krproxy itself and containerd does none of them."""
    with created(direct, containerd) as (pod_id, pod, container_id):
        requests = verb_requests(containerd, pod_id, pod, container_id)
        for verb, message in requests.items():
            path = spelt(spelling, verb)
            answer = raw_call(required_proxy.socket, path, message)

            assert Status.UNIMPLEMENTED == answer.grpc_status, (path, answer)
            if path.startswith("/"):
                assert answer.grpc_message.startswith(f"unknown method {path}: krproxy"), answer
            else:
                assert f'malformed method name: "{path}"' == answer.grpc_message
        assert_nothing_done(direct, requests, pod_id, container_id)


def test_present_server_only_canonical_runs_hooked(
    containerd: Containerd, required_proxy: Proxy, direct: Cri
) -> None:
    """With the required server there, no other spelling is accepted by anyone, and the canonical calls
    containerd accepts each ran their hook (the limits in the container's request)."""
    plugin = start_plugin(required_proxy, "limits", **HOOKS)
    try:
        with created(direct, containerd) as (pod_id, pod, container_id), cleanup(direct) as pods:
            requests = verb_requests(containerd, pod_id, pod, container_id)
            for spelling in SPELLINGS.values():
                for verb, message in requests.items():
                    answer = raw_call(required_proxy.socket, spelt(spelling, verb), message)
                    assert Status.OK != answer.grpc_status, (spelling, verb, answer)
            assert_nothing_done(direct, requests, pod_id, container_id)
            assert [] == plugin.hooks_called()

            socket = required_proxy.socket
            ran = raw_call(socket, f"/{SERVICE}/RunPodSandbox", requests["RunPodSandbox"])
            made = raw_call(socket, f"/{SERVICE}/CreateContainer", requests["CreateContainer"])
            assert Status.OK == ran.grpc_status == made.grpc_status, (ran, made)
            pods.append(pb.RunPodSandboxResponse.FromString(ran.message).pod_sandbox_id)
            made_id = pb.CreateContainerResponse.FromString(made.message).container_id
            started = raw_call(
                socket, f"/{SERVICE}/StartContainer", pb.StartContainerRequest(container_id=made_id)
            )

            assert Status.OK == started.grpc_status, started
            assert sorted(POINTS.split(",")) == sorted(plugin.hooks_called())
            assert pb.CONTAINER_RUNNING == state_of(direct, made_id)
            (hooked,) = plugin.requests("PreCreateContainer")
            assert "smuggled" == hooked["container_meta"]["name"], hooked
    finally:
        assert 0 == plugin.stop()


def test_slashless_path_reaches_old_grpc_go_directly(containerd: Containerd, direct: Cri) -> None:
    """What krproxy shields: straight to containerd, the slash-less Version is routed by grpc-go before
    1.79.3 (containerd 1.6, 1.7) and refused as malformed from 1.79.3 (2.1)."""
    answer = raw_call(containerd.socket, f"{SERVICE}/Version", pb.VersionRequest())
    version = direct.runtime.Version(pb.VersionRequest(), timeout=TIMEOUT).runtime_version
    if version.startswith(("1.6.", "1.7.", "v1.6.", "v1.7.")):
        assert Status.OK == answer.grpc_status, answer
    else:
        assert Status.UNIMPLEMENTED == answer.grpc_status, answer
        assert f'malformed method name: "{SERVICE}/Version"' == answer.grpc_message


def test_unhooked_methods_unaffected(containerd: Containerd, required_proxy: Proxy) -> None:
    """The required server's absence and the routing rule leave known methods without hooks alone."""
    with Cri.connect(required_proxy.socket) as via_proxy:
        assert via_proxy.runtime.Version(pb.VersionRequest(), timeout=TIMEOUT).runtime_name
        via_proxy.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=TIMEOUT)
        with pytest.raises(grpc.RpcError) as info:
            via_proxy.runtime.RunPodSandbox(
                pb.RunPodSandboxRequest(config=pod_config(containerd.cgroup_parent)), timeout=TIMEOUT
            )
        assert grpc.StatusCode.UNAVAILABLE == info.value.code()
