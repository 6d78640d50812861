"""Tests of 8aed375 (a watched RunPodSandbox reads its pod with upb when ``ByteSize()`` after
``DiscardUnknownFields`` equals the request's length): requests whose sizes match but whose readings
could differ.

Equal sizes do not prove equal readings: what upb drops or shortens (a message field sent twice, merged
into one; a varint longer than it need be) can be paid back by what it lengthens (an int32 of -1 sent
in 5 bytes, which every protobuf writes in 10). The one reading that then differs is a message field
sent twice: protobuf merges the two (upb, and Go's reading, which is containerd's), betterproto2 keeps
the last. The watch's record is Go's reading, which containerd acts on; so is the interceptor's, since
it reads what upb writes back (``_reading.as_go_reads``; this review's finding, fixed there)."""

from __future__ import annotations

from pathlib import Path

from krproxy.hooks import watched
from krproxy.hooks._reading import decode
from krproxy.hooks.convert import pod_from_run_request
from krproxy.proto.runtime import v1 as cri
from tests.unit.godecode_support import godecode  # noqa: F401 - the fixture
from tests.unit.test_fake_containerd_unmarshal_go import go_reads


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (payloads under 128 bytes)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


#: PodSandboxMetadata name, uid, namespace, then attempt 1 written in 4 bytes (3 more than it needs).
_METADATA = _field(1, b"web") + _field(2, b"u") + _field(3, b"ns") + b"\x20\x81\x80\x80\x00"
#: A PortMapping whose container_port is -1 in 5 bytes: upb (and Go) write it in 10.
_LONGER_PORT = _field(5, b"\x10\xff\xff\xff\xff\x0f")
#: config (1) sent twice: the metadata, then a label and the port mapping. Merged: 2 bytes shorter (one
#: config's tag and length), 3 shorter (the attempt), 5 longer (the port): the size upb writes is the request's.
SPLIT_CONFIG = _field(1, _field(1, _METADATA)) + _field(
    1, _field(6, _field(1, b"k") + _field(2, b"v")) + _LONGER_PORT
)


def _upb_size(data: bytes) -> int:
    request = watched._RUN_POD_SANDBOX.FromString(data)
    request.DiscardUnknownFields()
    return int(request.ByteSize())


def test_the_split_config_has_the_size_upb_writes() -> None:
    """The premise of the cases below: the watch takes upb's reading of SPLIT_CONFIG."""
    assert len(SPLIT_CONFIG) == _upb_size(SPLIT_CONFIG)


def test_the_watch_reads_a_split_config_as_go_does(godecode: str, tmp_path: Path) -> None:  # noqa: F811
    go = go_reads(godecode, tmp_path, SPLIT_CONFIG)
    assert go is not None
    pod = watched._pod_of_run_request(SPLIT_CONFIG)
    metadata = go["config"]["metadata"]
    assert (metadata["name"], metadata["uid"], metadata["namespace"]) == (pod.name, pod.uid, pod.namespace)
    assert metadata["attempt"] == pod.attempt
    assert go["config"]["labels"] == dict(pod.labels)


def test_the_interceptor_reads_a_split_config_as_the_watch_does() -> None:
    interceptors = pod_from_run_request(
        decode(cri.RunPodSandboxRequest, SPLIT_CONFIG, "RunPodSandboxRequest")
    )
    assert watched._pod_of_run_request(SPLIT_CONFIG) == interceptors
