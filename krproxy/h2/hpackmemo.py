"""Header blocks decoded field by field from a memo, where HPACK's state cannot matter.

A field sent as a static-table index or as a literal *without* indexing or *never* indexed
with a literal or static name (RFC 7541 §6.1, §6.2.2, §6.2.3) decodes to the same header
whatever the decoder's dynamic table holds, and leaves the table as it was. krproxy's own
encoder (:func:`krproxy.h2.frames.encode_headers`) sends only such fields, and a gRPC call
of one method sends the same ones every time (only ``grpc-timeout`` changes), so
:func:`decode` finds each of them by its bytes in a memo (``grpc-timeout`` by its name's bytes,
its value a plain literal read as it is) and leaves ``hpack`` the blocks
that touch the dynamic table (grpc-go's, h2's), the first sight of a field, and anything
malformed: ``hpack`` decodes those, and its errors and checks stay the rules. In the SDK's
hook server this took decoding from about a sixth of the process's Python time to a few
per cent (docs/performance.md).

Pure: no I/O, no clock; the memo is the process's, shared by all connections (a field's
meaning depends on no connection), bounded, and started over when full.
"""

from __future__ import annotations

from typing import cast

import hpack
from hpack import HeaderTuple
from hpack.table import HeaderTable

Headers = list[tuple[bytes, bytes]]

#: Static table entries (RFC 7541 Appendix A): index 1 to 61.
_STATIC = len(HeaderTable.STATIC_TABLE)
#: Fields remembered at most; a peer sending ever new ones makes the memo start over.
MEMO_LIMIT = 2048
#: Longer fields are left to ``hpack`` every time (a large cookie is no gRPC call's field).
FIELD_LIMIT = 512
#: Whole blocks remembered at most.
BLOCKS_LIMIT = 256
#: Longer blocks are left to ``hpack`` whole, without looking for fields to remember.
BLOCK_LIMIT = 4096

#: Fields whose value differs call by call: never remembered.
_UNIQUE = frozenset({b"grpc-timeout"})

_memo: dict[bytes, tuple[bytes, bytes]] = {}
#: A field of :data:`_UNIQUE` by the bytes before its value (its representation and name, as
#: first decoded by ``hpack``): its header's class and name. Only those names get entries, and
#: each only for the two plain literal representations: a few entries at most.
_unique_names: dict[bytes, tuple[type[HeaderTuple], bytes]] = {}
#: Whole blocks without a field of :data:`_UNIQUE` (answers' headers and trailers, requests
#: without a deadline): one look-up for all their fields.
_blocks: dict[bytes, tuple[tuple[tuple[bytes, bytes], ...], int]] = {}
#: Decodes single fields that touch no table, so its own table stays empty and its state unchanged.
_SCRATCH = hpack.Decoder(max_header_list_size=1 << 20)


def _integer(block: bytes, at: int, prefix_bits: int) -> tuple[int, int] | None:
    """RFC 7541 §5.1 integer at ``block[at]``: (value, position after it), None if cut off."""
    limit = (1 << prefix_bits) - 1
    value = block[at] & limit
    at += 1
    if value < limit:
        return value, at
    shift = 0
    while at < len(block) and shift <= 28:
        byte = block[at]
        at += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
    return None


def _string_end(block: bytes, at: int) -> int | None:
    """Where the string literal (RFC 7541 §5.2) at ``block[at]`` ends; None if cut off."""
    if at >= len(block):
        return None
    length = block[at] & 0x7F  # the Huffman flag aside
    if length < 0x7F:
        return at + 1 + length
    got = _integer(block, at, 7)
    return None if got is None else got[1] + got[0]


def _field_ends(block: bytes) -> list[int] | None:
    """Where each field of ``block`` ends, if every field is one the dynamic table cannot
    affect (see the module docstring); None otherwise or if the block is cut off."""
    ends = []
    at = 0
    size = len(block)
    while at < size:
        first = block[at]
        if first & 0x80:  # indexed field: static entries only (all below the 7-bit prefix's 127)
            if not 1 <= first & 0x7F <= _STATIC:
                return None
            at += 1
        elif first & 0xE0:  # 01xxxxxx adds to the table, 001xxxxx resizes it
            return None
        else:  # 0000xxxx without indexing, 0001xxxx never indexed
            got = _integer(block, at, 4)
            if got is None or got[0] > _STATIC:
                return None
            name_end = got[1] if got[0] else _string_end(block, got[1])  # an index or a literal
            value_end = None if name_end is None else _string_end(block, name_end)
            if value_end is None:
                return None
            at = value_end
        ends.append(at)
    return ends if at == size else None


def _value_start(field: bytes) -> int | None:
    """Where the value of ``field`` starts, if it is a literal without indexing or never
    indexed whose name is a static index below 15 or a short plain literal, and whose value is
    a plain literal (no Huffman coding) shorter than 127 bytes that ends the field; else None."""
    first = field[0]
    if first & 0xE0:  # not 0000xxxx nor 0001xxxx (callers pass those only; kept for safety)
        return None
    index = first & 0x0F
    if index == 0x0F:  # a multi-byte index
        return None
    at = 1
    if not index:  # a literal name: short and plain only
        if len(field) < 2 or field[1] >= 0x7F:
            return None
        at = 2 + field[1]
    if at >= len(field) or field[at] >= 0x7F or at + 1 + field[at] != len(field):
        return None
    return at + 1


def _unique_field(field: bytes) -> tuple[bytes, bytes] | None:
    """``field`` decoded without ``hpack``, if it is a field of :data:`_UNIQUE` whose name part
    was decoded by ``hpack`` before (:func:`_remember_unique`) and whose value is plain."""
    start = _value_start(field)
    if start is None:
        return None
    known = _unique_names.get(field[: start - 1])
    if known is None:
        return None
    cls, name = known
    return cls(name, field[start:])


def _remember_unique(field: bytes, header: tuple[bytes, bytes]) -> None:
    """Remember the name part of ``field``, which ``hpack`` decoded to ``header`` (a field of
    :data:`_UNIQUE`), if its value is plain and decoded to the bytes it holds."""
    start = _value_start(field)
    if start is not None and field[start:] == header[1]:
        _unique_names[field[: start - 1]] = (cast(type[HeaderTuple], header.__class__), header[0])


def decode(decoder: hpack.Decoder, block: bytes) -> Headers:
    """``decoder.decode(block, raw=True)``, the fields that allow it taken from the memo.

    The same headers (``hpack``'s tuple classes included, so never-indexed fields stay so),
    the same errors, and the same decoder state after it as ``hpack`` alone gives."""
    if decoder.header_table.maxsize > decoder.max_allowed_table_size:
        return cast(Headers, decoder.decode(block, raw=True))  # raises hpack's error
    whole = _blocks.get(block)  # (its headers, their size)
    if whole is not None and whole[1] <= decoder.max_header_list_size:
        return list(whole[0])
    ends = _field_ends(block) if len(block) <= BLOCK_LIMIT else None
    if ends is None:
        return cast(Headers, decoder.decode(block, raw=True))  # hpack's state, rules and errors
    memo = _memo
    headers = []
    start = 0
    unique = False
    for end in ends:
        field = block[start:end]
        header = memo.get(field)
        if header is None:
            if end - start > FIELD_LIMIT:
                return cast(Headers, decoder.decode(block, raw=True))
            known = _unique_field(field)  # e.g. grpc-timeout, its name seen before
            if known is not None:
                header, unique = known, True
            else:
                # A field of its own decodes alike in any decoder: one that never changes does.
                header = cast(Headers, _SCRATCH.decode(field, raw=True))[0]
                if header[0] in _UNIQUE:
                    unique = True
                    _remember_unique(field, header)
                else:
                    if len(memo) >= MEMO_LIMIT:
                        memo.clear()
                    memo[field] = header
        headers.append(header)
        start = end
    inflated = sum(32 + len(name) + len(value) for name, value in headers)  # RFC 7541 §4.1
    if inflated > decoder.max_header_list_size:
        return cast(Headers, decoder.decode(block, raw=True))  # raises hpack's error
    if not unique:
        if len(_blocks) >= BLOCKS_LIMIT:
            _blocks.clear()
        _blocks[block] = (tuple(headers), inflated)
    return headers
