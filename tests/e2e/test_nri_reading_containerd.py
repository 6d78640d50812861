"""CRI requests spelt oddly, sent straight to containerd while ``krproxy nri`` runs: the hook server is
shown what containerd acts on.

In NRI mode krproxy never reads kubelet's bytes: containerd decodes them (gogo protobuf or Go's), acts,
and sends NRI its own record of the pod and container, written by Go's protobuf (each field once, a map
key once). What a hook server is shown is that record, read by upb; each test compares it with what
containerd recorded (ContainerStatus, its verbose ``runtimeSpec``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cri_api.v1 import api_pb2 as pb

from krproxy import protowire
from tests.e2e.support import TIMEOUT, Containerd, Cri, container_config, outcome, pod_config, start_plugin
from tests.e2e.test_containerd_fields import UPDATES, _shown, _status
from tests.e2e.test_containerd_hooks import cleanup, create_container, run_pod
from tests.e2e.test_nri_containerd import hooks_in_effect, krproxy_nri


def _bytes(number: int, payload: bytes) -> bytes:
    """A length-delimited field *number* holding *payload*."""
    return protowire.varint(number << 3 | 2) + protowire.varint(len(payload)) + payload


def _int(number: int, value: int) -> bytes:
    return protowire.varint(number << 3) + protowire.varint(value)


@contextlib.contextmanager
def _observed(
    containerd: Containerd, direct: Cri, short_tmp: Path, name: str, **plugin: Any
) -> Iterator[tuple[Any, list[str]]]:
    """``krproxy nri`` in front of *containerd* with one scripted hook server (*name*, *plugin* its
    settings) in effect: yields it and the list of pods to clean up; the server must stop cleanly."""
    with krproxy_nri(containerd, short_tmp) as daemon:
        server = start_plugin(daemon, name, **plugin)
        try:
            hooks_in_effect(daemon)
            with cleanup(direct) as pods:
                yield server, pods
        finally:
            assert 0 == server.stop()


QUOTA, SHARES = 2, 3


def _recorded(direct: Cri, cid: str) -> dict[str, Any]:
    """What containerd recorded of a created container: its pod, name, resources, cgroup parent (from its
    spec's cgroupsPath, cgroupfs's PARENT/ID) and annotations."""
    reply = direct.runtime.ContainerStatus(
        pb.ContainerStatusRequest(container_id=cid, verbose=True), timeout=TIMEOUT
    )
    info = json.loads(reply.info["info"])
    return {
        "pod": info["sandboxID"],
        "name": reply.status.metadata.name,
        "quota": reply.status.resources.linux.cpu_quota,
        "shares": reply.status.resources.linux.cpu_shares,
        "cgroup_parent": info["runtimeSpec"]["linux"]["cgroupsPath"].rsplit("/", 1)[0],
        "annotations": dict(reply.status.annotations),
    }


def test_a_create_spelt_oddly_is_shown_as_containerd_acts_on_it(
    containerd: Containerd, direct: Cri, short_tmp: Path
) -> None:
    """CreateContainer spellings straight to containerd (``pod_sandbox_id`` twice naming two pods, the
    config's resources in two parts, the sandbox config's cgroup parent sent again, a container annotation
    twice): the PreCreateContainer hook server is shown the pod,
    name, resources, annotations and cgroup parent containerd created the container with. containerd
    1.7.24 and 2.1.9 put the container under the request's ``sandbox_config`` cgroup parent, not its
    pod's (the pod cgroup parent shown was the pod's before)."""
    path = "/runtime.v1.RuntimeService/CreateContainer"
    with _observed(containerd, direct, short_tmp, "observer", hooks=["PreCreateContainer"]) as (plugin, pods):
        first = pod_config(containerd.cgroup_parent, "first")
        second = pod_config(containerd.cgroup_parent, "second")
        first_id, second_id = run_pod(direct, first, pods), run_pod(direct, second, pods)
        pod_ids = {first.metadata.name: first_id, second.metadata.name: second_id}
        elsewhere = f"/{containerd.cgroup_parent}/elsewhere"

        def in_second(config: Any, then: bytes = b"", sandbox: Any = second) -> bytes:
            request = pb.CreateContainerRequest(
                pod_sandbox_id=second_id, config=config, sandbox_config=sandbox
            )
            return bytes(request.SerializeToString()) + then

        spellings = {
            "pod_sandbox_id twice": lambda config: (
                _bytes(1, first_id.encode())
                + _bytes(2, config.SerializeToString())
                + _bytes(3, second.SerializeToString())
                + _bytes(1, second_id.encode())
            ),
            "resources in two parts": lambda config: in_second(
                config,
                _bytes(2, _bytes(15, _bytes(1, _int(QUOTA, 30_000))))
                + _bytes(2, _bytes(15, _bytes(1, _int(SHARES, 300)))),
            ),
            "cgroup parent sent again": lambda config: in_second(
                config, _bytes(3, _bytes(8, _bytes(1, elsewhere.encode())))
            ),
            "annotation twice": lambda config: in_second(
                config,
                _bytes(2, _bytes(10, _bytes(1, b"a") + _bytes(2, b"one")))
                + _bytes(2, _bytes(10, _bytes(1, b"a") + _bytes(2, b"two"))),
            ),
        }
        for n, (spelling, build) in enumerate(spellings.items()):
            plugin.forget()
            config = container_config(containerd.busybox, f"c{n}")
            answer = outcome(lambda config=config, build=build: direct.raw(path, build(config)))
            assert not isinstance(answer, tuple), (spelling, answer)
            cid = pb.CreateContainerResponse.FromString(answer).container_id
            [shown] = plugin.requests("PreCreateContainer")
            seen = {
                "pod": pod_ids[shown["pod_meta"]["name"]],
                "name": shown["container_meta"]["name"],
                "quota": shown["container_resources"]["cpu_quota"],
                "shares": shown["container_resources"]["cpu_shares"],
                "cgroup_parent": shown["pod_cgroup_parent"],
                "annotations": {
                    k: v
                    for k, v in shown["container_annotations"].items()
                    if not k.startswith("io.kubernetes.cri.")
                },
            }
            assert _recorded(direct, cid) == seen, spelling


def test_a_create_with_another_pod_s_config_is_refused(
    containerd: Containerd, direct: Cri, short_tmp: Path
) -> None:
    """A CreateContainer straight to containerd for one pod carrying another pod's ``sandbox_config``:
    containerd would write the other pod's name and namespace into the container's spec annotations
    while NRI shows the hook server the stored pod; krproxy nri refuses it as proxy mode does, so
    containerd fails the create, naming both pods, and no hook server is called. The same create
    with the pod's own config goes through."""
    path = "/runtime.v1.RuntimeService/CreateContainer"
    with _observed(containerd, direct, short_tmp, "observer", hooks=["PreCreateContainer"]) as (plugin, pods):
        first = pod_config(containerd.cgroup_parent, "first")
        second = pod_config(containerd.cgroup_parent, "second")
        run_pod(direct, first, pods)
        second_id = run_pod(direct, second, pods)
        got: dict[str, Any] = {}
        for way, sandbox in (("another", first), ("own", second)):
            plugin.forget()
            request = pb.CreateContainerRequest(
                pod_sandbox_id=second_id,
                config=container_config(containerd.busybox, f"c-{way}"),
                sandbox_config=sandbox,
            )
            answer = outcome(lambda request=request: direct.raw(path, request.SerializeToString()))
            got[way] = (answer, len(plugin.requests("PreCreateContainer")))
    (refusal, called), (created, own_called) = got["another"], got["own"]
    print(f"\n{containerd.version}: {refusal}")
    assert isinstance(refusal, tuple) and "carries the sandbox_config of" in str(refusal[1]), refusal
    assert f"{second.metadata.namespace}/{second.metadata.name}" in str(refusal[1]), refusal
    assert 0 == called
    assert not isinstance(created, tuple) and 1 == own_called, created


@pytest.mark.parametrize("spelling", list(UPDATES))
def test_an_update_spelt_oddly_is_shown_as_containerd_acts_on_it(
    spelling: str, containerd: Containerd, direct: Cri, short_tmp: Path
) -> None:
    """Each UpdateContainerResources spelling of the proxy-mode test (linux twice, a scalar twice, a
    varint on ten bytes or past 64 bits, a unified key twice...), straight to containerd: where it takes
    it, the resources it records are those the PreUpdateContainerResources hook server was shown; where
    it refuses it, the hook server is not called. But on containerd 1.7: NRI 0.6.1's UpdateContainer
    request carries no unified keys, so the hook server is shown none of those containerd records
    (NRI's contract; 2.1's carries them)."""
    path = "/runtime.v1.RuntimeService/UpdateContainerResources"
    with _observed(containerd, direct, short_tmp, "observer", hooks=["PreUpdateContainerResources"]) as (
        plugin,
        pods,
    ):
        pod = pod_config(containerd.cgroup_parent, "update")
        pod_id = run_pod(direct, pod, pods)
        cid = create_container(direct, pod_id, pod, container_config(containerd.busybox))
        answer = outcome(lambda: direct.raw(path, _bytes(1, cid.encode()) + UPDATES[spelling]))
        shown = [_shown(r) for r in plugin.requests("PreUpdateContainerResources")]
        if isinstance(answer, tuple):
            assert [] == shown, answer
            return
        recorded = _status(direct, cid)
        if containerd.release == (1, 7) and "unified" in spelling:  # NRI 0.6.1 carries none
            assert recorded.pop("unified") and [{}] == [each.pop("unified") for each in shown]
        assert [recorded] == shown


def test_unified_of_an_update_a_hook_changed(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """An UpdateContainerResources with cpu_quota and kubelet's unified ``memory.high``, whose
    PreUpdateContainerResources hook server sets cpu_shares: containerd 2.1 records all three; containerd
    1.7 (NRI 0.6.1, whose UpdateContainer request carries no unified keys and whose answer replaces the
    request) records the quota and shares, and no unified key. NRI's, not krproxy's: pinned."""
    path = "/runtime.v1.RuntimeService/UpdateContainerResources"
    changes = {"PreUpdateContainerResources": {"cpu_shares": 700}}
    with _observed(
        containerd, direct, short_tmp, "changer", hooks=["PreUpdateContainerResources"], resources=changes
    ) as (_, pods):
        pod = pod_config(containerd.cgroup_parent, "update")
        pod_id = run_pod(direct, pod, pods)
        cid = create_container(direct, pod_id, pod, container_config(containerd.busybox))
        unified = _bytes(9, _bytes(1, b"memory.high") + _bytes(2, b"5000000"))
        direct.raw(path, _bytes(1, cid.encode()) + _bytes(2, _int(QUOTA, 40_000) + unified))
        recorded = _status(direct, cid)
    kept = {} if containerd.release == (1, 7) else {"memory.high": "5000000"}
    assert (40_000, 700, kept) == (recorded["cpu_quota"], recorded["cpu_shares"], recorded["unified"])


def test_a_create_with_another_pod_s_uid_is_refused(
    containerd: Containerd, direct: Cri, short_tmp: Path
) -> None:
    """A CreateContainer for a pod whose ``sandbox_config`` has the pod's name and namespace but another
    uid: containerd 1.7 and 2.1 write that uid into the spec (``io.kubernetes.cri.sandbox-uid``) while NRI
    shows the hook server the stored pod's; krproxy nri refuses it as proxy mode does, and no hook server
    is called. The pod's own config is created, its spec naming the uid the hook was shown."""
    with _observed(containerd, direct, short_tmp, "observer", hooks=["PreCreateContainer"]) as (plugin, pods):
        pod = pod_config(containerd.cgroup_parent, "uid")
        pod_id = run_pod(direct, pod, pods)
        other = pb.PodSandboxConfig()
        other.CopyFrom(pod)
        other.metadata.uid = "another-uid"
        got: dict[str, Any] = {}
        for way, sandbox in (("another", other), ("own", pod)):
            plugin.forget()
            request = pb.CreateContainerRequest(
                pod_sandbox_id=pod_id,
                config=container_config(containerd.busybox, f"c-{way}"),
                sandbox_config=sandbox,
            )
            answer = outcome(lambda request=request: direct.runtime.CreateContainer(request, timeout=TIMEOUT))
            if not isinstance(answer, tuple):
                reply = direct.runtime.ContainerStatus(
                    pb.ContainerStatusRequest(container_id=answer.container_id, verbose=True),
                    timeout=TIMEOUT,
                )
                answer = json.loads(reply.info["info"])["runtimeSpec"]["annotations"].get(
                    "io.kubernetes.cri.sandbox-uid"
                )
            got[way] = (
                answer,
                [shown["pod_meta"]["uid"] for shown in plugin.requests("PreCreateContainer")],
            )
    print(f"\n{containerd.version}: {got}")
    (refusal, called), (spec_uid, shown) = got["another"], got["own"]
    assert isinstance(refusal, tuple) and "carries the sandbox_config of" in str(refusal[1]), got
    assert [] == called
    assert (pod.metadata.uid, [pod.metadata.uid]) == (spec_uid, shown)
