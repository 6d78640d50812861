"""The relay's HTTP/2 handling, end to end: flow control and the deadline it enforces on its own
(streams, their limits, big header blocks and padding: test_relay_transport_streams.py).

Clients are grpcio (C core) and, where a test needs frames grpcio would not send, a bare
``h2`` connection over a blocking socket in a thread. Backends are krproxy.rpc servers
(:class:`~tests.integration.support.ScriptedBackend`), and bare ``h2`` servers in a thread where a
test needs what that server would not do (small windows, refused or reset streams).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable

import attrs
import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import trio

from krproxy import rpc
from krproxy.daemon import Daemon
from krproxy.relay.rpc import grpc_message
from tests.integration.support import (
    RequestsByStream,
    ScriptedBackend,
    hang,
    in_thread,
    raw_unary,
    start_proxy,
    start_scripted_backend,
    wait_until,
)

ECHO = "/test.Relay/Echo"
BIG = "/test.Relay/Big"
HANG = "/test.Relay/Hang"
BIG_REPLY = bytes(range(256)) * 1200  # 307,200 bytes


@attrs.frozen
class H2Answer:
    headers: dict[bytes, bytes]
    body: bytes
    trailers: dict[bytes, bytes]
    window_updates_sent: int


def h2_unary(
    path: str,
    method: str,
    message: bytes,
    *,
    extra: list[tuple[str, str]] | None = None,
    window: int | None = None,
    pad: int | None = None,
    priority: bool = False,
    limit: float = 10.0,
) -> H2Answer:
    """One gRPC call with the ``h2`` library, acknowledging data only as it is read.

    ``window`` sets our SETTINGS_INITIAL_WINDOW_SIZE (the relay must not send more than
    that per stream before we grant more); ``pad`` pads the request DATA frame; ``priority``
    sends a PRIORITY frame first. Never resets the stream on its own.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(limit)
    sock.connect(path)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    if window is not None:
        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    sock.sendall(conn.data_to_send())
    stream_id = conn.get_next_available_stream_id()
    if priority:
        conn.prioritize(stream_id, weight=200)
    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", method),
        (":authority", "relay-test"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *(extra or []),
    ]
    conn.send_headers(stream_id, fields)
    conn.send_data(stream_id, grpc_message(message), end_stream=True, pad_length=pad)
    sock.sendall(conn.data_to_send())
    headers: dict[bytes, bytes] = {}
    trailers: dict[bytes, bytes] = {}
    body = bytearray()
    updates = 0
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the relay closed the connection")
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    headers = dict(event.headers)  # type: ignore[arg-type]
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    updates += 1
                elif isinstance(event, h2.events.TrailersReceived):
                    trailers = dict(event.headers)  # type: ignore[arg-type]
                elif isinstance(event, h2.events.StreamReset):
                    raise ConnectionError(f"stream reset, error code {event.error_code}")
                elif isinstance(event, h2.events.StreamEnded):
                    if not trailers:  # trailers-only answer
                        trailers = headers
                    return H2Answer(headers, bytes(body), trailers, updates)
            sock.sendall(conn.data_to_send())
    finally:
        sock.close()


async def _big(stream: rpc.Stream, messages: list[bytes]) -> None:
    await stream.send_message(BIG_REPLY)


async def _backend_and_proxy(nursery: trio.Nursery, sockdir: str) -> tuple[ScriptedBackend, Daemon]:
    backend, _ = await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))
    backend.behaviours[BIG] = _big
    backend.behaviours[HANG] = hang
    return backend, await start_proxy(nursery, sockdir)


def echo_in_small_windows(listener: socket.socket, echoed: list[bytes]) -> None:
    """An ``h2`` gRPC server for one connection that echoes each request's message and grants the
    relay no more than h2's default windows (65,535 bytes per stream and for the connection), as
    it reads; its answers keep to the relay's windows. The messages of calls to :data:`ECHO` are
    put in ``echoed``. Blocking: run it in a thread."""
    conn_sock, _ = listener.accept()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    conn.initiate_connection()
    requests = RequestsByStream()
    unsent: dict[int, bytes] = {}
    # The proxy hanging up at the test's end ends this runtime (as in reset_every_stream below).
    with conn_sock, contextlib.suppress(BrokenPipeError, ConnectionResetError):
        conn_sock.sendall(conn.data_to_send())
        while data := conn_sock.recv(65536):
            for event in conn.receive_data(data):
                if (request := requests.take(conn, event)) is not None:
                    path, body = request
                    if path == ECHO.encode():
                        echoed.append(body[5:])  # one message: its 5-byte prefix, then the message
                    conn.send_headers(
                        event.stream_id, [(":status", "200"), ("content-type", "application/grpc")]
                    )
                    unsent[event.stream_id] = body
            for stream_id, rest in list(unsent.items()):
                while rest and (
                    room := min(conn.local_flow_control_window(stream_id), conn.max_outbound_frame_size)
                ):
                    conn.send_data(stream_id, rest[:room])
                    rest = rest[room:]
                unsent[stream_id] = rest
                if not rest:
                    del unsent[stream_id]
                    conn.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)
            conn_sock.sendall(conn.data_to_send())


class TestFlowControl:
    async def test_messages_larger_than_every_window(
        self, nursery: trio.Nursery, sockdir: str, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """6 MB each way through a backend that grants 64 KiB at a time arrives byte for byte."""
        backend = os.path.join(sockdir, "backend.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(backend)
        listener.listen(4)
        echoed: list[bytes] = []
        threading.Thread(target=echo_in_small_windows, args=(listener, echoed), daemon=True).start()
        daemon = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
        message = os.urandom(6 * 1024 * 1024)
        try:
            answer = await in_thread(raw_unary(channel_to(daemon.config.listen), ECHO), message, timeout=30)
        finally:
            listener.close()
        assert message == answer
        assert [message] == echoed

    async def test_a_reader_with_a_tiny_window_gets_everything(
        self, nursery: trio.Nursery, sockdir: str
    ) -> None:
        """The relay sends a caller no more than the caller's window allows, and waits for its grants."""
        _, daemon = await _backend_and_proxy(nursery, sockdir)
        answer: H2Answer = await in_thread(h2_unary, daemon.config.listen, BIG, b"", window=1000)
        assert (grpc_message(BIG_REPLY), b"0") == (answer.body, answer.trailers[b"grpc-status"])
        # h2 raises on any DATA beyond the window it granted, so arriving at all proves the
        # relay kept to it; the number of grants shows it really had to wait for them.
        assert answer.window_updates_sent >= len(grpc_message(BIG_REPLY)) // 1000


class TestDeadlines:
    async def test_enforced_when_the_caller_does_not(self, nursery: trio.Nursery, sockdir: str) -> None:
        """A caller that sent grpc-timeout but never cancels still gets DEADLINE_EXCEEDED, on time,
        and the runtime's call is cancelled."""
        backend, daemon = await _backend_and_proxy(nursery, sockdir)
        started = time.monotonic()
        answer: H2Answer = await in_thread(
            h2_unary, daemon.config.listen, HANG, b"", extra=[("grpc-timeout", "300m")]
        )
        took = time.monotonic() - started
        assert b"4" == answer.trailers[b"grpc-status"]
        assert b"deadline exceeded waiting for backend runtime" in answer.trailers[b"grpc-message"]
        assert (
            0.3 <= took < 30
        )  # at its deadline, not at the runtime's hour-long hang (a loaded machine is slow)
        await wait_until(lambda: HANG in backend.cancelled)

    async def test_finished_calls_are_not_kept_until_their_deadline(
        self, nursery: trio.Nursery, sockdir: str, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """kubelet's deadlines are minutes long: a finished call leaves the deadline heap's entry
        behind (until due or purged) but not itself, with its request and reply."""
        _, daemon = await _backend_and_proxy(nursery, sockdir)
        call = raw_unary(channel_to(daemon.config.listen), BIG)
        for _ in range(20):
            assert BIG_REPLY == await in_thread(call, b"", timeout=120)
        entries = [
            entry for entry in daemon.relay.transport._deadlines if entry[0] > trio.current_time() + 60
        ]
        assert 20 == len(entries)
        assert [None] * 20 == [entry[2] for entry in entries]
