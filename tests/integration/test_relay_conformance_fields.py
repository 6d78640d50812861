"""HTTP/2 conformance of the relay's caller side (RFC 9113): header fields (forbidden octets,
content-length, a lowered table size, never-indexed fields), stream ids, and the connection's
preface and cap. Each forbidden field fails only its own stream and never reaches the runtime.
"""

from __future__ import annotations

import socket
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
import pytest
import trio

from krproxy.fakes.containerd import FakeContainerd
from krproxy.h2 import frames as f
from tests.integration.support import LIVENESS_LIMIT, start_proxy
from tests.integration.test_relay_conformance import (
    GOOD,
    _after_preface,
    _h2_verdict,
    _relay_before_a_silent_runtime,
    _relay_before_no_runtime,
    _relay_frames_on,
    _relay_verdict,
    _replaced,
)

VERSION = "/runtime.v1.RuntimeService/Version"


def _three_versions(
    listen: str, middle: list[tuple[bytes, bytes]]
) -> tuple[dict[int, str], dict[int, bytes]]:
    """Three Version calls on one connection, ``middle`` added to the headers of the second:
    how each stream ended, and the grpc-status of those answered."""
    fields = [(name.encode(), value.encode()) for name, value in _replaced(":path", VERSION)]
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
    )
    conn.initiate_connection()
    for stream_id, extra in ((1, []), (3, middle), (5, [])):
        conn.send_headers(stream_id, [*fields, *extra])
        conn.send_data(stream_id, b"\x00\x00\x00\x00\x00", end_stream=True)
    endings: dict[int, str] = {}
    statuses: dict[int, bytes] = {}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(LIVENESS_LIMIT)
        sock.connect(listen)
        sock.sendall(conn.data_to_send())
        while len(endings) < 3:
            data = sock.recv(65536)
            assert data, "the relay closed the connection"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.TrailersReceived):
                    statuses[event.stream_id] = dict(event.headers)[b"grpc-status"]
                elif isinstance(event, h2.events.StreamEnded):
                    endings[event.stream_id] = "ended"
                elif isinstance(event, h2.events.StreamReset):
                    endings[event.stream_id] = f.ERROR_NAMES[event.error_code]
                elif isinstance(event, h2.events.ConnectionTerminated):
                    raise AssertionError(f"GOAWAY {event.error_code!r}")
            sock.sendall(conn.data_to_send())
    return endings, statuses


@pytest.mark.parametrize(
    "field",
    [(b"x-id", b"a\x00b"), (b"x-id", b"a\r\nx-injected: 1"), (b"x-id", b"a\x01"), (b"x(id)", b"1")],
    ids=["nul", "crlf", "control", "separator-in-name"],
)
async def test_a_forbidden_octet_fails_its_stream_not_the_runtime(
    fake_containerd: tuple[FakeContainerd, str],
    nursery: trio.Nursery,
    sockdir: str,
    field: tuple[bytes, bytes],
) -> None:
    """Three Version calls on one connection, the middle one carrying a field RFC 9113 §8.2.1 (or
    grpc-go's framer) forbids: that stream is reset PROTOCOL_ERROR, the calls before and after it
    are answered, and the runtime sees those two only, never the field."""
    fake, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    endings, statuses = await trio.to_thread.run_sync(_three_versions, proxy.config.listen, [field])
    assert {1: "ended", 3: "PROTOCOL_ERROR", 5: "ended"} == endings
    assert {1: b"0", 5: b"0"} == statuses
    seen = fake.headers("Version")
    assert 2 == len(seen)
    assert [] == [headers for headers in seen if field[0].decode("latin-1") in dict(headers)]
    assert [] == fake.rejected


@pytest.mark.parametrize(("length", "answered"), [(b"5", True), (b"4", False), (b"6", False)])
async def test_a_mismatched_content_length_never_reaches_runtime(
    fake_containerd: tuple[FakeContainerd, str],
    nursery: trio.Nursery,
    sockdir: str,
    length: bytes,
    answered: bool,
) -> None:
    """The middle of three Version calls (a 5-byte message each) declares a content-length: the
    right one is passed on and answered; a wrong one makes the request malformed (RFC 9113
    §8.1.1): that stream is reset PROTOCOL_ERROR and its message never reaches the runtime
    (which saw its headers, then a reset), the others go on."""
    fake, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    middle = [(b"content-length", length)]
    endings, statuses = await trio.to_thread.run_sync(_three_versions, proxy.config.listen, middle)
    assert {1: "ended", 3: "ended" if answered else "PROTOCOL_ERROR", 5: "ended"} == endings
    assert {1: b"0", 5: b"0", **({3: b"0"} if answered else {})} == statuses
    assert (3 if answered else 2) == len(fake.requests("Version"))


async def test_a_request_on_a_lower_stream_id_is_a_connection_error(
    nursery: trio.Nursery, short_tmp: Path
) -> None:
    """HEADERS opening stream 1 after stream 3 (RFC 9113 §5.1.1): GOAWAY PROTOCOL_ERROR, as h2
    says, instead of silence (the caller would wait for its deadline)."""
    encoder = hpack.Encoder()
    data = _after_preface(
        f.frame(f.HEADERS, f.END_HEADERS, 3, encoder.encode(list(GOOD))),
        f.frame(f.HEADERS, f.END_HEADERS, 1, encoder.encode(list(GOOD))),
    )
    listen, silent, _ = await _relay_before_a_silent_runtime(nursery, short_tmp)
    try:
        verdict = await trio.to_thread.run_sync(_relay_verdict, listen, data)
    finally:
        silent.close()
    assert f.PROTOCOL_ERROR == _h2_verdict(data) == verdict


async def test_a_lowered_header_table_size_is_acknowledged(nursery: trio.Nursery, short_tmp: Path) -> None:
    """A caller's SETTINGS_HEADER_TABLE_SIZE of 0: the relay's next header block starts with a
    dynamic table size update (RFC 7541 §4.2), which h2's decoder (as nghttp2's) insists on."""
    listen = await _relay_before_no_runtime(nursery, short_tmp)

    def call() -> list[object]:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 0})
        conn.send_headers(1, list(GOOD), end_stream=True)
        events: list[object] = []
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(listen)
            sock.sendall(conn.data_to_send())
            while not any(isinstance(e, h2.events.StreamEnded) for e in events):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                events += conn.receive_data(chunk)  # raises on a block without the update
                sock.sendall(conn.data_to_send())
        return events

    events = await trio.to_thread.run_sync(call)
    assert any(isinstance(e, h2.events.ResponseReceived) for e in events)


def test_never_indexed_fields_keep_their_flag() -> None:
    """A field the caller sent never-indexed (RFC 7541 §6.2.3) is passed on never-indexed."""
    block = hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(b"authorization", b"secret"), (b"a", b"b")])
    decoded = hpack.Decoder().decode(f.encode_headers(hpack.Decoder().decode(block, raw=True)), raw=True)
    assert [(b"authorization", b"secret"), (b"a", b"b")] == decoded
    assert [False, True] == [getattr(field, "indexable", True) for field in decoded]


async def test_a_connection_without_preface_is_closed(
    nursery: trio.Nursery, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that connects and never sends the preface is not kept forever."""
    monkeypatch.setattr("krproxy.relay.connection.HANDSHAKE_TIMEOUT", 0.3)
    listen = await _relay_before_no_runtime(nursery, short_tmp)

    def idle() -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(listen)
            received = b""
            while chunk := sock.recv(65536):  # the relay's SETTINGS, then the end
                received += chunk
            return received

    received = await trio.to_thread.run_sync(idle)
    assert f.SETTINGS == f.HEAD.unpack_from(received, 0)[2]


async def test_connections_beyond_the_cap_are_closed(
    nursery: trio.Nursery, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With MAX_CONNECTIONS open, one more is closed at once; the open ones still answer."""
    monkeypatch.setattr("krproxy.relay.transport.MAX_CONNECTIONS", 2)
    listen = await _relay_before_no_runtime(nursery, short_tmp)

    def three() -> tuple[bool, bool]:
        socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
        try:
            for sock in socks[:2]:
                sock.settimeout(10)
                sock.connect(listen)
                sock.recv(65536)  # its SETTINGS: accepted and served
            third = socks[2]
            third.settimeout(10)
            third.connect(listen)
            closed = third.recv(65536) == b""
            frames = _relay_frames_on(socks[0], _after_preface())
            return closed, any(kind == f.PING for kind, _, _ in frames)
        finally:
            for sock in socks:
                sock.close()

    assert (True, True) == await trio.to_thread.run_sync(three)
