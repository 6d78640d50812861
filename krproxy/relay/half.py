"""One stream of a call (:class:`Half`) and the one interface every call kind offers its halves
(:class:`CallSide`): a half hands its frames to its call kind and tells its call's state how the
stream ends (:attr:`Half.state`).

Flow control: a *stream's* credit is granted back to its sender only once its bytes were
written towards the other side, within that side's window, so a slow reader slows down its own
stream's writer and the relay holds at most one stream window of data per stream. The credit of
an *upstream connection* (shared by every caller) is granted back as soon as its bytes are
buffered here: a caller that stops reading holds up its own streams only, never the runtime
connection's window that every other caller needs. A caller's connection credit stays end to
end (its requests wait for the runtime's windows, not our memory).

A half's protocol state is the core's :class:`~krproxy.h2.streams.Stream` (``half.s``); the
calls (:mod:`krproxy.relay.rpc`) read it there on their hot path, not through properties.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from krproxy.h2.connection import STREAM_WINDOW
from krproxy.h2.streams import Stream

if TYPE_CHECKING:
    from krproxy.relay.connection import Endpoint
    from krproxy.relay.exchange import Exchange, Reading
    from krproxy.relay.served import Served
    from krproxy.relay.state import CallState

__all__ = ["CallSide", "Half", "Headers"]

Headers = list[tuple[bytes, bytes]]


class CallSide(Protocol):
    """What a stream's frames are handed to: the interface of every call kind of the transport.

    Five kinds implement it, each a plain class of its own: a relayed call
    (:class:`~krproxy.relay.call.Call`), an intercepted one (:class:`~krproxy.relay.intercepted.LocalCall`),
    a served one (:class:`~krproxy.relay.served.Served`), a unary call of our own
    (:class:`~krproxy.relay.exchange.Exchange`) and a server stream read message by message
    (:class:`~krproxy.relay.exchange.Reading`). A caller's half gets the ``on_request_*`` steps, an
    upstream half the ``on_reply_*`` steps. How a stream ends is told to its half's
    :attr:`Half.state` instead (``settle``, ``caller_gone``, ``upstream_gone``): the
    :class:`~krproxy.relay.state.CallState` a call of a caller's holds, or a stream of our own.
    """

    def on_request_data(self, data: bytes, end: bool) -> None: ...
    def on_request_trailers(self, headers: Headers) -> None: ...
    def on_reply_headers(self, headers: Headers, end: bool) -> None: ...
    def on_reply_data(self, data: bytes, end: bool) -> None: ...


class _Over:
    """What a half reports to once its call is over (see :meth:`Half.release`): nothing."""

    finished = True
    backend_clock = 0.0

    def on_request_data(self, data: bytes, end: bool) -> None:
        pass

    def on_request_trailers(self, headers: Headers) -> None:
        pass

    def on_reply_headers(self, headers: Headers, end: bool) -> None:
        pass

    def on_reply_data(self, data: bytes, end: bool) -> None:
        pass

    def caller_gone(self) -> None:
        pass

    def upstream_gone(self, reason: str, refused: bool = False, reset_code: int | None = None) -> None:
        pass

    def settle(self) -> None:
        pass


_OVER = _Over()


class Half:
    """One side of a relayed call: a stream on one connection.

    Its protocol state (windows, queued data, ends) is the core's :class:`~krproxy.h2.streams.Stream`,
    shared: the connection's own once the stream is open, a stream of its own while an upstream
    half waits for a slot (what is queued on it goes out when it starts)."""

    __slots__ = ("call", "ep", "opened", "peer", "s", "state")

    def __init__(
        self, ep: Endpoint, stream_id: int, call: CallSide, state: CallState | Exchange | Reading
    ) -> None:
        self.ep = ep
        #: Handed this stream's frames: the call kind (:class:`CallSide`).
        self.call = call
        #: Told how this stream ends (``settle``, ``caller_gone``, ``upstream_gone``) and read for
        #: ``finished``, ``backend_clock``: a caller's call's :class:`~krproxy.relay.state.CallState`,
        #: or a stream of our own (an ``Exchange``, a ``Reading``), which is its own state.
        self.state: CallState | Exchange | Reading | _Over = state
        #: Told of bytes queued here once they are written (or dropped): the paired half, whose
        #: sender gets flow-control credit back, or a served call waiting for room to send.
        self.peer: Half | Served | None = None
        stream = ep.h2.streams.get(stream_id) if stream_id else None
        self.opened = stream is not None
        self.s = stream if stream is not None else Stream(stream_id, 0, STREAM_WINDOW)

    # The stream's state, as the calls read (and mark) it.

    @property
    def id(self) -> int:
        return self.s.id

    @property
    def reset(self) -> bool:
        return self.s.reset

    @reset.setter
    def reset(self, value: bool) -> None:
        # The call is over without an RST_STREAM of ours (refused, or its connection lost).
        self.s.reset = value

    @property
    def recv_ended(self) -> bool:
        return self.s.recv_ended

    @recv_ended.setter
    def recv_ended(self, value: bool) -> None:
        self.s.recv_ended = value

    @property
    def send_ended(self) -> bool:
        return self.s.send_ended

    @property
    def headers_sent(self) -> bool:
        return self.s.headers_sent

    @property
    def pending(self) -> bytearray:
        return self.s.pending

    @property
    def done(self) -> bool:
        return self.s.done

    # -- sending towards this half's peer connection ---------------------------------------

    def send_data(self, data: bytes, end: bool) -> None:
        """Queue ``data`` (from the paired half) and send what the windows allow."""
        s = self.s
        over = s.reset or s.send_ended  # a variable: the send below may end it (no narrowing)
        if over:
            if self.peer is not None:
                self.peer.grant(len(data))
            return
        ep = self.ep
        if not self.opened:  # waiting for a slot: queued until it starts
            s.pending += data
            ep.waiting_held += len(data)
            if end:
                s.end_pending = True
            return
        taken = ep.h2.send_data(s.id, data, end)
        if not ep.dirty:
            ep.touch()
        if taken and self.peer is not None:
            self.peer.grant(taken)
        if ep.server_side and not ep.dirty and ep.h2.sender.buffered > ep.max_held:
            ep.mark_dirty()  # try_send closes it
        if s.send_ended:
            self.state.settle()

    def send_trailers(self, block: bytes) -> None:
        """Send a header block ending the stream, after any data still queued."""
        s = self.s
        over = s.reset or s.send_ended  # a variable: the send below may end it (no narrowing)
        if over:
            return
        if not self.opened:
            s.trailers_pending = block
            return
        ep = self.ep
        sent = ep.h2.send_trailers(s.id, block)
        if not ep.dirty:
            ep.touch()
        if sent and self.peer is not None:
            self.peer.grant(sent)
        if s.send_ended or s.reset:  # reset: over the peer's header list limit
            self.state.settle()

    def send_headers(self, block: bytes, end: bool) -> None:
        """Send response (or request) headers at once; they are not flow controlled."""
        s = self.s
        if s.reset or s.send_ended:
            return
        ep = self.ep
        ep.h2.send_headers(s.id, block, end)
        if not ep.dirty:
            ep.touch()
        if end or s.reset:  # reset: over the peer's header list limit
            self.state.settle()

    # -- receiving: give flow-control credit back ------------------------------------------

    def grant(self, size: int) -> None:
        """``size`` bytes received on this half were passed on: let its sender send more.

        On a caller's connection that is connection credit too; an upstream connection got
        its credit back when the bytes arrived (see the module docstring)."""
        ep = self.ep
        ep.h2.acknowledge_received_data(self.s.id, size)
        if not ep.dirty:
            ep.touch()

    def grant_stream(self, size: int) -> None:
        """Stream credit only, for a reader of our own that gave the connection's credit back on
        arrival and gives the stream's once its messages are taken (:mod:`krproxy.rpc`)."""
        self.ep.h2.acknowledge_stream_data(self.s.id, size)
        self.ep.touch()

    def drop_pending(self) -> None:
        """Discard what is still queued here (data, its end, trailers), granting the data back to
        its sender (the paired half's connection), whose window would otherwise shrink for good."""
        s = self.s
        if self.opened:
            dropped = self.ep.h2.abandon_output(s.id)
        else:
            dropped = len(s.pending)
            self.ep.waiting_held -= dropped
            s.pending.clear()
            s.end_pending = False
            s.trailers_pending = None
        if dropped and self.peer is not None:
            self.peer.grant(dropped)

    def release(self) -> None:
        """The call is over: drop the references between this half, its call and its peer, so
        that their memory goes at once (reference counting), not at a full garbage collection."""
        self.call = self.state = _OVER
        self.peer = None
        self.s.trailers_pending = None

    def abort(self, code: int) -> None:
        """Reset this stream (RST_STREAM) unless it is over already."""
        if self.s.done:
            return
        ep = self.ep
        if self.opened and not ep.closed:
            dropped = ep.h2.reset_stream(self.s.id, code)
            ep.touch()
            if dropped and self.peer is not None:
                self.peer.grant(dropped)
            return
        self.drop_pending()
        self.s.reset = True
