"""Garbage on the proxy socket (hypothesis): random bytes, the HTTP/2 preface followed by random frames, and
well-formed requests with bogus gRPC framing.

The daemon is a real ``krproxy serve`` process (in front of a fake containerd process), started once for the
module. After each example the connection must be closed or the call answered with an error, and a Version
call on a fresh connection must succeed; after each test the daemon's fd count is back to where it was.
Budget: see tests/fuzz/__init__.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import time
import urllib.parse
from collections.abc import Iterator

import h2.config
import h2.connection
import h2.events
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.fuzz import examples
from tests.integration import h2_client
from tests.integration.faults_support import FD_SLACK, Process, Processes, open_fds, version_ok
from tests.integration.support import LIVENESS_LIMIT

VERSION = "/runtime.v1.RuntimeService/Version"
CREATE = "/runtime.v1.RuntimeService/CreateContainer"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#: How long a garbage connection may stay open after we stopped sending, before it counts as hung (a
#: liveness bound).
CLOSE_LIMIT = LIVENESS_LIMIT

FUZZ = settings(
    max_examples=examples(40),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Process]:
    directory = tempfile.mkdtemp(prefix="kp-", dir="/tmp")
    started = Processes(directory)
    try:
        runtime = os.path.join(directory, "containerd.sock")
        started.containerd(runtime)
        yield started.proxy(os.path.join(directory, "proxy.sock"), runtime, os.path.join(directory, "hooks"))
    finally:
        started.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def fds_checked(daemon: Process) -> Iterator[Process]:
    """The daemon; after the test, its fd count must come back to what it was before."""
    assert version_ok(daemon.socket)
    before = open_fds(daemon.pid)
    yield daemon
    deadline = time.monotonic() + CLOSE_LIMIT
    while (after := open_fds(daemon.pid)) > before + FD_SLACK and time.monotonic() < deadline:
        time.sleep(0.05)
    assert after <= before + FD_SLACK, f"daemon fds: {before} before, {after} after"


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CLOSE_LIMIT)
    sock.connect(path)
    return sock


def send_and_drain(path: str, data: bytes) -> bytes:
    """Send ``data``, stop sending, and read until the daemon closes the connection; return what it sent.

    Fails if the connection is still open :data:`CLOSE_LIMIT` seconds later.
    """
    received = bytearray()
    with connect(path) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                received += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass  # closed on us: fine
        except TimeoutError:
            raise AssertionError(f"connection still open {CLOSE_LIMIT}s after {data[:64]!r}...") from None
    return bytes(received)


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


frames = st.builds(
    frame,
    kind=st.integers(0, 12),  # DATA..CONTINUATION, and a few unknown types
    flags=st.integers(0, 255),
    stream=st.sampled_from([0, 1, 2, 3, 5, 0x7FFFFFFF, 0xFFFFFFFF]),
    payload=st.binary(max_size=64),
)


class TestGarbageBytes:
    @FUZZ
    @given(data=st.binary(min_size=1, max_size=512))
    def test_random_bytes(self, fds_checked: Process, data: bytes) -> None:
        """Random bytes instead of HTTP/2: the daemon closes the connection and keeps serving."""
        send_and_drain(fds_checked.socket, data)
        assert version_ok(fds_checked.socket)

    @FUZZ
    @given(data=st.lists(frames, min_size=1, max_size=8))
    def test_random_frames_after_preface(self, fds_checked: Process, data: list[bytes]) -> None:
        """The HTTP/2 preface and a SETTINGS frame, then random frames: the connection ends, the daemon
        keeps serving."""
        send_and_drain(fds_checked.socket, PREFACE + frame(4, 0, 0, b"") + b"".join(data))
        assert version_ok(fds_checked.socket)


def grpc_request(path: str, body: bytes) -> tuple[bool, int | None]:
    """A well-formed HTTP/2 gRPC request to ``path`` whose DATA is ``body`` verbatim (no framing added).

    Returns (whether the stream was reset or the connection closed without an answer, the grpc-status
    answered if any).
    """
    reset, status, _message = grpc_answer(path, body)
    return reset, status


def grpc_answer(path: str, body: bytes) -> tuple[bool, int | None, str]:
    """:func:`grpc_request`, and the grpc-message answered ("" if none)."""
    message = ""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    conn.send_headers(1, h2_client.grpc_request(path))
    conn.send_data(1, body, end_stream=True)
    status: int | None = None
    with connect(SOCKET_OF[0]) as sock:
        sock.sendall(conn.data_to_send())
        deadline = time.monotonic() + CLOSE_LIMIT
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return True, status, message
            if not chunk:
                return True, status, message
            for event in conn.receive_data(chunk):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    headers = dict(event.headers)
                    if "grpc-status" in headers:
                        status = int(headers["grpc-status"])
                        message = headers.get("grpc-message", "")
                elif isinstance(event, h2.events.StreamReset):
                    return True, status, message
                elif isinstance(event, h2.events.StreamEnded):
                    return False, status, message
                elif isinstance(event, h2.events.ConnectionTerminated):
                    return True, status, message
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            sock.sendall(conn.data_to_send())
    raise AssertionError(f"no answer and no reset within {CLOSE_LIMIT}s for {body[:32]!r}")


#: The socket of the module's daemon, for grpc_request (hypothesis examples cannot take it as an argument).
SOCKET_OF: list[str] = []


def grpc_frame(compressed: int, length: int, payload: bytes) -> bytes:
    return bytes([compressed]) + struct.pack(">I", length) + payload


#: 0 OK is wrong for every case below except a correctly framed message; these are what gRPC defines.
ERROR_STATUSES = set(range(1, 17))
#: What containerd (and the fake imitating it) answers a bad CreateContainer with, under UNKNOWN: no
#: config metadata, an empty or ambiguous sandbox id.
RUNTIME_UNKNOWN = ("must include metadata", "when try to find sandbox", "failed to find sandbox")


class TestBogusGrpcFraming:
    @pytest.fixture(autouse=True)
    def _socket(self, fds_checked: Process) -> Iterator[None]:
        SOCKET_OF[:] = [fds_checked.socket]
        yield
        SOCKET_OF.clear()

    @FUZZ
    @given(
        path=st.sampled_from([VERSION, CREATE, "/runtime.v1.RuntimeService/NoSuchMethod"]),
        compressed=st.sampled_from([1, 2, 255]),
        payload=st.binary(max_size=64),
    )
    def test_compressed_flag_without_encoding(self, path: str, compressed: int, payload: bytes) -> None:
        """A message with the compressed flag set (no grpc-encoding was negotiated): an error status or a
        reset, never a success; the daemon keeps serving."""
        reset, status = grpc_request(path, grpc_frame(compressed, len(payload), payload))
        assert reset or status in ERROR_STATUSES, status
        assert version_ok(SOCKET_OF[0])

    @FUZZ
    @given(
        path=st.sampled_from([VERSION, CREATE]),
        declared=st.one_of(st.integers(0, 128), st.just(0xFFFFFFFF), st.integers(1 << 22, 1 << 31)),
        payload=st.binary(max_size=64),
    )
    def test_wrong_length_prefix(self, path: str, declared: int, payload: bytes) -> None:
        """A length prefix that does not match the bytes sent: longer than the data (up to 4 GiB) ends in an
        error status or a reset; shorter means a complete message plus trailing bytes, which the fake answers
        or refuses; either way the daemon keeps serving."""
        body = grpc_frame(0, declared, payload)
        reset, status = grpc_request(path, body)
        if declared > len(payload):
            assert reset or status in ERROR_STATUSES, status
        assert version_ok(SOCKET_OF[0])

    @FUZZ
    @given(payload=st.binary(max_size=256))
    @example(payload=b"\x10\x01")  # wrong wire type for `config`: decodes leniently, fails when read
    @example(payload=b"\x08\x00\t\x00\x00\x00\x00\x00\x00\x00\x00")  # pod_sandbox_id twice, wrong wire types
    def test_random_message_to_a_hooked_method(self, payload: bytes) -> None:
        """Correctly framed random bytes to CreateContainer (decoded by the proxy for its hooks): answered
        with a gRPC status, OK only if the runtime accepted it, and never INTERNAL or UNKNOWN from the proxy
        itself (the fake containerd's UNKNOWN for a config without metadata or an empty sandbox id is
        containerd's answer, passed on) but grpc-go's INTERNAL for bytes Go's decoder refuses; the daemon
        keeps serving."""
        reset, status, message = grpc_answer(CREATE, grpc_frame(0, len(payload), payload))
        assert not reset
        assert status is not None
        words = urllib.parse.unquote(message)
        runtime_said = status == 2 and any(w in words for w in RUNTIME_UNKNOWN)
        as_grpc_go = status == 13 and words.startswith(
            "grpc: error unmarshalling request: CreateContainerRequest:"
        )
        assert runtime_said or as_grpc_go or status not in (2, 13), (
            status,
            message,
        )  # a crash in the proxy's own code
        assert version_ok(SOCKET_OF[0])
