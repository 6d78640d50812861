"""Requests containerd's CRI decoder (gogo protobuf, on 1.6, 1.7 and 2.1) reads otherwise than upb and Go's
protobuf, through krproxy with a hook plugin and straight to the same containerd: krproxy refuses them, so
that its hooks are never shown other values than containerd acts on (docs/security.md, "Which bytes").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import grpc
from cri_api.v1 import api_pb2 as pb

from krproxy import protowire
from tests.e2e.support import TIMEOUT, Containerd, Cri, Plugin, container_config, outcome, pod_config
from tests.e2e.test_containerd_hooks import SKIP_LABEL, cleanup, create_container, run_pod


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field: its tag (any field number), its length, *payload*."""
    return protowire.varint(number << 3 | 2) + protowire.varint(len(payload)) + payload


def test_a_field_number_past_32_bits_is_not_read_as_another_id(
    containerd: Containerd, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
) -> None:
    """A StartContainer naming an id no one has, then a stored container's id under field number
    2**32 + 1: containerd 1.6, 1.7 and 2.1 (gogo protobuf, which cuts a field number to 32 bits) read
    that as container_id, 1, and start the container. krproxy refuses the call as upb does (INTERNAL),
    so the container's PreStartContainer hook, which refuses it, cannot be gone around."""
    plugin = plugins(
        "gate", hooks=["PreStartContainer"], failure_policy="Fail", error={"PreStartContainer": "refused"}
    )
    path = "/runtime.v1.RuntimeService/StartContainer"
    with cleanup(direct) as pods:
        pod = pod_config(containerd.cgroup_parent, "fieldnum")
        pod_id = run_pod(via_proxy, pod, pods)
        cid = create_container(via_proxy, pod_id, pod, container_config(containerd.busybox))
        smuggled = _field(1, b"no-such-container") + _field(2**32 + 1, cid.encode())
        got = outcome(lambda: via_proxy.raw(path, smuggled))
        state = direct.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=TIMEOUT)
        code = got[0] if isinstance(got, tuple) else got  # (b"": krproxy let it through)
        assert (grpc.StatusCode.INTERNAL, pb.CONTAINER_CREATED) == (code, state.status.state), got
        assert [] == plugin.hooks_called()
        # What krproxy shields: straight to containerd, the same bytes start that container.
        assert b"" == direct.raw(path, smuggled)
        state = direct.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=TIMEOUT)
        assert pb.CONTAINER_RUNNING == state.status.state


def test_a_map_entry_field_of_another_wire_type_is_refused(
    containerd: Containerd, via_proxy: Cri, direct: Cri, plugins: Callable[..., Plugin]
) -> None:
    """A pod label whose value comes twice, ``false`` as a string and then ``true`` as a fixed64
    (its length a padded varint, the string inside): gogo protobuf (containerd 1.6, 1.7, 2.1) reads a
    map entry's key and value whatever their wire type, so containerd records the skip label
    ``true``; upb and Go's protobuf read the fixed64 as an unknown field, and ``false``. krproxy
    cannot know which reading the runtime behind has: it refuses the pod (INVALID_ARGUMENT). Read as
    upb reads it, the pod was hooked as one without the skip label and recorded by containerd as one
    with it, whose containers' hooks krproxy skips once it has recovered its store from containerd."""
    plugin = plugins("observer", hooks=["PreRunPodSandbox"])
    path = "/runtime.v1.RuntimeService/RunPodSandbox"
    key = SKIP_LABEL[0].encode()
    entry = _field(1, key) + _field(2, b"false") + b"\x11\x84\x80\x80\x00" + SKIP_LABEL[1].encode()
    recorded = {}
    with cleanup(direct) as pods:
        for way, cri in (("krproxy", via_proxy), ("direct", direct)):
            pod = pod_config(containerd.cgroup_parent, f"entry-{way}")
            request = pb.RunPodSandboxRequest(config=pod).SerializeToString()
            # config (1) sent again with one labels (6) entry: protobuf merges the two
            got = outcome(functools.partial(cri.raw, path, request + _field(1, _field(6, entry))))
            if isinstance(got, bytes):
                pod_id = pb.RunPodSandboxResponse.FromString(got).pod_sandbox_id
                pods.append(pod_id)
                status = direct.runtime.PodSandboxStatus(
                    pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT
                )
                recorded[way] = status.status.labels.get(SKIP_LABEL[0])
            else:
                recorded[way] = got[0]
        assert {"krproxy": grpc.StatusCode.INVALID_ARGUMENT, "direct": "true"} == recorded
        assert [] == plugin.hooks_called()
