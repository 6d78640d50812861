"""Tests of the one HPACK memory (krproxy/h2/hpackmemo.py, 94c25ab): what a decoder answering
from the process's memory gives, against plain hpack, where the two rules could be fooled: several
connections whose tables differ, dynamic table size updates inside a remembered block, a decoder
whose allowed table size differs, odd grpc-timeout values, a template's bytes inside another
field's value, the header list limit on a hit, and another thread adding a name meanwhile."""

from __future__ import annotations

import hpack
import hpack.exceptions
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from krproxy.h2 import frames as f
from krproxy.h2 import hpackmemo
from tests.unit.h2peer import grpc_request

CALL = grpc_request(b"/runtime.v1.RuntimeService/Version", b"localhost")
TIMEOUT_PREFIX = b"\x00\x0cgrpc-timeout"  # a literal without indexing, its name plain (as we send it)


@pytest.fixture(autouse=True)
def empty_memo() -> None:
    hpackmemo._memo.clear()
    hpackmemo._unique_names.clear()


def decoder(allowed: int = 4096, limit: int = 16 << 20) -> hpack.Decoder:
    d = hpack.Decoder(max_header_list_size=limit)
    d.max_allowed_table_size = allowed  # what our SETTINGS_HEADER_TABLE_SIZE allows
    return d


def size_update(size: int) -> bytes:
    return f._integer(size, 5, 0x20)


def outcome(d: hpack.Decoder, block: bytes, memo: bool) -> tuple[str, object]:
    try:
        got = hpackmemo.decode(d, block) if memo else d.decode(block, raw=True)
    except hpack.exceptions.HPACKError as err:
        return "error", type(err)
    return "headers", [(h.__class__, *h) for h in got]


def same_table(a: hpack.Decoder, b: hpack.Decoder) -> bool:
    return list(a.header_table.dynamic_entries) == list(b.header_table.dynamic_entries) and (
        a.header_table_size == b.header_table_size
    )


def test_a_size_update_beyond_the_allowed_is_refused_from_memory() -> None:
    """A block that raises the table's size beyond 4096 and lowers it again leaves an empty table
    as it was: remembered for that state. A decoder whose SETTINGS allowed 8192 takes it; one that
    allows 4096 (the same empty table, the same size) must refuse it, as hpack does."""
    block = size_update(8192) + size_update(4096) + f.encode_headers(CALL)
    wide = decoder(allowed=8192)
    assert outcome(wide, block, memo=True) == outcome(decoder(allowed=8192), block, memo=False)
    narrow, plain = decoder(), decoder()
    assert outcome(plain, block, memo=False) == ("error", hpack.exceptions.InvalidTableSizeError)
    assert outcome(narrow, block, memo=True) == outcome(plain, block, memo=False)


def test_a_size_update_within_the_block_replays_as_hpack() -> None:
    """Updates inside a block (to 0 and back, to the same size) on two connections, one with a
    table entry: each decodes, and leaves its table, as hpack does, first sight and from memory."""
    encoder = hpack.Encoder()
    indexed = encoder.encode([(b"x-kept", b"1")])  # one connection holds an entry
    blocks = [
        size_update(0) + size_update(4096) + f.encode_headers(CALL),
        size_update(4096) + f.encode_headers(CALL),
        size_update(0) + size_update(4096) + b"\xbe",  # index 62: the first dynamic entry, if any
    ]
    for with_entry in (False, True, False, True):
        ours, plain = decoder(), decoder()
        if with_entry:
            assert outcome(ours, indexed, True) == outcome(plain, indexed, False)
        for block in blocks:
            assert outcome(ours, block, True) == outcome(plain, block, False)
            assert same_table(ours, plain)


@pytest.mark.parametrize(
    "value",
    [b"", b"999999999S", b"5x", b"1", b"\xff\x00\x80", b"m" * 126, b"m" * 127, b"5S" + TIMEOUT_PREFIX],
)
def test_odd_grpc_timeout_values_decode_as_hpack_decodes_them(value: bytes) -> None:
    """Whatever a grpc-timeout holds (a bad unit, 9 digits, empty, not text, the length byte's
    one-byte limit, the name's own bytes), the template and the field path give hpack's header."""
    first = [*CALL, (b"grpc-timeout", b"5S")]
    hpackmemo.decode(decoder(), f.encode_headers(first))  # the name and a template known
    hpackmemo.decode(decoder(), f.encode_headers(first))
    for headers in ([*CALL, (b"grpc-timeout", value)], [(b"grpc-timeout", value), *CALL]):
        for huffman in (False, True):
            block = hpack.Encoder().encode(headers, huffman=True) if huffman else f.encode_headers(headers)
            for _ in range(2):
                assert outcome(decoder(), block, True) == outcome(decoder(), block, False)


def test_template_bytes_inside_another_value_are_not_the_field() -> None:
    """Another field's value holding grpc-timeout's bytes (name and a length byte) before the real
    field, or without one: the same headers as hpack, never a field made of a value's bytes."""
    hpackmemo.decode(decoder(), f.encode_headers([*CALL, (b"grpc-timeout", b"5S")]))
    fake = TIMEOUT_PREFIX + b"\x025S"
    for headers in (
        [*CALL, (b"x-note", fake), (b"grpc-timeout", b"7S")],
        [*CALL, (b"x-note", fake)],
        [(b"x-note", fake + fake), *CALL, (b"grpc-timeout", b"5S")],
        [*CALL, (b"grpc-timeout", b"5S"), (b"x-note", fake)],
    ):
        block = f.encode_headers(headers)
        for _ in range(3):
            assert hpackmemo.decode(decoder(), block) == headers == decoder().decode(block, raw=True)


def test_a_kept_block_over_the_list_limit_is_refused_on_a_hit() -> None:
    """A block remembered with its table state (it indexes the dynamic table) answered from memory
    only within the decoder's header list limit, on the same connection after the limit fell."""
    encoder = hpack.Encoder()
    first = encoder.encode([(b"x-a", b"v" * 40), (b"x-b", b"w" * 40)])
    again = encoder.encode([(b"x-a", b"v" * 40), (b"x-b", b"w" * 40)])  # indexed: two bytes
    ours, plain = decoder(), decoder()
    for block in (first, again, again):
        assert outcome(ours, block, True) == outcome(plain, block, False)
    assert again in hpackmemo._memo
    ours.max_header_list_size = plain.max_header_list_size = 100
    assert outcome(plain, again, False) == ("error", hpack.exceptions.OversizedHeaderListError)
    assert outcome(ours, again, True) == outcome(plain, again, False)


def test_a_name_added_during_a_template_lookup_breaks_neither() -> None:
    """Header blocks are decoded in worker threads (relay/_input.py's _decode_block_aside, one for
    large blocks and one for small ones) and on the loop's thread: a grpc-timeout representation
    seen for the first time by one while another walks the known names (here: while the large
    block's search for a template runs) must not end that decode with 'dictionary changed size'."""
    hpackmemo.decode(decoder(), f.encode_headers([*CALL, (b"grpc-timeout", b"5S")]))
    secret = f.encode_headers([*CALL, hpack.NeverIndexedHeaderTuple(b"grpc-timeout", b"1S")])

    class Interleaved(bytes):
        """A block whose template search lets the other thread decode in the middle."""

        def find(self, *args: object) -> int:
            hpackmemo.decode(decoder(), secret)  # the never-indexed name: new to the memory
            return super().find(*args)  # type: ignore[arg-type]

    large = f.encode_headers([*CALL, (b"x-large", b"z" * 400)])
    block = Interleaved(large)
    assert hpackmemo.decode(decoder(), block) == decoder().decode(large, raw=True)
    assert len(hpackmemo._unique_names) == 2


# -- several connections on one memory, against hpack -----------------------------------------

names = st.sampled_from([b"content-type", b"x-a", b":path", b"grpc-timeout", b"te"])
values = st.sampled_from([b"", b"1", b"5S", b"application/grpc", b"trailers", TIMEOUT_PREFIX + b"\x012"])
header_lists = st.lists(st.tuples(names, values), max_size=5)
steps = st.lists(
    st.tuples(
        st.integers(0, 2),  # which connection
        st.sampled_from(["krproxy", "indexing", "huffman", "never", "resize", "updates"]),
        header_lists,
        st.sampled_from([0, 64, 4096, 8192]),  # a size for "resize" and "updates"
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(allowed=st.lists(st.sampled_from([0, 4096, 8192]), min_size=3, max_size=3), steps=steps)
def test_connections_sharing_the_memory_each_decode_as_hpack(
    allowed: list[int], steps: list[tuple[int, str, list[tuple[bytes, bytes]], int]]
) -> None:
    """Three connections with their own encoders, allowed table sizes and tables, their blocks
    interleaved on one memory: every block gives hpack's headers or its error, and leaves each
    table as hpack leaves it; a connection whose block failed is over (COMPRESSION_ERROR)."""
    hpackmemo._memo.clear()
    hpackmemo._unique_names.clear()
    conns = [(hpack.Encoder(), decoder(a), decoder(a)) for a in allowed]
    live = [True] * 3
    for which, how, headers, size in steps:
        if not live[which]:
            continue
        encoder, ours, plain = conns[which]
        if how == "krproxy":
            block = f.encode_headers(headers)
        elif how == "never":
            block = f.encode_headers([hpack.NeverIndexedHeaderTuple(*h) for h in headers])
        elif how == "resize":
            encoder.header_table_size = size  # its next block starts with the update
            block = encoder.encode(headers)
        elif how == "updates":  # to `size` and back, then our encoder's fields
            block = size_update(size) + size_update(plain.header_table_size) + f.encode_headers(headers)
        else:
            block = encoder.encode(headers, huffman=how == "huffman")
        expected = outcome(plain, block, False)
        assert outcome(ours, block, True) == expected
        if expected[0] == "error":
            live[which] = False
        else:
            assert same_table(ours, plain)
