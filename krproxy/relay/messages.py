"""gRPC's length-prefixed messages in one direction of a stream, and their flow-control credit.

Shared by the served calls (request messages) and the read server streams (reply messages).
DATA payloads are fed in as they arrive; complete messages queue until the handler (or the
caller iterating a server stream) takes them. Credit follows the reader: the bytes of a
message nobody has taken yet are granted back to the sender only when the queue is taken
empty, so a reader that stops reading stops its sender after one stream window; bytes of a
message still incomplete are granted at once (a message may be larger than the window).
"""

from __future__ import annotations

from collections import deque

import trio

from krproxy.grpcstatus import GRPCError, Status
from krproxy.relay.grpc import MessageTooLarge
from krproxy.relay.half import Half


class Messages:
    """Splits DATA into messages; ``ready`` holds the complete ones as (compressed, bytes).

    ``limit``: a message whose prefix announces more raises :class:`MessageTooLarge` at once,
    before any of it is kept. A flag byte other than 0 (plain) or 1 (compressed) raises
    :class:`GRPCError` INTERNAL, as grpc-go answers it.
    """

    __slots__ = ("_need", "_partial", "limit", "ready")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._partial = bytearray()  # the start of a message not complete yet
        self._need = 5  # the bytes `_partial` must hold before it is parsed again
        self.ready: deque[tuple[bool, bytes]] = deque()

    def feed(self, data: bytes) -> None:
        partial = self._partial
        if partial:
            # Appended to until the message is complete, parsed again only then: a large
            # message arriving in many frames is copied a constant number of times.
            partial += data
            if len(partial) < self._need:
                return
            data = bytes(partial)
            partial.clear()
        offset, total = 0, len(data)
        need = 5
        while total - offset >= 5:
            flag = data[offset]
            if flag > 1:
                raise GRPCError(Status.INTERNAL, f"grpc: received unexpected payload format {flag}")
            size = int.from_bytes(data[offset + 1 : offset + 5], "big")
            if size > self.limit:
                raise MessageTooLarge(size, self.limit)
            end = offset + 5 + size
            if end > total:
                need = 5 + size
                break
            self.ready.append((flag == 1, data[offset + 5 : end]))
            offset = end
        if offset < total:
            partial += memoryview(data)[offset:]
        self._need = need

    @property
    def incomplete(self) -> bool:
        """Whether part of a message has arrived (a stream ending now ends in the middle of one)."""
        return bool(self._partial)


class Inbox:
    """The messages arriving on one half, for one reader, with the credit rule of the module
    docstring. The connection's own credit is not this class's business (see its users)."""

    __slots__ = ("_waiter", "half", "messages", "owed")

    def __init__(self, half: Half, limit: int) -> None:
        self.half = half
        self.messages = Messages(limit)
        self.owed = 0  # stream credit held back: bytes of messages not taken yet
        self._waiter: trio.Event | None = None

    def arrived(self, data: bytes) -> None:
        """DATA arrived on the half. Raises :class:`MessageTooLarge`, :class:`GRPCError`."""
        messages = self.messages
        messages.feed(data)
        if messages.ready:
            self.owed += len(data)
            waiter = self._waiter  # (wake() inline: once per DATA frame of a request)
            if waiter is not None:
                waiter.set()
                self._waiter = None
        else:
            self.half.grant_stream(len(data))

    def take(self) -> tuple[bool, bytes] | None:
        """The next complete message (compressed flag, bytes), None if none has arrived yet."""
        ready = self.messages.ready
        if not ready:
            return None
        message = ready.popleft()
        if not ready and self.owed:
            half, owed = self.half, self.owed
            self.owed = 0
            half.grant_stream(owed)
            half.ep.transport.flush()  # a reader that sends nothing would leave the grant unsent
        return message

    def take_sole(self) -> bytes | None:
        """The half's one message if it is all that arrived (uncompressed, complete, nothing after
        it), for a reader that has the whole of the half's data: its sender ended the stream, so
        the message's credit is not granted back (no WINDOW_UPDATE is due on a stream whose sender
        has ended it). None otherwise, nothing taken."""
        messages = self.messages
        ready = messages.ready
        if len(ready) != 1 or messages._partial:
            return None
        compressed, message = ready[0]
        if compressed:
            return None
        ready.clear()
        self.owed = 0
        return message

    def wake(self) -> None:
        """Something happened (a message, the end, the call's end): the reader looks again."""
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    async def wait(self) -> None:
        """Until :meth:`wake`."""
        if self._waiter is None:
            self._waiter = trio.Event()
        await self._waiter.wait()
