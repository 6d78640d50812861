"""Fuzzing the trace reader (hypothesis): :func:`krproxy.trace.format.read_records` on damaged files.

Whatever the bytes, reading returns a result or raises :class:`~krproxy.trace.format.TraceError` (no other
exception, no hang), and a file that reads cleanly still reads when cut short (a torn tail, not an error).
Records are built with a correct CRC around random payloads, so the record decoder itself is fuzzed, not
only the CRC check. Budget: tests/fuzz/__init__.py.
"""

from __future__ import annotations

import contextlib
import struct
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.trace.format import KIND_CALL, TraceError, encode_header, read_records
from tests.fuzz import examples

FUZZ = settings(max_examples=examples(200), deadline=None)

HEADER = encode_header({"fuzz": True})


def frame(payload: bytes) -> bytes:
    return struct.pack(">II", len(payload), zlib.crc32(payload)) + payload


payloads = st.one_of(
    st.binary(min_size=1, max_size=200),
    st.binary(max_size=200).map(lambda rest: bytes([KIND_CALL]) + rest),  # a call record's kind byte first
)


class TestFuzzTraceReader:
    @FUZZ
    @given(st.binary(max_size=300))
    def test_random_bytes(self, data: bytes) -> None:
        """Random bytes: a result or a TraceError."""
        with contextlib.suppress(TraceError):
            read_records(data)

    @FUZZ
    @given(st.lists(payloads, max_size=6))
    def test_records_with_valid_crc_and_random_payload(self, records: list[bytes]) -> None:
        """A valid header and CRC-correct records with random payloads: a result or a TraceError naming the
        damaged record."""
        with contextlib.suppress(TraceError):
            result = read_records(HEADER + b"".join(frame(p) for p in records))
            assert len(result.records) + result.unknown_kinds <= len(records)

    @FUZZ
    @given(st.lists(payloads, min_size=1, max_size=6), st.data())
    def test_cut_short_anywhere(self, records: list[bytes], data: st.DataObject) -> None:
        """A file that reads cleanly, cut at any point after its header (a crash mid-write): still reads,
        the records before the cut intact, and a torn tail reported unless the cut is at a record end."""
        whole = HEADER + b"".join(frame(p) for p in records)
        try:
            complete = read_records(whole)
        except TraceError:
            return  # a damaged record: covered by the test above
        ends = {len(HEADER) + sum(8 + len(p) for p in records[:i]) for i in range(len(records) + 1)}
        cut = data.draw(st.integers(len(HEADER), len(whole)))

        result = read_records(whole[:cut])

        assert complete.records[: len(result.records)] == result.records
        assert (cut not in ends) == (result.torn is not None)

    @FUZZ
    @given(st.lists(payloads, min_size=1, max_size=4), st.data())
    def test_flipped_bytes(self, records: list[bytes], data: st.DataObject) -> None:
        """A byte flipped anywhere in a file: a result or a TraceError."""
        whole = bytearray(HEADER + b"".join(frame(p) for p in records))
        position = data.draw(st.integers(0, len(whole) - 1))
        whole[position] ^= data.draw(st.integers(1, 255))
        with contextlib.suppress(TraceError):
            read_records(bytes(whole))
