"""The plugin client's HTTP/2 end (krproxy.hooks.h2), driven by bytes: what it writes, and what it makes of
scripted answers, broken ones included. No sockets: a transport that records writes stands in.
(tests/integration/test_hooks_h2.py runs it against grpcio and grpclib servers.)"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator

import hpack
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from krproxy.hooks import h2
from krproxy.hooks.h2 import ClientConnection, PluginProtocolError

PATH = "/runtime.v1alpha1.RuntimeHookService/PreCreateContainerHook"
RESPONSE = h2.header_block((b":status", b"200"), (b"content-type", b"application/grpc"))
OK = h2.header_block((b"grpc-status", b"0"))


class RecordingTransport(asyncio.Transport):
    """Keeps what is written; closing only sets a flag."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing


def parse(data: bytes | bytearray) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of every frame in ``data`` (after a client preface, if any)."""
    if data.startswith(h2.PREFACE):
        data = data[len(h2.PREFACE) :]
    frames = []
    while data:
        high, low, kind, flags, stream_id = struct.unpack_from(">BHBBL", data)
        size = high << 16 | low
        frames.append((kind, flags, stream_id, bytes(data[9 : 9 + size])))
        data = data[9 + size :]
    return frames


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.SelectorEventLoop()
    yield loop
    loop.close()


class Peer:
    """A client connection on a recording transport, and helpers to play the plugin's side."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = RecordingTransport()
        self.connection = ClientConnection(loop)
        self.connection.connection_made(self.transport)
        self.transport.written.clear()  # the preface, SETTINGS and WINDOW_UPDATE: see test_opening

    def call(self, message: bytes = b"req", path: str = PATH) -> h2._Call:
        block = h2.header_block((b":method", b"POST"), (b":path", path.encode()))
        return self.connection.start(block, message)

    def feed(self, *frames: bytes, chunk: int = 0) -> None:
        data = b"".join(frames)
        for i in range(0, len(data), chunk or len(data) or 1):
            self.connection.data_received(data[i : i + (chunk or len(data))])

    def written(self) -> list[tuple[int, int, int, bytes]]:
        frames = parse(self.transport.written)
        self.transport.written.clear()
        return frames

    def answer(self, stream_id: int, message: bytes) -> None:
        self.feed(
            h2.frame(h2.HEADERS, h2.END_HEADERS, stream_id, RESPONSE),
            h2.frame(h2.DATA, 0, stream_id, h2.grpc_message(message)),
            h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, stream_id, OK),
        )


@pytest.fixture
def peer(loop: asyncio.AbstractEventLoop) -> Peer:
    return Peer(loop)


def outcome(call: h2._Call) -> bytes | BaseException:
    assert call.future.done()
    return call.future.exception() or call.future.result()


class TestRequest:
    def test_opening(self, loop: asyncio.AbstractEventLoop) -> None:
        """The connection opens with the preface, SETTINGS (no push, a 4 MiB stream window) and a WINDOW_UPDATE
        raising the connection's window to 4 MiB."""
        transport = RecordingTransport()
        ClientConnection(loop).connection_made(transport)

        assert transport.written.startswith(h2.PREFACE)
        settings, update = parse(transport.written)
        assert (h2.SETTINGS, 0, 0) == settings[:3]
        values = dict(struct.iter_unpack(">HL", settings[3]))
        assert {h2.ENABLE_PUSH: 0, h2.INITIAL_WINDOW_SIZE: h2.RECV_WINDOW} == {
            k: v for k, v in values.items() if k != h2.MAX_HEADER_LIST_SIZE
        }
        assert (h2.WINDOW_UPDATE, 0, 0, struct.pack(">L", h2.RECV_WINDOW - 65535)) == update

    def test_one_write_of_headers_and_data(self, peer: Peer) -> None:
        """A call is HEADERS then one DATA frame with END_STREAM and the gRPC prefix, in a single write; odd
        stream ids, counting up."""
        peer.call(b"hello")
        peer.call(b"again")

        frames = peer.written()
        assert [(h2.HEADERS, h2.END_HEADERS, 1), (h2.DATA, h2.END_STREAM, 1)] == [f[:3] for f in frames[:2]]
        assert h2.grpc_message(b"hello") == frames[1][3]
        assert [3, 3] == [f[2] for f in frames[2:]]
        headers = dict(hpack.Decoder().decode(frames[0][3], raw=True))
        assert PATH.encode() == headers[b":path"]

    def test_channel_header_block(self) -> None:
        """The channel's header block: POST, the method path, te: trailers, the gRPC content type and the
        remaining time as grpc-timeout."""
        channel = h2.PluginChannel("/nonexistent")
        headers = dict(hpack.Decoder().decode(channel._head(PATH, 2.5), raw=True))

        assert b"POST" == headers[b":method"]
        assert PATH.encode() == headers[b":path"]
        assert b"trailers" == headers[b"te"]
        assert b"application/grpc+proto" == headers[b"content-type"]
        assert b"2500m" == headers[b"grpc-timeout"]

    def test_flow_control_and_frame_size(self, peer: Peer) -> None:
        """DATA never exceeds the stream's window or the peer's frame size; the rest follows the WINDOW_UPDATE."""
        settings = struct.pack(">HL", h2.INITIAL_WINDOW_SIZE, 20_000)
        peer.feed(h2.frame(h2.SETTINGS, 0, 0, settings))
        assert [(h2.SETTINGS, h2.ACK, 0, b"")] == peer.written()
        message = bytes(range(256)) * 100  # 25,600 bytes

        call = peer.call(message)
        sent = peer.written()[1:]
        assert [16_384, 20_000 - 16_384] == [len(f[3]) for f in sent]
        assert [0, 0] == [f[1] for f in sent]

        peer.feed(h2.frame(h2.WINDOW_UPDATE, 0, call.id, struct.pack(">L", 10_000)))
        rest = peer.written()
        assert [(h2.DATA, h2.END_STREAM, call.id)] == [f[:3] for f in rest]
        assert h2.grpc_message(message) == b"".join(f[3] for f in sent + rest)

    def test_connection_window_limits_too(self, peer: Peer) -> None:
        """A request larger than the connection's initial 65,535-byte window waits for a connection-level
        WINDOW_UPDATE, whatever the stream's window."""
        peer.feed(h2.frame(h2.SETTINGS, 0, 0, struct.pack(">HL", h2.INITIAL_WINDOW_SIZE, 1 << 20)))
        peer.written()
        message = b"x" * 70_000
        peer.call(message)
        assert 65_535 == sum(len(f[3]) for f in peer.written() if f[0] == h2.DATA)

        peer.feed(h2.frame(h2.WINDOW_UPDATE, 0, 0, struct.pack(">L", 100_000)))
        rest = peer.written()
        assert 70_005 - 65_535 == sum(len(f[3]) for f in rest)
        assert h2.END_STREAM == rest[-1][1]


class TestAnswer:
    def test_answer(self, peer: Peer) -> None:
        """Headers, one message, trailers with grpc-status 0: the message; the stream is gone, nothing reset."""
        call = peer.call()
        peer.written()

        peer.answer(call.id, b"answer")

        assert b"answer" == outcome(call)
        assert {} == peer.connection.streams
        assert [] == peer.written()

    def test_byte_by_byte_with_continuation_and_padding(self, peer: Peer) -> None:
        """An answer split into single bytes, its header block continued and its DATA padded, reads the same."""
        call = peer.call()
        block = RESPONSE + h2.header_block((b"x-long", b"v" * 100))
        padded = bytes((3,)) + h2.grpc_message(b"answer") + b"\0\0\0"

        peer.feed(
            h2.frame(h2.HEADERS, 0, call.id, block[:10]),
            h2.frame(h2.CONTINUATION, h2.END_HEADERS, call.id, block[10:]),
            h2.frame(h2.DATA, h2.PADDED, call.id, padded),
            h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, call.id, OK),
            chunk=1,
        )

        assert b"answer" == outcome(call)

    def test_huffman_and_dynamic_table(self, peer: Peer) -> None:
        """Header blocks from a real HPACK encoder (Huffman coding, indexed fields) decode."""
        encoder = hpack.Encoder()
        calls = [peer.call(), peer.call()]
        for call in calls:
            peer.feed(
                h2.frame(h2.HEADERS, h2.END_HEADERS, call.id, encoder.encode(RESPONSE_FIELDS)),
                h2.frame(h2.DATA, 0, call.id, h2.grpc_message(b"a")),
                h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, call.id, encoder.encode(OK_FIELDS)),
            )

        assert [b"a", b"a"] == [outcome(call) for call in calls]

    def test_receive_window_granted_back(self, peer: Peer) -> None:
        """A 3 MB answer: WINDOW_UPDATEs for the stream and the connection once half the window is used."""
        call = peer.call()
        peer.written()
        data = h2.grpc_message(b"z" * 3_000_000)
        frames = [h2.frame(h2.HEADERS, h2.END_HEADERS, call.id, RESPONSE)]
        frames += [h2.frame(h2.DATA, 0, call.id, data[i : i + 16_384]) for i in range(0, len(data), 16_384)]
        frames.append(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, call.id, OK))

        peer.feed(*frames)

        assert 3_000_000 == len(outcome(call))  # type: ignore[arg-type]
        updates = [f for f in peer.written() if f[0] == h2.WINDOW_UPDATE]
        assert {0, call.id} == {f[2] for f in updates}

    @pytest.mark.parametrize(
        ("status", "message", "expected"),
        [
            (b"14", b"busy%20now", GRPCError(Status.UNAVAILABLE, "busy now")),
            (b"13", None, GRPCError(Status.INTERNAL)),
            (b"99", None, GRPCError(Status.UNKNOWN, "Invalid grpc-status: '99'")),
        ],
    )
    def test_trailers_only_status(
        self, peer: Peer, status: bytes, message: bytes | None, expected: GRPCError
    ) -> None:
        """A trailers-only answer carries the status; grpc-message is percent-decoded."""
        call = peer.call()
        fields = [(b":status", b"200"), (b"grpc-status", status)]
        if message is not None:
            fields.append((b"grpc-message", message))

        peer.feed(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, call.id, h2.header_block(*fields)))

        error = outcome(call)
        assert isinstance(error, GRPCError)
        assert (expected.status, expected.message) == (error.status, error.message)

    def test_http_status_mapped(self, peer: Peer) -> None:
        """A non-200 :status becomes gRPC's status for it (404: UNIMPLEMENTED); the stream is reset."""
        call = peer.call()
        peer.written()

        peer.feed(h2.frame(h2.HEADERS, h2.END_HEADERS, call.id, h2.header_block((b":status", b"404"))))

        error = outcome(call)
        assert isinstance(error, GRPCError)
        assert (Status.UNIMPLEMENTED, "Received :status = '404'") == (error.status, error.message)
        assert [(h2.RST_STREAM, 0, call.id, struct.pack(">L", h2.CANCEL))] == peer.written()

    @pytest.mark.parametrize(
        ("frames", "expected"),
        [
            ([(h2.HEADERS, 0, h2.header_block((b":status", b"200")))], "Missing content-type header"),
            (
                [(h2.HEADERS, 0, h2.header_block((b":status", b"200"), (b"content-type", b"text/html")))],
                "Invalid content-type: 'text/html'",
            ),
            ([(h2.DATA, 0, h2.grpc_message(b"a"))], "DATA before the response headers"),
            (
                [(h2.HEADERS, 0, RESPONSE), (h2.DATA, h2.END_STREAM, h2.grpc_message(b"a"))],
                "without trailers",
            ),
            ([(h2.HEADERS, 0, RESPONSE), (h2.HEADERS, 0, OK)], "trailers that do not end the stream"),
            ([(h2.HEADERS, 0, RESPONSE), (h2.HEADERS, h2.END_STREAM, OK)], "carried no message"),
            (
                [(h2.HEADERS, 0, RESPONSE), (h2.DATA, 0, b"\x01" + h2.grpc_message(b"a")[1:])],
                "is compressed",
            ),
            (
                [(h2.HEADERS, 0, RESPONSE), (h2.DATA, 0, h2.grpc_message(b"a") * 2)],
                "not one whole message",
            ),
            ([(h2.HEADERS, 0, RESPONSE), (h2.DATA, 0, b"\0\0\0\0\x09abc")], "not one whole message"),
            (
                [(h2.HEADERS, 0, RESPONSE), (h2.HEADERS, h2.END_STREAM, h2.header_block((b"x", b"y")))],
                "Missing grpc-status header",
            ),
        ],
    )
    def test_broken_answers(self, peer: Peer, frames: list[tuple[int, int, bytes]], expected: str) -> None:
        """Answers that break gRPC's framing fail the call, naming what was wrong; other calls go on."""
        call, other = peer.call(), peer.call()
        needs_trailers = frames[-1][0] == h2.DATA and not frames[-1][1] & h2.END_STREAM
        for kind, flags, payload in frames:
            extra = h2.END_HEADERS if kind == h2.HEADERS else 0
            peer.feed(h2.frame(kind, flags | extra, call.id, payload))
        if needs_trailers:
            peer.feed(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, call.id, OK))

        error = outcome(call)
        assert isinstance(error, (GRPCError, PluginProtocolError))
        assert expected in str(error.message if isinstance(error, GRPCError) else error)
        peer.answer(other.id, b"fine")
        assert b"fine" == outcome(other)

    def test_oversized_answer(self, peer: Peer) -> None:
        """An answer beyond MAX_MESSAGE fails the call and resets the stream, before it is all buffered."""
        call = peer.call()
        peer.written()
        peer.feed(h2.frame(h2.HEADERS, h2.END_HEADERS, call.id, RESPONSE))
        chunk = h2.frame(h2.DATA, 0, call.id, b"\0" * 16_384)

        for _ in range(h2.MAX_MESSAGE // 16_384 + 1):
            peer.feed(chunk)

        error = outcome(call)
        assert isinstance(error, PluginProtocolError)
        assert "larger than" in str(error)
        assert (h2.RST_STREAM, call.id) in {(f[0], f[2]) for f in peer.written()}


class TestStreamsAndConnection:
    def test_reset_by_the_plugin(self, peer: Peer) -> None:
        """RST_STREAM fails that call (grpclib's wording), and only that one."""
        call, other = peer.call(), peer.call()

        peer.feed(h2.frame(h2.RST_STREAM, 0, call.id, struct.pack(">L", h2.CANCEL)))

        error = outcome(call)
        assert isinstance(error, StreamTerminatedError)
        assert "Stream reset by remote party, error_code: CANCEL" == str(error)
        assert not other.future.done()

    def test_cancel_resets(self, peer: Peer) -> None:
        """A caller that stops waiting resets its stream (CANCEL); a late answer is ignored."""
        call = peer.call()
        peer.written()

        peer.connection.cancel(call)
        peer.answer(call.id, b"late")

        assert [(h2.RST_STREAM, 0, call.id, struct.pack(">L", h2.CANCEL))] == peer.written()
        assert not call.future.done()

    def test_goaway(self, peer: Peer) -> None:
        """GOAWAY: calls above the last stream id fail at once, those below still get their answer, no new
        calls go on this connection, and it closes when the last call ends."""
        first, second = peer.call(), peer.call()

        peer.feed(h2.frame(h2.GOAWAY, 0, 0, struct.pack(">LL", first.id, h2.NO_ERROR)))

        error = outcome(second)
        assert isinstance(error, StreamTerminatedError)
        assert "GOAWAY NO_ERROR" in str(error)
        assert not peer.connection.usable
        assert not peer.transport.closing
        peer.answer(first.id, b"done")
        assert b"done" == outcome(first)
        assert peer.transport.closing

    def test_ping_and_settings_acknowledged(self, peer: Peer) -> None:
        """PING is answered with the same payload; SETTINGS with an ACK."""
        peer.feed(h2.frame(h2.PING, 0, 0, b"12345678"), h2.frame(h2.SETTINGS, 0, 0))

        assert [(h2.PING, h2.ACK, 0, b"12345678"), (h2.SETTINGS, h2.ACK, 0, b"")] == peer.written()

    def test_max_concurrent_streams(self, peer: Peer) -> None:
        """The peer's limit on concurrent streams is kept: no room while it is reached."""
        peer.feed(h2.frame(h2.SETTINGS, 0, 0, struct.pack(">HL", h2.MAX_CONCURRENT_STREAMS, 1)))
        assert peer.connection.has_room()

        call = peer.call()
        assert not peer.connection.has_room()
        peer.answer(call.id, b"a")
        assert peer.connection.has_room()

    @pytest.mark.parametrize(
        ("data", "error"),
        [
            (h2.frame(h2.DATA, 0, 1, b"x" * 16_385), "FRAME_SIZE_ERROR"),
            (h2.frame(h2.HEADERS, h2.END_HEADERS, 1, b"\xff\xff\xff\xff"), "COMPRESSION_ERROR"),
            (h2.frame(h2.PUSH_PROMISE, h2.END_HEADERS, 1, b"\0\0\0\x02"), "PROTOCOL_ERROR"),
            (h2.frame(h2.HEADERS, 0, 1, RESPONSE) + h2.frame(h2.DATA, 0, 1, b""), "PROTOCOL_ERROR"),
            (h2.frame(h2.SETTINGS, 0, 0, b"\0\x04\xff\xff\xff\xff"), "FLOW_CONTROL_ERROR"),
            (h2.frame(h2.DATA, 0, 7, b"x"), "PROTOCOL_ERROR"),
        ],
    )
    def test_connection_errors(self, peer: Peer, data: bytes, error: str) -> None:
        """A frame that breaks HTTP/2 for the connection: GOAWAY with the code, the transport closed, every
        call failed naming the error."""
        calls = [peer.call(), peer.call()]
        peer.written()

        peer.feed(data)

        goaway = [f for f in peer.written() if f[0] == h2.GOAWAY]
        assert 1 == len(goaway)
        assert peer.transport.closing and peer.connection.closed
        for call in calls:
            failure = outcome(call)
            assert isinstance(failure, PluginProtocolError)
            assert f"HTTP/2 {error}" in str(failure)

    def test_connection_lost(self, peer: Peer) -> None:
        """The plugin went away: every call fails with "Connection lost", and the connection is unusable."""
        calls = [peer.call(), peer.call()]

        peer.connection.connection_lost(None)

        assert [("StreamTerminatedError", "Connection lost")] * 2 == [
            (type(e).__name__, str(e)) for e in map(outcome, calls)
        ]
        assert not peer.connection.usable


RESPONSE_FIELDS = [(":status", "200"), ("content-type", "application/grpc")]
OK_FIELDS = [("grpc-status", "0"), ("grpc-message", "")]
