"""krproxy.h2._hpack.Decoder: blocks that left the dynamic table as it was are answered from
memory, and only while the table stays as it was."""

from __future__ import annotations

from typing import Any

import hpack
import pytest

from krproxy.h2._hpack import KEPT_BLOCK, Decoder

ANSWER = [(b":status", b"200"), (b"content-type", b"application/grpc")]


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The blocks hpack itself decoded."""
    decoded: list[bytes] = []
    real = hpack.Decoder.decode

    def decode(self: hpack.Decoder, data: bytes, raw: bool = False) -> Any:
        decoded.append(bytes(data))
        return real(self, data, raw)

    monkeypatch.setattr(hpack.Decoder, "decode", decode)
    return decoded


def test_an_indexed_block_seen_before_is_not_decoded_again(counted: list[bytes]) -> None:
    encoder, decoder = hpack.Encoder(), Decoder(max_header_list_size=1 << 20)
    first = encoder.encode(ANSWER)  # literals with incremental indexing: the table changes
    again = encoder.encode(ANSWER)  # indexed fields only (the dynamic table's two entries)
    assert first != again
    assert ANSWER == decoder.decode(first, raw=True)
    assert ANSWER == decoder.decode(again, raw=True)
    assert ANSWER == decoder.decode(again, raw=True)
    assert ANSWER == decoder.decode(again, raw=True)
    assert [first, again] == counted  # the last two came from memory


def test_a_block_that_changes_the_table_is_decoded_each_time(counted: list[bytes]) -> None:
    decoder = Decoder(max_header_list_size=1 << 20)
    block = hpack.Encoder().encode([(b"x-call", b"1")])  # a literal with incremental indexing
    for _ in range(3):
        assert [(b"x-call", b"1")] == decoder.decode(block, raw=True)
    assert 3 == len(counted)


def test_a_kept_block_is_decoded_again_once_the_table_changed(counted: list[bytes]) -> None:
    """Index 62 is the newest dynamic entry: after a new entry it names that one."""
    encoder, decoder = hpack.Encoder(), Decoder(max_header_list_size=1 << 20)
    decoder.decode(encoder.encode([(b"x-a", b"1")]), raw=True)
    newest = b"\xbe"  # indexed field 62
    assert [(b"x-a", b"1")] == decoder.decode(newest, raw=True)
    assert [(b"x-a", b"1")] == decoder.decode(newest, raw=True)
    decoder.decode(encoder.encode([(b"x-b", b"2")]), raw=True)
    assert [(b"x-b", b"2")] == decoder.decode(newest, raw=True)
    assert 4 == len(counted)  # the second read of 62 only came from memory


def test_the_same_entry_added_again_is_a_change(counted: list[bytes]) -> None:
    """A full table gets an entry equal to its newest: the oldest goes, and index 63 names
    another entry, though the count and the newest entry's value are as they were."""
    decoder = Decoder(max_header_list_size=1 << 20)
    decoder.header_table_size = decoder.header_table.maxsize = 68  # two entries of 34 bytes
    decoder.decode(b"\x40\x01a\x01b", raw=True)  # literals with incremental indexing: (a, b)
    decoder.decode(b"\x40\x01c\x01d", raw=True)  # then (c, d): the table is [(c, d), (a, b)]
    assert [(b"a", b"b")] == decoder.decode(b"\xbf", raw=True)  # indexed field 63
    decoder.decode(b"\x40\x01c\x01d", raw=True)  # (a, b) goes: [(c, d), (c, d)]
    assert [(b"c", b"d")] == decoder.decode(b"\xbf", raw=True)


def test_large_blocks_are_not_kept(counted: list[bytes]) -> None:
    decoder = Decoder(max_header_list_size=1 << 20)
    block = b"\x82" * (KEPT_BLOCK + 1)  # indexed :method GET, over and over
    decoder.decode(block, raw=True)
    decoder.decode(block, raw=True)
    assert 2 == len(counted)


def test_an_undecodable_block_still_raises() -> None:
    decoder = Decoder(max_header_list_size=1 << 20)
    with pytest.raises(hpack.exceptions.HPACKError):
        decoder.decode(b"\xff\xff\xff\xff", raw=True)
    with pytest.raises(hpack.exceptions.HPACKError):
        decoder.decode(b"\xff\xff\xff\xff", raw=True)
