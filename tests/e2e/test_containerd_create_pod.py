"""A CreateContainer's ``sandbox_config`` spelt oddly (sent twice, its metadata sent twice, partly another
pod's), straight to containerd and through ``krproxy serve``: krproxy refuses exactly the creates whose
spec containerd would write with another pod's name, namespace or uid than the stored sandbox's."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from krproxy import protowire
from tests.e2e.support import TIMEOUT, Containerd, Cri, Plugin, container_config, outcome, pod_config
from tests.e2e.test_containerd_hooks import cleanup, run_pod

SANDBOX_CONFIG, METADATA = 3, 1


def _bytes(number: int, payload: bytes) -> bytes:
    return protowire.varint(number << 3 | 2) + protowire.varint(len(payload)) + payload


def _meta(**fields: str) -> bytes:
    return pb.PodSandboxConfig(metadata=pb.PodSandboxMetadata(**fields)).SerializeToString()


#: Each spelling: the sandbox_config fields appended after the pod's own (``own``) or another's, as bytes.
SPELLINGS: dict[str, Callable[[bytes, bytes], bytes]] = {
    "another's, then own": lambda own, other: _bytes(SANDBOX_CONFIG, other) + _bytes(SANDBOX_CONFIG, own),
    "own, then another's": lambda own, other: _bytes(SANDBOX_CONFIG, own) + _bytes(SANDBOX_CONFIG, other),
    "own, then another's name only": lambda own, other: (
        _bytes(SANDBOX_CONFIG, own) + _bytes(SANDBOX_CONFIG, _meta(name="someone-else"))
    ),
    "own, then an empty uid": lambda own, other: (
        _bytes(SANDBOX_CONFIG, own) + _bytes(SANDBOX_CONFIG, _meta(uid=""))
    ),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_a_create_is_refused_as_containerd_names_its_pod(
    containerd: Containerd, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin], spelling: str
) -> None:
    """Straight to containerd: the spec's sandbox name, namespace (and uid, 1.7 and later) say which pod
    containerd read; through krproxy the create passes when that is the stored pod, else is refused."""
    plugins("observer", hooks=["PreCreateContainer"])
    path = "/runtime.v1.RuntimeService/CreateContainer"
    with cleanup(direct) as pods:
        pod = pod_config(containerd.cgroup_parent, "odd")
        pod_id = run_pod(via_proxy, pod, pods)
        other = pb.PodSandboxConfig()
        other.CopyFrom(pod)
        other.metadata.name, other.metadata.namespace, other.metadata.uid = "someone-else", "elsewhere", "x"
        got: dict[str, Any] = {}
        for way, cri in (("direct", direct), ("krproxy", via_proxy)):
            head = pb.CreateContainerRequest(
                pod_sandbox_id=pod_id, config=container_config(containerd.busybox, f"c-{way}")
            ).SerializeToString()
            data = head + SPELLINGS[spelling](pod.SerializeToString(), other.SerializeToString())
            answer = outcome(lambda cri=cri, data=data: cri.raw(path, data))
            if isinstance(answer, tuple):
                got[way] = answer[0]
                continue
            cid = pb.CreateContainerResponse.FromString(answer).container_id
            reply = direct.runtime.ContainerStatus(
                pb.ContainerStatusRequest(container_id=cid, verbose=True), timeout=TIMEOUT
            )
            notes = json.loads(reply.info["info"])["runtimeSpec"]["annotations"]
            got[way] = tuple(
                notes.get(f"io.kubernetes.cri.sandbox-{k}") for k in ("name", "namespace", "uid")
            )
    print(f"\n{containerd.version} {spelling}: {got}")
    own = (pod.metadata.name, pod.metadata.namespace, pod.metadata.uid)
    spec = got["direct"]
    if spec[:2] == own[:2] and spec[2] in (None, own[2]):
        assert own[:2] == got["krproxy"][:2], got
    else:
        assert grpc.StatusCode.INVALID_ARGUMENT == got["krproxy"], got
