"""HPACK header blocks decoded from one memory: by their bytes, where the decoder's state
cannot matter or is as it was.

Decoding is a function of the block and the decoder's dynamic table. Two rules make most blocks
a gRPC peer sends a dictionary look-up instead of ``hpack``'s ~5-20 µs in Python, and a third
reads grpc-go's in one function:

- **Fields that cannot touch the table.** A field sent as a static-table index or as a literal
  *without* indexing or *never* indexed with a literal or static name (RFC 7541 §6.1, §6.2.2,
  §6.2.3) decodes to the same header whatever the table holds, and leaves it as it was.
  krproxy's own encoder (:func:`krproxy.h2.frames.encode_headers`) sends only such fields, and
  a gRPC call of one method sends the same ones every time; only ``grpc-timeout`` changes. Such
  a block is remembered whole, for any decoder; a block of them with a ``grpc-timeout`` is
  remembered without that field, as a template the field's bytes are read into (its name's
  bytes known, its value a plain literal, as krproxy's encoder sends it); a block seen first is
  decoded field by field, each field remembered as a block of one.
- **Blocks that left the table as it was.** Other blocks (grpc-go's and h2's, which index into
  the dynamic table: a runtime's answers and trailers are the same few indexed bytes call after
  call) are read by the table rule below or by ``hpack``; one of at most :data:`KEPT_BLOCK`
  bytes that left the table unchanged is remembered with the table's state it was decoded
  against (the newest entry *object*, held by the entry so that its identity cannot be reused,
  the entry count and the size limit), and answered from memory only while a decoder's table is
  in that state.
- **Blocks read against the table.** A block of indexed fields and literals of any kind with
  short strings (a grpc-go client's: it indexes every field, and a fresh ``grpc-timeout`` for a
  short deadline is a new entry each call, which shifts every index) is read here against the
  decoder's table (:func:`_by_table`), whole, before its new entries go into the table through
  ``hpack``'s own ``HeaderTable.add``.

``hpack`` decodes everything else (table size updates, strings of 127 bytes or more, anything
malformed, anything the table rule does not read whole): its errors and checks stay the rules,
and a decoder's table is always ``hpack``'s. Every answer is checked against the decoder's
header list limit.

Pure: no I/O, no clock. The memory is the process's, shared by all connections (a remembered
block's meaning depends on no connection), bounded (:data:`MEMO_LIMIT` entries), and started
over when full. Safe to call from several threads (one connection's decoder in one at a time).
"""

from __future__ import annotations

from typing import Any, cast

import hpack
from hpack import HeaderTuple, NeverIndexedHeaderTuple
from hpack.exceptions import HPACKDecodingError
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

__all__ = ["BLOCK_LIMIT", "FIELD_LIMIT", "KEPT_BLOCK", "MEMO_LIMIT", "decode"]

Headers = list[tuple[bytes, bytes]]
#: What a remembered block was decoded against: the newest dynamic entry, entry count, size limit.
State = tuple[object, int, int]

#: Static table entries (RFC 7541 Appendix A): index 1 to 61.
_STATIC = len(HeaderTable.STATIC_TABLE)
#: Entries remembered at most (blocks, fields, templates); one more starts the memory over.
MEMO_LIMIT = 4096
#: Longer fields are left to ``hpack`` every time (a large cookie is no gRPC call's field).
FIELD_LIMIT = 512
#: Longer blocks are left to ``hpack`` whole, without looking for fields to remember.
BLOCK_LIMIT = 4096
#: Largest block remembered with a table state: a gRPC answer's or trailers' blocks are a few
#: bytes once indexed.
KEPT_BLOCK = 128

#: Fields whose value differs call by call: never remembered.
_UNIQUE = frozenset({b"grpc-timeout"})

#: The memory. A block's bytes: (its headers, their size (RFC 7541 §4.1), the table state it
#: holds for or None for any, None). A template, by (where the field of :data:`_UNIQUE` was,
#: the block without it): (the other headers, their size, None, the field's place among them).
_memo: dict[Any, tuple[tuple[tuple[bytes, bytes], ...], int, State | None, int | None]] = {}
#: A field of :data:`_UNIQUE` by the bytes before its value (its representation and name, as
#: first decoded by ``hpack``): its header's class and name. Only those names get entries, and
#: each only for the two plain literal representations: a few entries at most. Replaced, never
#: changed in place (a thread may be walking it).
_unique_names: dict[bytes, tuple[type[HeaderTuple], bytes]] = {}
#: ``tuple.__new__``: what ``HeaderTuple(name, value)`` calls, called directly (one Python call
#: fewer per header read by :func:`_by_table`).
_new_header = tuple.__new__
#: Decodes single fields that touch no table, so its own table stays empty and its state unchanged.
_SCRATCH = hpack.Decoder(max_header_list_size=1 << 20)


def _remember(key: Any, entry: tuple[tuple[tuple[bytes, bytes], ...], int, State | None, int | None]) -> None:
    if len(_memo) >= MEMO_LIMIT:
        _memo.clear()
    _memo[key] = entry


def _state(decoder: hpack.Decoder) -> State:
    table = decoder.header_table
    entries = table.dynamic_entries
    return (entries[0] if entries else None, len(entries), table.maxsize)


def _same(a: State, b: State) -> bool:
    """The same table: the same newest entry *object* (an entry equal to the newest one may be
    added again, evicting the oldest), entry count and size limit."""
    return a[0] is b[0] and a[1] == b[1] and a[2] == b[2]


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
    global _unique_names
    start = _value_start(field)
    if start is not None and field[start:] == header[1]:
        # A new dict, not an item added: another thread may be walking the names (_from_template).
        known = (cast(type[HeaderTuple], header.__class__), header[0])
        _unique_names = {**_unique_names, field[: start - 1]: known}


def decode(decoder: hpack.Decoder, block: bytes) -> Headers:
    """``decoder.decode(block, raw=True)``, from the memory where the module's rules allow.

    The same headers (``hpack``'s tuple classes included, so never-indexed fields stay so),
    the same errors, and the same decoder state after it as ``hpack`` alone gives."""
    if decoder.header_table.maxsize > decoder.max_allowed_table_size:
        return cast(Headers, decoder.decode(block, raw=True))  # raises hpack's error
    limit = decoder.max_header_list_size
    kept = _memo.get(block)
    if kept is not None:
        headers, size, state, _ = kept
        if size <= limit and (state is None or _same(state, _state(decoder))):
            return list(headers)
    if _unique_names:
        found = _from_template(block, limit)
        if found is not None:
            return found
    if len(block) <= BLOCK_LIMIT:
        ends = _field_ends(block)
        if ends is not None:
            return _by_fields(decoder, block, ends)
        read = _by_table(decoder, block, limit)
        if read is not None:
            return read
    return _by_hpack(decoder, block)


def _from_template(block: bytes, limit: int) -> Headers | None:
    """``block`` from a template: a remembered block with a field of :data:`_UNIQUE` at the place
    one of their known names' bytes is found in ``block``. The block is then exactly the
    template's fields with that field between them (the template's key holds the bytes on each
    side), so it decodes to theirs with that field's header between them."""
    for prefix, (cls, name) in _unique_names.items():
        at = block.find(prefix)
        if at < 0:
            continue
        start = at + len(prefix)  # the value's length byte
        if start >= len(block) or block[start] >= 0x7F:
            continue
        end = start + 1 + block[start]
        template = _memo.get((at, block[:at] + block[end:])) if end <= len(block) else None
        if template is None:
            continue
        headers, size, _, place = template
        value = block[start + 1 : end]
        size += 32 + len(name) + len(value)
        if size > limit:
            return None  # hpack raises its error
        got = list(headers)
        assert place is not None  # a template holds its field's place (typing.cast is a call)
        got.insert(place, cls(name, value))
        return got
    return None


def _by_hpack(decoder: hpack.Decoder, block: bytes) -> Headers:
    """``hpack``'s decoding; a short block that left the table as it was is remembered with the
    table's state."""
    before = _state(decoder)
    headers = cast(Headers, decoder.decode(block, raw=True))
    # Not one that starts with a size update: hpack checks it against the decoder's allowed
    # size (our SETTINGS_HEADER_TABLE_SIZE), which the table's state does not hold.
    if 0 < len(block) <= KEPT_BLOCK and block[0] & 0xE0 != 0x20 and _same(_state(decoder), before):
        size = sum(32 + len(name) + len(value) for name, value in headers)
        _remember(block, (tuple(headers), size, before, None))
    return headers


def _by_table(decoder: hpack.Decoder, block: bytes, limit: int) -> Headers | None:
    """``block`` read against the decoder's table, if it holds only indexed fields and literals
    (with incremental indexing, without, never indexed; their names indexed or literal) whose
    strings are under 127 bytes: grpc-go's blocks, whose encoder indexes every field, and whose
    fresh ``grpc-timeout`` shifts the indexes call by call (or, never indexed as grpc-go's PR 9377
    would send it, stands among indexed fields). None for anything else (a table size update),
    anything that does not read, or a list over ``limit``: ``hpack`` then reads it and raises
    its error.

    The block is read whole against a view of the table (its entries, this block's additions
    before them, the oldest evicted as ``hpack`` evicts them) before the additions go into the
    table (``HeaderTable.add``, ``hpack``'s own): a block that fails leaves the table untouched
    for ``hpack``. One that adds nothing is remembered with the table's state, as by
    :func:`_by_hpack`, unless it holds a :data:`_UNIQUE` field as a literal."""
    table = decoder.header_table
    current = getattr(table, "_current_size", None)  # hpack's sum of its entries' sizes (§4.1)
    if current is None:
        return None  # an hpack that keeps it elsewhere: its own reading
    entries = table.dynamic_entries
    maxsize = table.maxsize
    kept = len(entries)  # the table's entries still in the view (the oldest evicted first)
    added: list[tuple[bytes, bytes]] = []  # this block's new entries, oldest first
    fresh = 0  # len(added)
    unique = False  # a field of _UNIQUE sent as a literal: the block is not remembered
    headers: Headers = []
    inflated = 0
    at = 0
    size = len(block)
    while at < size:
        first = block[at]
        if first & 0x80:  # an indexed field
            mask = 0x7F
        elif first & 0x40:  # a literal with incremental indexing
            mask = 0x3F
        elif first & 0x20:  # a table size update
            return None
        else:  # a literal without indexing (0000xxxx) or never indexed (0001xxxx)
            mask = 0x0F
        index = first & mask
        at += 1
        if index == mask:  # a multi-byte index (one _integer cannot read is hpack's)
            got = _integer(block, at - 1, mask.bit_length())
            if got is None:
                return None
            index, at = got
        if not index:
            if mask == 0x7F:
                return None  # index 0
            entry = None  # a literal name
        elif index <= _STATIC:
            entry = HeaderTable.STATIC_TABLE[index - 1]
        else:
            place = index - _STATIC - 1
            if place < fresh:
                entry = added[-1 - place]
            elif place - fresh < kept:
                entry = entries[place - fresh]
            else:
                return None  # beyond the table
        if mask == 0x7F:
            assert entry is not None  # (typing.cast is a call)
            header = _new_header(HeaderTuple, entry)  # HeaderTuple(*entry), without its Python __new__
        else:
            if entry is None:
                string = _string(block, at)
                if string is None:
                    return None
                name, at = string
            else:
                name = entry[0]
            string = _string(block, at)
            if string is None:
                return None
            value, at = string
            kind = NeverIndexedHeaderTuple if first & 0xF0 == 0x10 else HeaderTuple
            header = _new_header(kind, (name, value))
            if name in _UNIQUE:
                unique = True
            if mask == 0x3F:
                grown = 32 + len(name) + len(value)
                if grown > maxsize:
                    return None  # it empties the table
                added.append(header)
                fresh += 1
                current += grown
                while current > maxsize:
                    if not kept:
                        return None  # it evicts this block's own entries
                    kept -= 1
                    old = entries[kept]
                    current -= 32 + len(old[0]) + len(old[1])
        headers.append(header)
        inflated += 32 + len(header[0]) + len(header[1])
        if inflated > limit:
            return None
    if added:
        for name, value in added:
            table.add(name, value)
    elif size <= KEPT_BLOCK and not unique:  # (a fresh grpc-timeout's block is never seen again)
        _remember(block, (tuple(headers), inflated, _state(decoder), None))
    return headers


def _string(block: bytes, at: int) -> tuple[bytes, int] | None:
    """The string literal (RFC 7541 §5.2) at ``block[at]``, Huffman-decoded, and where it ends;
    None if it is cut off, 127 bytes or longer, or its Huffman code does not decode (hpack's)."""
    if at >= len(block):
        return None
    length = block[at]
    end = at + 1 + (length & 0x7F)
    if length & 0x7F == 0x7F or end > len(block):
        return None
    value = block[at + 1 : end]
    if length & 0x80:
        try:
            value = decode_huffman(value)
        except HPACKDecodingError:
            return None
    return value, end


def _by_fields(decoder: hpack.Decoder, block: bytes, ends: list[int]) -> Headers:
    """A block of fields that cannot touch the table (:func:`_field_ends`), field by field."""
    memo = _memo
    headers: Headers = []
    start = 0
    unique: tuple[int, int, int] | None = None  # the field of _UNIQUE: its start, end and place
    several = False
    for end in ends:
        field = block[start:end]
        kept = memo.get(field)
        if kept is not None and kept[2] is None and len(kept[0]) == 1:
            header = kept[0][0]
        else:
            if end - start > FIELD_LIMIT:
                return cast(Headers, decoder.decode(block, raw=True))
            known = _unique_field(field)  # e.g. grpc-timeout, its name seen before
            if known is not None:
                header = known
            else:
                # A field of its own decodes alike in any decoder: one that never changes does.
                try:
                    header = cast(Headers, _SCRATCH.decode(field, raw=True))[0]
                except HPACKDecodingError:  # hpack's error, in its order (a list over the limit first)
                    return cast(Headers, decoder.decode(block, raw=True))
                if header[0] in _UNIQUE:
                    _remember_unique(field, header)
                else:
                    _remember(field, ((header,), 32 + len(header[0]) + len(header[1]), None, None))
            if header[0] in _UNIQUE:
                several = unique is not None
                unique = (start, end, len(headers))
        headers.append(header)
        start = end
    inflated = sum(32 + len(name) + len(value) for name, value in headers)  # RFC 7541 §4.1
    if inflated > decoder.max_header_list_size:
        return cast(Headers, decoder.decode(block, raw=True))  # raises hpack's error
    if unique is None:
        _remember(block, (tuple(headers), inflated, None, None))
    elif not several:
        at, end, place = unique
        field = block[at:end]
        value_start = _value_start(field)
        if value_start is not None and field[: value_start - 1] in _unique_names:  # as found later
            one = headers[place]
            others = (*headers[:place], *headers[place + 1 :])
            size = inflated - 32 - len(one[0]) - len(one[1])
            _remember((at, block[:at] + block[end:]), (others, size, None, place))
    return headers
