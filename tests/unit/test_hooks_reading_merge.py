"""The interceptors read a whole request as containerd's Go decoder does (``_reading.decode``, through
``as_go_reads``): a message field sent more than once is merged, at any depth, where betterproto2 alone
keeps the last occurrence; the rest of betterproto2's reading (unknown fields kept for the write-back,
map entries in their order) is unchanged, and a request Go refuses is refused, as betterproto2's refusals
are, with INTERNAL as grpc-go refuses them, before any hook sees it (betterproto2 took a field cut short as it was)."""

from __future__ import annotations

import pytest

from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks import _reading as reading
from krproxy.hooks import rewrite
from krproxy.proto.runtime import v1 as cri


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (payloads under 128 bytes; a tag of two bytes from field 16 on)."""
    assert len(payload) < 128
    tag = number << 3 | 2
    head = bytes([tag]) if tag < 128 else bytes([tag & 0x7F | 0x80, tag >> 7])
    return head + bytes([len(payload)]) + payload


def _varint(number: int, value: int) -> bytes:
    assert value < 128
    return bytes([number << 3, value])


_METADATA = _field(1, _field(1, b"web") + _field(2, b"u1") + _field(3, b"ns"))  # PodSandboxMetadata
#: PodSandboxConfig.linux (8) sent twice: cgroup_parent (1), then resources (5) with cpu_shares (3).
_LINUX_TWICE = _field(8, _field(1, b"/kubepods")) + _field(8, _field(5, _varint(3, 64)))
#: RunPodSandboxRequest.config (1) in two parts, the second with its linux in two parts itself.
SPLIT_RUN = _field(1, _METADATA) + _field(1, _field(2, b"host") + _LINUX_TWICE)


def test_a_config_sent_in_parts_is_read_whole() -> None:
    assert cri.RunPodSandboxRequest.FromString(SPLIT_RUN).config.metadata is None  # the premise
    request = reading.decode(cri.RunPodSandboxRequest, SPLIT_RUN, "RunPodSandboxRequest")
    config = request.config
    assert (config.metadata.name, config.metadata.uid, config.metadata.namespace) == ("web", "u1", "ns")
    assert config.hostname == "host"
    assert (config.linux.cgroup_parent, config.linux.resources.cpu_shares) == ("/kubepods", 64)


def test_an_update_whose_resources_come_in_parts_is_read_whole() -> None:
    data = _field(1, b"c1") + _field(2, _varint(3, 64)) + _field(2, _varint(4, 100))
    request = reading.decode(cri.UpdateContainerResourcesRequest, data, "UpdateContainerResourcesRequest")
    assert (request.linux.cpu_shares, request.linux.memory_limit_in_bytes) == (64, 100)


def test_unknown_fields_and_map_order_survive_to_the_write_back() -> None:
    unknown_top = _field(9, b"top")  # RunPodSandboxRequest has fields 1 and 2
    unknown_in_config = _field(91, b"inner")  # beyond PodSandboxConfig's fields
    labels = _field(6, _field(1, b"z") + _field(2, b"1")) + _field(6, _field(1, b"a") + _field(2, b"2"))
    data = _field(1, _METADATA + labels + unknown_in_config) + unknown_top
    request = reading.decode(cri.RunPodSandboxRequest, data, "RunPodSandboxRequest")
    assert list(request.config.labels.items()) == [("z", "1"), ("a", "2")]
    written = bytes(request)  # the interceptor's write-back after a plugin's change
    assert unknown_top in written
    assert unknown_in_config in written


@pytest.mark.parametrize(
    "data",
    [b"\x0a\x05ab", b"\x0a\x03\x0a\x05a", b"\x12\x02\xff\xfe"],
    ids=["truncated", "a truncated config", "a runtime handler not UTF-8"],
)
def test_a_malformed_request_is_refused(data: bytes) -> None:
    """Bytes Go's decoder refuses are answered as grpc-go answers them: INTERNAL, "grpc: error
    unmarshalling request", naming the message."""
    with pytest.raises(GRPCError) as caught:
        reading.decode(cri.RunPodSandboxRequest, data, "RunPodSandboxRequest")
    assert caught.value.status == Status.INTERNAL
    assert caught.value.message.startswith("grpc: error unmarshalling request: RunPodSandboxRequest:")


def test_upb_and_non_cri_messages_are_read_as_they_came() -> None:
    """Upb classes and messages that are no cri message are read as they came."""

    class NotCri:
        _betterproto = None

    data = _field(1, b"x")
    assert reading.as_go_reads(NotCri, data) is data
    assert reading.as_go_reads(rewrite.CreateContainerRequest, data) is data  # upb merges by itself
