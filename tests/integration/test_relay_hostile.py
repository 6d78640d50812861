"""Hostile and careless callers against the relay in front of the fake containerd, with a raw
``h2`` client (issue 16's review): stream accounting over thousands of calls that end every
way a stream can end, what a reset frees, and the answers held for a caller that stops reading.
"""

from __future__ import annotations

import gzip
import os
import socket
import threading

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import pytest
import trio
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc

from krproxy.fakes.containerd import FakeContainerd
from krproxy.grpcstatus import Status
from krproxy.relay.rpc import grpc_message, request_headers
from tests.integration.support import in_thread, received, start_proxy, wait_until

VERSION = "/runtime.v1.RuntimeService/Version"
LIST = "/runtime.v1.RuntimeService/ListContainers"
RUN = "/runtime.v1.RuntimeService/RunPodSandbox"


def _fields(path: str, *extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return [*request_headers(path), *extra]


class RawCaller:
    """One HTTP/2 connection driven frame by frame with ``h2`` over a blocking unix socket."""

    def __init__(self, path: str, *, read: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(20)
        self.sock.connect(path)
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(
                client_side=True,
                header_encoding=None,
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
            )
        )
        self.conn.initiate_connection()
        self.read = read  # acknowledge received data (False: a caller that stops reading)
        self.ended: dict[int, str] = {}
        self.trailers: dict[int, dict[bytes, bytes]] = {}
        self.flush()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def pump(self) -> None:
        """Read what arrived and handle it (once)."""
        data = self.sock.recv(1 << 20)
        if not data:
            raise ConnectionError("the relay closed the connection")
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived) and self.read:
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
                self.trailers[event.stream_id] = dict(event.headers)  # (the last block: the status)
            if isinstance(event, h2.events.StreamEnded):
                self.ended[event.stream_id] = "ended"
            elif isinstance(event, h2.events.StreamReset):
                self.ended[event.stream_id] = f"reset {event.error_code!r}"
        self.flush()

    def wait(self, stream_id: int) -> str:
        while stream_id not in self.ended:
            self.pump()
        return self.ended[stream_id]

    def open(self, path: str, message: bytes | None, *extra: tuple[bytes, bytes], end: bool = True) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, _fields(path, *extra), end_stream=message is None and end)
        if message is not None:
            self.conn.send_data(stream_id, grpc_message(message), end_stream=end)
        self.flush()
        return stream_id

    def send_body(self, stream_id: int, data: bytes, end: bool) -> None:
        """Send ``data`` on ``stream_id`` in frames, within the relay's windows."""
        view = memoryview(data)
        while view:
            size = min(
                len(view), self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size
            )
            if size <= 0:
                self.pump()  # wait for a WINDOW_UPDATE
                continue
            self.conn.send_data(stream_id, bytes(view[:size]), end_stream=end and size == len(view))
            view = view[size:]
            self.flush()

    def reset(self, stream_id: int) -> None:
        try:
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        except h2.exceptions.StreamClosedError:
            return
        self.flush()

    def close(self) -> None:
        self.sock.close()


async def test_thousands_of_calls_ending_any_way_leave_no_stream(
    fake_containerd: tuple[FakeContainerd, str], nursery: trio.Nursery, sockdir: str
) -> None:
    """5000 calls on one connection, ending by answer, by the caller's reset before or after the
    answer, by a malformed request, by a deadline, by a too large request: none stays counted
    against the 1000 streams advertised, so the next call is served, not refused."""
    _, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    request = pb.VersionRequest().SerializeToString()

    def run() -> tuple[list[str], str]:
        caller = RawCaller(proxy.config.listen)
        endings = []
        try:
            for i in range(5000):
                kind = i % 6
                if kind == 0:
                    endings.append(caller.wait(caller.open(VERSION, request)))
                elif kind == 1:  # reset at once, before any answer
                    caller.reset(caller.open(VERSION, request))
                elif kind == 2:  # headers only, then reset
                    caller.reset(caller.open(VERSION, None, end=False))
                elif kind == 3:  # malformed: reset by the relay
                    endings.append(caller.wait(caller.open(VERSION, request, (b"connection", b"close"))))
                elif kind == 4:  # a deadline already past
                    endings.append(caller.wait(caller.open(VERSION, request, (b"grpc-timeout", b"1n"))))
                else:  # announced larger than the limit
                    stream_id = caller.open(VERSION, None, end=False)
                    caller.conn.send_data(stream_id, b"\x00\x7f\xff\xff\xff", end_stream=False)
                    caller.flush()
                    endings.append(caller.wait(stream_id))
            last = caller.wait(caller.open(VERSION, request))
            return endings, last
        finally:
            caller.close()

    endings, last = await in_thread(run)
    assert "ended" == last
    # Reset by the relay: the malformed requests (PROTOCOL_ERROR), and the too large ones once
    # answered (NO_ERROR: the rest of the request is not wanted, RFC 9113 §8.1).
    assert {"ended", "reset <ErrorCodes.PROTOCOL_ERROR: 1>", "reset <ErrorCodes.NO_ERROR: 0>"} == set(endings)
    await wait_until(lambda: proxy.relay.transport.in_flight == 0)


SANDBOX = pb.RunPodSandboxRequest(
    config=pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="web", namespace="default", uid="uid-1"),
        annotations={"note": "x" * 4000},
    )
)


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate])
async def test_a_compressed_request_with_hook_points_is_decompressed(
    fake_containerd: tuple[FakeContainerd, str],
    nursery: trio.Nursery,
    sockdir: str,
    compression: grpc.Compression,
) -> None:
    """A grpcio client that compresses its requests (grpc-encoding gzip or deflate, the message's
    compressed flag set): a call with hook points gets the request it sent, not its compressed
    bytes read as protobuf (which failed as INVALID_ARGUMENT, or could pass as another request)."""
    fake, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    channel = grpc.insecure_channel("unix://" + proxy.config.listen, compression=compression)
    try:
        stub = api_pb2_grpc.RuntimeServiceStub(channel)
        reply = await in_thread(stub.RunPodSandbox, SANDBOX, timeout=10)
    finally:
        channel.close()
    (received,) = fake.requests("RunPodSandbox")
    assert SANDBOX.SerializeToString() == bytes(received.message)
    assert reply.pod_sandbox_id


async def test_a_compressed_request_krproxy_cannot_read_is_refused(
    fake_containerd: tuple[FakeContainerd, str], nursery: trio.Nursery, sockdir: str
) -> None:
    """The compressed flag with an encoding krproxy cannot read: UNIMPLEMENTED, as grpc-go answers;
    without any grpc-encoding: INTERNAL; a small gzip message that inflates beyond the 16 MiB
    limit: RESOURCE_EXHAUSTED. Nothing is sent on."""
    fake, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    body = SANDBOX.SerializeToString()
    bomb = gzip.compress(b"\x00" * (16 * 1024 * 1024 + 1))
    cases = [([(b"grpc-encoding", b"snappy")], body), ([], body), ([(b"grpc-encoding", b"gzip")], bomb)]

    def run() -> list[dict[bytes, bytes]]:
        caller = RawCaller(proxy.config.listen)
        try:
            statuses = []
            for extra, message in cases:
                stream_id = caller.open(RUN, None, *extra, end=False)
                caller.conn.send_data(
                    stream_id, b"\x01" + len(message).to_bytes(4, "big") + message, end_stream=True
                )
                caller.flush()
                caller.wait(stream_id)
                statuses.append(caller.trailers[stream_id])
            return statuses
        finally:
            caller.close()

    unknown, missing, inflated = await in_thread(run)
    assert b"%d" % Status.UNIMPLEMENTED.value == unknown[b"grpc-status"]
    assert b"snappy" in unknown[b"grpc-message"]
    assert b"%d" % Status.INTERNAL.value == missing[b"grpc-status"]
    assert b"%d" % Status.RESOURCE_EXHAUSTED.value == inflated[b"grpc-status"]
    assert [] == fake.requests("RunPodSandbox")


async def test_requests_collected_for_hooks_are_bounded_per_connection(
    fake_containerd: tuple[FakeContainerd, str],
    nursery: trio.Nursery,
    sockdir: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay collects a call with hook points whole before it runs the hooks, granting the
    caller's windows as it goes; what one connection may have collected at once is bounded as
    its unread answers are (MAX_HELD), or a caller sending 1000 unfinished 16 MiB requests would
    have krproxy hold 16 GB. The call beyond the bound is RESOURCE_EXHAUSTED; those within it, and
    other connections, go on."""
    monkeypatch.setattr("krproxy.relay.connection.MAX_HELD", 6 * 1024 * 1024)
    fake, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    part = b"\x00" + (3 * 1024 * 1024).to_bytes(4, "big") + b"\x0a" * (2 * 1024 * 1024)  # unfinished

    def run() -> tuple[set[int], dict[bytes, bytes], str]:
        caller = RawCaller(proxy.config.listen)
        caller.sock.settimeout(5)
        try:
            streams = []
            for _ in range(4):
                stream_id = caller.open(RUN, None, end=False)
                caller.send_body(stream_id, part, end=False)
                streams.append(stream_id)
            while len(caller.ended) < 2:
                caller.pump()
            ended = set(caller.ended)
            status = caller.trailers[max(ended)]
            other = RawCaller(proxy.config.listen)
            try:
                version = other.wait(other.open(VERSION, pb.VersionRequest().SerializeToString()))
            finally:
                other.close()
            return ended, status, version
        finally:
            caller.close()

    ended, status, version = await in_thread(run)
    assert {5, 7} == ended  # 2 x 2 MiB collected; the third and fourth would pass 6 MiB
    assert b"%d" % Status.RESOURCE_EXHAUSTED.value == status[b"grpc-status"]
    assert "ended" == version
    assert [] == fake.requests("RunPodSandbox")  # none finished; the refused one never goes on


async def test_requests_waiting_for_runtime_window_keep_connection(
    nursery: trio.Nursery, sockdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MAX_HELD bounds what one *caller* connection has waiting for it. Request bytes waiting for
    a runtime that grants no window are many callers' (each bounded by its own windows): their
    sum past MAX_HELD must not close the runtime connection, which would fail every caller's
    calls (UNAVAILABLE) for what a few large requests queued."""
    monkeypatch.setattr("krproxy.relay.connection.MAX_HELD", 1024 * 1024)
    backend = os.path.join(sockdir, "backend.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(backend)
    listener.listen(4)
    stop = threading.Event()

    def no_window() -> None:  # a runtime that takes streams but grants no window (65,535 bytes in all)
        conn_sock, _ = listener.accept()
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        conn_sock.sendall(conn.data_to_send())
        with conn_sock:
            for data in received(conn_sock, stop.is_set):
                conn.receive_data(data)
                conn_sock.sendall(conn.data_to_send())

    thread = threading.Thread(target=no_window, daemon=True)
    thread.start()
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)

    def callers() -> list[RawCaller]:
        opened = []
        for _ in range(3):  # 3 x 512 KiB: more than MAX_HELD in all, each well within it
            caller = RawCaller(proxy.config.listen)
            stream_id = caller.open(VERSION, None, end=False)
            caller.send_body(stream_id, b"\x00" * (512 * 1024), end=True)
            opened.append(caller)
        return opened

    opened = await in_thread(callers)
    try:
        route = proxy.relay.runtime
        assert route is not None

        def queued() -> int:
            return route.ep.held if route.ep is not None else 0

        with trio.move_on_after(5):
            while queued() < 3 * 512 * 1024 - 65_535:  # noqa: ASYNC110 - all but what the runtime's window took
                await trio.sleep(0.02)
        await trio.sleep(0.1)
        assert (3, False) == (proxy.relay.transport.in_flight, route.ep is None or route.ep.closed)
    finally:
        for caller in opened:
            caller.close()
        stop.set()
        listener.close()
        await trio.to_thread.run_sync(thread.join)
