"""An HPACK header block read for its effect on the dynamic table only (RFC 7541), as it arrives.

A peer that ignores the SETTINGS_MAX_HEADER_LIST_SIZE krproxy advertises may send a header block
larger than krproxy reads (:data:`krproxy.h2.connection.MAX_HEADER_BLOCK`). Its stream is then
reset, but the connection's HPACK state must still take the block in: a later block may name an
entry this one added. ``hpack`` cannot do that affordably: it decodes every field and copies the
rest of the block once per literal, 1.6 s per MiB of one Huffman-coded value and 19-26 s per MiB of
small fields on the machines here (docs/security.md, "Header list limits, per side").

A :class:`Skimmer` reads the block's fragments as they arrive, keeping none of them:

* a string that cannot enter the dynamic table (any string of a field without indexing; one of a
  field with incremental indexing whose length alone puts the entry over the table's size) is
  skipped by its length, unread: its Huffman code is not checked;
* a field with incremental indexing whose entry may fit is decoded (its strings are at most a few
  KiB) and added as ``hpack`` adds it; one that cannot fit empties the table, as RFC 7541 §4.4 says;
* indexes are checked against the table, and table size updates applied, as ``hpack`` does.

The table then holds what ``hpack`` would have left in it. Bounded: :data:`MAX_FIELDS` fields and
:data:`MAX_BLOCK` bytes at most (beyond: a connection error, as grpc-go ends the connection on any
frame of a block past its limit); a field's work is a few steps whatever its size. Pure: no I/O.
"""

from __future__ import annotations

import hpack
import hpack.exceptions
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

from krproxy.h2 import frames as f
from krproxy.h2 import hpackmemo

__all__ = ["MAX_BLOCK", "MAX_FIELDS", "Skimmer"]

#: Fields a skimmed block may hold: a field costs 2-8 µs here (one-byte indexes to small literals),
#: so this is ~30 ms of the reader at most. A block past the limit holds few fields (one large
#: value, as containerd's echo of a huge id); thousands of tiny ones are a flood, and end the
#: connection.
MAX_FIELDS = 4096
#: Bytes a skimmed block may hold: grpc-go's default header list limit (16 MiB), the most any
#: grpc-go peer sends; beyond it the connection ends.
MAX_BLOCK = 16 * 1024 * 1024

_STATIC = len(HeaderTable.STATIC_TABLE)
#: What the skimmer waits for next, within a field.
_FIELD, _NAME, _VALUE = 0, 1, 2


def _shortest_decoding(length: int, huffman: bool) -> int:
    """The fewest bytes a string literal of ``length`` bytes can decode to (RFC 7541 §5.2):
    itself, or with Huffman codes of 30 bits at most and padding under 8 bits."""
    return -(-(8 * length - 7) // 30) if huffman and length else length


class Skimmer:
    """Takes one header block's fragments (:meth:`feed`), then :meth:`finish`; the decoder's table
    ends as ``hpack`` would leave it. Raises :class:`~krproxy.h2.frames.ProtocolError`
    (COMPRESSION_ERROR for a block ``hpack`` refuses, ENHANCE_YOUR_CALM past the bounds)."""

    def __init__(self, decoder: hpack.Decoder) -> None:
        self.decoder = decoder
        self.table = decoder.header_table
        self.size = 0
        self.fields = 0
        self._carry = b""  # the start of an integer or a kept string cut by a fragment's end
        self._skip = 0  # bytes left of a string skipped unread
        self._want = _FIELD
        self._indexing = False
        self._name: bytes | None = None  # the name of the field under way; None: too long to keep
        self._too_big = False  # the field under way cannot enter the table

    def feed(self, fragment: bytes) -> None:
        self.size += len(fragment)
        if self.size > MAX_BLOCK:
            raise f.ProtocolError(f"header block over {MAX_BLOCK} bytes", f.ENHANCE_YOUR_CALM)
        data = self._carry + fragment if self._carry else fragment
        self._carry = b""
        at = 0
        end = len(data)
        while at < end:
            if self._skip:
                taken = min(self._skip, end - at)
                self._skip -= taken
                at += taken
                if self._skip:
                    return
                self._string_done(None)
                continue
            got = self._step(data, at)
            if got < 0:  # cut off: keep the rest for the next fragment
                self._carry = bytes(data[at:])
                return
            at = got

    def finish(self) -> None:
        """The block ended (END_HEADERS): it must end between fields."""
        if self._carry or self._skip or self._want != _FIELD:
            raise f.ProtocolError("undecodable header block: truncated", f.COMPRESSION_ERROR)

    # -- one step: a field's start, or one of its strings -----------------------------------

    def _step(self, data: bytes, at: int) -> int:
        if self._want != _FIELD:
            return self._string(data, at)
        first = data[at]
        if first & 0x80:  # indexed
            got = _integer(data, at, 7)
            if got is None:
                return -1
            self._lookup(got[0])
            self._count()
            return got[1]
        if first & 0xC0 == 0x40:
            prefix, self._indexing = 6, True
        elif first & 0xE0 == 0x20:  # dynamic table size update: before any field (as hpack)
            got = _integer(data, at, 5)
            if got is None:
                return -1
            if self.fields:
                raise f.ProtocolError(
                    "undecodable header block: size update after a field", f.COMPRESSION_ERROR
                )
            if got[0] > self.decoder.max_allowed_table_size:
                raise f.ProtocolError(
                    "undecodable header block: table size over the limit", f.COMPRESSION_ERROR
                )
            self.table.maxsize = got[0]
            return got[1]
        else:
            prefix, self._indexing = 4, False
        got = _integer(data, at, prefix)
        if got is None:
            return -1
        index, at = got
        self._too_big = False
        if index:
            self._name = self._lookup(index)[0]
            self._want = _VALUE
        else:
            self._name = None
            self._want = _NAME
        return at

    def _string(self, data: bytes, at: int) -> int:
        got = _integer(data, at, 7)
        if got is None:
            return -1
        length, start = got
        huffman = bool(data[at] & 0x80)
        room = self.table.maxsize - 32
        if self._want == _VALUE and self._name is not None:
            room -= len(self._name)
        if not self._indexing or self._too_big or _shortest_decoding(length, huffman) > room:
            self._too_big = True  # read no further: the entry cannot fit (or none is made)
            self._skip = length
            taken = min(length, len(data) - start)
            self._skip -= taken
            if not self._skip:
                self._string_done(None)
            return start + taken
        stop = start + length
        if stop > len(data):
            return -1
        raw = bytes(data[start:stop])
        try:
            value = decode_huffman(raw) if huffman else raw
        except hpack.exceptions.HPACKDecodingError as err:
            raise f.ProtocolError(f"undecodable header block: {err}", f.COMPRESSION_ERROR) from None
        self._string_done(value)
        return stop

    def _string_done(self, value: bytes | None) -> None:
        if self._want == _NAME:
            self._name = value
            self._want = _VALUE
            return
        self._want = _FIELD
        if self._indexing:
            if value is None or self._name is None or self._too_big:
                # Larger than the table: adding it empties the table (RFC 7541 §4.4), as hpack does.
                self.table.add(b"", bytes(max(0, self.table.maxsize - 31)))
            else:
                self.table.add(self._name, value)
        self._count()

    def _lookup(self, index: int) -> tuple[bytes, bytes]:
        try:
            return self.table.get_by_index(index)
        except hpack.exceptions.InvalidTableIndex as err:
            raise f.ProtocolError(f"undecodable header block: {err}", f.COMPRESSION_ERROR) from None

    def _count(self) -> None:
        self.fields += 1
        if self.fields > MAX_FIELDS:
            raise f.ProtocolError(f"header block of more than {MAX_FIELDS} fields", f.ENHANCE_YOUR_CALM)


def _integer(data: bytes, at: int, prefix_bits: int) -> tuple[int, int] | None:
    """RFC 7541 §5.1 integer at ``data[at]`` (:func:`krproxy.h2.hpackmemo._integer`): (value,
    position after it), None if cut off; one of more than five continuation bytes is refused
    (2^35 and beyond: no length or index of a block we take)."""
    got = hpackmemo._integer(data, at, prefix_bits)
    if got is None and len(data) - at > 6:
        raise f.ProtocolError("undecodable header block: integer too long", f.COMPRESSION_ERROR)
    return got
