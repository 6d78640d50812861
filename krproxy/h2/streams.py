"""One HTTP/2 stream's state inside a :class:`krproxy.h2.connection.Connection`.

A stream is created when it opens (a peer's HEADERS, or :meth:`Connection.start_stream`) and
stays in the connection's table until the driver releases it
(:meth:`Connection.release_stream`), closed or not: it counts against the stream limits until
then, so resets (ours or the peer's) never free a slot while work for the stream still runs
(Rapid Reset, MadeYouReset).

States (RFC 9113 §5.1) are kept as three flags: ``recv_ended`` (half-closed remote),
``send_ended`` (half-closed local), ``reset``; closed is ``reset`` or both ends.
"""

from __future__ import annotations

__all__ = ["Stream"]


class Stream:
    """One stream's windows, queued output and ends. Plain mutable state owned by its connection."""

    __slots__ = (
        "end_pending",
        "expect",
        "headers_received",
        "headers_sent",
        "id",
        "pending",
        "recv_ended",
        "recv_window",
        "reset",
        "send_ended",
        "send_window",
        "to_grant",
        "trailers_pending",
    )

    def __init__(self, stream_id: int, send_window: int, recv_window: int) -> None:
        self.id = stream_id
        #: What the peer lets us send on it (its SETTINGS_INITIAL_WINDOW_SIZE and WINDOW_UPDATEs).
        self.send_window = send_window
        #: What we let the peer send on it; below zero is the peer's FLOW_CONTROL_ERROR.
        self.recv_window = recv_window
        #: Credit taken by the consumer, not yet sent back in a WINDOW_UPDATE.
        self.to_grant = 0
        #: Data queued beyond the windows, sent as they open.
        self.pending = bytearray()
        self.end_pending = False
        #: A header block ending the stream, sent after the queued data.
        self.trailers_pending: bytes | None = None
        self.headers_sent = False
        self.headers_received = False
        self.recv_ended = False
        self.send_ended = False
        self.reset = False
        #: Request bytes still due by the peer's content-length (None: it sent none).
        self.expect: int | None = None

    @property
    def done(self) -> bool:
        """Closed (RFC 9113 §5.1): reset, or ended both ways."""
        return self.reset or (self.send_ended and self.recv_ended)

    def __repr__(self) -> str:
        return (
            f"<Stream {self.id} send_window={self.send_window} recv_window={self.recv_window}"
            f" pending={len(self.pending)} recv_ended={self.recv_ended}"
            f" send_ended={self.send_ended} reset={self.reset}>"
        )
