"""The fields of the hooked methods beyond their ids, sent in odd spellings (a nested message twice, a
scalar twice, a varint longer than it need be, a field of another wire type, ``windows`` beside
``linux``) to containerd 1.6, 1.7 and 2.1 (gogo protobuf) straight and through krproxy with a plugin
that records what it is shown: containerd acts, through krproxy, on the values the hook was shown, and
answers each spelling through krproxy as it answers it straight (docs/security.md, "Which bytes").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from krproxy import protowire
from tests.e2e.support import TIMEOUT, Containerd, Cri, Plugin, container_config, outcome, pod_config
from tests.e2e.test_containerd_hooks import cleanup, create_container, run_pod

MiB = 1 << 20


def _bytes(number: int, payload: bytes) -> bytes:
    """A length-delimited field *number* holding *payload*."""
    return protowire.varint(number << 3 | 2) + protowire.varint(len(payload)) + payload


def _int(number: int, value: int) -> bytes:
    """A varint field *number* holding *value* (a negative one as ten bytes, as protobuf writes it)."""
    return protowire.varint(number << 3) + protowire.varint(value)


def _padded(number: int, value: int, width: int = 10, top: int = 0) -> bytes:
    """A varint field *number* holding *value* written on *width* bytes (continuation bits set on the
    first ones), the last byte or'ed with *top* (bits past the 64th when *width* is 10)."""
    out = bytearray()
    for _ in range(width - 1):
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value | top)
    return protowire.varint(number << 3) + bytes(out)


def _entry(key: str, value: str) -> bytes:
    return _bytes(1, key.encode()) + _bytes(2, value.encode())


# LinuxContainerResources: cpu_period 1, cpu_quota 2, cpu_shares 3, memory_limit_in_bytes 4, unified 9.
# UpdateContainerResourcesRequest: container_id 1, linux 2, windows 3.
QUOTA, SHARES, MEMORY, UNIFIED = 2, 3, 4, 9

#: UpdateContainerResources spellings after the container id: what follows it on the wire.
UPDATES: dict[str, bytes] = {
    "linux twice, merged": _bytes(2, _int(QUOTA, 50_000)) + _bytes(2, _int(SHARES, 512)),
    "cpu_quota twice in one linux": _bytes(2, _int(QUOTA, 50_000) + _int(QUOTA, 30_000)),
    "memory limit in two linux": _bytes(2, _int(MEMORY, 64 * MiB)) + _bytes(2, _int(MEMORY, 128 * MiB)),
    "cpu_quota on ten bytes": _bytes(2, _padded(QUOTA, 30_000)),
    "cpu_quota past 64 bits": _bytes(2, _padded(QUOTA, 30_000, top=0x7E)),
    "cpu_quota -1": _bytes(2, _int(QUOTA, -1) + _int(SHARES, 300)),
    "cpu_shares as fixed64": _bytes(2, _int(QUOTA, 40_000) + b"\x19" + (700).to_bytes(8, "little")),
    "linux as a varint, then linux": _int(2, 5) + _bytes(2, _int(QUOTA, 40_000)),
    "windows beside linux": _bytes(2, _int(QUOTA, 30_000)) + _bytes(3, _int(4, 256 * MiB) + _int(1, 9)),
    "unified key twice": _bytes(
        2, _bytes(UNIFIED, _entry("memory.high", "1000000")) + _bytes(UNIFIED, _entry("memory.high", "2000000"))
    ),
    "unified in two linux": _bytes(2, _bytes(UNIFIED, _entry("pids.max", "10")))
    + _bytes(2, _bytes(UNIFIED, _entry("memory.high", "3000000"))),
}

FIELDS = ("cpu_period", "cpu_quota", "cpu_shares", "memory_limit_in_bytes", "unified")


def _status(cri: Cri, container_id: str) -> dict[str, Any]:
    linux = cri.runtime.ContainerStatus(
        pb.ContainerStatusRequest(container_id=container_id), timeout=TIMEOUT
    ).status.resources.linux
    return {field: dict(linux.unified) if field == "unified" else getattr(linux, field) for field in FIELDS}


def _shown(request: dict[str, Any]) -> dict[str, Any]:
    resources = request["container_resources"]
    return {field: resources[field] for field in FIELDS}


@pytest.mark.parametrize("spelling", list(UPDATES))
def test_an_update_spelt_oddly_acts_on_what_the_hook_was_shown(
    spelling: str, containerd: Containerd, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
) -> None:
    """Each UpdateContainerResources spelling, to a container of its own through krproxy and straight:
    where containerd takes it, it records through krproxy the resources the PreUpdateContainerResources
    hook was shown, and the same as straight; where it refuses it, krproxy's answer has its code."""
    plugin = plugins("observer", hooks=["PreUpdateContainerResources"])
    path = "/runtime.v1.RuntimeService/UpdateContainerResources"
    with cleanup(direct) as pods:
        pod = pod_config(containerd.cgroup_parent, "fields")
        pod_id = run_pod(via_proxy, pod, pods)
        got: dict[str, Any] = {}
        for way, cri in (("krproxy", via_proxy), ("direct", direct)):
            cid = create_container(via_proxy, pod_id, pod, container_config(containerd.busybox, way))
            answer = outcome(lambda cri=cri, cid=cid: cri.raw(path, _bytes(1, cid.encode()) + UPDATES[spelling]))
            got[way] = answer[0] if isinstance(answer, tuple) else _status(direct, cid)
        shown = [_shown(request) for request in plugin.requests("PreUpdateContainerResources")]
        print(f"\n{containerd.version} {spelling!r}: {got} shown {shown}")
        assert got["direct"] == got["krproxy"]
        if isinstance(got["krproxy"], dict):
            assert [got["krproxy"]] == shown
        else:
            assert isinstance(got["krproxy"], grpc.StatusCode)
