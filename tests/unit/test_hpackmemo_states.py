"""krproxy.h2.hpackmemo over sequences of blocks on decoders that share its memory: each block
decodes, fails and leaves the table as a plain ``hpack`` decoder given the same blocks does."""

from __future__ import annotations

import sys
import threading
from typing import Any

import hpack
import pytest
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.h2 import frames as f
from krproxy.h2 import hpackmemo
from krproxy.h2.frames import _integer

_HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)


@pytest.fixture(autouse=True)
def empty_memo() -> None:
    hpackmemo._memo.clear()
    hpackmemo._unique_names.clear()


def _string(value: bytes, huffman: bool) -> bytes:
    coded = _HUFFMAN.encode(value) if huffman else value
    return _integer(len(coded), 7, 0x80 if huffman else 0) + coded


class Pair:
    """A decoder read through hpackmemo and a plain one given the same blocks, and an encoder."""

    def __init__(self) -> None:
        self.ours = hpack.Decoder(max_header_list_size=16 << 20)
        self.plain = hpack.Decoder(max_header_list_size=16 << 20)
        self.encoder = hpack.Encoder()

    def set(self, name: str, value: int) -> None:
        setattr(self.ours, name, value)
        setattr(self.plain, name, value)

    def feed(self, block: bytes) -> None:
        """``block`` to both: the same headers (and classes) or the same error, the same table."""
        try:
            expected: Any = self.plain.decode(block, raw=True)
        except Exception as err:  # whatever hpack raises, ours must raise too
            with pytest.raises(type(err)):
                hpackmemo.decode(self.ours, block)
        else:
            got = hpackmemo.decode(self.ours, block)
            assert got == expected
            assert [h.__class__ for h in got] == [h.__class__ for h in expected]
        mine, theirs = self.ours.header_table, self.plain.header_table
        assert list(mine.dynamic_entries) == list(theirs.dynamic_entries)
        assert mine.maxsize == theirs.maxsize
        assert mine._current_size == theirs._current_size


_NAMES = [b"grpc-timeout", b":path", b"content-type", b"x-a", b"user-agent", b"te"]
#: Values by length, the string boundaries among them (plain 126/127/128; Huffman-coded 'a's
#: are 5 bits: 202 of them take 127 bytes) and entries near the small tables' sizes.
_VALUES = st.one_of(
    st.sampled_from([b"", b"1S", b"5S", b"/a/B", b"application/grpc", b"trailers"]),
    st.builds(
        lambda n, c: bytes([c]) * n,
        st.sampled_from([1, 20, 29, 30, 60, 125, 126, 127, 128, 200, 201, 202, 203, 204, 600]),
        st.sampled_from(b"a0"),
    ),
)
_SIZES = st.sampled_from([0, 32, 64, 96, 100, 150, 300, 4096, 5000])
_INDEX = st.one_of(st.integers(min_value=0, max_value=75), st.sampled_from([126, 127, 128, 200, 1 << 20]))

_INDEXED = _INDEX.map(lambda i: _integer(i, 7, 0x80))
_LITERAL = st.builds(
    lambda kind, index, name, value, hname, hvalue: (
        _integer(index, 6 if kind == 0x40 else 4, kind)
        + (b"" if index else _string(name, hname))
        + _string(value, hvalue)
    ),
    st.sampled_from([0x40, 0x40, 0x00, 0x10]),
    st.one_of(st.just(0), st.just(0), _INDEX),
    st.sampled_from(_NAMES),
    _VALUES,
    st.booleans(),
    st.booleans(),
)
#: Stray bytes: a bad Huffman code (EOS, wrong padding), a cut integer, index 0.
_STRAY = st.sampled_from(
    [b"\x81\xff", b"\x84\xff\xff\xff\xff", b"\x81\x00", b"\xff", b"\x80", b"\x0f", b"\x7f\x80"]
)
#: A literal whose value is a bad Huffman code, or a stray piece alone.
_BAD = st.builds(
    lambda kind, index, stray: (
        _integer(index, 6 if kind == 0x40 else 4, kind) + (b"\x01x" if not index else b"") + stray
    ),
    st.sampled_from([0x40, 0x00, 0x10]),
    st.sampled_from([0, 1, 4, 62]),
    _STRAY,
)
_FIELD = st.one_of(_INDEXED, _INDEXED, _LITERAL, _LITERAL, _LITERAL, _STRAY, _BAD)


#: Fields that cannot touch the table: static indexes, literals without indexing or never
#: indexed with a static or literal name; some with a bad Huffman code.
_PLAIN_FIELD = st.one_of(
    st.integers(min_value=1, max_value=61).map(lambda i: _integer(i, 7, 0x80)),
    st.builds(
        lambda kind, index, name, value, hname, hvalue: (
            _integer(index, 4, kind) + (b"" if index else _string(name, hname)) + _string(value, hvalue)
        ),
        st.sampled_from([0x00, 0x10]),
        st.one_of(st.just(0), st.integers(min_value=1, max_value=61)),
        st.sampled_from(_NAMES),
        _VALUES,
        st.booleans(),
        st.booleans(),
    ),
    st.builds(lambda kind, stray: bytes([kind]) + b"\x01x" + stray, st.sampled_from([0x00, 0x10]), _STRAY),
)


def _hand(updates: list[int], fields: list[bytes], cut: int | None) -> bytes:
    block = b"".join(_integer(size, 5, 0x20) for size in updates) + b"".join(fields)
    return block[: cut % (len(block) + 1)] if cut is not None else block


_HEADERS = st.lists(st.tuples(st.sampled_from(_NAMES), _VALUES), max_size=6)
_WHO = st.integers(min_value=0, max_value=1)
_STEP = st.one_of(
    st.tuples(
        st.just("hand"),
        _WHO,
        st.builds(
            _hand,
            st.lists(_SIZES, max_size=2),
            st.lists(_FIELD, max_size=6),
            st.one_of(st.none(), st.none(), st.none(), st.integers(min_value=0, max_value=400)),
        ),
    ),
    st.tuples(
        st.just("hand"),
        _WHO,
        st.lists(_PLAIN_FIELD, max_size=5).map(b"".join),
    ),
    st.tuples(st.just("encoder"), _WHO, st.tuples(_HEADERS, st.booleans(), st.booleans())),
    st.tuples(st.just("krproxy"), _WHO, st.tuples(_HEADERS, st.booleans())),
    st.tuples(st.just("again"), _WHO, st.integers(min_value=0, max_value=1000)),
    st.tuples(st.just("again"), _WHO, st.integers(min_value=0, max_value=1000)),
    st.tuples(st.just("encoder size"), _WHO, _SIZES),
    st.tuples(st.just("allowed"), _WHO, _SIZES),
    st.tuples(st.just("header_table_size"), _WHO, _SIZES),
    st.tuples(st.just("list limit"), _WHO, st.sampled_from([40, 64, 100, 200, 300, 700, 16 << 20])),
)


def _run(steps: list[tuple[str, int, Any]], *, fresh: bool = True) -> None:
    """The steps on two pairs of decoders; ``fresh``: from an empty memory."""
    if fresh:
        hpackmemo._memo.clear()
        hpackmemo._unique_names.clear()
    pairs = [Pair(), Pair()]
    sent: list[bytes] = []
    for what, who, arg in steps:
        pair = pairs[who]
        block: bytes | None = None
        if what == "hand":
            block = arg
        elif what == "encoder":
            headers, huffman, never = arg
            if never:
                headers = [hpack.NeverIndexedHeaderTuple(*h) for h in headers]
            block = pair.encoder.encode(headers, huffman=huffman)
        elif what == "krproxy":
            headers, never = arg
            if never:
                headers = [hpack.NeverIndexedHeaderTuple(*h) for h in headers]
            block = f.encode_headers(headers)
        elif what == "again":
            if sent:
                block = sent[arg % len(sent)]
        elif what == "encoder size":
            pair.encoder.header_table_size = arg
        elif what == "allowed":
            pair.set("max_allowed_table_size", arg)
        elif what == "header_table_size":  # the table resized without a block (evictions)
            pair.set("header_table_size", arg)
        else:
            pair.set("max_header_list_size", arg)
        if block is not None:
            sent.append(block)
            pair.feed(block)


@settings(max_examples=400, deadline=None)
@given(steps=st.lists(_STEP, min_size=1, max_size=30))
def test_two_decoders_read_any_blocks_as_hpack_reads_them(steps: list[tuple[str, int, Any]]) -> None:
    """Blocks of every representation (hpack's encoder, krproxy's, by hand with size updates,
    bad Huffman codes and cut ends), blocks sent again, table and header list limits changed,
    on two decoders that share the memory: hpack's headers, errors and tables after each."""
    _run(steps)


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(_STEP, min_size=1, max_size=30))
def test_without_hpacks_table_size_blocks_read_as_hpack_reads_them(steps: list[tuple[str, int, Any]]) -> None:
    """An hpack whose table keeps no ``_current_size``: the table rule steps aside and every
    block still reads as hpack reads it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hpackmemo, "getattr", lambda _obj, _name, default: default, raising=False)
        _run(steps)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(_STEP, min_size=1, max_size=30), limit=st.sampled_from([1, 2, 3, 8]))
def test_a_memory_started_over_mid_block_reads_as_hpack_reads(
    steps: list[tuple[str, int, Any]], limit: int
) -> None:
    """A memory of a few entries, started over while a block's fields are being remembered:
    every block still reads as hpack reads it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hpackmemo, "MEMO_LIMIT", limit)
        _run(steps)


@settings(max_examples=40, deadline=None)
@given(runs=st.lists(st.lists(_STEP, min_size=1, max_size=30), min_size=4, max_size=4))
def test_threads_sharing_the_memory_read_as_hpack_reads(runs: list[list[tuple[str, int, Any]]]) -> None:
    """Four threads, each with its own decoders, on one memory of a few entries started over
    often, switching every microsecond: each thread's blocks read as hpack reads them."""
    hpackmemo._memo.clear()
    hpackmemo._unique_names.clear()
    failures: list[BaseException] = []

    def run(steps: list[tuple[str, int, Any]]) -> None:
        try:
            _run(steps, fresh=False)
        except BaseException as err:  # reported by the test's thread
            failures.append(err)

    interval = sys.getswitchinterval()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hpackmemo, "MEMO_LIMIT", 8)
        sys.setswitchinterval(1e-6)
        try:
            threads = [threading.Thread(target=run, args=(steps,)) for steps in runs]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            sys.setswitchinterval(interval)
    if failures:
        raise failures[0]


def _add(name: bytes, value: bytes) -> bytes:
    """A literal with incremental indexing, its name literal too."""
    return b"\x40" + _string(name, False) + _string(value, False)


def test_an_equal_entry_in_the_newest_place_is_another_table() -> None:
    """A block read against [H, A] is remembered with H, the newest entry; once the table is
    [H', B] (B added, then H again, each evicting the oldest) its newest entry equals H and
    the count and size are the same, but index 63 is B now, not A: read again, not answered."""
    pair = Pair()
    pair.feed(_integer(72, 5, 0x20))  # room for two entries of 36 bytes
    for block in (_add(b"x-a", b"A"), _add(b"x-h", b"H")):
        pair.feed(block)
    pair.feed(b"\xbf")  # index 63: A
    assert b"\xbf" in hpackmemo._memo
    for block in (_add(b"x-b", b"B"), _add(b"x-h", b"H")):
        pair.feed(block)
    assert list(pair.ours.header_table.dynamic_entries) == [(b"x-h", b"H"), (b"x-b", b"B")]
    pair.feed(b"\xbf")  # index 63: B, as hpack reads it


def _fill(pair: Pair, count: int) -> None:
    for i in range(count):
        pair.feed(_add(b"x-%d" % i, b"v"))


@pytest.mark.parametrize("index", [126, 127, 128, 129, 141, 142, 143, 1 << 14])
@pytest.mark.parametrize("kind", [0x80, 0x40, 0x00, 0x10])
def test_indexes_with_continuation_bytes_read_as_hpack_reads_them(index: int, kind: int) -> None:
    """Indexes past the 4-, 6- and 7-bit prefixes (continuation bytes), up to the last entry of
    a table of 80 (index 141) and past it, as an indexed field and as each literal's name."""
    pair = Pair()
    _fill(pair, 80)
    bits = {0x80: 7, 0x40: 6}.get(kind, 4)
    field = _integer(index, bits, kind) + (b"" if kind == 0x80 else _string(b"w", False))
    pair.feed(b"\x83" + field)
    pair.feed(b"\x83" + field)


@pytest.mark.parametrize("overlong", [4, 5, 6])
@pytest.mark.parametrize("kind", [0x80, 0x40, 0x00, 0x10])
def test_an_index_with_zero_continuation_bytes_reads_as_hpack_reads_it(overlong: int, kind: int) -> None:
    """An index sent with ``overlong`` continuation bytes, zeros after the first: hpack reads
    five at most (the fifth ending the integer), and so do the module's rules."""
    pair = Pair()
    _fill(pair, 70)
    bits = {0x80: 7, 0x40: 6}.get(kind, 4)
    prefix = (1 << bits) - 1
    field = bytes([kind | prefix, 0x83]) + b"\x80" * (overlong - 2) + b"\x00"  # prefix + 3
    field += b"" if kind == 0x80 else _string(b"w", False)
    pair.feed(field)
    pair.feed(b"\x86" + field)


@pytest.mark.parametrize("length", [125, 126, 127, 128, 129, 200, 201, 202, 203, 204, 205])
@pytest.mark.parametrize("kind", [0x40, 0x00, 0x10])
@pytest.mark.parametrize("huffman", [False, True])
@pytest.mark.parametrize("literal_name", [False, True])
def test_strings_at_the_length_prefix_read_as_hpack_reads_them(
    length: int, kind: int, huffman: bool, literal_name: bool
) -> None:
    """Names and values of lengths about the 7-bit prefix's 127 (a Huffman-coded 'a' is 5 bits:
    202 of them take 127 bytes) in each literal, beside an indexed field, twice, on a table
    with room for them or not."""
    for table in (4096, 200):
        pair = Pair()
        pair.feed(_integer(table, 5, 0x20))
        _fill(pair, 1)
        text = b"a" * length
        if literal_name:
            field = bytes([kind]) + _string(text, huffman) + _string(b"v", huffman)
        else:
            field = bytes([kind | 4]) + _string(text, huffman)
        for _ in range(2):
            pair.feed(b"\xbe" + field)


#: Every representation: an indexed field, a new entry, a literal without indexing (static name,
#: plain value), one never indexed (literal name, Huffman value), a new entry whose name index
#: takes a continuation byte (6-bit prefix) and whose value is plain.
_EVERY = (
    b"\xbe"
    + _add(b"x-new", b"vvv")
    + b"\x04\x03/ab"
    + b"\x10\x03x-s"
    + _string(b"secret", True)
    + b"\x7f\x04\x02zz"
)


@pytest.mark.parametrize("cut", range(1, len(_EVERY) + 1))
def test_a_block_cut_anywhere_reads_as_hpack_reads_it(cut: int) -> None:
    """A block of every representation cut after any byte: hpack's error or headers, on a
    fresh table and again after the same cut block."""
    for before in (False, True):
        pair = Pair()
        _fill(pair, 5)
        if before:
            pair.feed(_EVERY[:cut])
        pair.feed(_EVERY[:cut])


def _block_of(length: int, head: bytes) -> bytes:
    """``head`` then literals without indexing of ``x-pad`` to ``length`` bytes."""
    block = head
    while len(block) < length:
        room = length - len(block) - 8  # b"\x00\x05x-pad" and the value's length byte
        block += b"\x00\x05x-pad" + _string(b"p" * max(0, min(room, 100)), False)
    assert len(block) == length, (len(block), length)
    return block


@pytest.mark.parametrize(
    "length",
    [
        hpackmemo.KEPT_BLOCK - 1,
        hpackmemo.KEPT_BLOCK,
        hpackmemo.KEPT_BLOCK + 1,
        hpackmemo.BLOCK_LIMIT - 1,
        hpackmemo.BLOCK_LIMIT,
        hpackmemo.BLOCK_LIMIT + 1,
    ],
)
@pytest.mark.parametrize("head", [b"", b"\xbe", b"\xbe\x40\x03x-n\x01n"])
def test_blocks_at_the_size_limits_read_as_hpack_reads_them(length: int, head: bytes) -> None:
    """Blocks of KEPT_BLOCK and BLOCK_LIMIT bytes and one either side (fields that cannot touch
    the table, with an indexed field, with a new entry), on two decoders, read again after the
    table changed."""
    block = _block_of(length, head)
    pairs = [Pair(), Pair()]
    for pair in pairs:
        _fill(pair, 2)
    for pair in (*pairs, *pairs):
        pair.feed(block)
    _fill(pairs[0], 1)
    pairs[0].feed(block)


@pytest.mark.parametrize(
    "length", [hpackmemo.FIELD_LIMIT - 1, hpackmemo.FIELD_LIMIT, hpackmemo.FIELD_LIMIT + 1]
)
@pytest.mark.parametrize("kind", [0x00, 0x10])
def test_fields_at_the_field_limit_read_as_hpack_reads_them(length: int, kind: int) -> None:
    """A field of FIELD_LIMIT bytes and one either side, first and again, in a block and alone."""
    value = b"q" * (length - 1 - 6 - 3)  # its first byte, b"\x05x-big", a 3-byte value length
    field = bytes([kind]) + _string(b"x-big", False) + _string(value, False)
    assert len(field) == length
    pair = Pair()
    for block in (field, b"\x83" + field, field, b"\x83" + field):
        pair.feed(block)


@pytest.mark.parametrize(
    "code",
    [
        b"\x81\xff",  # 8 bits of padding
        b"\x81\x00",  # '0' (00000), then padding of zeros
        b"\x84\xff\xff\xff\xff",  # EOS
        b"\x82\x1f\xff",  # 'a' then 11 bits of padding
    ],
)
@pytest.mark.parametrize("kind", [0x40, 0x00, 0x10])
@pytest.mark.parametrize("where", ["name", "value"])
@pytest.mark.parametrize("beside", [b"", b"\xbe", b"\x83"])
def test_a_bad_huffman_code_fails_as_hpack_fails(code: bytes, kind: int, where: str, beside: bytes) -> None:
    """A name or value whose Huffman code does not decode, in each literal, alone or beside a
    static or dynamic index: hpack's error, the tables alike, first and again."""
    field = bytes([kind]) + (
        code + _string(b"v", False) if where == "name" else _string(b"x-a", False) + code
    )
    pair = Pair()
    _fill(pair, 1)
    for _ in range(2):
        pair.feed(beside + field)
        pair.feed(beside + field + b"\x82")
