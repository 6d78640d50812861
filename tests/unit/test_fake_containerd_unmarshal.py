"""The fake containerd reads a request as containerd's Go decoder does (fakes/containerd/server.py's
_unmarshal): a field sent with a wire type other than its own is an unknown field and dropped, the
last of a singular field sent twice wins, bytes that are no message are INTERNAL."""

from __future__ import annotations

import pytest

from krproxy.fakes.containerd.records import Code, CriError
from krproxy.fakes.containerd.server import _unmarshal
from krproxy.grpcstatus import GRPCError, Status
from krproxy.proto.runtime import v1 as cri
from tests.unit.test_fake_containerd_state import new_state, run_pod


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (payloads here are shorter than 128 bytes)."""
    return bytes([number << 3 | 2, len(payload)]) + payload


def test_a_message_field_sent_as_a_varint_is_unknown_and_dropped() -> None:
    """`config` (2) as the varint 1: Go's decoder keeps it as an unknown field, so the config is
    nil; betterproto2 alone held the int 1 in the message's place."""
    request = _unmarshal(cri.CreateContainerRequest, _field(1, b"pod-1") + b"\x10\x01")
    assert cri.CreateContainerRequest(pod_sandbox_id="pod-1") == request


def test_a_wrong_wire_type_deep_inside_is_dropped_rest_kept() -> None:
    """A wrong wire type deep inside is dropped and the rest kept."""
    metadata_as_varint = b"\x08\x05"  # ContainerConfig.metadata (1) as a varint
    image = _field(2, _field(1, b"nginx:1.25"))
    request = _unmarshal(cri.CreateContainerRequest, _field(2, metadata_as_varint + image))
    assert request.config is not None
    assert request.config.metadata is None
    assert cri.ImageSpec(image="nginx:1.25") == request.config.image


def test_a_singular_field_sent_twice_keeps_the_last() -> None:
    request = _unmarshal(cri.CreateContainerRequest, _field(1, b"first") + _field(1, b"last"))
    assert "last" == request.pod_sandbox_id


def test_bytes_that_are_no_message_are_internal_as_grpc_go_says() -> None:
    with pytest.raises(GRPCError) as caught:
        _unmarshal(cri.CreateContainerRequest, b"\x0a\x05ab")  # a string field cut short
    assert Status.INTERNAL == caught.value.status
    assert caught.value.message.startswith("grpc: error unmarshalling request: ")


def test_a_create_with_varint_config_is_refused_for_metadata() -> None:
    """What the fake answers is its model of containerd's for a nil config, not a Python error
    (an AttributeError on the int was answered UNKNOWN)."""
    state = new_state()
    pod = run_pod(state)
    request = _unmarshal(cri.CreateContainerRequest, _field(1, pod.encode()) + b"\x10\x01")
    with pytest.raises(CriError) as caught:
        state.create_container(request)
    assert (Code.UNKNOWN, "container config must include metadata") == (
        caught.value.code,
        caught.value.message,
    )
