"""Protobuf's wire format, the few pieces krproxy writes and reads by hand (no generated code, no I/O).

Used where a message is small and fixed and a generated class would cost more than it saves: the hook
requests krproxy serializes once per chain (:mod:`krproxy.hooks.convert`) and ttrpc's envelopes
(:mod:`krproxy.nri._ttrpc`).
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["MAX_FIELD_NUMBER", "DecodeError", "fields", "read_varint", "varint"]

#: The largest field number protobuf allows (2**29 - 1). A tag naming a larger one is refused, as upb and
#: Go's protobuf refuse it (Go's past 2**31 - 1): gogo protobuf, containerd 1.6-2.1's CRI decoder, cuts
#: the number to 32 bits, so field 2**32 + 1 is its field 1, an id that a reader skipping an unknown
#: field would not see (tests/e2e/test_containerd_gogo_reading.py).
MAX_FIELD_NUMBER = (1 << 29) - 1


class DecodeError(ValueError):
    """Bytes that are no protobuf message of the expected shape (truncated, or a field of the wrong wire type)."""


def varint(value: int) -> bytes:
    """A varint (an int64 or uint64 field's value, a length, a tag)."""
    value &= (1 << 64) - 1  # a negative int64 is ten bytes of two's complement, as protobuf writes it
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` (as an unsigned 64-bit number) and the position after it."""
    result = shift = 0
    while True:
        if pos >= len(data):
            raise DecodeError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result & ((1 << 64) - 1), pos
        shift += 7
        if shift >= 70:
            raise DecodeError("varint longer than 10 bytes")


def fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """``(number, wire_type, value)`` of each field; fixed-width values are skipped (yielded as 0)."""
    pos = 0
    while pos < len(data):
        key, pos = read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0 or number > MAX_FIELD_NUMBER:
            raise DecodeError(f"field number {number}")
        if wire_type == 0:
            value, pos = read_varint(data, pos)
            yield number, wire_type, value
        elif wire_type == 2:
            length, pos = read_varint(data, pos)
            if pos + length > len(data):
                raise DecodeError(f"field {number}: {length} bytes announced, {len(data) - pos} left")
            yield number, wire_type, data[pos : pos + length]
            pos += length
        elif wire_type in (1, 5):
            width = 8 if wire_type == 1 else 4
            if pos + width > len(data):
                raise DecodeError(f"field {number}: truncated fixed-width value")
            pos += width
            yield number, wire_type, 0
        else:  # groups (3, 4) and 6, 7: nothing ttrpc's envelopes contain
            raise DecodeError(f"field {number}: unsupported wire type {wire_type}")
