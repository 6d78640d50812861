"""Header list limits through the proxy: an answer over krproxy's advertised limit ends that call
alone, with the status grpc-go gives, intercepted and relayed calls alike; a request over the
runtime's advertised limit is failed by krproxy, unsent, as grpc-go's client fails it.

The runtime is the fake containerd, served by krproxy's own HTTP/2 core, which honours the
SETTINGS_MAX_HEADER_LIST_SIZE krproxy advertises as grpc-go does: trailers over it are not sent,
the stream is reset with INTERNAL_ERROR (docs/security.md, "Header list limits, per side").
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import urllib.parse
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
import trio
from cri_api.v1 import api_pb2, api_pb2_grpc

from krproxy.fakes.containerd import Fault
from krproxy.grpcstatus import Status
from krproxy.h2 import frames as f
from krproxy.h2.connection import ADVERTISED_HEADER_LIST, MAX_HEADER_BLOCK
from tests.integration.faults_support import channel, version_ok
from tests.integration.support import in_thread, start_proxy
from tests.integration.test_relay_transport import BIG, ECHO, H2Answer, h2_unary

#: Trailers whose header list is over what krproxy advertises to the runtime: status details
#: (base64 on the wire, a third larger) or any other field.
OVERSIZED = {
    "details": ("grpc-status-details-bin", b"\x08\x05" * (ADVERTISED_HEADER_LIST // 2)),
    "metadata": ("x-echo", "e" * (ADVERTISED_HEADER_LIST + 1)),
}


@pytest.mark.parametrize(
    ("method", "request_"),
    [
        pytest.param(
            "StartContainer", api_pb2.StartContainerRequest(container_id="c" * 64), id="intercepted"
        ),
        pytest.param("ExecSync", api_pb2.ExecSyncRequest(container_id="c" * 64, cmd=["true"]), id="relayed"),
    ],
)
@pytest.mark.parametrize("trailer", sorted(OVERSIZED))
async def test_answer_over_the_limit_ends_one_call(
    nursery: trio.Nursery, sockdir: str, fake_containerd: Any, method: str, request_: Any, trailer: str
) -> None:
    """The runtime's answer is over krproxy's header list limit, by its status details or another
    trailer: the runtime resets the stream, the caller gets INTERNAL naming the reset (as grpc-go's
    client does), not UNAVAILABLE, and the next call on the same runtime connection is answered."""
    fake, runtime = fake_containerd
    oversized = (OVERSIZED[trailer],)
    fault = Fault(status=Status.NOT_FOUND, message="no such container", trailing_metadata=oversized)
    fake.inject(method, fault)
    daemon = await start_proxy(nursery, sockdir, runtime_endpoint=runtime)
    with channel(daemon.config.listen) as ch:
        call = getattr(api_pb2_grpc.RuntimeServiceStub(ch), method)
        with pytest.raises(grpc.RpcError) as failed:
            await in_thread(call, request_, timeout=30)
    assert grpc.StatusCode.INTERNAL == failed.value.code(), failed.value.details()
    assert "reset the stream (INTERNAL_ERROR)" in (failed.value.details() or "")
    assert await in_thread(version_ok, daemon.config.listen)


def _serve_limited(listener: socket.socket, limit: int, seen: list[int]) -> None:
    """An ``h2`` runtime advertising SETTINGS_MAX_HEADER_LIST_SIZE ``limit``: it answers every
    request OK and notes the header list size of each :data:`ECHO` request it received."""
    conn_sock, _ = listener.accept()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    conn.local_settings = h2.settings.Settings(
        client=False, initial_values={h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: limit}
    )
    conn.initiate_connection()
    with conn_sock, contextlib.suppress(OSError):
        conn_sock.sendall(conn.data_to_send())
        while data := conn_sock.recv(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    if (b":path", ECHO.encode()) in event.headers:
                        seen.append(sum(32 + len(n) + len(v) for n, v in event.headers))
                elif isinstance(event, h2.events.StreamEnded):
                    conn.send_headers(
                        event.stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc")]
                    )
                    conn.send_data(event.stream_id, b"\0\0\0\0\0")
                    conn.send_headers(event.stream_id, [(b"grpc-status", b"0")], end_stream=True)
            conn_sock.sendall(conn.data_to_send())


async def _three_calls_via(
    nursery: trio.Nursery, sockdir: str, serve: Any, *args: Any, path: str = ECHO, extra: Any = None
) -> tuple[H2Answer, H2Answer, H2Answer]:
    """Through a proxy in front of ``serve(listener, *args)`` (an ``h2`` runtime in a thread): a
    plain call, the call under test (``path``, ``extra`` metadata), a plain call; their answers,
    after asserting their statuses OK, INTERNAL, OK."""
    backend = os.path.join(sockdir, "backend.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(backend)
    listener.listen(4)
    threading.Thread(target=serve, args=(listener, *args), daemon=True).start()
    daemon = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    listen = daemon.config.listen
    try:
        first = await in_thread(h2_unary, listen, ECHO, b"")
        tested = await in_thread(h2_unary, listen, path, b"", extra=extra)
        after = await in_thread(h2_unary, listen, ECHO, b"")
    finally:
        listener.close()
    statuses = [answer.trailers[b"grpc-status"] for answer in (first, tested, after)]
    assert [b"0", b"13", b"0"] == statuses
    return first, tested, after


async def test_request_over_the_runtimes_limit_is_not_sent(nursery: trio.Nursery, sockdir: str) -> None:
    """A caller's request whose header list exceeds the runtime's SETTINGS_MAX_HEADER_LIST_SIZE
    (16 KiB, as grpcio advertises): krproxy does not send it, the caller gets INTERNAL with
    grpc-go's words; the runtime never sees it, and the next call on the connection passes."""
    seen: list[int] = []
    _, big, _ = await _three_calls_via(
        nursery, sockdir, _serve_limited, 16384, seen, extra=[("x-big", "v" * 20_000)]
    )
    message = urllib.parse.unquote(big.trailers[b"grpc-message"].decode())
    assert "header list size to send violates the maximum size (16384 bytes)" in message, message
    assert 2 == len(seen) and max(seen) < 16384, seen


def _serve_ignoring_the_limit(listener: socket.socket) -> None:
    """An ``h2`` runtime that ignores the header list limit krproxy advertises, on one connection
    only (a call on a second one would wait unanswered): it answers
    :data:`BIG` with a header block over MAX_HEADER_BLOCK (encoded with its connection's own HPACK
    encoder, so its table moves on), and every other call OK, naming what its table now holds."""
    conn_sock, _ = listener.accept()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    conn.initiate_connection()
    plain = [(b":status", b"200"), (b"content-type", b"application/grpc")]
    with conn_sock, contextlib.suppress(OSError):
        conn_sock.sendall(conn.data_to_send())
        while data := conn_sock.recv(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived) and (b":path", BIG.encode()) in event.headers:
                    fields = [*plain, (b"x-big", b"b" * (MAX_HEADER_BLOCK + 100_000)), (b"x-after", b"1")]
                    block = conn.encoder.encode(fields, huffman=False)
                    conn_sock.sendall(
                        conn.data_to_send() + f.header_frames(event.stream_id, block, False, 16384)
                    )
                elif isinstance(event, h2.events.StreamEnded):
                    conn.send_headers(event.stream_id, [*plain, (b"x-after", b"1")])
                    conn.send_data(event.stream_id, b"\0\0\0\0\0")
                    conn.send_headers(event.stream_id, [(b"grpc-status", b"0")], end_stream=True)
            conn_sock.sendall(conn.data_to_send())


async def test_a_block_over_what_krproxy_reads_ends_one_call(nursery: trio.Nursery, sockdir: str) -> None:
    """A runtime sends an answer's header block over the 1 MiB krproxy reads, ignoring the limit it
    advertised: that call fails INTERNAL (as grpc-go's client fails it), the runtime connection
    lives on, and the next answer, indexed against the oversized block's HPACK state, is read."""
    _, big, after = await _three_calls_via(nursery, sockdir, _serve_ignoring_the_limit, path=BIG)
    message = urllib.parse.unquote(big.trailers[b"grpc-message"].decode())
    assert "peer header list size exceeded limit" in message, message
    assert b"1" == after.headers[b"x-after"]
