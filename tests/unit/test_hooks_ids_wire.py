"""Tests of d448e7b: krproxy.hooks._reading reads the id of id-only messages off the wire (``plain_id``) and
leaves other bytes to betterproto2. Beyond agreeing where it answers (tests/unit/test_hooks_ids.py), it must
not answer where betterproto2 refuses: a request betterproto2 cannot decode was refused INVALID_ARGUMENT and
must still be, whatever field makes it so, unless Go reads it (StopContainerRequest's int64 timeout sent as a
fixed32: betterproto2 raises KeyError, Go keeps it as an unknown field, and since review8 the interceptor reads
the id as Go does). Also: the id's occurrences around groups, truncated varints and the id first sent with
another wire type."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy import protowire
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks import _reading as reading
from krproxy.hooks import wire
from tests.fuzz import examples
from tests.unit.test_hooks_ids import ID_MESSAGES

FRAGMENTS = [
    b"\x0a\x03abc",  # the id
    b"\x0a\x00",  # an empty id
    b"\x08\x01",  # the id as a varint
    b"\x0d\x00\x00\x00\x00",  # the id as a fixed32
    b"\x10\x05",  # field 2 as a varint (StopContainerRequest's timeout)
    b"\x15\x01\x00\x00\x00",  # field 2 as a fixed32
    b"\x11" + bytes(8),  # field 2 as a fixed64
    b"\x12\x01x",  # field 2 length-delimited
    b"\xa8\x06\x01",  # field 101, a varint
    b"\xad\x06\x00\x00\x00\x00",  # field 101, a fixed32
    b"\x13\x14",  # a group, field 2
    b"\x10\xff",  # a truncated varint
    b"\x0a\x02\xff\xfe",  # an id that is not UTF-8
    b"\x8a\x80\x80\x80\x80\x01\x03xyz",  # field 2**32 + 1: gogo's field 1 (its number cut to 32 bits)
]


def refused_as_betterproto2_refuses(message_type: type[Any], field: str, data: bytes) -> None:
    try:
        value = getattr(message_type.FromString(data), field)
    except Exception:
        value = None
    if value is None:  # betterproto2 refuses it
        assert reading.plain_id(message_type, data, field) is None
        if not message_type.__name__.endswith("Response"):
            try:  # upb refuses it too (as Go does), or betterproto2 is handed what Go reads (review8)
                go = getattr(wire.message_class(message_type.__name__).FromString(data), field)
            except DecodeError:
                go = None
            if go is None:
                with pytest.raises(GRPCError) as caught:
                    reading.decode_id(message_type, data, field)
                assert caught.value.status is Status.INTERNAL  # as grpc-go answers what its codec refuses
            else:
                assert go == reading.decode_id(message_type, data, field)
    elif isinstance(value, str):
        plain = reading.plain_id(message_type, data, field)
        assert plain is None or plain == value


@pytest.mark.parametrize(("message_type", "field"), ID_MESSAGES, ids=[m.__name__ for m, _ in ID_MESSAGES])
def test_a_stop_with_a_fixed32_timeout_is_not_read_off_the_wire(message_type: type[Any], field: str) -> None:
    """A stop request with its timeout as a fixed32 is not read off the wire."""
    refused_as_betterproto2_refuses(message_type, field, b"\x0a\x01a\x15\x00\x00\x00\x00")
    refused_as_betterproto2_refuses(message_type, field, b"\x15\x00\x00\x00\x00")


@settings(max_examples=examples(400))
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=4).map(b"".join))
def test_fuzz_nothing_betterproto2_refuses_is_read_off_the_wire(data: bytes) -> None:
    for message_type, field in ID_MESSAGES:
        refused_as_betterproto2_refuses(message_type, field, data)


@pytest.mark.parametrize(("message_type", "field"), ID_MESSAGES, ids=[m.__name__ for m, _ in ID_MESSAGES])
def test_a_field_number_past_protobufs_largest_is_refused(message_type: type[Any], field: str) -> None:
    """An id, then another under field number 2**32 + 1, which gogo protobuf (containerd 1.6-2.1) cuts to
    32 bits and reads as the id, field 1: not read off the wire (where it was skipped as an unknown
    field, naming the first id), but refused as upb and Go's protobuf refuse it."""
    data = b"\x0a\x03abc" + protowire.varint((2**32 + 1) << 3 | 2) + b"\x03xyz"
    assert reading.plain_id(message_type, data, field) is None
    with pytest.raises(protowire.DecodeError):
        list(protowire.fields(data))
    with pytest.raises(protowire.DecodeError):
        reading.with_id(data, 1, "full")
    if not message_type.__name__.endswith("Response"):
        with pytest.raises(GRPCError) as caught:
            reading.decode_id(message_type, data, field)
        assert caught.value.status is Status.INTERNAL
    largest = b"\x0a\x03abc" + protowire.varint(protowire.MAX_FIELD_NUMBER << 3 | 2) + b"\x03xyz"
    assert "abc" == reading.plain_id(message_type, largest, field)  # protobuf's largest: an unknown field
