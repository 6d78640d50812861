"""Tests of bfe13dd (the fake containerd reads a request with upb first, as containerd's Go decoder
reads it), against Go itself: tests/godecode reads the same bytes with google.golang.org/protobuf, as
containerd does. Each case: both refuse it (the fake with INTERNAL "error unmarshalling request", as
grpc-go answers), or both read the same message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory

from krproxy.fakes.containerd.server import _unmarshal
from krproxy.grpcstatus import GRPCError, Status
from krproxy.proto import descriptors
from krproxy.proto.runtime import v1 as cri
from tests.unit.godecode_support import (
    go_decode,
    godecode,  # noqa: F401 - the fixture
)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (payloads under 128 bytes)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


_METADATA = _field(1, b"web") + _field(2, b"u") + _field(3, b"ns")

CASES = {
    "a string not UTF-8": _field(1, _field(1, _field(1, b"\xff"))),
    "a map key not UTF-8": _field(1, _field(6, _field(1, b"\xc3") + _field(2, b"v"))),
    "a surrogate's UTF-8 bytes": _field(1, _field(2, b"\xed\xa0\x80")),
    "an unknown group": _field(1, b"") + b"\x9b\x06\x9c\x06",
    "a group ended by another number": b"\x9b\x06\xa4\x06",
    "a varint of 11 bytes": b"\x20" + b"\x80" * 10 + b"\x01",
    "a uint32 past 2**32": _field(1, _field(1, b"\x20\x81\x80\x80\x80\x10")),
    "field number 0": b"\x02\x00",
    "the largest field number": b"\xfa\xff\xff\xff\x0f\x00",
    "a length past the end": b"\x0a\x05ab",
    "wire type 6": b"\x0e",
    "a length of 2**32-1": b"\x0a\xff\xff\xff\xff\x0f",
    "the config twice, merged": _field(1, _field(1, _METADATA))
    + _field(1, _field(6, _field(1, b"k") + _field(2, b"v"))),
    "the metadata as a varint": _field(1, b"\x08\x05" + _field(2, b"host")),
    "a label's value before its key": _field(1, _field(6, _field(2, b"v") + _field(1, b"k"))),
    "a label key twice, the last wins": _field(
        1, _field(6, _field(1, b"k") + _field(2, b"1")) + _field(6, _field(1, b"k") + _field(2, b"2"))
    ),
    "an empty label entry": _field(1, _field(6, b"")),
}


def _cri_request_class() -> Any:
    """RunPodSandboxRequest from the CRI's own descriptor (its maps are maps), in a pool of its own."""
    pool = descriptor_pool.DescriptorPool()
    pool.Add(descriptor_pb2.FileDescriptorProto.FromString(descriptors.CRI_V1))
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("runtime.v1.RunPodSandboxRequest"))


def go_reads(program: str, tmp_path: Path, data: bytes) -> dict[str, Any] | None:
    """Go's reading of *data* as a RunPodSandboxRequest (protojson, proto names), None if Go refuses it."""
    descriptor = tmp_path / "cri.desc"
    descriptor.write_bytes(descriptors.CRI_V1)
    done = go_decode(program, descriptor, "runtime.v1.RunPodSandboxRequest", data)
    assert done.returncode in (0, 1), done.stderr.decode()
    return dict(json.loads(done.stdout)) if done.returncode == 0 else None


@pytest.mark.parametrize("data", CASES.values(), ids=CASES.keys())
def test_the_fake_reads_a_request_as_go_does(godecode: str, tmp_path: Path, data: bytes) -> None:  # noqa: F811
    go = go_reads(godecode, tmp_path, data)
    if go is None:
        with pytest.raises(GRPCError) as caught:
            _unmarshal(cri.RunPodSandboxRequest, data)
        assert Status.INTERNAL == caught.value.status
        assert caught.value.message.startswith("grpc: error unmarshalling request")
        return
    read = _unmarshal(cri.RunPodSandboxRequest, data)
    as_upb = _cri_request_class().FromString(bytes(read.SerializeToString()))
    assert go == json_format.MessageToDict(as_upb, preserving_proto_field_name=True)
