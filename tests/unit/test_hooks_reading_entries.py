"""A map entry whose key or value comes with another wire type is refused (INVALID_ARGUMENT) before any hook
sees the request: gogo protobuf (containerd 1.6, 1.7 and 2.1) reads an entry's fields 1 and 2 whatever their
wire type, as a length and a string, while upb and Go's protobuf (containerd 2.3) keep them as unknown fields
of the entry and read it without them; krproxy cannot know which reading the runtime behind has
(tests/e2e/test_containerd_gogo_reading.py measures gogo's on containerd)."""

from __future__ import annotations

from typing import Any

import pytest

from krproxy import protowire
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks import _reading as reading
from krproxy.hooks import rewrite, watched
from krproxy.proto.runtime import v1 as cri


def _field(number: int, payload: bytes) -> bytes:
    return protowire.varint(number << 3 | 2) + protowire.varint(len(payload)) + payload


_METADATA = _field(1, _field(1, b"web") + _field(2, b"u1") + _field(3, b"ns"))
#: An entry's value, ``true`` for gogo (a length as a padded varint, the string, 8 bytes in all), in
#: each wire type gogo reads as a string and upb does not: varint (the length, then ``true`` read as
#: fields by upb, which ``\x08\x01`` is), fixed64, fixed32, a group.
_SMUGGLED = {
    "a varint": b"\x10\x02\x08\x01",
    "a fixed64": b"\x11\x84\x80\x80\x00true",
    "a fixed32": b"\x15\x83\x80\x00\x00",
    "a group": b"\x13\x14",
}


def _entry(smuggled: bytes) -> bytes:
    return _field(1, b"runtimeproxy.koordinator.sh/skip-hookserver") + _field(2, b"false") + smuggled


def _requests(smuggled: bytes) -> dict[str, tuple[type[Any], bytes]]:
    labels = _field(6, _entry(smuggled))  # PodSandboxConfig.labels, ContainerConfig.labels (9 there)
    return {
        "a pod label": (cri.RunPodSandboxRequest, _field(1, _METADATA + labels)),
        "a pod annotation (upb)": (
            rewrite.CreateContainerRequest,
            _field(1, b"pod") + _field(3, _METADATA + _field(7, _entry(smuggled))),
        ),
        "a container label (upb)": (
            rewrite.CreateContainerRequest,
            _field(1, b"pod") + _field(2, _field(9, _entry(smuggled))),
        ),
        "an update's unified": (
            cri.UpdateContainerResourcesRequest,
            _field(1, b"c") + _field(2, _field(9, _entry(smuggled))),  # LinuxContainerResources.unified
        ),
    }


@pytest.mark.parametrize("smuggled", _SMUGGLED.values(), ids=_SMUGGLED.keys())
def test_an_entry_key_or_value_of_another_wire_type_is_refused(smuggled: bytes) -> None:
    for what, (message_type, data) in _requests(smuggled).items():
        with pytest.raises(GRPCError) as caught:
            reading.decode(message_type, data, message_type.__name__)
        assert Status.INVALID_ARGUMENT == caught.value.status, what
        assert "the value (field 2) with wire type" in caught.value.message, what
        assert "refuses it" in caught.value.message


def test_a_smuggled_key_is_refused_too() -> None:
    """gogo reads this entry's key as ``evil``, upb as ``shown``."""
    entry = _field(1, b"shown") + b"\x09\x84\x80\x80\x00evil" + _field(2, b"v")
    data = _field(1, _METADATA + _field(7, entry))
    with pytest.raises(GRPCError) as caught:
        reading.decode(cri.RunPodSandboxRequest, data, "RunPodSandboxRequest")
    assert "config.annotations: the key (field 1) with wire type 1" in caught.value.message


def test_the_watched_run_leaves_it_to_the_interceptor() -> None:
    _, data = _requests(_SMUGGLED["a fixed64"])["a pod label"]
    with pytest.raises(GRPCError):
        watched._pod_of_run_request(data)


def test_other_unknown_fields_of_an_entry_are_read_as_before() -> None:
    """A field of an entry that is neither key nor value is skipped by every reading: the entry is read."""
    data = _field(1, _METADATA + _field(6, _entry(b"\x18\x01" + _field(4, b"x"))))
    request = reading.decode(cri.RunPodSandboxRequest, data, "RunPodSandboxRequest")
    assert {"runtimeproxy.koordinator.sh/skip-hookserver": "false"} == request.config.labels
    create = _field(1, b"pod") + _field(2, _field(9, _entry(b"\x18\x01")))
    assert "false" == reading.decode(rewrite.CreateContainerRequest, create, "x").config.labels[0].value
