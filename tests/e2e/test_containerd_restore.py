"""RestorePod through krproxy to a real containerd (1.6, 1.7, 2.1 answer it UNIMPLEMENTED).

krproxy passes the runtime's answer back unchanged where hooks allow the call (no required server; or
the required server there, having run its PreRunPodSandbox and PreCreateContainer hooks), and refuses
it itself, nothing forwarded, while a required server is missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from krproxy.proto.runtime import v1 as cri
from tests.e2e.support import (
    TIMEOUT,
    Containerd,
    Cri,
    Proxy,
    pod_config,
    serving_proxy,
    start_plugin,
)
from tests.e2e.test_containerd_routing import HOOKS, REQUIRED

PATH = "/runtime.v1.RuntimeService/RestorePod"


@pytest.fixture
def held_proxy(containerd: Containerd, short_tmp: Path) -> Iterator[Proxy]:
    """krproxy with the required server ``limits`` (PreRunPodSandbox, PreCreateContainer, PreStartContainer)."""
    with serving_proxy(short_tmp, containerd.socket, REQUIRED) as daemon:
        yield daemon


def restore_request(containerd: Containerd, archive: Path) -> bytes:
    archive.write_bytes(b"not a checkpoint")
    config = cri.PodSandboxConfig.parse(pod_config(containerd.cgroup_parent, "restored").SerializeToString())
    container = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name="loop"), image=cri.ImageSpec(image=containerd.busybox)
    )
    return bytes(
        cri.RestorePodRequest(checkpoint_path=str(archive), config=config, container_configs=[container])
    )


def outcome(socket: str, request: bytes) -> tuple[Any, str]:
    with Cri.connect(socket) as cri_client, pytest.raises(grpc.RpcError) as info:
        cri_client.raw(PATH, request)
    return info.value.code(), info.value.details() or ""


def restored_pods(direct: Cri) -> list[str]:
    items = direct.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=TIMEOUT).items
    return [p.id for p in items if p.metadata.name.startswith("restored-")]


def test_runtime_answer_passes_through(
    containerd: Containerd, proxy: Proxy, direct: Cri, short_tmp: Path
) -> None:
    """No required server: the runtime's UNIMPLEMENTED comes back as containerd gives it directly."""
    request = restore_request(containerd, short_tmp / "c.tar")
    straight = outcome(containerd.socket, request)
    assert grpc.StatusCode.UNIMPLEMENTED == straight[0]
    assert straight == outcome(proxy.socket, request)
    assert [] == restored_pods(direct)


def test_refused_while_required_missing(
    containerd: Containerd,
    held_proxy: Proxy,
    direct: Cri,
    short_tmp: Path,
) -> None:
    """The required server absent: UNAVAILABLE from krproxy naming it; once it is there, the call runs its
    hooks and the runtime's own answer comes back."""
    request = restore_request(containerd, short_tmp / "c.tar")
    code, details = outcome(held_proxy.socket, request)
    assert grpc.StatusCode.UNAVAILABLE == code, details
    assert "required hook server limits" in details and "PreRunPodSandbox" in details

    plugin = start_plugin(held_proxy, "limits", **HOOKS)
    try:
        assert outcome(containerd.socket, request) == outcome(held_proxy.socket, request)
        assert ["PreRunPodSandbox", "PreCreateContainer"] == plugin.hooks_called()
    finally:
        assert 0 == plugin.stop()
    assert [] == restored_pods(direct)
