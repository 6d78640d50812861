"""krproxy.h2.hpackmemo's second rule: blocks that left the dynamic table as it was are answered
from memory, and only while the table stays as it was; and the whole module against hpack."""

from __future__ import annotations

from typing import Any

import hpack
import pytest
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from krproxy.h2 import hpackmemo
from krproxy.h2.frames import _integer
from krproxy.h2.hpackmemo import KEPT_BLOCK


@pytest.fixture(autouse=True)
def empty_memo() -> None:
    hpackmemo._memo.clear()
    hpackmemo._unique_names.clear()


class Decoder(hpack.Decoder):
    """A connection's decoder as the core decodes with it: through :func:`hpackmemo.decode`."""

    def decode_block(self, block: bytes) -> Any:
        return hpackmemo.decode(self, block)


ANSWER = [(b":status", b"200"), (b"content-type", b"application/grpc")]


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The blocks read rather than answered from memory: by hpack, or against the table by the
    module's table rule (:func:`hpackmemo._by_table`, which reads without hpack)."""
    decoded: list[bytes] = []
    by_hpack, by_table = hpackmemo._by_hpack, hpackmemo._by_table

    def hpack_read(decoder: hpack.Decoder, block: bytes) -> Any:
        decoded.append(bytes(block))
        return by_hpack(decoder, block)

    def table_read(decoder: hpack.Decoder, block: bytes, limit: int) -> Any:
        got = by_table(decoder, block, limit)
        if got is not None:
            decoded.append(bytes(block))
        return got

    monkeypatch.setattr(hpackmemo, "_by_hpack", hpack_read)
    monkeypatch.setattr(hpackmemo, "_by_table", table_read)
    return decoded


def test_an_indexed_block_seen_before_is_not_decoded_again(counted: list[bytes]) -> None:
    encoder, decoder = hpack.Encoder(), Decoder(max_header_list_size=1 << 20)
    first = encoder.encode(ANSWER)  # literals with incremental indexing: the table changes
    again = encoder.encode(ANSWER)  # indexed fields only (the dynamic table's two entries)
    assert first != again
    assert ANSWER == decoder.decode_block(first)
    assert ANSWER == decoder.decode_block(again)
    assert ANSWER == decoder.decode_block(again)
    assert ANSWER == decoder.decode_block(again)
    assert [first, again] == counted  # the last two came from memory


def test_a_block_that_changes_the_table_is_decoded_each_time(counted: list[bytes]) -> None:
    decoder = Decoder(max_header_list_size=1 << 20)
    block = hpack.Encoder().encode([(b"x-call", b"1")])  # a literal with incremental indexing
    for _ in range(3):
        assert [(b"x-call", b"1")] == decoder.decode_block(block)
    assert 3 == len(counted)


def test_a_kept_block_is_decoded_again_once_the_table_changed(counted: list[bytes]) -> None:
    """Index 62 is the newest dynamic entry: after a new entry it names that one."""
    encoder, decoder = hpack.Encoder(), Decoder(max_header_list_size=1 << 20)
    decoder.decode_block(encoder.encode([(b"x-a", b"1")]))
    newest = b"\xbe"  # indexed field 62
    assert [(b"x-a", b"1")] == decoder.decode_block(newest)
    assert [(b"x-a", b"1")] == decoder.decode_block(newest)
    decoder.decode_block(encoder.encode([(b"x-b", b"2")]))
    assert [(b"x-b", b"2")] == decoder.decode_block(newest)
    assert 4 == len(counted)  # the second read of 62 only came from memory


def test_the_same_entry_added_again_is_a_change(counted: list[bytes]) -> None:
    """A full table gets an entry equal to its newest: the oldest goes, and index 63 names
    another entry, though the count and the newest entry's value are as they were."""
    decoder = Decoder(max_header_list_size=1 << 20)
    decoder.header_table_size = decoder.header_table.maxsize = 68  # two entries of 34 bytes
    decoder.decode_block(b"\x40\x01a\x01b")  # literals with incremental indexing: (a, b)
    decoder.decode_block(b"\x40\x01c\x01d")  # then (c, d): the table is [(c, d), (a, b)]
    assert [(b"a", b"b")] == decoder.decode_block(b"\xbf")  # indexed field 63
    decoder.decode_block(b"\x40\x01c\x01d")  # (a, b) goes: [(c, d), (c, d)]
    assert [(b"c", b"d")] == decoder.decode_block(b"\xbf")


def test_a_shared_block_is_answered_only_for_its_own_table(
    counted: list[bytes],
) -> None:
    """Two connections whose tables differ read index 62 each as their own newest entry,
    whichever remembered it first."""
    first, second = Decoder(max_header_list_size=1 << 20), Decoder(max_header_list_size=1 << 20)
    first.decode_block(b"\x40\x01a\x01b")
    second.decode_block(b"\x40\x01c\x01d")
    for _ in range(2):
        assert [(b"a", b"b")] == first.decode_block(b"\xbe")
        assert [(b"c", b"d")] == second.decode_block(b"\xbe")
    assert 4 + 2 == len(counted)  # each decoder's second read from memory


def test_large_blocks_are_not_kept(counted: list[bytes]) -> None:
    decoder = Decoder(max_header_list_size=1 << 20)
    decoder.decode_block(b"\x40\x01a\x01b")  # a dynamic entry, (a, b)
    block = b"\xbe" * (KEPT_BLOCK + 1)  # indexed field 62, over and over
    decoder.decode_block(block)
    decoder.decode_block(block)
    assert 3 == len(counted)


def test_an_undecodable_block_still_raises() -> None:
    decoder = Decoder(max_header_list_size=1 << 20)
    with pytest.raises(hpack.exceptions.HPACKError):
        decoder.decode_block(b"\xff\xff\xff\xff")
    with pytest.raises(hpack.exceptions.HPACKError):
        decoder.decode_block(b"\xff\xff\xff\xff")


# -- the memory against hpack itself ----------------------------------------------------------


_HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)


def _string(data: bytes) -> bytes:
    return _integer(len(data), 7, 0) + data


def _huffman(data: bytes) -> bytes:
    coded = _HUFFMAN.encode(data)
    return _integer(len(coded), 7, 0x80) + coded


_NAMES = st.sampled_from([b"a", b"c", b"grpc-status", b"content-type", b"x-big", b":status"])
# Values over the small header list limit, and large enough that one entry evicts the others (the
# count may stay, the entries not).
_VALUES = st.one_of(
    st.sampled_from(
        [b"", b"0", b"1", b"d", b"application/grpc", b"m" * 300, b"x" * 1000, b"y" * 2100, b"z" * 3000]
    ),
    st.binary(max_size=8),
)
_FIELDS = st.one_of(
    # Indexed: mostly the dynamic table's first entries (0 and beyond the table: errors).
    st.one_of(st.integers(62, 65), st.integers(0, 75)).map(lambda i: _integer(i, 7, 0x80)),
    st.tuples(_NAMES, _VALUES).map(lambda nv: b"\x40" + _string(nv[0]) + _string(nv[1])),  # adds an entry
    st.tuples(st.integers(1, 70), _VALUES).map(lambda iv: _integer(iv[0], 6, 0x40) + _string(iv[1])),
    st.tuples(_NAMES, _VALUES).map(lambda nv: b"\x00" + _string(nv[0]) + _string(nv[1])),
    st.tuples(_NAMES, _VALUES).map(lambda nv: b"\x10" + _string(nv[0]) + _string(nv[1])),
    # Without indexing and never indexed, with a name from the static table or beyond it, Huffman
    # coded or not: fields krproxy.h2.hpackmemo may answer from its memo.
    st.tuples(
        st.one_of(st.integers(62, 63), st.integers(0, 65)),
        st.sampled_from([0x00, 0x10]),
        _VALUES,
        st.booleans(),
    ).map(
        lambda f: (
            _integer(f[0], 4, f[1])
            + (b"" if f[0] else _string(b"x-name"))
            + (_huffman(f[2]) if f[3] else _string(f[2]))
        )
    ),
    # Size updates: to sizes already in force (no change), below the entries (evicting), too large.
    st.one_of(st.sampled_from([0, 64, 4096]), st.integers(0, 5000)).map(lambda size: _integer(size, 5, 0x20)),
)
_BLOCKS = st.lists(_FIELDS, max_size=5).map(b"".join)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    size=st.sampled_from([68, 150, 4096]),
    pool=st.lists(_BLOCKS, min_size=1, max_size=8),
    order=st.lists(st.integers(0, 7), max_size=60),
)
def test_answers_from_memory_are_what_hpack_decodes(size: int, pool: list[bytes], order: list[int]) -> None:
    """Differential: blocks drawn again and again from a small pool (so the memories answer),
    mixing fields that add entries, evict them (a table of two small entries, or values up to
    3000 bytes in 4096), resize the table inside a block, fields that touch no table (the
    memo of krproxy.h2.hpackmemo, shared by all decoders), header lists over the limit, and
    failures. Decoded as the core and the relay do (``hpackmemo.decode``), every answer and
    every failure is hpack's; so is the table after each block. Two connections take the same
    blocks, one with a header list limit of 200 bytes: the memory is shared, the limit and
    the table are each decoder's."""
    hpackmemo._memo.clear()
    hpackmemo._unique_names.clear()
    pairs = [(Decoder(max_header_list_size=n), hpack.Decoder(max_header_list_size=n)) for n in (1 << 20, 200)]
    for ours, theirs in pairs:
        ours.header_table_size = theirs.header_table_size = size
    for i, (ours, theirs) in ((i, pair) for i in order for pair in pairs):
        block = pool[i % len(pool)]
        try:
            expected: Any = list(theirs.decode(block, raw=True))
        except Exception as err:  # the type is what is compared
            expected = type(err)
        try:
            got: Any = list(ours.decode_block(block))
        except Exception as err:
            got = type(err)
        assert expected == got
        if isinstance(got, list):  # the never-indexed flag survives the memory too
            assert [type(h) for h in expected] == [type(h) for h in got]
        assert list(theirs.header_table.dynamic_entries) == list(ours.header_table.dynamic_entries)
        assert theirs.header_table.maxsize == ours.header_table.maxsize
