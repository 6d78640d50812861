"""Tests of 28615d1 (an intercepted request is read by upb and written back before betterproto2 reads
it), against Go itself (tests/godecode reads the bytes with google.golang.org/protobuf, as containerd
does). Wire bytes are drawn from the CRI's own descriptor: known fields (sometimes with another wire
type), unknown ones, groups, messages and map entries sent more than once, strings that are not UTF-8,
then sometimes cut short or spliced. Whenever Go accepts the bytes, what the interceptor reads
(``_reading.decode``) is what Go read; whenever Go refuses them, ``decode`` raises INTERNAL, as grpc-go does (INVALID_ARGUMENT where upb
reads them and betterproto2 does not). One exception, where containerd's decoders differ: a map entry whose
key or value came with another wire type, which Go reads without it and gogo protobuf (containerd 1.6-2.1)
reads as the key or value, is refused (INVALID_ARGUMENT; tests/unit/test_hooks_reading_entries.py)."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks import _reading as reading
from krproxy.hooks import convert, rewrite, watched, wire
from krproxy.proto import descriptors
from krproxy.proto.runtime import v1 as cri
from tests.unit.godecode_support import (
    go_decode,
    godecode,  # noqa: F401 - the fixture
)

_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(descriptor_pb2.FileDescriptorProto.FromString(descriptors.CRI_V1))


def _upb(name: str) -> Any:
    """The CRI message *name* from the CRI's own descriptor (maps are maps), in a pool of its own."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"runtime.v1.{name}"))


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _delimited(number: int, payload: bytes) -> bytes:
    return _tag(number, 2) + _varint(len(payload)) + payload


_VARINT_TYPES = {
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT32,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_BOOL,
    FieldDescriptor.TYPE_ENUM,
}
_FIXED64 = {FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64, FieldDescriptor.TYPE_DOUBLE}
_FIXED32 = {FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_FLOAT}

_TEXT = st.one_of(
    st.sampled_from(["", "web", "k", "v", "/kubepods", "ns"]),
    st.text(max_size=6).map(lambda text: text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")),
)


@st.composite
def _string(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 9)) == 0:  # not UTF-8 (a lone continuation byte, a surrogate, a cut sequence)
        return draw(st.sampled_from([b"\xff", b"a\x80", b"\xed\xa0\x80", b"\xc3", b"\xe2\x82"]))
    return draw(_TEXT).encode()


@st.composite
def _value(draw: st.DrawFn, field: FieldDescriptor, depth: int) -> bytes:
    """One occurrence of *field* on the wire, sometimes with another wire type than its own."""
    number = field.number
    if draw(st.integers(0, 11)) == 0:  # another wire type
        wire_type = draw(st.sampled_from([0, 1, 2, 5]))
        payload = {0: _varint(draw(st.integers(0, 300))), 1: bytes(8), 5: b"\x01\x00\x00\x00"}
        if wire_type == 2:
            return _delimited(number, draw(st.binary(max_size=4)))
        return _tag(number, wire_type) + payload[wire_type]
    kind = field.type
    if kind == FieldDescriptor.TYPE_MESSAGE:
        return _delimited(number, draw(_message(field.message_type, depth + 1)))
    if kind == FieldDescriptor.TYPE_STRING:
        return _delimited(number, draw(_string()))
    if kind == FieldDescriptor.TYPE_BYTES:
        return _delimited(number, draw(st.binary(max_size=4)))
    if kind in _VARINT_TYPES:
        value = draw(st.one_of(st.integers(0, 300), st.integers(-(2**63), 2**64 - 1)))
        if field.is_repeated and draw(st.booleans()):  # packed
            return _delimited(number, b"".join(_varint(value) for _ in range(draw(st.integers(0, 3)))))
        return _tag(number, 0) + _varint(value)
    if kind in _FIXED64:
        return _tag(number, 1) + draw(st.binary(min_size=8, max_size=8))
    assert kind in _FIXED32, kind
    return _tag(number, 5) + draw(st.binary(min_size=4, max_size=4))


@st.composite
def _message(draw: st.DrawFn, descriptor: Descriptor, depth: int = 0) -> bytes:
    fields = list(descriptor.fields)
    parts = []
    for _ in range(draw(st.integers(0, 5 if depth < 3 else 1))):
        pick = draw(st.integers(0, 15))
        if pick == 0 or not fields:  # an unknown field, now and then a group
            number = draw(st.integers(30, 40))
            if draw(st.booleans()):
                parts.append(_tag(number, 3) + _delimited(1, b"x") + _tag(number, 4))
            else:
                parts.append(_delimited(number, draw(st.binary(max_size=3))))
        else:
            parts.append(draw(_value(draw(st.sampled_from(fields)), depth)))
    return b"".join(parts)


#: A varint's tenth byte above 1: Go refuses it (more than 64 bits), upb and betterproto2 take it
#: (test_a_varint_past_64_bits_is_refused_as_go_refuses_it); left out of the drawn requests. (A string
#: of nine bytes past 0x7F then one below is left out too: no loss.)
_VARINT_PAST_64_BITS = re.compile(rb"[\x80-\xff]{9}[\x02-\x7f]")


@st.composite
def _request(draw: st.DrawFn, name: str) -> bytes:
    data = draw(_message(_POOL.FindMessageTypeByName(f"runtime.v1.{name}")))
    mutation = draw(st.integers(0, 9))
    if mutation == 0 and data:  # cut short
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif mutation == 1:  # a byte changed
        at = draw(st.integers(0, len(data)))
        data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
    assume(not _VARINT_PAST_64_BITS.search(data))
    return data


#: google.golang.org/protobuf's reflective decoder (dynamicpb) panics on a map entry whose key came
#: with another wire type ("type mismatch: cannot convert nil to map key"); containerd's generated
#: code does not take that path. Such bytes have no Go reading to compare with.
GO_PANICKED = "panicked"


def go_reads(program: str, descriptor: Path, name: str, data: bytes) -> dict[str, Any] | str | None:
    """Go's reading of *data* (protojson, proto names), None if Go refuses it, GO_PANICKED."""
    done = go_decode(program, descriptor, f"runtime.v1.{name}", data)
    if done.returncode == 2 and b"panic: type mismatch: cannot convert nil to map key" in done.stderr:
        return GO_PANICKED
    assert done.returncode in (0, 1), done.stderr.decode()
    return dict(json.loads(done.stdout)) if done.returncode == 0 else None


def as_dict(name: str, message: Any) -> dict[str, Any]:
    """A betterproto2 message as Go's protojson prints it (read back by upb from its bytes)."""
    read = _upb(name).FromString(bytes(message))
    return dict(json_format.MessageToDict(read, preserving_proto_field_name=True))


def _upb_refuses(name: str, data: bytes) -> bool:
    try:
        wire.message_class(name).FromString(data)
    except DecodeError:
        return True
    return False


def _check(godecode: str, tmp_path: Path, name: str, data: bytes) -> None:  # noqa: F811
    descriptor = tmp_path / "cri.desc"
    if not descriptor.exists():
        descriptor.write_bytes(descriptors.CRI_V1)
    message_type = getattr(cri, name)
    go = go_reads(godecode, descriptor, name, data)
    if go == GO_PANICKED:  # read or refused, no crash
        with contextlib.suppress(GRPCError):
            reading.decode(message_type, data, name)
        return
    if go is None:
        with pytest.raises(GRPCError) as caught:
            reading.decode(message_type, data, name)
        # grpc-go's answer to what its codec refuses where upb refuses too; betterproto2's refusal else
        upb_refuses = _upb_refuses(name, data)
        assert (Status.INTERNAL if upb_refuses else Status.INVALID_ARGUMENT) == caught.value.status
        if name == "RunPodSandboxRequest":  # the watched path leaves it to the interceptor
            with pytest.raises(Exception):  # noqa: B017 - any: the watcher steps aside on all
                watched._pod_of_run_request(data)
        return
    assert isinstance(go, dict)
    entry = wire.misread_entry(wire.message_class(name).FromString(data))
    if entry is not None:  # Go reads the entry without it, gogo (containerd 1.6-2.1) with it: refused
        with pytest.raises(GRPCError) as caught:
            reading.decode(message_type, data, name)
        assert Status.INVALID_ARGUMENT == caught.value.status
        assert entry in caught.value.message
        return
    request = reading.decode(message_type, data, name)
    assert go == as_dict(name, request)
    if name == "RunPodSandboxRequest":  # the record the hooks get is the one Go's reading makes
        as_go = cri.RunPodSandboxRequest.FromString(
            json_format.ParseDict(go, _upb(name)()).SerializeToString()
        )
        record = convert.pod_from_run_request(request)
        assert convert.pod_from_run_request(as_go) == record
        assert watched._pod_of_run_request(data) == record  # the watched path reads it so too


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@pytest.mark.parametrize(
    "name", ["RunPodSandboxRequest", "UpdateContainerResourcesRequest", "UpdatePodSandboxResourcesRequest"]
)
@given(data=st.data())
def test_a_request_is_read_as_go_reads_it(
    godecode: str,  # noqa: F811
    tmp_path: Path,
    name: str,
    data: st.DataObject,
) -> None:
    _check(godecode, tmp_path, name, data.draw(_request(name), label="request"))


#: Go reads a known field sent with another wire type as an unknown field (and skips an unknown group
#: whole); upb too, which writes both back at the message's end for betterproto2, which reads the first
#: as the known field (a value of the wrong type, or a KeyError) and the fields inside a group as the
#: outer message's own.
MISREAD = {
    "runtime_handler as a varint": ("RunPodSandboxRequest", b"\x10\x00"),
    "runtime_handler as a varint, then as a string": ("RunPodSandboxRequest", b"\x10\x00\x12\x01a"),
    "the config as a varint": ("RunPodSandboxRequest", b"\x08\x01"),
    "the config as a fixed64": ("RunPodSandboxRequest", b"\x09" + bytes(8)),
    "the config's hostname as a fixed32": ("RunPodSandboxRequest", _delimited(1, b"\x15\x01\x00\x00\x00")),
    "cpu_shares as a fixed64": ("UpdateContainerResourcesRequest", _delimited(2, b"\x19" + bytes(8))),
    "the container id as a varint": ("UpdateContainerResourcesRequest", b"\x08\x07"),
    "the overhead as a varint": ("UpdatePodSandboxResourcesRequest", b"\x10\x01"),
    "an unknown group holding a field 1": ("RunPodSandboxRequest", b"\xf3\x01\x0a\x01\x01\xf4\x01"),
    "an unknown group holding a bad field 1": ("RunPodSandboxRequest", b"\xf3\x01\x0a\x01x\xf4\x01"),
}


@pytest.mark.parametrize(("name", "data"), MISREAD.values(), ids=MISREAD.keys())
def test_a_field_go_keeps_as_unknown_is_not_read_as_a_known_one(
    godecode: str,  # noqa: F811
    tmp_path: Path,
    name: str,
    data: bytes,
) -> None:
    _check(godecode, tmp_path, name, data)


def _unknown_numbers(message: Any) -> list[tuple[str, int]]:
    """Every unknown field of a upb message, at any depth, as (message name, field number)."""
    from google.protobuf.unknown_fields import UnknownFieldSet

    found = [(message.DESCRIPTOR.name, field.field_number) for field in UnknownFieldSet(message)]
    for field, value in message.ListFields():
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for each in value if field.is_repeated else (value,):
                found += _unknown_numbers(each)
    return found


def test_a_written_back_change_keeps_unknown_fields_at_any_depth(
    godecode: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A config sent in two parts, each with a field of a newer kubelet, and one in the metadata: the
    request the interceptor sends on after a plugin's change holds all three, and the change, and Go
    reads it as the merged request with the change."""
    metadata = _delimited(1, _delimited(1, b"web") + _delimited(3, b"ns") + _delimited(35, b"m"))
    label = _delimited(6, _delimited(1, b"k") + _delimited(2, b"v"))
    data = (
        _delimited(1, metadata + _delimited(36, b"c1"))
        + _delimited(1, label + _delimited(37, b"c2"))
        + _delimited(2, b"runc")
        + _delimited(38, b"top")
    )
    request = reading.decode(cri.RunPodSandboxRequest, data, "RunPodSandboxRequest")
    request.config.labels["added"] = "by-plugin"
    written = bytes(request)
    read = _upb("RunPodSandboxRequest").FromString(written)
    assert sorted(_unknown_numbers(read)) == [
        ("PodSandboxConfig", 36),
        ("PodSandboxConfig", 37),
        ("PodSandboxMetadata", 35),
        ("RunPodSandboxRequest", 38),
    ]
    go = go_reads(godecode, _desc(tmp_path), "RunPodSandboxRequest", written)
    assert go == {
        "config": {
            "metadata": {"name": "web", "namespace": "ns"},
            "labels": {"k": "v", "added": "by-plugin"},
        },
        "runtime_handler": "runc",
    }


def _desc(tmp_path: Path) -> Path:
    """The CRI's descriptor in a file, for tests/godecode."""
    descriptor = tmp_path / "cri.desc"
    descriptor.write_bytes(descriptors.CRI_V1)
    return descriptor


async def test_a_16_mib_request_in_two_parts_is_read_whole_in_a_thread(
    godecode: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """decode_request's thread path reads through upb too: 16 MiB of annotations in the config's first
    part and its metadata in the second reach the hooks together, as Go reads them."""
    annotations = b"".join(
        _delimited(7, _delimited(1, b"a%05d" % i) + _delimited(2, b"v" * 1024)) for i in range(16 * 1024)
    )
    data = _delimited(1, annotations) + _delimited(1, _delimited(1, _delimited(1, b"web")))
    assert len(data) >= 16 * 1024 * 1024 > reading.THREAD_DECODE_AT
    request = await reading.decode_request(cri.RunPodSandboxRequest, data, "RunPodSandboxRequest")
    assert request.config.metadata.name == "web"
    assert len(request.config.annotations) == 16 * 1024
    go = go_reads(godecode, _desc(tmp_path), "RunPodSandboxRequest", data)
    assert isinstance(go, dict)
    assert go == as_dict("RunPodSandboxRequest", request)


@pytest.mark.xfail(strict=True, reason="upb refuses groups nested past 100, Go's limit is 10,000")
def test_groups_deeper_than_upbs_limit_are_read_as_go_reads(
    godecode: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Go skips unknown groups nested up to 10,000 deep; upb refuses them past 100, so the interceptor
    refuses (INVALID_ARGUMENT) what containerd would read (betterproto2 alone skipped them). No kubelet
    sends a group (proto3 has none)."""
    data = _tag(30, 3) * 101 + _tag(30, 4) * 101 + _delimited(2, b"runc")
    _check(godecode, tmp_path, "RunPodSandboxRequest", data)


@pytest.mark.xfail(
    strict=True,
    reason="upb reads a varint past 64 bits cut to 64 bits, as containerd 1.6, 1.7 and 2.1 do; google.golang.org/protobuf refuses it",
)
def test_a_varint_past_64_bits_is_refused_as_go_refuses_it(
    godecode: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """cpu_period as ten bytes whose last is 2: google.golang.org/protobuf (tests/godecode) refuses the
    request (the varint overflows 64 bits), upb reads it cut to 64 bits, and so did betterproto2 alone
    before 28615d1; no kubelet sends one. Real containerd reads it as upb does (measured on 1.6.20,
    1.7.24 and 2.1.9: tests/e2e/test_containerd_hooks.py's TestReading), so krproxy keeps upb's
    reading; a runtime whose CRI decoder is google.golang.org/protobuf's would refuse it."""
    past = b"\x08" + b"\xff" * 9 + b"\x02"
    assert _VARINT_PAST_64_BITS.search(past)
    _check(godecode, tmp_path, "UpdateContainerResourcesRequest", _delimited(2, past))


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_create_is_read_as_go_reads_it(
    godecode: str,  # noqa: F811
    tmp_path: Path,
    data: st.DataObject,
) -> None:
    """A CreateContainer, read by the upb class the interceptor and the watched create read it with
    (hooks/rewrite.py), holds what Go read, or is refused where Go refuses it (INTERNAL) or where gogo
    would read a map entry otherwise (INVALID_ARGUMENT); and the record the hooks get is Go's reading's."""
    name = "CreateContainerRequest"
    raw = data.draw(_request(name), label="request")
    go = go_reads(godecode, _desc(tmp_path), name, raw)
    if go == GO_PANICKED:
        with contextlib.suppress(GRPCError):
            reading.decode(rewrite.CreateContainerRequest, raw, name)
        return
    if go is None:
        with pytest.raises(GRPCError) as caught:
            reading.decode(rewrite.CreateContainerRequest, raw, name)
        assert Status.INTERNAL == caught.value.status
        return
    if wire.misread_entry(wire.message_class(name).FromString(raw)) is not None:
        with pytest.raises(GRPCError) as caught:
            reading.decode(rewrite.CreateContainerRequest, raw, name)
        assert Status.INVALID_ARGUMENT == caught.value.status
        return
    request = reading.decode(rewrite.CreateContainerRequest, raw, name)
    as_go = rewrite.CreateContainerRequest.FromString(
        json_format.ParseDict(go, _upb(name)()).SerializeToString()
    )
    # (compared as records: python upb's maps drop an entry that holds only an unknown field, Go does not)
    ours, gos = (convert.pod_from_wire_config(each.sandbox_config) for each in (request, as_go))
    assert ours == gos
    assert convert.container_from_wire_create(as_go, gos) == convert.container_from_wire_create(request, ours)
