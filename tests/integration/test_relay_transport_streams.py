"""The relay's HTTP/2 streams, end to end: more concurrent calls than the backend allows (queued,
bounded, taking turns by caller), the stream limit it advertises, refused and reset streams,
header blocks larger than a frame, padding and PRIORITY. Peers as in test_relay_transport.py:
grpcio, and bare ``h2`` connections where a test needs frames grpcio would not send.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import urllib.parse
from collections.abc import Callable

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
import trio

from krproxy import rpc
from krproxy.fakes.grpc_go import metadata_items
from krproxy.h2 import frames as f
from krproxy.relay import Relay
from krproxy.relay.rpc import grpc_message, request_headers
from tests.integration.support import (
    ScriptedBackend,
    in_thread,
    raw_unary,
    serve_relay,
    start_proxy,
    start_scripted_backend,
    wait_until,
)
from tests.integration.test_relay_transport import ECHO, HANG, H2Answer, _backend_and_proxy, h2_unary
from tests.unit.h2peer import split_frames

SLOW = "/test.Relay/Slow"


def _held_calls(
    backend: ScriptedBackend, channel: grpc.Channel, count: int
) -> tuple[trio.Event, list[grpc.Future]]:
    """``count`` calls to SLOW over ``channel`` (messages b"0", b"1", ...), each held by ``backend``
    until the event returned is set, then echoed; the event and the calls' futures."""
    released = trio.Event()

    async def slow(stream: rpc.Stream, messages: list[bytes]) -> None:
        await released.wait()
        await stream.send_message(messages[0])

    backend.behaviours[SLOW] = slow
    call = raw_unary(channel, SLOW)
    return released, [call.future(b"%d" % i, timeout=30) for i in range(count)]


class TestStreams:
    async def test_more_concurrent_calls_than_the_backend_allows(
        self, nursery: trio.Nursery, sockdir: str, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """The backend takes 100 streams per connection; the relay queues the rest instead of failing them."""
        backend, daemon = await _backend_and_proxy(nursery, sockdir)
        released, futures = _held_calls(backend, channel_to(daemon.config.listen), 150)
        await wait_until(lambda: backend.started.count(SLOW) >= 100)
        await trio.sleep(0.2)
        running = backend.started.count(SLOW)
        released.set()
        answers = [await in_thread(future.result) for future in futures]
        assert 100 == running  # the backend's limit held while the others waited in the relay
        assert [b"%d" % i for i in range(150)] == answers

    async def test_calls_waiting_for_a_stream_slot_are_bounded(
        self,
        nursery: trio.Nursery,
        sockdir: str,
        channel_to: Callable[[str], grpc.Channel],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Beyond the backend's 100 streams and MAX_WAITING queued calls, a call fails at once
        (naming the queue) instead of waiting in an unbounded list; the queued ones go on."""
        monkeypatch.setattr("krproxy.relay.connection.MAX_WAITING", 5)
        backend, daemon = await _backend_and_proxy(nursery, sockdir)
        released, futures = _held_calls(backend, channel_to(daemon.config.listen), 110)
        await wait_until(lambda: backend.started.count(SLOW) >= 100)
        await wait_until(lambda: sum(future.done() for future in futures) >= 5)
        released.set()
        answers: list[bytes] = []
        refusals: list[str] = []
        for future in futures:
            try:
                answers.append(await in_thread(future.result))
            except grpc.RpcError as err:
                assert grpc.StatusCode.UNAVAILABLE == err.code()
                refusals.append(str(err.details()))
        # 100 running, 5 queued (fewer if store recovery's own calls took places), the rest refused.
        assert 5 <= len(refusals) <= 10
        assert all("5 calls already wait for a stream slot" in r for r in refusals)
        assert len(answers) == len(set(answers)) == 110 - len(refusals)
        assert set(answers) <= {b"%d" % i for i in range(110)}

    async def test_a_full_queue_refuses_the_caller_with_most_waiting(
        self,
        nursery: trio.Nursery,
        sockdir: str,
        channel_to: Callable[[str], grpc.Channel],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """One caller fills the backend's 100 streams and the MAX_WAITING queue: another caller's
        one call still gets a place in the queue (the first caller's latest queued call is
        refused for it) instead of failing at once: one caller cannot lock kubelet out."""
        monkeypatch.setattr("krproxy.relay.connection.MAX_WAITING", 5)
        backend, _ = await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))
        # A bare relay: no store recovery whose calls would take places of their own.
        relay = Relay()
        await nursery.start(relay.run)
        relay.configure(relay.route_to(os.path.join(sockdir, "backend.sock"), "backend"), None, {}, [SLOW])
        listen = await serve_relay(nursery, relay, os.path.join(sockdir, "relay.sock"))
        released = trio.Event()

        async def slow(stream: rpc.Stream, messages: list[bytes]) -> None:
            await released.wait()
            await stream.send_message(messages[0])

        backend.behaviours[SLOW] = slow
        greedy = raw_unary(channel_to(listen), SLOW)
        futures = [greedy.future(b"%d" % i, timeout=30) for i in range(105)]
        await wait_until(lambda: backend.started.count(SLOW) >= 100)
        await wait_until(lambda: relay.runtime is not None and len(relay.runtime.ep.waiting) >= 5)
        # A connection of its own (grpcio shares one between channels to the same target).
        channel = grpc.insecure_channel("unix://" + listen, options=[("grpc.use_local_subchannel_pool", 1)])
        try:
            other = raw_unary(channel, SLOW).future(b"other", timeout=30)
            await wait_until(lambda: sum(future.done() for future in futures) + other.done() >= 1)
            released.set()
            assert b"other" == await in_thread(other.result)
        finally:
            released.set()
            channel.close()
        refused = []
        for future in futures:
            try:
                await in_thread(future.result)
            except grpc.RpcError as err:
                refused.append((err.code(), "5 calls already wait for a stream slot" in str(err.details())))
        assert [(grpc.StatusCode.UNAVAILABLE, True)] == refused  # its latest made room for the other's

    async def test_queued_calls_take_turns_by_caller(
        self, nursery: trio.Nursery, sockdir: str, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """One caller fills the backend's 100 streams and queues 100 more; another caller's call
        gets the first slot that frees, not the one after the first caller's whole queue."""
        backend, daemon = await _backend_and_proxy(nursery, sockdir)
        release = trio.Semaphore(0)

        async def slow(stream: rpc.Stream, messages: list[bytes]) -> None:
            await release.acquire()
            await stream.send_message(messages[0])

        backend.behaviours[SLOW] = slow
        greedy = raw_unary(channel_to(daemon.config.listen), SLOW)
        futures = [greedy.future(b"%d" % i, timeout=30) for i in range(200)]
        await wait_until(lambda: backend.started.count(SLOW) >= 100)
        await wait_until(lambda: daemon.relay.transport.in_flight >= 200)
        other = grpc.insecure_channel(f"unix://{daemon.config.listen}")  # a connection of its own
        try:
            answer = raw_unary(other, ECHO).future(b"mine", timeout=30)
            await wait_until(lambda: daemon.relay.transport.in_flight >= 201)
            release.release()  # two slots free: one for each caller's turn
            release.release()
            # In arrival order it would wait for all 100 queued calls of the first caller.
            assert b"mine" == await in_thread(answer.result, timeout=10)
            assert backend.started.count(SLOW) < 200
        finally:
            for _ in range(200):
                release.release()
            for future in futures:
                await in_thread(future.result)
            other.close()

    async def test_the_stream_limit_is_advertised_and_kept(
        self, nursery: trio.Nursery, sockdir: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The relay states SETTINGS_MAX_CONCURRENT_STREAMS to callers and refuses a stream
        beyond it (REFUSED_STREAM: the caller may send it again), keeping the others."""
        monkeypatch.setattr("krproxy.relay.connection.CALLER_MAX_STREAMS", 3)
        _, daemon = await _backend_and_proxy(nursery, sockdir)

        def four_calls() -> tuple[int, list[tuple[int, int]]]:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect(daemon.config.listen)
            conn = h2.connection.H2Connection(
                h2.config.H2Configuration(client_side=True, header_encoding=None)
            )
            conn.initiate_connection()
            sock.sendall(conn.data_to_send())
            advertised = None
            while advertised is None:
                for event in conn.receive_data(sock.recv(65536)):
                    if isinstance(event, h2.events.RemoteSettingsChanged):
                        advertised = conn.remote_settings.max_concurrent_streams
            fields = request_headers(HANG, b"relay-test")
            for stream_id in (1, 3, 5):
                conn.send_headers(stream_id, fields)
                conn.send_data(stream_id, grpc_message(b""), end_stream=True)
            # h2 keeps to the advertised limit itself: the 4th stream is written by hand.
            fourth = f.header_frames(7, f.encode_headers(fields), False, 16384)
            sock.sendall(conn.data_to_send() + fourth + f.frame(f.DATA, f.END_STREAM, 7, grpc_message(b"")))
            reset: list[tuple[int, int]] = []
            buf = b""
            try:
                while not reset:  # read frames by hand: h2 would take a reset of stream 7 as an error
                    frames, buf = split_frames(buf + sock.recv(65536))
                    reset += [
                        (stream, int.from_bytes(p, "big")) for k, _, stream, p in frames if k == f.RST_STREAM
                    ]
            finally:
                sock.close()
            return advertised, reset

        advertised, reset = await in_thread(four_calls)
        assert (3, [(7, f.REFUSED_STREAM)]) == (advertised, reset)

    async def test_a_refused_call_is_refused_to_the_caller(self, nursery: trio.Nursery, sockdir: str) -> None:
        """A runtime that refuses a stream unprocessed (RST_STREAM REFUSED_STREAM): the relay refuses the
        caller's stream the same way, which grpc-go (kubelet) takes as leave to send the call again."""
        backend = os.path.join(sockdir, "backend.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(backend)
        listener.listen(4)
        refused: list[int] = []

        def serve_one_connection() -> None:
            conn_sock, _ = listener.accept()
            conn = h2.connection.H2Connection(
                h2.config.H2Configuration(client_side=False, header_encoding=None)
            )
            conn.initiate_connection()
            conn_sock.sendall(conn.data_to_send())
            bodies: dict[int, bytes] = {}
            while True:
                data = conn_sock.recv(65536)
                if not data:
                    return
                for event in conn.receive_data(data):
                    if (
                        isinstance(event, h2.events.RequestReceived)
                        and (b":path", ECHO.encode()) in event.headers
                        and not refused
                    ):
                        refused.append(event.stream_id)
                        conn.reset_stream(event.stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
                    elif isinstance(event, h2.events.DataReceived):
                        bodies[event.stream_id] = bodies.get(event.stream_id, b"") + event.data
                        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, h2.events.StreamEnded) and event.stream_id not in refused:
                        conn.send_headers(
                            event.stream_id, [(":status", "200"), ("content-type", "application/grpc")]
                        )
                        conn.send_data(event.stream_id, bodies.pop(event.stream_id, b""))
                        conn.send_headers(event.stream_id, [("grpc-status", "0")], end_stream=True)
                conn_sock.sendall(conn.data_to_send())

        thread = threading.Thread(target=serve_one_connection, daemon=True)
        thread.start()
        daemon = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
        try:
            with pytest.raises(ConnectionError, match="stream reset, error code 7"):
                await in_thread(h2_unary, daemon.config.listen, ECHO, b"refused")
            answer: H2Answer = await in_thread(h2_unary, daemon.config.listen, ECHO, b"again")
        finally:
            listener.close()
        assert (grpc_message(b"again"), b"0") == (answer.body, answer.trailers[b"grpc-status"])
        assert 1 == len(refused)

    @pytest.mark.parametrize(
        ("code", "status"),
        [
            (h2.errors.ErrorCodes.PROTOCOL_ERROR, b"13"),  # INTERNAL
            (h2.errors.ErrorCodes.CANCEL, b"1"),  # CANCELLED
            (h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, b"8"),  # RESOURCE_EXHAUSTED
            (h2.errors.ErrorCodes.FLOW_CONTROL_ERROR, b"8"),  # RESOURCE_EXHAUSTED
            (h2.errors.ErrorCodes.INADEQUATE_SECURITY, b"7"),  # PERMISSION_DENIED
        ],
    )
    async def test_a_stream_reset_by_the_runtime_is_named(
        self, nursery: trio.Nursery, sockdir: str, code: int, status: bytes
    ) -> None:
        """A runtime that resets a stream (e.g. containerd on a request it takes for malformed):
        the caller gets the status grpc-go gives that reset, naming the code, not UNAVAILABLE."""
        backend = os.path.join(sockdir, "backend.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(backend)
        listener.listen(4)

        def reset_every_stream() -> None:
            conn_sock, _ = listener.accept()
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
            conn.initiate_connection()
            # The proxy closes its connection when the test ends, maybe while this thread answers
            # frames that followed the reset (the request's DATA, a PING): that ends this runtime,
            # it is no failure of the test's (an unhandled thread error fails the test under
            # pytest; seen once in a run of the whole suite).
            with conn_sock, contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn_sock.sendall(conn.data_to_send())
                while data := conn_sock.recv(65536):
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.RequestReceived):
                            conn.reset_stream(event.stream_id, code)
                    conn_sock.sendall(conn.data_to_send())

        threading.Thread(target=reset_every_stream, daemon=True).start()
        daemon = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
        try:
            answer: H2Answer = await in_thread(h2_unary, daemon.config.listen, ECHO, b"x")
        finally:
            listener.close()
        assert status == answer.trailers[b"grpc-status"]
        message = urllib.parse.unquote(answer.trailers[b"grpc-message"].decode())
        assert f"reset the stream ({h2.errors.ErrorCodes(code).name})" in message, message

    async def test_header_blocks_larger_than_a_frame(self, nursery: trio.Nursery, sockdir: str) -> None:
        """40 KB of metadata crosses in HEADERS + CONTINUATION frames, both ways."""
        backend, daemon = await _backend_and_proxy(nursery, sockdir)
        big = "v" * 40_000

        async def echo_metadata(stream: rpc.Stream, messages: list[bytes]) -> None:
            await stream.send_initial_metadata()
            await stream.send_message(messages[0])
            reply = str(dict(metadata_items(stream.metadata)).get("x-big"))
            await stream.send_trailing_metadata(metadata=[(b"x-big-reply", reply.encode())])

        backend.behaviours[ECHO] = echo_metadata
        channel = grpc.insecure_channel(
            f"unix://{daemon.config.listen}", options=[("grpc.max_metadata_size", 1 << 20)]
        )
        try:
            answer, call = await in_thread(
                raw_unary(channel, ECHO).with_call, b"ping", metadata=[("x-big", big)], timeout=10
            )
        finally:
            channel.close()
        assert b"ping" == answer
        assert big == dict(call.trailing_metadata())["x-big-reply"]
        (received,) = [r for r in backend.received if r.path == ECHO]
        assert big == received.metadata["x-big"]

    async def test_padded_data_and_priority_frames(self, nursery: trio.Nursery, sockdir: str) -> None:
        """Padding is removed before the message is passed on; PRIORITY frames are ignored."""
        backend, daemon = await _backend_and_proxy(nursery, sockdir)
        answer: H2Answer = await in_thread(
            h2_unary, daemon.config.listen, ECHO, b"padded", pad=40, priority=True
        )
        assert (grpc_message(b"padded"), b"0") == (answer.body, answer.trailers[b"grpc-status"])
        assert [[b"padded"]] == backend.messages_for(ECHO)
