"""Tests of the relay (krproxy/relay/): HTTP/2 situations the other tests do not reach.

Peers are bare ``h2`` connections over blocking sockets in threads, so a test can send and
withhold exactly the frames it needs: an upstream that answers in odd ways, a caller that
resets streams or never grants flow-control window.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import pytest
import trio

from krproxy.forward import Forward, Reply
from krproxy.grpcstatus import GRPCError, Status
from krproxy.relay import Relay, Route, connect_unix
from krproxy.relay.connection import CONNECTION_WINDOW
from krproxy.relay.rpc import UpstreamError, grpc_message, request_headers
from tests.integration.support import (
    LIVENESS_LIMIT,
    RequestsByStream,
    ThreadedUnixServer,
    received,
    serve_relay,
    serve_relay_to,
    wait_until,
)

PATH = "/test.Review/Call"
Fields = list[tuple[bytes, bytes]]


@attrs.define
class Answer:
    """What the scripted upstream sends on one stream."""

    headers: Fields | None = attrs.field(
        factory=lambda: [(b":status", b"200"), (b"content-type", b"application/grpc")]
    )
    body: bytes = b""
    trailers: Fields | None = attrs.field(factory=lambda: [(b"grpc-status", b"0")])


Script = Callable[[bytes, bytes], Answer]  # (path, request body) -> answer


class RawServer(ThreadedUnixServer):
    """An ``h2`` server on a unix socket, one thread per connection, answering by ``script``.

    Honours the relay's flow-control windows; ``sent`` counts answers sent completely.
    """

    def __init__(self, path: str, script: Script, settings: dict[int, int] | None = None) -> None:
        self.script = script
        self.settings = settings or {}
        self.sent = 0
        self.lock = threading.Lock()
        super().__init__(path, backlog=16)

    def serve_connection(self, sock: socket.socket) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        if self.settings:
            conn.update_settings(self.settings)
        sock.sendall(conn.data_to_send())
        requests = RequestsByStream()
        outgoing: dict[int, tuple[bytearray, Fields | None]] = {}
        try:
            for data in received(sock, lambda: self.stopping):
                for event in conn.receive_data(data):
                    if (request := requests.take(conn, event)) is not None:
                        answer = self.script(*request)
                        if answer.headers is not None:
                            conn.send_headers(
                                event.stream_id,
                                answer.headers,
                                end_stream=answer.trailers is None and not answer.body,
                            )
                        outgoing[event.stream_id] = (bytearray(answer.body), answer.trailers)
                    elif isinstance(event, h2.events.StreamReset):
                        outgoing.pop(event.stream_id, None)
                self._send(conn, outgoing)
                sock.sendall(conn.data_to_send())
        except (OSError, h2.exceptions.ProtocolError):
            return
        finally:
            sock.close()

    def _send(
        self, conn: h2.connection.H2Connection, outgoing: dict[int, tuple[bytearray, Fields | None]]
    ) -> None:
        for stream_id, (body, trailers) in list(outgoing.items()):
            while body:
                size = min(len(body), conn.local_flow_control_window(stream_id), conn.max_outbound_frame_size)
                if size <= 0:
                    break
                conn.send_data(
                    stream_id, bytes(body[:size]), end_stream=trailers is None and size == len(body)
                )
                del body[:size]
            if body:
                continue
            if trailers is not None:
                conn.send_headers(stream_id, trailers, end_stream=True)
            del outgoing[stream_id]
            with self.lock:
                self.sent += 1


@pytest.fixture
def upstream_path(short_tmp: Path) -> str:
    return str(short_tmp / "upstream.sock")


@contextlib.contextmanager
def serving(path: str, script: Script, settings: dict[int, int] | None = None) -> Iterator[RawServer]:
    server = RawServer(path, script, settings)
    try:
        yield server
    finally:
        server.close()


class Client:
    """A bare ``h2`` client connection to the relay (blocking; use it from a worker thread)."""

    def __init__(self, path: str, window: int | None = None, limit: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(limit)
        self.sock.connect(path)
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.conn.initiate_connection()
        if window is not None:
            self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.sock.sendall(self.conn.data_to_send())

    def close(self) -> None:
        self.sock.close()

    def start(self, path: str, message: bytes, extra: Fields | None = None) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        fields = [*request_headers(path, b"review"), *(extra or [])]
        self.conn.send_headers(stream_id, fields)
        self.conn.send_data(stream_id, grpc_message(message), end_stream=True)
        return stream_id

    def flush(self) -> None:
        self.sock.sendall(self.conn.data_to_send())

    def events(self) -> Iterator[h2.events.Event]:
        """The connection's events as they are read; ConnectionError when the relay closes it."""
        while True:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the relay closed the connection")
            yield from self.conn.receive_data(data)

    def until(self, stream_id: int, done: Callable[[h2.events.Event], bool]) -> list[h2.events.Event]:
        """Read (granting window as data is read) until ``done`` holds for an event of the stream."""
        seen: list[h2.events.Event] = []
        for event in self.events():
            if isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            self.flush()  # the window granted, and h2's own answers (SETTINGS and PING acks)
            if getattr(event, "stream_id", None) == stream_id:
                seen.append(event)
                if done(event):
                    return seen
        raise AssertionError("unreachable: events() ends only by raising")

    def call(self, path: str, message: bytes) -> tuple[bytes, dict[bytes, bytes]]:
        """A whole unary call: the body and the trailers."""
        stream_id = self.start(path, message)
        self.flush()
        events = self.until(
            stream_id, lambda e: isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset))
        )
        body = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
        # The trailers, or the headers of a trailers-only answer.
        blocks = [
            e for e in events if isinstance(e, (h2.events.ResponseReceived, h2.events.TrailersReceived))
        ]
        return body, dict(blocks[-1].headers) if blocks else {}  # type: ignore[arg-type]


class TestFlowControlCredit:
    async def test_reply_bytes_dropped_by_a_reset_credit_the_upstream(
        self, nursery: trio.Nursery, short_tmp: Path, upstream_path: str
    ) -> None:
        """A caller that resets a call while its reply waits in the relay (its window is closed):
        the bytes the relay drops must be given back to the upstream connection's window. Else
        fifteen such calls of 1 MiB leave less than 1 MiB of the 16 MiB connection window, and
        a 1 MiB answer to a caller that reads it never arrives (nor any answer after it)."""
        big = b"r" * (1 << 20)
        relay = Relay()
        listen = str(short_tmp / "relay.sock")
        with serving(
            upstream_path,
            lambda path, body: Answer(body=grpc_message(big) if body == grpc_message(b"big") else body),
        ) as server:
            relay.configure(Route(relay.transport, "runtime", connect_unix(upstream_path)), None, {}, [])
            await serve_relay(nursery, relay, listen)
            stalled = Client(listen, window=0)  # never grants the relay any stream window
            try:
                for i in range(15):  # 15.7 MiB of the connection's 16 MiB
                    stream_id = stalled.start(PATH, b"big")
                    await trio.to_thread.run_sync(stalled.flush)
                    await wait_until(lambda i=i: server.sent == i + 1)  # type: ignore[misc]
                    await wait_until(lambda: _pending_to_callers(relay) == len(big) + 5)
                    stalled.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
                    await trio.to_thread.run_sync(stalled.flush)
                    await wait_until(lambda: relay.transport.in_flight == 0)
                fresh = Client(listen)
                try:
                    body, trailers = await trio.to_thread.run_sync(fresh.call, PATH, b"big")
                finally:
                    fresh.close()
            finally:
                stalled.close()
        assert (grpc_message(big), b"0") == (body, trailers[b"grpc-status"])


def _pending_to_callers(relay: Relay) -> int:
    return sum(len(half.pending) for ep in relay.transport._clients for half in ep.halves.values())


class TestOwnCalls:
    async def test_large_trailers_are_an_answer_not_a_broken_connection(
        self, relay: Relay, upstream_path: str
    ) -> None:
        """A status message of 100 KB (grpc-go accepts header lists up to 16 MiB) is the answer;
        the relay must not take it for an HPACK error and drop the connection with every call on it."""
        message = "m" * 100_000
        route = relay.route_to(upstream_path, "plugin p")

        def script(path: bytes, body: bytes) -> Answer:
            fields = [(b":status", b"200"), (b"grpc-status", b"9"), (b"grpc-message", message.encode())]
            return Answer(headers=None, trailers=fields)

        with serving(upstream_path, script), pytest.raises(GRPCError) as info:
            await relay.transport.call(route, PATH, b"x", within=LIVENESS_LIMIT)
        assert (Status.FAILED_PRECONDITION, message) == (info.value.status, info.value.message)

    async def test_an_answer_without_trailers_frees_its_stream(
        self, relay: Relay, upstream_path: str
    ) -> None:
        """An upstream ending its answer with DATA (END_STREAM) and no status: the call fails, and
        its stream no longer counts against the upstream's MAX_CONCURRENT_STREAMS (here 1)."""
        route = relay.route_to(upstream_path, "plugin p")

        def script(path: bytes, body: bytes) -> Answer:
            return Answer(
                body=body, trailers=None if body == grpc_message(b"bad") else [(b"grpc-status", b"0")]
            )

        with serving(upstream_path, script, {h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1}):
            assert b"warm-up" == await relay.transport.call(
                route, PATH, b"warm-up", within=LIVENESS_LIMIT
            )  # SETTINGS known
            with pytest.raises(UpstreamError, match="without a status"):
                await relay.transport.call(route, PATH, b"bad", within=LIVENESS_LIMIT)
            assert b"good" == await relay.transport.call(route, PATH, b"good", within=LIVENESS_LIMIT)

    async def test_undecodable_status_details_leave_the_status(
        self, relay: Relay, upstream_path: str
    ) -> None:
        """grpc-status-details-bin that is not base64 (5 characters cannot be): the answer's
        status and message still come back (as GRPCError), not a binascii.Error from deep inside."""
        route = relay.route_to(upstream_path, "plugin p")
        trailers = [
            (b"grpc-status", b"5"),
            (b"grpc-message", b"gone"),
            (b"grpc-status-details-bin", b"AAAAA"),
        ]
        with (
            serving(upstream_path, lambda path, body: Answer(trailers=trailers)),
            pytest.raises(GRPCError) as info,
        ):
            await relay.transport.call(route, PATH, b"x", within=LIVENESS_LIMIT)
        assert (Status.NOT_FOUND, "gone", None) == (info.value.status, info.value.message, info.value.details)

    async def test_an_answer_cut_off_for_size_gives_back_all_its_window(
        self, relay: Relay, upstream_path: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An answer above its limit: every byte received on the connection is granted back,
        the frame that crossed the limit included (else each such answer shrinks the window)."""
        route = relay.route_to(upstream_path, "plugin p")
        with serving(upstream_path, lambda path, body: Answer(body=grpc_message(b"x" * 300_000))):
            with pytest.raises(UpstreamError, match="larger than 100000 bytes"):
                await relay.transport.call(route, PATH, b"x", within=LIVENESS_LIMIT, max_answer=100_000)
            ep = route.ep
            assert ep is not None
            await wait_until(lambda: ep.recv_window + ep.to_grant == CONNECTION_WINDOW)


class TestCallsWithHookPoints:
    async def test_a_call_reset_before_its_interceptor_does_not_run_it(
        self, nursery: trio.Nursery, short_tmp: Path
    ) -> None:
        """A caller that sends a request and resets the stream in the same packet has cancelled
        the call: its interceptor (which would forward, e.g., a RunPodSandbox) must not run."""
        seen: list[bytes] = []

        async def interceptor(path: str, request: bytes, forward: Forward) -> Reply:
            seen.append(request)
            return Reply(request)

        relay = Relay()
        relay.configure(None, None, {PATH: interceptor}, [PATH])
        listen = str(short_tmp / "relay.sock")
        await serve_relay(nursery, relay, listen)
        client = Client(listen)
        try:
            stream_id = client.start(PATH, b"cancelled")
            client.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            await trio.to_thread.run_sync(client.flush)  # HEADERS, DATA, RST_STREAM at once
            body, trailers = await trio.to_thread.run_sync(client.call, PATH, b"second")
        finally:
            client.close()
        assert (grpc_message(b"second"), b"0") == (body, trailers[b"grpc-status"])
        assert [b"second"] == seen

    async def test_a_runtime_lost_under_an_intercepted_call_is_unavailable(
        self, nursery: trio.Nursery, short_tmp: Path, upstream_path: str
    ) -> None:
        """An intercepted call whose forward finds the runtime unreachable, or loses it mid-call,
        ends UNAVAILABLE naming the runtime (docs/operations.md), as a relayed call does, and
        not UNKNOWN as if the interceptor had a bug."""

        async def passthrough(path: str, request: bytes, forward: Forward) -> Reply:
            return await forward(request)

        relay = Relay()
        runtime = Route(relay.transport, "backend runtime rt.sock", connect_unix(upstream_path))
        relay.configure(runtime, None, {PATH: passthrough}, [PATH])
        listen = str(short_tmp / "relay.sock")
        await serve_relay(nursery, relay, listen)
        client = Client(listen)
        try:
            _, unreachable = await trio.to_thread.run_sync(client.call, PATH, b"x")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(upstream_path)
            listener.listen(1)

            def hang_up() -> None:  # reads the request, then the runtime "dies"
                conn, _ = listener.accept()
                conn.recv(65536)
                conn.close()

            thread = threading.Thread(target=hang_up)
            thread.start()
            try:
                _, dropped = await trio.to_thread.run_sync(client.call, PATH, b"x")
            finally:
                thread.join()
                listener.close()
        finally:
            client.close()
        for trailers in (unreachable, dropped):
            assert b"14" == trailers[b"grpc-status"], trailers
            assert b"backend runtime rt.sock is unavailable" in trailers[b"grpc-message"], trailers


class TestHardening:
    async def test_an_upstream_refusing_every_call_is_not_retried_forever(
        self, relay: Relay, upstream_path: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Refused calls are sent again, but a bounded number of times, even without a deadline."""
        import krproxy.relay.transport as relay_module

        monkeypatch.setattr(relay_module, "REFUSED_ATTEMPTS", 5)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(upstream_path)
        listener.listen(1)
        listener.settimeout(5)
        refused = []

        def refuse_everything() -> None:
            sock, _ = listener.accept()
            sock.settimeout(5)
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
            conn.initiate_connection()
            sock.sendall(conn.data_to_send())
            with contextlib.suppress(OSError):
                while len(refused) < 5:
                    data = sock.recv(65536)
                    if not data:
                        break
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.RequestReceived):
                            refused.append(event.stream_id)
                            conn.reset_stream(event.stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
                    sock.sendall(conn.data_to_send())
            sock.close()

        thread = threading.Thread(target=refuse_everything, daemon=True)
        thread.start()
        try:
            with pytest.raises(UpstreamError, match="refused the call 5 times"):
                await relay.transport.unary(relay.route_to(upstream_path, "upstream"), PATH, b"x")
        finally:
            thread.join(5)
            listener.close()
        assert 5 == len(refused)

    async def test_a_stream_window_beyond_the_limit_resets_that_stream(
        self, nursery: trio.Nursery, relay: Relay, upstream_path: str, short_tmp: Path
    ) -> None:
        """A WINDOW_UPDATE taking a stream's window past 2^31-1 is that stream's flow-control
        error (RFC 9113 §6.9.1): RST_STREAM FLOW_CONTROL_ERROR, and the connection still answers."""
        from krproxy.h2 import frames

        started = threading.Event()

        def slow(path: bytes, body: bytes) -> Answer:
            started.set()
            import time

            time.sleep(1)
            return Answer(body=grpc_message(b"late"))

        listen = await serve_relay_to(nursery, relay, upstream_path, str(short_tmp), [PATH])

        def run() -> tuple[int, bool]:
            client = Client(listen)
            try:
                stream_id = client.start(PATH, b"x")
                client.flush()
                started.wait(5)
                client.sock.sendall(frames.window_update(stream_id, 2**31 - 1))
                code = None
                for event in client.events():
                    if isinstance(event, h2.events.ConnectionTerminated):
                        raise AssertionError(f"GOAWAY {event.error_code!r}")
                    if isinstance(event, h2.events.StreamReset):
                        code = int(event.error_code)
                        client.conn.ping(b"still-up")
                        client.flush()
                    if isinstance(event, h2.events.PingAckReceived):
                        assert code is not None
                        return code, True
                raise AssertionError("unreachable: events() ends only by raising")
            finally:
                client.close()

        with serving(upstream_path, slow):
            answered = await trio.to_thread.run_sync(run)
        assert (h2.errors.ErrorCodes.FLOW_CONTROL_ERROR, True) == answered

    async def test_a_peer_that_sends_without_reading_is_cut_off(
        self,
        nursery: trio.Nursery,
        relay: Relay,
        upstream_path: str,
        short_tmp: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Pings answered into a connection nobody reads: the relay closes it instead of queueing forever."""
        from krproxy.h2 import frames

        monkeypatch.setattr("krproxy.relay.connection.MAX_UNSENT", 64 * 1024)
        listen = await serve_relay_to(nursery, relay, upstream_path, str(short_tmp), [PATH])
        client = Client(listen)
        ping = frames.frame(frames.PING, 0, 0, b"12345678")
        try:

            def flood() -> None:
                with contextlib.suppress(OSError):  # the relay closing its end ends the flood
                    for _ in range(200):
                        client.sock.sendall(ping * 1000)

            await trio.to_thread.run_sync(flood)
            await wait_until(lambda: not relay.transport._clients)
        finally:
            client.close()
