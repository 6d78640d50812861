"""The fake containerd's RestorePod (KEP-5823): sandbox and containers from the configs, all or nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from krproxy.fakes.containerd.records import Code, CriError, sequential_ids, stepping_clock
from krproxy.fakes.containerd.restore import restore_pod
from krproxy.fakes.containerd.state import RuntimeState
from krproxy.proto.runtime import v1 as cri


def request(archive: str, *names: str) -> cri.RestorePodRequest:
    return cri.RestorePodRequest(
        checkpoint_path=archive,
        config=cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name="r", uid="uid-r", namespace="ns"), labels={"app": "r"}
        ),
        runtime_handler="runc",
        container_configs=[
            cri.ContainerConfig(metadata=cri.ContainerMetadata(name=n), image=cri.ImageSpec(image="busybox"))
            for n in names
        ],
    )


@pytest.fixture
def state() -> RuntimeState:
    return RuntimeState(clock=stepping_clock(), new_id=sequential_ids())


@pytest.fixture
def archive(tmp_path: Path) -> str:
    (tmp_path / "c.tar").write_bytes(b"x")
    return str(tmp_path / "c.tar")


def test_restore_creates_sandbox_and_containers(state: RuntimeState, archive: str) -> None:
    reply = restore_pod(state, request(archive, "a", "b"))

    (pod,) = state.list_pod_sandbox(cri.ListPodSandboxRequest()).items
    assert reply.pod_sandbox_id == pod.id and cri.PodSandboxState.SANDBOX_READY == pod.state
    assert {"app": "r"} == pod.labels and "runc" == pod.runtime_handler
    assert ["a", "b"] == [c.name for c in reply.restored_containers]
    listed = state.list_containers(cri.ListContainersRequest()).containers
    assert {c.container_id for c in reply.restored_containers} == {c.id for c in listed}
    assert {cri.ContainerState.CONTAINER_CREATED} == {c.state for c in listed}
    assert {reply.pod_sandbox_id} == {c.pod_sandbox_id for c in listed}


@pytest.mark.parametrize(
    ("make_path", "code"),
    [(lambda d: "", Code.INVALID_ARGUMENT), (lambda d: d + "/gone.tar", Code.NOT_FOUND)],
)
def test_restore_needs_an_existing_archive(
    state: RuntimeState, tmp_path: Path, make_path: Callable[[str], str], code: Code
) -> None:
    with pytest.raises(CriError) as info:
        restore_pod(state, request(make_path(str(tmp_path)), "a"))
    assert code == info.value.code
    assert [] == list(state.list_pod_sandbox(cri.ListPodSandboxRequest()).items)


def test_restore_is_all_or_nothing(state: RuntimeState, archive: str) -> None:
    """A container that cannot be created (no metadata) undoes the sandbox and the containers before it."""
    bad = request(archive, "a")
    bad.container_configs.append(cri.ContainerConfig(image=cri.ImageSpec(image="busybox")))
    with pytest.raises(CriError) as info:
        restore_pod(state, bad)
    assert Code.UNKNOWN == info.value.code  # containerd: UNKNOWN "container config must include metadata"
    assert [] == list(state.list_pod_sandbox(cri.ListPodSandboxRequest()).items)
    assert [] == list(state.list_containers(cri.ListContainersRequest()).containers)
    restore_pod(state, request(archive, "a"))  # the names were released
