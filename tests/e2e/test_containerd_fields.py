"""The fields of the hooked methods beyond their ids, sent in odd spellings (a nested message twice, a
scalar twice, a varint longer than it need be, a field of another wire type, ``windows`` beside
``linux``) to containerd 1.6, 1.7 and 2.1 (gogo protobuf) straight and through krproxy with a plugin
that records what it is shown: containerd acts, through krproxy, on the values the hook was shown, and
answers each spelling through krproxy as it answers it straight (docs/security.md, "Which bytes").
"""

from __future__ import annotations

import json
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
        2,
        _bytes(UNIFIED, _entry("memory.high", "1000000")) + _bytes(UNIFIED, _entry("memory.high", "2000000")),
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
            answer = outcome(
                lambda cri=cri, cid=cid: cri.raw(path, _bytes(1, cid.encode()) + UPDATES[spelling])
            )
            got[way] = answer[0] if isinstance(answer, tuple) else _status(direct, cid)
        shown = [_shown(request) for request in plugin.requests("PreUpdateContainerResources")]
        print(f"\n{containerd.version} {spelling!r}: {got} shown {shown}")
        assert got["direct"] == got["krproxy"]
        if isinstance(got["krproxy"], dict):
            assert [got["krproxy"]] == shown
        else:
            assert isinstance(got["krproxy"], grpc.StatusCode)


def _create_status(direct: Cri, cid: str) -> dict[str, Any]:
    """What containerd recorded of a created container: its pod, name, resources, cgroup path."""
    reply = direct.runtime.ContainerStatus(
        pb.ContainerStatusRequest(container_id=cid, verbose=True), timeout=TIMEOUT
    )
    listed = direct.runtime.ListContainers(
        pb.ListContainersRequest(filter=pb.ContainerFilter(id=cid)), timeout=TIMEOUT
    ).containers
    info = json.loads(reply.info["info"])
    return {
        "pod": listed[0].pod_sandbox_id,
        "name": reply.status.metadata.name,
        "attempt": reply.status.metadata.attempt,
        "quota": reply.status.resources.linux.cpu_quota,
        "shares": reply.status.resources.linux.cpu_shares,
        "cgroup_parent": info["runtimeSpec"]["linux"]["cgroupsPath"].rsplit("/", 1)[0],
    }


def test_a_create_spelt_oddly_acts_on_what_the_hook_was_shown(
    containerd: Containerd, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
) -> None:
    """CreateContainer spellings (``pod_sandbox_id`` twice naming two pods, the config's metadata or
    resources sent again, the sandbox config's cgroup parent sent again), through krproxy and straight:
    containerd creates the container in the pod, under the name and cgroup parent and with the resources
    the PreCreateContainer hook was shown, and the same straight."""
    plugin = plugins("observer", hooks=["PreCreateContainer"])
    path = "/runtime.v1.RuntimeService/CreateContainer"
    with cleanup(direct) as pods:
        first = pod_config(containerd.cgroup_parent, "first")
        second = pod_config(containerd.cgroup_parent, "second")
        first_id, second_id = run_pod(via_proxy, first, pods), run_pod(via_proxy, second, pods)
        elsewhere = f"/{containerd.cgroup_parent}/elsewhere"
        spellings = {
            "pod_sandbox_id twice": lambda config: (
                _bytes(1, first_id.encode())
                + _bytes(2, config.SerializeToString())
                + _bytes(3, second.SerializeToString())
                + _bytes(1, second_id.encode())
            ),
            "metadata sent again": lambda config: (
                pb.CreateContainerRequest(
                    pod_sandbox_id=second_id, config=config, sandbox_config=second
                ).SerializeToString()
                + _bytes(2, _bytes(1, _bytes(1, config.metadata.name.encode() + b"-renamed")))
            ),
            "resources in two parts": lambda config: (
                pb.CreateContainerRequest(
                    pod_sandbox_id=second_id, config=config, sandbox_config=second
                ).SerializeToString()
                + _bytes(2, _bytes(15, _bytes(1, _int(QUOTA, 30_000))))
                + _bytes(2, _bytes(15, _bytes(1, _int(SHARES, 300))))
            ),
            "attempt past 32 bits": lambda config: (
                pb.CreateContainerRequest(
                    pod_sandbox_id=second_id, config=config, sandbox_config=second
                ).SerializeToString()
                + _bytes(2, _bytes(1, _int(2, 2**32 + 3)))
            ),
            "attempt -1": lambda config: (
                pb.CreateContainerRequest(
                    pod_sandbox_id=second_id, config=config, sandbox_config=second
                ).SerializeToString()
                + _bytes(2, _bytes(1, _int(2, -1)))
            ),
            "cgroup parent sent again": lambda config: (
                pb.CreateContainerRequest(
                    pod_sandbox_id=second_id, config=config, sandbox_config=second
                ).SerializeToString()
                + _bytes(3, _bytes(8, _bytes(1, elsewhere.encode())))
            ),
        }
        for n, (spelling, build) in enumerate(spellings.items()):
            got: dict[str, Any] = {}
            for way, cri in (("krproxy", via_proxy), ("direct", direct)):
                plugin.forget()
                config = container_config(containerd.busybox, f"c{n}-{way}")
                answer = outcome(lambda cri=cri, config=config, build=build: cri.raw(path, build(config)))
                if isinstance(answer, tuple):
                    got[way] = answer[0]
                    continue
                cid = pb.CreateContainerResponse.FromString(answer).container_id
                got[way] = _create_status(direct, cid)
                if way == "krproxy":
                    [shown] = plugin.requests("PreCreateContainer")
                    seen = {
                        "pod": {first.metadata.name: first_id, second.metadata.name: second_id}[
                            shown["pod_meta"]["name"]
                        ],
                        "name": shown["container_meta"]["name"],
                        "attempt": shown["container_meta"]["attempt"],
                        "quota": shown["container_resources"]["cpu_quota"],
                        "shares": shown["container_resources"]["cpu_shares"],
                        "cgroup_parent": shown["pod_cgroup_parent"],
                    }
                    assert seen == got[way], spelling
            print(f"\n{containerd.version} {spelling!r}: {got}")
            for each in got.values():
                if isinstance(each, dict):
                    each["name"] = each["name"].replace("-krproxy", "").replace("-direct", "")
            assert got["direct"] == got["krproxy"], spelling


def test_a_pod_spelt_oddly_is_run_as_the_hook_was_shown(
    containerd: Containerd, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
) -> None:
    """RunPodSandbox spellings (the config's metadata, a label and the cgroup parent sent again), through
    krproxy and straight: containerd records the pod with the name, labels and cgroup parent the
    PreRunPodSandbox hook was shown, and the same straight."""
    plugin = plugins("observer", hooks=["PreRunPodSandbox"])
    path = "/runtime.v1.RuntimeService/RunPodSandbox"
    spellings: dict[str, Callable[[Any], bytes]] = {
        "metadata name sent again": lambda pod: _bytes(
            1, _bytes(1, _bytes(1, pod.metadata.name.encode() + b"-2"))
        ),
        "attempt past 32 bits": lambda pod: _bytes(1, _bytes(1, _int(4, 2**32 + 2))),
        "a label sent again": lambda pod: _bytes(1, _bytes(6, _entry("app", "second"))),
        "cgroup parent sent again": lambda pod: _bytes(
            1, _bytes(8, _bytes(1, pod.linux.cgroup_parent.encode() + b"-again"))
        ),
    }
    with cleanup(direct) as pods:
        for spelling, extra in spellings.items():
            got: dict[str, Any] = {}
            for way, cri in (("krproxy", via_proxy), ("direct", direct)):
                plugin.forget()
                pod = pod_config(containerd.cgroup_parent, way)
                pod.labels["app"] = "first"
                answer = outcome(
                    lambda cri=cri, pod=pod, extra=extra: cri.raw(
                        path, pb.RunPodSandboxRequest(config=pod).SerializeToString() + extra(pod)
                    )
                )
                if isinstance(answer, tuple):
                    got[way] = answer[0]
                    continue
                pod_id = pb.RunPodSandboxResponse.FromString(answer).pod_sandbox_id
                pods.append(pod_id)
                reply = direct.runtime.PodSandboxStatus(
                    pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True), timeout=TIMEOUT
                )
                info = json.loads(reply.info["info"])
                got[way] = {
                    "name": reply.status.metadata.name.replace(pod.metadata.uid, "UID"),
                    "attempt": reply.status.metadata.attempt,
                    "app": reply.status.labels["app"],
                    "cgroup_parent": info["config"]["linux"]["cgroup_parent"].replace(
                        pod.metadata.uid, "UID"
                    ),
                }
                if way == "krproxy":
                    [shown] = plugin.requests("PreRunPodSandbox")
                    assert {
                        "name": shown["pod_meta"]["name"].replace(pod.metadata.uid, "UID"),
                        "attempt": shown["pod_meta"]["attempt"],
                        "app": shown["labels"]["app"],
                        "cgroup_parent": shown["cgroup_parent"].replace(pod.metadata.uid, "UID"),
                    } == got[way], spelling
            print(f"\n{containerd.version} {spelling!r}: {got}")
            for each in got.values():
                if isinstance(each, dict):
                    each["name"] = each["name"].replace("krproxy", "WAY").replace("direct", "WAY")
            assert got["direct"] == got["krproxy"], spelling


def test_a_create_names_its_pod_in_the_spec_as_the_hook_was_shown(
    containerd: Containerd, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
) -> None:
    """A CreateContainer for a stored pod whose sandbox_config carries another pod's name and namespace:
    containerd 1.6, 1.7 and 2.1 create the container in the pod the id names and write the sandbox name
    and namespace of the request into its OCI spec's annotations (``io.kubernetes.cri.sandbox-name``,
    ``-namespace``; printed), while the PreCreateContainer hook would be shown the stored pod's. Through
    krproxy the call is refused INVALID_ARGUMENT before any hook runs, and the pod's own config is created
    with the spec naming the pod the hook was shown."""
    plugin = plugins("observer", hooks=["PreCreateContainer"])
    with cleanup(direct) as pods:
        pod = pod_config(containerd.cgroup_parent, "real")
        pod_id = run_pod(via_proxy, pod, pods)
        other = pb.PodSandboxConfig()
        other.CopyFrom(pod)
        other.metadata.name, other.metadata.namespace = "someone-else", "elsewhere"
        spec: dict[str, Any] = {}
        for way, cri, config in (
            ("direct", direct, other),
            ("krproxy", via_proxy, other),
            ("own", via_proxy, pod),
        ):
            plugin.forget()
            request = pb.CreateContainerRequest(
                pod_sandbox_id=pod_id,
                config=container_config(containerd.busybox, f"c-{way}"),
                sandbox_config=config,
            )
            got = outcome(
                lambda cri=cri, request=request: cri.runtime.CreateContainer(request, timeout=TIMEOUT)
            )
            if isinstance(got, tuple):
                spec[way] = got[0]
                assert [] == plugin.requests("PreCreateContainer"), way  # refused before the hooks
                continue
            reply = direct.runtime.ContainerStatus(
                pb.ContainerStatusRequest(container_id=got.container_id, verbose=True), timeout=TIMEOUT
            )
            notes = json.loads(reply.info["info"])["runtimeSpec"]["annotations"]
            spec[way] = (
                notes["io.kubernetes.cri.sandbox-name"],
                notes["io.kubernetes.cri.sandbox-namespace"],
            )
            if way == "own":
                [shown] = plugin.requests("PreCreateContainer")
                assert (shown["pod_meta"]["name"], shown["pod_meta"]["namespace"]) == spec[way]
        print(f"\n{containerd.version}: {spec}")
        assert ("someone-else", "elsewhere") == spec["direct"]
        assert grpc.StatusCode.INVALID_ARGUMENT == spec["krproxy"]
        assert (pod.metadata.name, pod.metadata.namespace) == spec["own"]
