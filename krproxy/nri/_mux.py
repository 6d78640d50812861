"""NRI's connection multiplexer, without I/O: two ttrpc connections over one socket.

An NRI plugin and the runtime share one unix socket, and each side is both a ttrpc client and a ttrpc
server on it: the runtime calls the plugin's ``Plugin`` service (Configure, Synchronize, the events) and
the plugin calls the runtime's ``Runtime`` service (RegisterPlugin, UpdateContainers). NRI carries the two
connections over the socket with its own framing (``pkg/net/multiplex`` in containerd/nri, identical in
0.6.1 and 0.8.0 except for the writer's frame size limit):

* Each frame is an **8-byte header** — connection id (4 bytes, big-endian), payload length (4 bytes,
  big-endian) — and the payload: bytes of that connection's stream. Connection id 0 is reserved;
  :data:`PLUGIN_SERVICE_CONN` (1) carries the runtime's calls to the plugin (the plugin is the ttrpc
  server), :data:`RUNTIME_SERVICE_CONN` (2) the plugin's calls to the runtime (the runtime serves).
* Frames for a connection id nobody opened are dropped.

How a frame is cut matters for a Go reader: its ttrpc reads each logical connection through a 4096-byte
``bufio.Reader``, and the multiplexer's ``Read`` copies one whole frame into the space the reader asks for
— failing with ``ENOMEM`` when the frame is larger. Go's own writer never trips on this because ttrpc
writes through a 4096-byte ``bufio.Writer`` flushed after each message: a message of up to 4096 bytes
goes as one frame; a longer one as a first frame of 4096 bytes (header and the payload's start) and a
second holding the rest, which the reader then asks for whole. :func:`frames` cuts messages exactly so.
"""

from __future__ import annotations

import struct
from collections import deque

import attrs

__all__ = [
    "FRAME_LENGTH_MAX",
    "HEADER_LENGTH",
    "PLUGIN_SERVICE_CONN",
    "RUNTIME_SERVICE_CONN",
    "Demultiplexer",
    "MuxError",
    "frames",
]

#: Bytes in a frame header.
HEADER_LENGTH = 8
#: The runtime calls the plugin on this connection (``multiplex.PluginServiceConn``).
PLUGIN_SERVICE_CONN = 1
#: The plugin calls the runtime on this connection (``multiplex.RuntimeServiceConn``).
RUNTIME_SERVICE_CONN = 2
#: The largest frame accepted: NRI 0.6.1's writer limit (``1 << 24``); 0.8.0 writes at most 4 MiB + 10.
FRAME_LENGTH_MAX = 1 << 24
#: Go's bufio buffer size, which bounds the first frame of a message (see the module docstring).
_GO_BUFIO_SIZE = 4096

_HEADER = struct.Struct(">II")


class MuxError(Exception):
    """The peer broke NRI's framing; the socket cannot be read any further."""


def frames(conn_id: int, data: bytes) -> bytes:
    """One ttrpc message of connection ``conn_id`` as frames a Go reader accepts (see the module docstring)."""
    if not 0 < conn_id <= 0xFFFFFFFF:
        raise ValueError(f"connection id {conn_id} is reserved or out of range")
    if len(data) <= _GO_BUFIO_SIZE:
        return _HEADER.pack(conn_id, len(data)) + data
    first, rest = data[:_GO_BUFIO_SIZE], data[_GO_BUFIO_SIZE:]
    return _HEADER.pack(conn_id, len(first)) + first + _HEADER.pack(conn_id, len(rest)) + rest


@attrs.define
class Demultiplexer:
    """Splits the socket's bytes into ``(connection id, payload)`` frames.

    Feed bytes with :meth:`receive_data` in any chunking; :meth:`next_frame` returns complete frames in
    order. A frame longer than ``max_frame_length`` raises :class:`MuxError` (the stream cannot be
    resynchronised after it).
    """

    max_frame_length: int = FRAME_LENGTH_MAX
    _buffer: bytearray = attrs.field(factory=bytearray, init=False)
    _frames: deque[tuple[int, bytes]] = attrs.field(factory=deque, init=False)

    def receive_data(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= HEADER_LENGTH:
            conn_id, length = _HEADER.unpack_from(self._buffer)
            if length > self.max_frame_length:
                raise MuxError(
                    f"NRI multiplexer frame of {length} bytes for connection {conn_id} exceeds the"
                    f" {self.max_frame_length} bytes allowed: the peer does not speak NRI's framing"
                )
            if len(self._buffer) < HEADER_LENGTH + length:
                return
            self._frames.append((conn_id, bytes(self._buffer[HEADER_LENGTH : HEADER_LENGTH + length])))
            del self._buffer[: HEADER_LENGTH + length]

    def next_frame(self) -> tuple[int, bytes] | None:
        return self._frames.popleft() if self._frames else None

    @property
    def buffered(self) -> int:
        """Bytes received that do not make a whole frame yet."""
        return len(self._buffer)
