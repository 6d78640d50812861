"""A raw HTTP/2 client for tests that must send what gRPC libraries will not (this module holds no tests).

One request per connection, header block exactly as given (a 9-digit ``grpc-timeout``, no
``:method``), over a unix socket, on trio; no timers of its own, so it works under a stopped
MockClock. The answer says everything the peer did: its SETTINGS, the response headers and
trailers, the data, or the RST_STREAM code.
"""

from __future__ import annotations

import urllib.parse

import attrs
import h2.config
import h2.connection
import h2.events
import trio

from krproxy.relay.rpc import encode_grpc_timeout

Fields = list[tuple[str, str]]


@attrs.define
class H2Answer:
    """What the peer answered to one request."""

    settings: dict[int, int] = attrs.field(factory=dict)  # its first SETTINGS frame
    headers: Fields = attrs.field(factory=list)
    trailers: Fields = attrs.field(factory=list)
    data: bytes = b""
    reset: int | None = None  # RST_STREAM error code
    connection_closed: bool = False

    def field(self, name: str) -> str | None:
        """A field of the trailers, or of the headers for a trailers-only answer."""
        for key, value in [*self.trailers, *self.headers]:
            if key == name:
                return value
        return None

    @property
    def grpc_status(self) -> int | None:
        status = self.field("grpc-status")
        return None if status is None else int(status)

    @property
    def grpc_message(self) -> str:
        return urllib.parse.unquote(self.field("grpc-message") or "")

    @property
    def message(self) -> bytes:
        """The one gRPC message of a unary answer (without its 5-byte prefix)."""
        assert len(self.data) >= 5, self
        size = int.from_bytes(self.data[1:5], "big")
        assert len(self.data) == 5 + size, self
        return self.data[5:]


def grpc_request(path: str, timeout: float | None = None, **extra: str) -> Fields:
    """The header block a grpc-go client sends for ``path``, with ``grpc-timeout`` written as
    grpc-go writes it (``krproxy.relay.rpc.encode_grpc_timeout`` follows its encodeTimeout)."""
    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    if timeout is not None:
        fields.append(("grpc-timeout", encode_grpc_timeout(timeout).decode()))
    fields += extra.items()
    return fields


def framed(message: bytes) -> bytes:
    """``message`` with gRPC's 5-byte prefix (not compressed)."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


async def request(
    socket_path: str, fields: Fields, body: bytes | None = None, padding: int | None = None
) -> H2Answer:
    """Send one request (``body``: DATA, already framed, in frames of the largest size allowed; None:
    headers only, ending the stream; ``padding``: each DATA frame padded with that many bytes)."""
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(
            client_side=True,
            header_encoding="utf-8",
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
            validate_inbound_headers=False,
        )
    )
    answer = H2Answer()
    stream = await trio.open_unix_socket(socket_path)
    async with stream:
        conn.initiate_connection()
        conn.send_headers(1, fields, end_stream=body is None)
        if body is not None:
            size = conn.max_outbound_frame_size - (0 if padding is None else padding + 1)
            chunks = [body[at : at + size] for at in range(0, len(body), size)] or [b""]
            for index, chunk in enumerate(chunks):
                conn.send_data(1, chunk, end_stream=index == len(chunks) - 1, pad_length=padding)
        await stream.send_all(conn.data_to_send())
        settings_seen = done = False
        while not done:
            data = await stream.receive_some(65536)
            if not data:
                answer.connection_closed = True
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RemoteSettingsChanged) and not settings_seen:
                    settings_seen = True
                    answer.settings = {int(key): c.new_value for key, c in event.changed_settings.items()}
                elif isinstance(event, h2.events.ResponseReceived):
                    answer.headers = [(str(k), str(v)) for k, v in event.headers]
                elif isinstance(event, h2.events.TrailersReceived):
                    answer.trailers = [(str(k), str(v)) for k, v in event.headers]
                elif isinstance(event, h2.events.DataReceived):
                    answer.data += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    answer.reset = int(event.error_code)
                    done = True
                elif isinstance(event, h2.events.StreamEnded):
                    done = True
                elif isinstance(event, h2.events.ConnectionTerminated):
                    answer.connection_closed = done = True
            await stream.send_all(conn.data_to_send())
    return answer
