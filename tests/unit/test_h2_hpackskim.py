"""krproxy.h2.hpackskim: a header block read for the dynamic table only leaves the table as
``hpack`` decoding it whole does (``hpack`` is the oracle), whatever the fragments; its errors
and bounds. No sockets."""

from __future__ import annotations

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.h2 import frames as f
from krproxy.h2 import hpackskim
from krproxy.h2.hpackskim import Skimmer


def _sized(min_size: int, max_size: int) -> st.SearchStrategy[bytes]:
    """Bytes of a drawn length, a short drawn pattern repeated: a 20 kB value costs Hypothesis a few
    bytes of its input, where ``st.binary`` of that size drew every byte and, several such fields in
    a block, ran past its input limit now and then (``data_too_large``: seeds 13 and 29)."""
    return st.builds(
        lambda size, unit: (unit * (size // len(unit) + 1))[:size],
        st.integers(min_value=min_size, max_value=max_size),
        st.binary(min_size=1, max_size=16),
    )


#: Values on both sides of what fits the 4096-byte table, from a few bytes to several table sizes.
_VALUES = st.one_of(st.binary(max_size=40), _sized(4000, 4100), _sized(0, 20_000))
_NAMES = st.one_of(st.sampled_from([b"x-a", b"x-b", b":path", b"grpc-message"]), _sized(1, 5000))
_FIELD = st.tuples(_NAMES, _VALUES, st.booleans())  # (name, value, never indexed)
_BLOCK = st.tuples(st.lists(_FIELD, max_size=6), st.booleans(), st.sampled_from([None, 0, 256, 4096]))


def _encode(
    encoder: hpack.Encoder, fields: list[tuple[bytes, bytes, bool]], huffman: bool, size: int | None
) -> bytes:
    if size is not None:
        encoder.header_table_size = size  # the next block starts with a size update
    headers = [hpack.NeverIndexedHeaderTuple(n, v) if never else (n, v) for n, v, never in fields]
    return encoder.encode(headers, huffman=huffman)


def _skim(decoder: hpack.Decoder, block: bytes, cuts: list[int]) -> None:
    skimmer = Skimmer(decoder)
    at = 0
    for cut in sorted(c % (len(block) + 1) for c in cuts):
        skimmer.feed(block[at:cut])
        at = max(at, cut)
    skimmer.feed(block[at:])
    skimmer.finish()


@settings(max_examples=60, deadline=None)
@given(st.lists(_BLOCK, min_size=1, max_size=5), st.lists(st.integers(min_value=0), max_size=8))
def test_the_table_ends_as_hpack_leaves_it(
    blocks: list[tuple[list[tuple[bytes, bytes, bool]], bool, int | None]], cuts: list[int]
) -> None:
    """Blocks from hpack's encoder (indexed, literal, never-indexed fields, Huffman or not, size
    updates), skimmed in arbitrary fragments: after each block the dynamic table is hpack's."""
    encoder = hpack.Encoder()
    oracle = hpack.Decoder(max_header_list_size=1 << 40)
    skimmed = hpack.Decoder()
    for fields, huffman, size in blocks:
        block = _encode(encoder, fields, huffman, size)
        oracle.decode(block, raw=True)
        _skim(skimmed, block, cuts)
        ours, theirs = skimmed.header_table, oracle.header_table
        assert (list(ours.dynamic_entries), ours.maxsize) == (list(theirs.dynamic_entries), theirs.maxsize)


def test_a_huge_literal_is_skipped_in_fragments() -> None:
    """A 5 MiB value in 16 KiB fragments: the table takes the small field before it and is
    emptied by the huge one added with indexing, as hpack leaves it; nothing of it is kept."""
    encoder = hpack.Encoder()
    block = encoder.encode([(b"x-small", b"1"), (b"grpc-message", b"m" * (5 << 20))], huffman=False)
    decoder = hpack.Decoder()
    skimmer = Skimmer(decoder)
    for at in range(0, len(block), 16384):
        skimmer.feed(block[at : at + 16384])
        assert len(skimmer._carry) < 16  # the value is counted, never held
    skimmer.finish()
    oracle = hpack.Decoder(max_header_list_size=1 << 40)
    oracle.decode(block, raw=True)
    assert list(oracle.header_table.dynamic_entries) == list(decoder.header_table.dynamic_entries)


@pytest.mark.parametrize(
    ("block", "reason"),
    [
        (b"\x80", "Invalid table index 0"),  # index 0
        (b"\xbf\x7f", "Invalid table index"),  # an index beyond the static table, the dynamic one empty
        (b"\x82\x20", "size update after a field"),
        (b"\x3f\xe2\x1f", "table size over the limit"),  # 4097 > 4096
        (b"\x40\x81\xff\x00", "Huffman"),  # a bad Huffman name, for an entry that may fit: decoded
    ],
)
def test_what_hpack_refuses_is_a_compression_error(block: bytes, reason: str) -> None:
    with pytest.raises(f.ProtocolError) as refused:
        skimmer = Skimmer(hpack.Decoder())
        skimmer.feed(block)
        skimmer.finish()
    assert f.COMPRESSION_ERROR == refused.value.code
    assert reason.lower() in str(refused.value).lower(), str(refused.value)


def test_a_block_cut_inside_a_field_is_a_compression_error() -> None:
    skimmer = Skimmer(hpack.Decoder())
    skimmer.feed(b"\x00\x03ab")  # a literal name of 3 bytes, 2 sent
    with pytest.raises(f.ProtocolError, match="truncated") as cut:
        skimmer.finish()
    assert f.COMPRESSION_ERROR == cut.value.code


def test_past_the_bounds_is_enhance_your_calm() -> None:
    """More fields than MAX_FIELDS, or more bytes than MAX_BLOCK: ENHANCE_YOUR_CALM."""
    with pytest.raises(f.ProtocolError, match="fields") as many:
        Skimmer(hpack.Decoder()).feed(b"\x82" * (hpackskim.MAX_FIELDS + 1))
    skimmer = Skimmer(hpack.Decoder())
    skimmer.feed(b"\x00\x01a\x7f" + b"\xff" * 3 + b"\x07")  # one value of 2^21 + 126 bytes, skipped
    with pytest.raises(f.ProtocolError, match="bytes") as large:
        for _ in range(hpackskim.MAX_BLOCK // 16384 + 1):
            skimmer.feed(bytes(16384))
    assert (f.ENHANCE_YOUR_CALM, f.ENHANCE_YOUR_CALM) == (many.value.code, large.value.code)
