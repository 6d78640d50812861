"""Header blocks received by a :class:`krproxy.h2.connection.Connection` (RFC 9113 §4.3, §8; RFC
7541): a block gathered from HEADERS and CONTINUATION frames, decoded with the connection's HPACK
state, and what it does — a request opening a peer's stream, its trailers, an answer's headers
and trailers. A :class:`Blocks` holds the HPACK decoder, the block being gathered, the decode
budget and a block handed out for the driver to decode. No I/O.

A block past :data:`MAX_HEADER_BLOCK` is read for the HPACK state only
(:mod:`krproxy.h2.hpackskim`) and resets its stream (FRAME_SIZE_ERROR). Blocks are decoded here
while :attr:`Blocks.decode_budget` lasts; beyond it, a block is handed out whole
(:class:`~krproxy.h2.events.HeaderBlockReceived`) and input waits until the driver feeds the
decoded fields back (``Connection.receive_headers``).
"""

from __future__ import annotations

import hpack
import hpack.exceptions

from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2 import hpackmemo
from krproxy.h2._control import Control
from krproxy.h2._send import Sender
from krproxy.h2._state import State
from krproxy.h2.hpackskim import Skimmer
from krproxy.h2.streams import Stream

__all__ = ["ADVERTISED_HEADER_LIST", "MAX_HEADER_BLOCK", "MAX_HEADER_LIST", "SELF_DEPENDENT", "Blocks"]

Headers = ev.Headers

#: Largest header block (with CONTINUATIONs) decoded from a peer; one beyond resets its stream.
MAX_HEADER_BLOCK = 1024 * 1024
#: SETTINGS_MAX_HEADER_LIST_SIZE we advertise: a block within it fits MAX_HEADER_BLOCK, and grpc-go
#: resets a stream over it rather than send it (docs/security.md, "Header list limits, per side").
ADVERTISED_HEADER_LIST = MAX_HEADER_BLOCK - 16_384
#: Largest decoded header list (grpc-go's server default); beyond: COMPRESSION_ERROR, hpack stops.
MAX_HEADER_LIST = 16 * 1024 * 1024
#: A private flag on a header block: its HEADERS frame made the stream depend on itself.
SELF_DEPENDENT = 0x100


class Blocks:
    """Header blocks in: gathered, decoded (here or by the driver), and acted on."""

    def __init__(
        self,
        state: State,
        sender: Sender,
        control: Control,
        *,
        check_request_headers: bool,
        max_concurrent_streams: int | None,
    ) -> None:
        self.state = state
        self.sender = sender
        self.control = control
        self.server = state.server
        self.streams = state.streams  # the state's (never replaced)
        self.check_request_headers = check_request_headers
        self.max_concurrent_streams = max_concurrent_streams
        self.decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)  # through hpackmemo.decode
        #: Bytes of header blocks decoded here before one is handed out
        #: (:class:`~krproxy.h2.events.HeaderBlockReceived`); None: no limit. The driver sets it.
        self.decode_budget: int | None = None
        #: The block being gathered: (stream id, first frame's flags, fragments or a Skimmer).
        self.continuation: tuple[int, int, bytearray | Skimmer] | None = None
        #: A block handed out, awaiting its fields: (stream id, flags).
        self.deferred: tuple[int, int] | None = None

    def decode_block(self, block: bytes) -> Headers | f.ProtocolError:
        """The fields of a block handed out by :class:`~krproxy.h2.events.HeaderBlockReceived`,
        decoded with the connection's HPACK state, or the COMPRESSION_ERROR it is. Safe in a
        worker thread while nothing else touches the connection."""
        try:
            return hpackmemo.decode(self.decoder, block)
        except (hpack.exceptions.HPACKError, IndexError, ValueError) as err:
            return f.ProtocolError(f"undecodable header block: {err}", f.COMPRESSION_ERROR)

    def on_continuation(self, stream_id: int, flags: int, payload: bytes) -> None:
        if self.continuation is None or self.continuation[0] != stream_id:
            raise f.ProtocolError("CONTINUATION without a header block to continue")
        _, first_flags, block = self.continuation
        if isinstance(block, bytearray) and len(block) + len(payload) <= MAX_HEADER_BLOCK:
            block += payload
        else:  # over MAX_HEADER_BLOCK: read for the HPACK state only (krproxy.h2.hpackskim)
            block = self._skim(stream_id, first_flags, block, payload)
        if flags & f.END_HEADERS:
            self.continuation = None
            if isinstance(block, Skimmer):
                self._on_oversized_block(stream_id, block)
            else:
                self.block(stream_id, first_flags, bytes(block))

    def block(self, stream_id: int, flags: int, block: bytes) -> None:
        """A whole header block arrived: decode it here, or hand it out (decode_budget)."""
        if self.decode_budget is not None:
            self.decode_budget -= len(block)
            if self.decode_budget < 0:
                self.deferred = (stream_id, flags)
                self.state.events.append(ev.HeaderBlockReceived(stream_id, block))
                return
        try:  # decode_block's work, without its result's isinstance test (once per block)
            headers = hpackmemo.decode(self.decoder, block)
        except (hpack.exceptions.HPACKError, IndexError, ValueError) as err:
            raise f.ProtocolError(f"undecodable header block: {err}", f.COMPRESSION_ERROR) from None
        if self.server:
            self.on_block(stream_id, flags, headers)
        else:
            self._on_answer_block(self.streams.get(stream_id), headers, bool(flags & f.END_STREAM))

    def on_block(self, stream_id: int, flags: int, headers: Headers) -> None:
        """The decoded fields of a block on ``stream_id`` (``flags``: its HEADERS frame's)."""
        end = bool(flags & f.END_STREAM)
        stream = self.streams.get(stream_id)
        if not self.server:
            self._on_answer_block(stream, headers, end)
            return
        if stream is None:
            self._open_peer_stream(stream_id, flags, headers, end)
            return
        if stream.reset:
            return
        if stream.recv_ended:  # half-closed (remote): a stream error (RFC 9113 §5.1)
            self.control.stream_error(stream_id, f.STREAM_CLOSED)
            return
        stream.recv_ended = end
        if not end:
            raise f.ProtocolError(f"second header block on stream {stream_id} without END_STREAM")
        problem = f.request_header_problem(headers, trailers=True) if self.check_request_headers else None
        if problem is not None or stream.expect:  # malformed, or DATA short of content-length
            self.control.stream_error(stream_id, f.PROTOCOL_ERROR)
            return
        self.state.events.append(ev.TrailersReceived(stream_id, headers))

    def _open_peer_stream(self, stream_id: int, flags: int, headers: Headers, end: bool) -> None:
        if not self._take_peer_stream_id(stream_id):
            return  # we reset it: frames already on their way are ignored (§5.1)
        limit = self.max_concurrent_streams
        sender = self.sender
        if sender.goaway_state == "final" or (limit is not None and len(self.streams) >= limit):
            # Above the last id of our GOAWAY, or beyond the streams we advertised: not
            # processed, so the caller may send it again (elsewhere).
            sender.send_reset(stream_id, f.REFUSED_STREAM)
            return
        if flags & SELF_DEPENDENT:
            problem: str | None = "it depends on itself"
        elif self.check_request_headers:
            problem = f.request_header_problem(headers)
        else:
            problem = None
        length = None if problem is not None else f.content_length(headers)
        if end and length:
            problem = f"content-length {length} but no DATA"
        if problem is not None:  # malformed (RFC 9113 §8.1.1): a stream error
            sender.send_reset(stream_id, f.PROTOCOL_ERROR)
            return
        stream = Stream(stream_id, sender.peer_initial_window, self.state.stream_window)
        stream.headers_received = True
        stream.recv_ended = end
        stream.expect = length
        self.streams[stream_id] = stream
        self.state.events.append(ev.RequestReceived(stream_id, headers, end))

    def _on_answer_block(self, stream: Stream | None, headers: Headers, end: bool) -> None:
        """A header block on a stream of ours (client role): the answer's headers, then its
        trailers (END_STREAM). A second block without END_STREAM is malformed (RFC 9113 §8.1),
        that stream's error, not a second answer (no 1xx answers: gRPC sends none)."""
        if stream is None or stream.recv_ended or stream.reset:
            return
        if stream.headers_received and not end:
            self.control.stream_error(stream.id, f.PROTOCOL_ERROR)
            return
        stream.recv_ended = end
        stream.headers_received = True
        self.state.events.append(ev.HeadersReceived(stream.id, headers, end))

    def _skim(self, stream_id: int, flags: int, block: bytearray | Skimmer, payload: bytes) -> Skimmer:
        """A header block past what we decode: from now on read for the HPACK state only."""
        if isinstance(block, bytearray):
            skimmer = Skimmer(self.decoder)
            skimmer.feed(bytes(block))
            self.continuation = (stream_id, flags, skimmer)
            block = skimmer
        block.feed(payload)
        return block

    def _on_oversized_block(self, stream_id: int, skimmer: Skimmer) -> None:
        """A header block over what we decode ended (its HPACK state taken in): that stream is
        reset with FRAME_SIZE_ERROR, as grpc-go resets a stream whose header list is over its
        limit; a request's stream is never opened. Stream id rules as for any block."""
        skimmer.finish()
        if self.server and stream_id not in self.streams:
            if self._take_peer_stream_id(stream_id):
                self.sender.send_reset(stream_id, f.FRAME_SIZE_ERROR)
            return
        self.control.stream_error(stream_id, f.FRAME_SIZE_ERROR)

    def _take_peer_stream_id(self, stream_id: int) -> bool:
        """A caller's header block opens ``stream_id`` (server role): True if it is the next one
        of theirs, False for a stream we reset (frames already on their way are ignored, §5.1);
        a connection error otherwise (odd ids only, never lower nor reused, RFC 9113 §5.1.1)."""
        if stream_id % 2 == 0:
            raise f.ProtocolError(f"caller opened even stream {stream_id}")
        state = self.state
        if stream_id <= state.last_peer_id:
            if stream_id in state.reset_ids:
                return False
            raise f.ProtocolError(
                f"HEADERS opening stream {stream_id}, not above stream {state.last_peer_id}"
                " (stream ids are never lower nor reused, RFC 9113 §5.1.1)"
            )
        state.last_peer_id = stream_id
        return True
