"""What :meth:`krproxy.h2.connection.Connection.receive_data` reports: immutable values.

Every byte handed to :meth:`~krproxy.h2.connection.Connection.send_data` is accounted for exactly
once, so that a relay can give its sender flow-control credit back: in the method's return value
(framed at once, or dropped on a stream that is over), in a later :class:`DataSent` (framed when a
window opened), or in :attr:`StreamReset.unsent` (dropped when the stream was reset). Bytes still
queued when the connection ends are the driver's to account for.
"""

from __future__ import annotations

import attrs

Headers = list[tuple[bytes, bytes]]

__all__ = [
    "ConnectionTerminated",
    "DataReceived",
    "DataSent",
    "Event",
    "GoAwayReceived",
    "HeaderBlockReceived",
    "Headers",
    "HeadersReceived",
    "PingAcked",
    "PingReceived",
    "RequestReceived",
    "SettingsAcked",
    "SettingsChanged",
    "StreamReset",
    "TrailersReceived",
]


class Event:
    """Base of the events (for type annotations)."""

    __slots__ = ()


@attrs.frozen(slots=True)
class RequestReceived(Event):
    """A peer opened a stream with a well-formed request header list (server role).

    Attributes:
        stream_id: the new stream.
        headers: the decoded fields, in order (names and values as bytes).
        end_stream: the request has no body (the stream is half-closed, remote).
        body: with ``whole_requests`` (``Connection``), the DATA frame ending the stream read
            in the same step, its event as it would have come alone (already through the
            windows and the stream's rules; its credit is the consumer's to acknowledge, as for
            any :class:`DataReceived`); None: its DATA, if any, comes in later events.
    """

    stream_id: int
    headers: Headers
    end_stream: bool
    body: DataReceived | None = None


@attrs.frozen(slots=True)
class HeadersReceived(Event):
    """A header block on a stream we opened (client role): the response's headers, or its
    trailers (``end_stream``), as the peer sent them."""

    stream_id: int
    headers: Headers
    end_stream: bool


@attrs.frozen(slots=True)
class TrailersReceived(Event):
    """A request's trailers (server role); they end the stream."""

    stream_id: int
    headers: Headers


@attrs.frozen(slots=True)
class HeaderBlockReceived(Event):
    """A header block too large to decode now (the decode budget is spent, see
    :attr:`~krproxy.h2._blocks.Blocks.decode_budget`). The connection takes no more input
    until the driver decodes it with :meth:`~krproxy.h2.connection.Connection.decode_block`
    (in a worker thread if it likes: nothing else touches the connection meanwhile) and hands
    the result to :meth:`~krproxy.h2.connection.Connection.receive_headers`. Always the last
    event of its batch."""

    stream_id: int
    block: bytes


@attrs.frozen(slots=True)
class DataReceived(Event):
    """Body bytes on a stream, padding removed. ``flow_controlled_length`` is what the frame
    counted against the windows; the padding's share is credited back at once, the data's when
    the consumer calls :meth:`~krproxy.h2.connection.Connection.acknowledge_received_data`."""

    stream_id: int
    data: bytes
    flow_controlled_length: int
    end_stream: bool


@attrs.frozen(slots=True)
class DataSent(Event):
    """Queued bytes of a stream were framed, once the peer's windows opened (``size`` of them);
    ``stream_ended``: the queued end of the stream (or its trailers) went out with them."""

    stream_id: int
    size: int
    stream_ended: bool


@attrs.frozen(slots=True)
class StreamReset(Event):
    """A stream ended abnormally: the peer reset it (``remote``), or it broke a rule on that
    stream only and we reset it (a stream error, RFC 9113 §5.4.2), or a GOAWAY left it out.

    Attributes:
        error_code: the RST_STREAM code (RFC 9113 §7).
        remote: the peer sent the RST_STREAM.
        unsent: bytes queued for it that were dropped (see the module docstring).
    """

    stream_id: int
    error_code: int
    remote: bool
    unsent: int = 0


@attrs.frozen(slots=True)
class SettingsChanged(Event):
    """The peer's SETTINGS, applied (and acknowledged): ``(identifier, value)`` in order."""

    changes: tuple[tuple[int, int], ...]


@attrs.frozen(slots=True)
class SettingsAcked(Event):
    """The peer acknowledged our SETTINGS."""


@attrs.frozen(slots=True)
class PingReceived(Event):
    """A PING, already answered."""

    payload: bytes


@attrs.frozen(slots=True)
class PingAcked(Event):
    """The answer to a PING of ours."""

    payload: bytes


@attrs.frozen(slots=True)
class GoAwayReceived(Event):
    """The peer opens no more streams (server role) or takes no more (client role).

    Attributes:
        refused: streams of ours above ``last_stream_id``, which the peer did not process:
            they are over (no RST_STREAM is sent) and safe to send again elsewhere.
    """

    last_stream_id: int
    error_code: int
    debug: bytes
    refused: tuple[int, ...] = ()


@attrs.frozen(slots=True)
class ConnectionTerminated(Event):
    """The connection is over: the peer broke HTTP/2 (a GOAWAY with ``error_code`` and the
    reason is queued for it) or stopped early. Always the last event; the connection takes no
    more input."""

    error_code: int
    reason: str
