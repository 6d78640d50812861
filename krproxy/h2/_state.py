"""What every part of a :class:`krproxy.h2.connection.Connection` reads and writes: its role, its
streams by id, the stream ids used on both sides, the resets it sent, and its two queues out
(bytes for the peer, events for the driver). No I/O, no rules: the parts that hold it
(:mod:`krproxy.h2._send`, :mod:`._control`, :mod:`._inflow`, :mod:`._blocks`) carry those.

The containers are never replaced (``events`` aside, handed out whole by
:meth:`Connection.next_events <krproxy.h2.connection.Connection.next_events>`), so a part may keep
a reference to ``streams`` or ``output`` to spare an attribute look-up per frame; its scalars are
read and written here, through the one ``State`` every part is given.
"""

from __future__ import annotations

from collections import deque

from krproxy.h2 import events as ev
from krproxy.h2.streams import Stream

__all__ = ["State"]


class State:
    """One connection's shared state (see the module docstring). Plain data, no methods."""

    __slots__ = (
        "events",
        "last_peer_id",
        "next_id",
        "output",
        "reset_ids",
        "reset_order",
        "server",
        "stream_window",
        "streams",
    )

    def __init__(self, *, server: bool, stream_window: int) -> None:
        #: The server role (streams opened by the peer, odd ids); else the client role.
        self.server = server
        #: The window we grant each stream (SETTINGS_INITIAL_WINDOW_SIZE, ours).
        self.stream_window = stream_window
        #: Streams not yet released by the driver, by id (:mod:`krproxy.h2.streams`).
        self.streams: dict[int, Stream] = {}
        #: The id our next stream takes (client role: odd ids).
        self.next_id = 1 if not server else 2
        #: The largest id of a stream the peer opened.
        self.last_peer_id = 0
        #: Streams we reset whose late frames are ignored (RFC 9113 §5.1), oldest first in
        #: ``reset_order`` (the sender keeps :data:`krproxy.h2._send.RESET_IDS_KEPT` of them).
        self.reset_ids: set[int] = set()
        self.reset_order: deque[int] = deque()
        #: The bytes queued for the peer: ``Connection.data_to_send`` takes them, or a driver
        #: writes from this buffer and trims it in place (one copy less per write).
        self.output = bytearray()
        #: Events of the input being read, handed out (and replaced) by ``next_events``.
        self.events: list[ev.Event] = []
