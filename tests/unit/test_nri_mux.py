"""NRI's multiplexer without I/O (krproxy.nri._mux): frame layout, reassembly, limits, and frames Go can read."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from krproxy.nri import _mux, _ttrpc
from krproxy.nri._mux import Demultiplexer, MuxError, frames


class GoReader:
    """What reads one multiplexed connection in Go: ttrpc's channel.recv over a 4096-byte bufio.Reader over
    NRI's mux conn, whose Read copies one whole frame into the space asked for or fails with ENOMEM."""

    def __init__(self, frame_list: list[bytes]) -> None:
        self.frames = frame_list
        self.buf = b""
        self.r = 0

    def _conn_read(self, space: int) -> bytes:
        frame = self.frames.pop(0)
        if len(frame) > space:
            raise MemoryError(f"ENOMEM: frame of {len(frame)} bytes, {space} asked for")
        return frame

    def _read(self, want: int) -> bytes:  # bufio.Reader.Read
        if self.r == len(self.buf):
            if want >= 4096:
                return self._conn_read(want)
            self.buf, self.r = self._conn_read(4096), 0
        out = self.buf[self.r : self.r + want]
        self.r += len(out)
        return out

    def _read_full(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            out += self._read(n - len(out))
        return out

    def recv(self) -> tuple[int, bytes]:
        length, stream_id, _, _ = _ttrpc.decode_header(self._read_full(10))
        return stream_id, self._read_full(length)


def demux(data: bytes) -> list[tuple[int, bytes]]:
    d = Demultiplexer()
    d.receive_data(data)
    out = []
    while (frame := d.next_frame()) is not None:
        out.append(frame)
    return out


class TestFrames:
    def test_header_layout(self) -> None:
        """Connection id then length, both 4 bytes big-endian, then the bytes."""
        assert b"\x00\x00\x00\x02\x00\x00\x00\x03abc" == frames(_mux.RUNTIME_SERVICE_CONN, b"abc")

    @pytest.mark.parametrize(
        "size", [0, 1, 4086, 4087, 4096, 5000, 8182, 8183, 100_000, _ttrpc.MESSAGE_LENGTH_MAX]
    )
    def test_go_reads_every_size(self, size: int) -> None:
        """Messages of any size up to ttrpc's limit, cut by frames(), are read back by Go's reader."""
        payloads = [bytes([i % 251]) * size for i in range(3)]
        wire = b"".join(frames(1, _ttrpc.encode_message(2 * i + 1, 1, p)) for i, p in enumerate(payloads))
        reader = GoReader([payload for _, payload in demux(wire)])
        assert [(2 * i + 1, p) for i, p in enumerate(payloads)] == [reader.recv() for _ in payloads]

    def test_one_big_frame_is_what_go_cannot_read(self) -> None:
        """The emulation is faithful to the constraint: a message over 4096 bytes in one frame fails in Go."""
        reader = GoReader([_ttrpc.encode_message(1, 1, b"x" * 5000)])
        with pytest.raises(MemoryError, match="ENOMEM"):
            reader.recv()

    def test_first_frame_is_go_sized(self) -> None:
        """A long message goes as 4096 bytes, then the rest (what Go's 4096-byte bufio.Writer writes)."""
        message = _ttrpc.encode_message(1, 1, b"y" * 10_000)
        assert [(1, message[:4096]), (1, message[4096:])] == demux(frames(1, message))

    def test_reserved_connection_id(self) -> None:
        """Connection id 0 is NRI's reserved id and cannot be written."""
        with pytest.raises(ValueError, match="connection id 0 is reserved"):
            frames(0, b"")


class TestDemultiplexer:
    @given(
        st.lists(st.tuples(st.integers(1, 5), st.binary(max_size=300)), max_size=6),
        st.lists(st.integers(0, 2000), max_size=10),
    )
    def test_any_chunking(self, sent: list[tuple[int, bytes]], cuts: list[int]) -> None:
        """Frames come out whole and in order however the socket cuts the bytes."""
        wire = b"".join(struct.pack(">II", c, len(p)) + p for c, p in sent)
        d = Demultiplexer()
        points = sorted({c % (len(wire) + 1) for c in cuts})
        for a, b in zip([0, *points], [*points, len(wire)], strict=True):
            d.receive_data(wire[a:b])
        got = []
        while (frame := d.next_frame()) is not None:
            got.append(frame)
        assert sent == got
        assert 0 == d.buffered

    def test_oversized_frame_is_an_error(self) -> None:
        """A frame longer than allowed means the peer does not speak NRI: a clear error, at the header."""
        d = Demultiplexer(max_frame_length=100)
        with pytest.raises(
            MuxError, match="frame of 101 bytes for connection 1 exceeds the 100 bytes allowed"
        ):
            d.receive_data(struct.pack(">II", 1, 101))

    def test_http_is_not_nri(self) -> None:
        """Something else on the socket (here an HTTP/2 preface) fails at once instead of waiting for 1 GB."""
        with pytest.raises(MuxError, match="does not speak NRI's framing"):
            Demultiplexer().receive_data(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
