"""Header blocks decoded field by field from a memo, where HPACK's state cannot matter.

A field sent as a static-table index or as a literal *without* indexing or *never* indexed
with a literal or static name (RFC 7541 §6.1, §6.2.2, §6.2.3) decodes to the same header
whatever the decoder's dynamic table holds, and leaves the table as it was. krproxy's own
encoder (:func:`krproxy.h2.frames.encode_headers`) sends only such fields, and a gRPC call
of one method sends the same ones every time (only ``grpc-timeout`` changes), so
:func:`decode` finds each of them by its bytes in a memo and leaves ``hpack`` the blocks
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
from hpack.table import HeaderTable

Headers = list[tuple[bytes, bytes]]

#: Static table entries (RFC 7541 Appendix A): index 1 to 61.
_STATIC = len(HeaderTable.STATIC_TABLE)
#: Fields remembered at most; a peer sending ever new ones makes the memo start over.
MEMO_LIMIT = 2048
#: Longer fields are left to ``hpack`` every time (a large cookie is no gRPC call's field).
FIELD_LIMIT = 512
#: Longer blocks are left to ``hpack`` whole, without looking for fields to remember.
BLOCK_LIMIT = 4096

#: Fields whose value differs call by call: never remembered.
_UNIQUE = frozenset({b"grpc-timeout"})

_memo: dict[bytes, tuple[bytes, bytes]] = {}
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


def _field_ends(block: bytes) -> list[int] | None:
    """Where each field of ``block`` ends, if every field is one the dynamic table cannot
    affect (see the module docstring); None otherwise or if the block is cut off."""
    ends = []
    at = 0
    size = len(block)
    while at < size:
        first = block[at]
        if first & 0x80:  # indexed field: static entries only
            got = _integer(block, at, 7)
            if got is None or not 1 <= got[0] <= _STATIC:
                return None
            at = got[1]
        elif first & 0xE0:  # 01xxxxxx adds to the table, 001xxxxx resizes it
            return None
        else:  # 0000xxxx without indexing, 0001xxxx never indexed
            got = _integer(block, at, 4)
            if got is None or got[0] > _STATIC:
                return None
            at = got[1]
            for _ in range(1 if got[0] else 2):  # the value, after the name if it is a literal
                if at >= size:
                    return None
                length = _integer(block, at, 7)
                if length is None:
                    return None
                at = length[1] + length[0]
            if at > size:
                return None
        ends.append(at)
    return ends


def decode(decoder: hpack.Decoder, block: bytes) -> Headers:
    """``decoder.decode(block, raw=True)``, the fields that allow it taken from the memo.

    The same headers (``hpack``'s tuple classes included, so never-indexed fields stay so),
    the same errors, and the same decoder state after it as ``hpack`` alone gives."""
    ends = _field_ends(block) if len(block) <= BLOCK_LIMIT else None
    if ends is None or decoder.header_table.maxsize > decoder.max_allowed_table_size:
        return cast(Headers, decoder.decode(block, raw=True))  # hpack's state, rules and errors
    memo = _memo
    headers = []
    start = 0
    inflated = 0
    for end in ends:
        field = block[start:end]
        header = memo.get(field)
        if header is None:
            if end - start > FIELD_LIMIT:
                return cast(Headers, decoder.decode(block, raw=True))
            # A field of its own decodes alike in any decoder: one that never changes does.
            header = cast(Headers, _SCRATCH.decode(field, raw=True))[0]
            if header[0] not in _UNIQUE:
                if len(memo) >= MEMO_LIMIT:
                    memo.clear()
                memo[field] = header
        headers.append(header)
        inflated += 32 + len(header[0]) + len(header[1])  # RFC 7541 §4.1, as hpack counts
        start = end
    if inflated > decoder.max_header_list_size:
        return cast(Headers, decoder.decode(block, raw=True))  # raises hpack's error
    return headers
