"""krproxy.hooks._reading reads the id of id-only messages (RemoveContainerRequest, CreateContainerResponse,
...) off the wire (``plain_id``) and leaves everything else to betterproto2: where it answers, it must
answer what betterproto2 reads; and the malformed requests keep betterproto2's refusal."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks import _reading as reading
from krproxy.proto.runtime import v1 as cri

ID_MESSAGES = [
    (cri.RemoveContainerRequest, "container_id"),
    (cri.StopContainerRequest, "container_id"),
    (cri.StartContainerRequest, "container_id"),
    (cri.StopPodSandboxRequest, "pod_sandbox_id"),
    (cri.RemovePodSandboxRequest, "pod_sandbox_id"),
    (cri.CreateContainerResponse, "container_id"),
    (cri.RunPodSandboxResponse, "pod_sandbox_id"),
]

CASES = {
    "empty": b"",
    "an id": b"\x0a\x03abc",
    "the id twice: the last counts": b"\x0a\x03abc\x0a\x02de",
    "other fields around it": b"\x10\x05\x0a\x01x\x1d\x00\x00\x00\x00\x21" + bytes(8),
    "the id as a varint": b"\x08\x01",
    "not UTF-8": b"\x0a\x02\xff\xfe",
    "truncated": b"\x0a\x05ab",
    "a group": b"\x0b",
    "field number 0": b"\x02\x00",
    "an id of 127 bytes": b"\x0a\x7f" + b"i" * 127,
    "an id of 128 bytes": b"\x0a\x80\x01" + b"i" * 128,
    # a two-byte length whose first byte + 2 is the size: truncated, not an id of the rest
    "a long length's first byte": b"\x0a\x85\x01" + b"i" * 132,
}


def agrees(message_type: type[Any], field: str, data: bytes) -> None:
    plain = reading.plain_id(message_type, data, field)
    if plain is None:  # left to betterproto2
        return
    assert plain == getattr(message_type.FromString(data), field)


@pytest.mark.parametrize(("message_type", "field"), ID_MESSAGES, ids=[m.__name__ for m, _ in ID_MESSAGES])
@pytest.mark.parametrize("data", CASES.values(), ids=CASES.keys())
def test_the_wire_reading_is_betterproto2s(message_type: type[Any], field: str, data: bytes) -> None:
    agrees(message_type, field, data)


def test_well_formed_ids_are_read_off_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    """The point: no betterproto2 for the usual message (refused here)."""

    def refuse(data: bytes) -> Any:
        raise AssertionError("decoded with betterproto2")

    monkeypatch.setattr(cri.RemoveContainerRequest, "FromString", refuse)
    data = bytes(cri.RemoveContainerRequest(container_id="c" * 64))
    assert "c" * 64 == reading.decode_id(cri.RemoveContainerRequest, data, "container_id")
    for case in ("empty", "an id", "the id twice: the last counts", "other fields around it"):
        assert reading.plain_id(cri.RemoveContainerRequest, CASES[case], "container_id") is not None


def test_an_id_sent_as_a_varint_is_read_as_go_reads_it() -> None:
    """Go keeps the varint as an unknown field: no id (betterproto2 alone held the int, refused)."""
    assert "" == reading.decode_id(cri.RemoveContainerRequest, CASES["the id as a varint"], "container_id")


@pytest.mark.parametrize("case", ["not UTF-8", "a group"])
def test_malformed_requests_are_refused_as_before(case: str) -> None:
    """Bytes Go refuses too get grpc-go's answer to a request its codec refuses: INTERNAL."""
    with pytest.raises(GRPCError) as caught:
        reading.decode_id(cri.RemoveContainerRequest, CASES[case], "container_id")
    assert caught.value.status is Status.INTERNAL
    assert "RemoveContainerRequest" in (caught.value.message or "")


@given(st.binary(max_size=24) | st.lists(st.sampled_from(list(CASES.values())), max_size=4).map(b"".join))
def test_any_bytes_read_as_betterproto2_reads_them(data: bytes) -> None:
    for message_type, field in ID_MESSAGES:
        agrees(message_type, field, data)
