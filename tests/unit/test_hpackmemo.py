"""krproxy.h2.hpackmemo's first rule: header blocks decoded from a memo of fields (and of
whole blocks, and of blocks with their grpc-timeout read into them) give what hpack gives; and its
table rule: grpc-go's indexed blocks read against the table give hpack's headers, errors and table."""

from __future__ import annotations

import copy

import hpack
import hpack.exceptions
import pytest
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.h2 import frames as f
from krproxy.h2 import hpackmemo
from krproxy.h2.frames import _integer as hpack_integer
from tests.unit.h2peer import grpc_request

# :method, :scheme, :path (the tests below cut the list after it), :authority, content-type, te
CALL = [
    *grpc_request(b"/runtime.v1alpha1.RuntimeHookService/PreCreateContainerHook", b"localhost"),
    (b"te", b"trailers"),
]


@pytest.fixture(autouse=True)
def empty_memo() -> None:
    hpackmemo._memo.clear()
    hpackmemo._unique_names.clear()


def remembered() -> tuple[list[bytes], list[tuple[int, bytes]]]:
    """The memory's blocks (single fields among them) and its templates' keys."""
    blocks = [key for key in hpackmemo._memo if isinstance(key, bytes)]
    return blocks, [key for key in hpackmemo._memo if isinstance(key, tuple)]


def decoder() -> hpack.Decoder:
    return hpack.Decoder(max_header_list_size=16 << 20)


def test_a_call_decodes_as_hpack_decodes_it_first_and_again() -> None:
    block = f.encode_headers([*CALL, (b"grpc-timeout", b"4999871u")])
    expected = decoder().decode(block, raw=True)
    ours = decoder()
    assert hpackmemo.decode(ours, block) == expected
    assert hpackmemo.decode(ours, block) == expected  # from the memo
    fields, templates = remembered()
    assert len(fields) == len(CALL)  # every field but grpc-timeout remembered
    timeout = b"\x00\x0cgrpc-timeout\x084999871u"  # a literal without indexing, plain
    assert block.endswith(timeout)
    assert [(len(block) - len(timeout), block[: -len(timeout)])] == templates  # the block without it
    answer = f.encode_headers([(b":status", b"200"), (b"content-type", b"application/grpc")])
    assert (
        hpackmemo.decode(ours, answer) == hpackmemo.decode(ours, answer) == decoder().decode(answer, raw=True)
    )
    assert answer in remembered()[0]  # a block without one is remembered whole


def test_grpc_timeout_is_never_remembered() -> None:
    ours = decoder()
    for micros in range(100):
        block = f.encode_headers([*CALL, (b"grpc-timeout", b"%du" % micros)])
        assert hpackmemo.decode(ours, block)[-1] == (b"grpc-timeout", b"%du" % micros)
    assert len(remembered()[0]) == len(CALL)
    assert all(name != b"grpc-timeout" for entry in hpackmemo._memo.values() for name, _ in entry[0])


def test_grpc_timeout_after_the_first_is_read_without_hpack(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = decoder()
    hpackmemo.decode(ours, f.encode_headers([*CALL, (b"grpc-timeout", b"5S")]))
    monkeypatch.setattr(hpackmemo, "_SCRATCH", None)  # any field left to hpack now fails
    for value in (b"4999871u", b"100m", b"99999999n"):
        got = hpackmemo.decode(ours, f.encode_headers([*CALL, (b"grpc-timeout", value)]))
        assert got == decoder().decode(f.encode_headers([*CALL, (b"grpc-timeout", value)]), raw=True)
        assert got[-1].__class__ is hpack.HeaderTuple
    secret = hpack.NeverIndexedHeaderTuple(b"grpc-timeout", b"1S")  # another representation
    with pytest.raises(AttributeError):  # first seen: left to hpack, which is gone
        hpackmemo.decode(ours, f.encode_headers([*CALL, secret]))


def test_another_grpc_timeout_is_read_into_its_template(monkeypatch: pytest.MonkeyPatch) -> None:
    """The template holds the fields on each side of grpc-timeout: a later block with another
    value (of another length too) is decoded without looking at its fields; a block that
    differs anywhere else is not taken for it."""
    ours = decoder()
    middle = [*CALL[:3], (b"grpc-timeout", b"5S"), *CALL[3:]]
    hpackmemo.decode(ours, f.encode_headers(middle))
    monkeypatch.setattr(hpackmemo, "_field_ends", None)  # any block not from memory fails now
    for value in (b"4999871u", b"1S", b""):
        headers = [*CALL[:3], (b"grpc-timeout", value), *CALL[3:]]
        block = f.encode_headers(headers)
        got = hpackmemo.decode(ours, block)
        assert got == decoder().decode(block, raw=True) == headers
        assert [h.__class__ for h in got] == [hpack.HeaderTuple] * len(headers)
    other = [*CALL[:2], (b":path", b"/other"), (b"grpc-timeout", b"5S"), *CALL[3:]]
    with pytest.raises(TypeError):  # not from the template: on to _field_ends, which is gone
        hpackmemo.decode(ours, f.encode_headers(other))


def test_a_template_answers_within_the_header_list_limit_only() -> None:
    headers = [*CALL, (b"grpc-timeout", b"5S")]
    hpackmemo.decode(decoder(), f.encode_headers(headers))
    size = sum(32 + len(n) + len(v) for n, v in headers)
    exact = hpack.Decoder(max_header_list_size=size)
    assert headers == hpackmemo.decode(exact, f.encode_headers(headers))
    with pytest.raises(hpack.exceptions.OversizedHeaderListError):
        hpackmemo.decode(exact, f.encode_headers([*CALL, (b"grpc-timeout", b"50S")]))


def test_a_never_indexed_field_stays_never_indexed() -> None:
    secret = hpack.NeverIndexedHeaderTuple(b"authorization", b"Bearer x")
    block = f.encode_headers([*CALL, secret])
    for _ in range(2):
        got = hpackmemo.decode(decoder(), block)
        assert got[-1] == secret
        assert got[-1].__class__ is hpack.NeverIndexedHeaderTuple
        assert f.encode_headers(got) == block  # passed on as it came


def test_an_empty_block_decodes_to_no_headers_by_either_rule() -> None:
    # Legal HPACK (a HEADERS frame with no fields). decode() reads it as a block of no fields; the
    # table-state rule looked at its first byte to tell a size update, and raised IndexError.
    assert [] == hpackmemo.decode(hpack.Decoder(), b"")
    assert [] == hpackmemo._by_hpack(hpack.Decoder(), b"")


def test_the_memo_is_bounded() -> None:
    ours = decoder()
    for i in range(hpackmemo.MEMO_LIMIT + 10):
        hpackmemo.decode(ours, f.encode_headers([(b"x-request-id", b"%d" % i)]))
    assert 0 < len(hpackmemo._memo) <= hpackmemo.MEMO_LIMIT


def test_a_header_list_too_large_is_refused_from_the_memo_too() -> None:
    block = f.encode_headers([(b"x-big", b"v" * 400)] * 3)
    small = hpack.Decoder(max_header_list_size=1000)
    hpackmemo.decode(decoder(), block)  # the field is in the memo now
    with pytest.raises(hpack.exceptions.OversizedHeaderListError):
        hpackmemo.decode(small, block)


def test_an_unshrunk_table_size_is_refused_from_the_memo_too() -> None:
    """A table size the encoder did not shrink is refused from the memo too."""
    block = f.encode_headers(CALL)
    hpackmemo.decode(decoder(), block)
    shrunk = decoder()
    shrunk.max_allowed_table_size = 0  # we sent SETTINGS_HEADER_TABLE_SIZE 0; no size update came
    with pytest.raises(hpack.exceptions.InvalidTableSizeError):
        hpackmemo.decode(shrunk, block)


@pytest.mark.parametrize(
    "block",
    [
        f.encode_headers(CALL)[:-3],  # cut in a value
        b"\x00\x7f",  # a name length cut off
        b"\x80",  # index 0
        b"\xff\xff\xff\xff\xff\xff\x7f",  # an index beyond any table
    ],
)
def test_a_broken_block_raises_as_hpack_raises(block: bytes) -> None:
    with pytest.raises(hpack.exceptions.HPACKError) as theirs:
        decoder().decode(block, raw=True)
    with pytest.raises(type(theirs.value)):
        hpackmemo.decode(decoder(), block)


names = st.sampled_from([b"content-type", b"x-a", b"x-b", b":path", b"user-agent", b"grpc-timeout"])
values = st.sampled_from([b"", b"1", b"application/grpc", b"/a/B", b"grpc-go/1.60", b"x" * 70])
header_lists = st.lists(st.tuples(names, values), max_size=8)


@settings(max_examples=150, deadline=None)
@given(
    blocks=st.lists(
        st.tuples(header_lists, st.sampled_from(["krproxy", "indexing", "huffman", "never"])),
        min_size=1,
        max_size=8,
    ),
    table_size=st.sampled_from([0, 64, 4096]),
)
def test_any_blocks_decode_and_leave_the_table_as_hpack_does(
    blocks: list[tuple[list[tuple[bytes, bytes]], str]], table_size: int
) -> None:
    """Blocks of our encoder (no table) mixed with hpack's (the dynamic table, Huffman coding,
    never-indexed fields) on one connection: each decodes to what hpack alone decodes, and both
    decoders' tables are the same after each block."""
    hpackmemo._memo.clear()
    hpackmemo._unique_names.clear()
    encoder = hpack.Encoder()
    encoder.header_table_size = table_size
    plain, ours = decoder(), decoder()
    for headers, how in blocks:
        if how == "krproxy":
            block = f.encode_headers(headers)
        elif how == "never":
            block = f.encode_headers([hpack.NeverIndexedHeaderTuple(*h) for h in headers])
        else:
            block = encoder.encode(headers, huffman=how == "huffman")
        expected = plain.decode(block, raw=True)
        got = hpackmemo.decode(ours, block)
        assert got == expected
        assert [h.__class__ for h in got] == [h.__class__ for h in expected]
        assert list(ours.header_table.dynamic_entries) == list(plain.header_table.dynamic_entries)
        assert ours.header_table_size == plain.header_table_size


def _grpc_go_blocks(timeouts: list[bytes], table_size: int = 4096) -> list[bytes]:
    """Blocks as grpc-go's encoder writes a call's headers: every field indexed into the dynamic
    table (hpack's encoder does the same), Huffman-coded, a fresh grpc-timeout each call."""
    encoder = hpack.Encoder()
    encoder.header_table_size = table_size
    return [
        encoder.encode([*CALL, (b"grpc-timeout", timeout), (b"user-agent", b"grpc-go/1.64.0")])
        for timeout in timeouts
    ]


def test_indexed_blocks_with_a_new_timeout_are_read_without_hpack(monkeypatch: pytest.MonkeyPatch) -> None:
    """A grpc-go client's blocks after its first: indexed fields and a new grpc-timeout added to
    the table, the indexes shifting each call. Each is read by the table rule, not by hpack, to
    what hpack reads, and leaves the table as hpack leaves it."""
    blocks = _grpc_go_blocks([b"%du" % (2999990 - 7 * i) for i in range(40)])
    plain, ours = decoder(), decoder()
    assert hpackmemo.decode(ours, blocks[0]) == plain.decode(blocks[0], raw=True)
    monkeypatch.setattr(hpackmemo, "_by_hpack", None)  # any block left to hpack fails now
    for block in blocks[1:]:
        expected = plain.decode(block, raw=True)
        got = hpackmemo.decode(ours, block)
        assert got == expected
        assert [h.__class__ for h in got] == [hpack.HeaderTuple] * len(expected)
        assert list(ours.header_table.dynamic_entries) == list(plain.header_table.dynamic_entries)


def _set_up(table_size: int) -> tuple[hpack.Decoder, hpack.Decoder, hpack.Encoder]:
    encoder = hpack.Encoder()
    encoder.header_table_size = table_size
    first = encoder.encode([*CALL, (b"grpc-timeout", b"1S")])
    plain, ours = decoder(), decoder()
    plain.decode(first, raw=True)
    hpackmemo.decode(ours, first)
    return plain, ours, encoder


@pytest.mark.parametrize(
    ("table_size", "tail"),
    [
        (4096, b"\x7e\x02ab\xff\x7f"),  # a new entry, then an index beyond the table
        (4096, b"\x7e\x05ab"),  # a new entry's value cut off
        (4096, b"\x7e\x85\xff\xff\xff\xff\xff"),  # a Huffman value that is all padding (EOS)
        (120, b"\x7e\x02ab\xc0"),  # a new entry that evicts the one the next field names
    ],
)
def test_a_broken_indexed_block_fails_as_hpack_fails(table_size: int, tail: bytes) -> None:
    """A block that adds to the table and then goes wrong raises hpack's error, and leaves both
    decoders' tables alike: the table rule changes the table only once a block is read whole."""
    plain, ours, _ = _set_up(table_size)
    block = b"\x83\x86" + tail
    with pytest.raises(hpack.exceptions.HPACKError) as theirs:
        plain.decode(block, raw=True)
    with pytest.raises(type(theirs.value)):
        hpackmemo.decode(ours, block)
    assert list(ours.header_table.dynamic_entries) == list(plain.header_table.dynamic_entries)


def test_an_indexed_block_over_the_list_limit_is_refused() -> None:
    """The header list limit holds for a block read by the table rule: hpack's error."""
    plain, ours, encoder = _set_up(4096)
    block = encoder.encode([*CALL, (b"grpc-timeout", b"2S")])
    plain.max_header_list_size = ours.max_header_list_size = 100
    with pytest.raises(hpack.exceptions.OversizedHeaderListError):
        plain.decode(block, raw=True)
    with pytest.raises(hpack.exceptions.OversizedHeaderListError):
        hpackmemo.decode(ours, block)
    assert list(ours.header_table.dynamic_entries) == list(plain.header_table.dynamic_entries)


#: Indexes mostly within the table _set_up fills (61 static entries and 5 dynamic ones).
_INDEX = st.one_of(*[st.integers(min_value=1, max_value=64)] * 24, st.integers(min_value=0, max_value=200))
_INDEXED = _INDEX.map(lambda i: hpack_integer(i, 7, 0x80))
_HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)


def _string(huffman: bool, value: bytes) -> bytes:
    coded = _HUFFMAN.encode(value) if huffman else value
    return bytes([(0x80 if huffman else 0) | len(coded)]) + coded


def _literal(name: int, huffman: bool, value: bytes) -> bytes:
    return hpack_integer(name, 6, 0x40) + _string(huffman, value)


#: The literal representations beside the indexing one with an indexed name: without indexing
#: (0000), never indexed (0001), and each kind with a literal name (index 0).
_OTHER_LITERAL = st.builds(
    lambda kind, name, huffman, value: (
        hpack_integer(name, 6 if kind == 0x40 else 4, kind)
        + (_string(huffman, b"x-" + value[:4]) if name == 0 else b"")
        + _string(huffman, value)
    ),
    st.sampled_from([0x00, 0x10, 0x40]),
    st.one_of(st.just(0), _INDEX),
    st.booleans(),
    st.binary(max_size=12),
)
_LITERAL = st.builds(_literal, _INDEX, st.booleans(), st.binary(max_size=12))
_PIECES = st.one_of(_INDEXED, _LITERAL, _OTHER_LITERAL)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(_PIECES, min_size=1, max_size=8),
    stray=st.one_of(
        st.none(),
        st.none(),
        st.none(),
        st.tuples(st.integers(min_value=0), st.binary(min_size=1, max_size=3)),
    ),
    table_size=st.sampled_from([100, 300, 4096]),
)
def test_indexed_blocks_of_any_bytes_read_as_hpack_reads_them(
    pieces: list[bytes], stray: tuple[int, bytes] | None, table_size: int
) -> None:
    """Indexed fields and indexing literals with any index and value (Huffman-coded or not), with
    stray bytes among them, against a table a grpc-go block filled: the same headers or the same
    error class as hpack's, and the same table after."""
    plain, ours, _ = _set_up(table_size)
    if stray is not None:
        pieces.insert(stray[0] % (len(pieces) + 1), stray[1])
    block = b"".join(pieces)
    try:
        expected = plain.decode(block, raw=True)
    except hpack.exceptions.HPACKError as err:
        with pytest.raises(type(err)):
            hpackmemo.decode(ours, block)
    else:
        got = hpackmemo.decode(ours, block)
        assert got == expected
        assert [h.__class__ for h in got] == [h.__class__ for h in expected]
    assert list(ours.header_table.dynamic_entries) == list(plain.header_table.dynamic_entries)


@pytest.mark.parametrize(
    "timeout",
    [
        hpack.NeverIndexedHeaderTuple(b"grpc-timeout", b"2999987u"),  # grpc-go's PR 9377 would send this
        hpack.HeaderTuple(b"x-trace", b"never-seen"),  # a literal name added to the table
    ],
)
def test_literal_fields_among_indexed_ones_are_read_without_hpack(
    monkeypatch: pytest.MonkeyPatch, timeout: hpack.HeaderTuple
) -> None:
    """A grpc-go block's indexed fields with a literal beside them (never indexed, or with a
    literal name, as after an eviction): read by the table rule, not by hpack, to what hpack
    reads (the never-indexed class kept), the tables alike after."""
    plain, ours, encoder = _set_up(4096)
    block = encoder.encode([*CALL, timeout], huffman=True)
    monkeypatch.setattr(hpackmemo, "_by_hpack", None)  # any block left to hpack fails now
    expected = plain.decode(block, raw=True)
    got = hpackmemo.decode(ours, block)
    assert got == expected
    assert [h.__class__ for h in got] == [h.__class__ for h in expected]
    assert list(ours.header_table.dynamic_entries) == list(plain.header_table.dynamic_entries)


@pytest.mark.parametrize("seen", [False, True])
def test_a_list_over_the_limit_is_refused_before_a_later_bad_field(seen: bool) -> None:
    """A block of fields that cannot touch the table, over the header list limit before a field
    whose Huffman code does not decode: hpack's OversizedHeaderListError (it stops at the
    limit), not the later field's HPACKDecodingError, whether the first field is remembered
    or not."""
    big = b"\x00\x03x-a" + f._integer(128, 7, 0) + b"a" * 128  # 163 bytes in the list
    block = big + b"\x00\x03x-b\x81\xff"  # a Huffman value that is all padding
    if seen:
        hpackmemo.decode(decoder(), big)
    small = hpack.Decoder(max_header_list_size=100)
    with pytest.raises(hpack.exceptions.OversizedHeaderListError):
        small.decode(block, raw=True)
    with pytest.raises(hpack.exceptions.OversizedHeaderListError):
        hpackmemo.decode(hpack.Decoder(max_header_list_size=100), block)


def _limit_cases() -> list[tuple[list[bytes], bytes]]:
    """(blocks a decoder reads first, a block then read twice) for each of the module's ways."""
    timeout = [*CALL, (b"grpc-timeout", b"5S")]
    encoder = hpack.Encoder()
    first = encoder.encode([*CALL, (b"grpc-timeout", b"1S")])
    indexed = encoder.encode(CALL)  # the dynamic table's entries only
    fresh = encoder.encode([*CALL, (b"grpc-timeout", b"2S")])  # one new entry
    small = hpack.Encoder()
    small.header_table_size = 256
    return [
        ([], f.encode_headers(CALL)),  # fields, then the whole block from memory
        ([f.encode_headers([*CALL, (b"grpc-timeout", b"1S")])], f.encode_headers(timeout)),  # a template
        ([first], indexed),  # the table rule, then from memory with the table's state
        ([first], fresh),  # the table rule, a new entry each time
        ([], small.encode(CALL)),  # a size update first: hpack's
    ]


@pytest.mark.parametrize(("before", "block"), _limit_cases())
@pytest.mark.parametrize("over", [0, 1])
def test_the_header_list_limit_holds_exactly_by_every_rule(
    before: list[bytes], block: bytes, over: int
) -> None:
    """A block's list exactly at the decoder's header list limit is read, one byte over it is
    refused with hpack's error, first and once the block is remembered; the tables stay alike."""
    plain, ours = decoder(), decoder()
    for earlier in before:
        assert hpackmemo.decode(ours, earlier) == plain.decode(earlier, raw=True)
    for limited in (True, False, True):
        probe = hpack.Decoder(max_header_list_size=16 << 20)
        probe.header_table = copy.deepcopy(plain.header_table)
        size = sum(32 + len(name) + len(value) for name, value in probe.decode(block, raw=True))
        plain.max_header_list_size = ours.max_header_list_size = size - over if limited else 16 << 20
        if limited and over:
            with pytest.raises(hpack.exceptions.OversizedHeaderListError):
                plain.decode(block, raw=True)
            with pytest.raises(hpack.exceptions.OversizedHeaderListError):
                hpackmemo.decode(ours, block)
        else:
            assert hpackmemo.decode(ours, block) == plain.decode(block, raw=True)
        assert list(ours.header_table.dynamic_entries) == list(plain.header_table.dynamic_entries)
