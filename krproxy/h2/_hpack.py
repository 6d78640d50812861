"""HPACK decoding for :class:`krproxy.h2.connection.Connection`: hpack's decoder, remembering
the blocks that left its dynamic table as it was.

A gRPC peer sends the same few header blocks again and again once their fields are in its
encoder's table: a runtime's answers (``:status``, ``content-type``) and trailers
(``grpc-status: 0``) are a handful of indexed fields each. Decoding is a function of the block
and the dynamic table, so while the table stays as it was, such a block decodes to what it
decoded to before; hpack takes ~5 µs a block in Python to find that out again, a dictionary
lookup takes well under one. A block that changes the table (a literal with incremental
indexing, a size update) is never kept, and any change to the table, by whichever call,
forgets every block kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import hpack

__all__ = ["KEPT_BLOCK", "KEPT_BLOCKS", "Decoder"]

#: Largest block kept: a gRPC answer's or trailers' blocks are a few bytes once indexed.
KEPT_BLOCK = 128
#: Blocks kept at most; one more forgets them all (a peer varying its blocks gains nothing).
KEPT_BLOCKS = 64


class Decoder(hpack.Decoder):
    """``hpack.Decoder`` whose :meth:`decode` answers a block it decoded before, while the
    dynamic table is as it was then, from memory (``raw=True`` only: the relay's way)."""

    def __init__(self, max_header_list_size: int) -> None:
        super().__init__(max_header_list_size=max_header_list_size)
        self._kept: dict[bytes, tuple[tuple[bytes, bytes], ...]] = {}
        # What the kept blocks were decoded against: the table's newest entry (held here, so
        # its identity cannot be reused), its entry count and size limit.
        self._table: tuple[object, int, int] = self._state()

    def _state(self) -> tuple[object, int, int]:
        table = self.header_table
        entries = table.dynamic_entries
        return (entries[0] if entries else None, len(entries), table.maxsize)

    def decode(self, data: bytes, raw: bool = False) -> Any:
        if not raw:
            return super().decode(data, raw)
        block = bytes(data)
        before = self._state()
        if _same(before, self._table):
            kept = self._kept.get(block)
            if kept is not None:
                return list(kept)
        else:  # the table changed since the blocks were kept
            self._kept.clear()
            self._table = before
        headers: Iterable[tuple[bytes, bytes]] = super().decode(block, raw)
        if len(block) <= KEPT_BLOCK and _same(self._state(), before):
            if len(self._kept) >= KEPT_BLOCKS:
                self._kept.clear()
            self._kept[block] = tuple(headers)
        return headers


def _same(a: tuple[object, int, int], b: tuple[object, int, int]) -> bool:
    """The same table: the same newest entry *object* (an entry equal to the newest one may be
    added again, evicting the oldest), entry count and size limit."""
    return a[0] is b[0] and a[1] == b[1] and a[2] == b[2]
