"""Review of createlat5's hand-over: the relay's resend of a handed-over call the runtime refused, against
callers that give up, a runtime that restarts (GOAWAY, a new connection), a runtime's trailers-only
errors, and a relay that drains.

A scripted h2 runtime on a unix socket (a thread; every connection it accepts is served) answers each
stream as its script says: refuse it (REFUSED_STREAM), go away (GOAWAY saying no stream was processed,
then close the connection), answer with an error in a trailers-only block, or echo the request.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import pytest
import trio

import krproxy.relay._local as local_module
from krproxy.calls import CallRecord
from krproxy.forward import Forward, Reply, Watcher
from krproxy.grpcstatus import Status
from krproxy.relay import Relay
from krproxy.relay.rpc import grpc_message
from tests.integration.support import LIVENESS_LIMIT, serve_relay, wait_until

PATH = "/test.Echo/Hooked"

REFUSE, GOAWAY, ERROR, ECHO, SILENT = "refuse", "goaway", "error", "echo", "silent"
SLOW_REFUSE = "refuse after a second"  # (a runtime that took its time before refusing)


class Runtime:
    """Answers the n-th stream it is sent (over all connections) as ``script(n)`` says."""

    def __init__(self, path: str, script: Callable[[int], str]) -> None:
        self.script = script
        self.bodies: list[bytes] = []
        self.headers: list[dict[bytes, bytes]] = []
        self.resets: list[int] = []  # the error codes of the streams the relay reset
        self.connections = 0
        self.socks: list[socket.socket] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(8)
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            self.socks.append(sock)
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        bodies: dict[int, bytes] = {}
        with sock:
            try:
                sock.sendall(conn.data_to_send())
                while True:
                    data = sock.recv(65536)
                    if not data:
                        return
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.RequestReceived):
                            self.headers.append(dict(event.headers))
                        elif isinstance(event, h2.events.StreamReset):
                            self.resets.append(event.error_code)
                        elif isinstance(event, h2.events.DataReceived):
                            bodies[event.stream_id] = bodies.get(event.stream_id, b"") + event.data
                            conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                        elif isinstance(event, h2.events.StreamEnded):
                            body = bodies.pop(event.stream_id, b"")
                            with self.lock:
                                self.bodies.append(body)
                                action = self.script(len(self.bodies))
                            if action == GOAWAY:  # a runtime restarting: nothing processed, connection closed
                                conn.close_connection(last_stream_id=0)
                                sock.sendall(conn.data_to_send())
                                return
                            with contextlib.suppress(h2.exceptions.StreamClosedError):  # the relay gave up
                                self._answer(conn, event.stream_id, action, body)
                    sock.sendall(conn.data_to_send())
            except OSError:  # the relay went away, or close() shut the socket down
                return

    @staticmethod
    def _answer(conn: h2.connection.H2Connection, stream_id: int, action: str, body: bytes) -> None:
        if action == SILENT:
            return
        if action == SLOW_REFUSE:
            time.sleep(1.0)
        if action in (REFUSE, SLOW_REFUSE):
            conn.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
        elif action == ERROR:
            conn.send_headers(
                stream_id,
                [
                    (":status", "200"),
                    ("content-type", "application/grpc"),
                    ("grpc-status", "5"),
                    ("grpc-message", "no such sandbox"),
                ],
                end_stream=True,
            )
        else:
            conn.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
            if len(body) > 16000:  # (more than one frame: answer its size instead)
                body = grpc_message(b"%d bytes" % len(body))
            conn.send_data(stream_id, body)
            conn.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # its accept returns (closing alone does not wake it)
        self.listener.close()
        for sock in self.socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self.threads:
            thread.join(5)


class Hooked:
    """Runs its "hooks" (counted), changes the request and hands the forward over."""

    def __init__(self) -> None:
        self.runs = 0
        self.told: list[tuple[Status, bytes | None]] = []
        self.hand_over = True  # False: await the forward, as every interceptor did on d5d66c5

    async def __call__(self, path: str, request: bytes, forward: Forward) -> Reply:
        self.runs += 1
        await trio.lowlevel.checkpoint()
        if not self.hand_over:
            return await forward(b"changed " + request)
        watcher: Watcher = lambda status, reply: self.told.append((status, reply))  # noqa: E731
        reply: Reply = forward.hand_over(b"changed " + request, watcher)  # type: ignore[attr-defined]
        return reply


class Harness:
    def __init__(
        self, relay: Relay, nursery: trio.Nursery, short_tmp: Path, channel: Callable[[str], grpc.Channel]
    ):
        self.relay, self.nursery, self.short_tmp, self.channel_to = relay, nursery, short_tmp, channel
        self.records: list[CallRecord] = []
        self.runtimes: list[Runtime] = []
        self.hooked = Hooked()

    async def start(self, script: Callable[[int], str]) -> tuple[Runtime, grpc.UnaryUnaryMultiCallable]:
        runtime = Runtime(str(self.short_tmp / "runtime.sock"), script)
        self.runtimes.append(runtime)
        relay = self.relay
        relay.keep_messages = True
        relay.observers.append(self.records.append)
        route = relay.route_to(str(self.short_tmp / "runtime.sock"), "runtime")
        relay.configure(route, None, {PATH: self.hooked}, [PATH])
        listen = await serve_relay(self.nursery, relay, str(self.short_tmp / "relay.sock"))
        method = self.channel_to(listen).unary_unary(
            PATH, request_serializer=None, response_deserializer=None
        )
        return runtime, method

    async def call(
        self,
        method: grpc.UnaryUnaryMultiCallable,
        timeout: float = LIVENESS_LIMIT,  # noqa: ASYNC109
        compression: grpc.Compression | None = None,
        request: bytes = b"ping",
    ) -> bytes | grpc.RpcError:
        try:
            with trio.fail_after(LIVENESS_LIMIT + 5):
                call = functools.partial(method, request, timeout=timeout, compression=compression)
                answer: bytes = await trio.to_thread.run_sync(call)
                return answer
        except grpc.RpcError as err:
            return err


@pytest.fixture
def harness(
    relay: Relay, nursery: trio.Nursery, short_tmp: Path, channel_to: Callable[[str], grpc.Channel]
) -> Iterator[Harness]:
    made = Harness(relay, nursery, short_tmp, channel_to)
    yield made
    for runtime in made.runtimes:
        runtime.close()


def code_of(result: bytes | grpc.RpcError) -> grpc.StatusCode:
    assert isinstance(result, grpc.RpcError), result
    code: grpc.StatusCode = result.code()
    return code


async def settled(count: Callable[[], int], seconds: float = 1.0) -> int:
    """*count* once it stayed the same for *seconds*."""
    while True:
        before = count()
        await trio.sleep(seconds)
        if count() == before:
            return before


class TestARefusedHandedOverCall:
    async def test_is_not_sent_again_once_its_deadline_passed(self, harness: Harness) -> None:
        """The runtime refuses every attempt; the caller's 1 s deadline passes: it gets DEADLINE_EXCEEDED,
        the resends stop, the watcher is told, no call is left in flight."""
        runtime, method = await harness.start(lambda n: REFUSE)
        result = await harness.call(method, timeout=1.0)

        assert grpc.StatusCode.DEADLINE_EXCEEDED == code_of(result)
        with trio.fail_after(LIVENESS_LIMIT):
            await harness.relay.wait_idle()
        sent = await settled(lambda: len(runtime.bodies))
        assert 1 <= sent < 200
        await wait_until(lambda: bool(harness.hooked.told))
        # (the relay's timer or grpcio's RST_STREAM at its own deadline, whichever comes first)
        ends = {Status.DEADLINE_EXCEEDED, Status.CANCELLED}
        ((status, reply),) = harness.hooked.told
        assert (True, None) == (status in ends, reply)
        assert 1 == harness.hooked.runs
        await wait_until(lambda: bool(harness.records))
        assert status == harness.records[0].status

    async def test_waiting_to_be_resent_when_its_deadline_passes_is_not_sent(
        self, harness: Harness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The pause before a resend made 4 s long: the caller's 2 s deadline passes during it, and the
        runtime (refused once) never gets the request again: a create nobody waits for."""
        monkeypatch.setattr(local_module, "_REFUSED_PAUSE", 4.0)
        runtime, method = await harness.start(lambda n: REFUSE)
        result = await harness.call(method, timeout=2.0)

        assert grpc.StatusCode.DEADLINE_EXCEEDED == code_of(result)
        await trio.sleep(4.0)  # past the pause's end
        assert [grpc_message(b"changed ping")] == runtime.bodies
        assert 0 == harness.relay.in_flight

    async def test_is_not_sent_again_once_its_caller_cancelled(self, harness: Harness) -> None:
        runtime, method = await harness.start(lambda n: REFUSE)
        future = method.future(b"ping", timeout=LIVENESS_LIMIT)
        await wait_until(lambda: len(runtime.bodies) >= 3)
        future.cancel()

        with trio.fail_after(LIVENESS_LIMIT):
            await harness.relay.wait_idle()
        sent = await settled(lambda: len(runtime.bodies))
        assert sent < 200
        await wait_until(lambda: bool(harness.hooked.told))
        assert [(Status.CANCELLED, None)] == harness.hooked.told
        assert 1 == harness.hooked.runs

    async def test_is_sent_again_on_a_new_connection_after_the_runtime_went_away(
        self, harness: Harness
    ) -> None:
        """containerd restarted under the proxy: GOAWAY (nothing processed), the connection closed. The
        same rewritten bytes go to the new connection; the hooks ran once."""
        runtime, method = await harness.start(lambda n: GOAWAY if n == 1 else ECHO)
        result = await harness.call(method)

        assert b"changed ping" == result
        assert [grpc_message(b"changed ping")] * 2 == runtime.bodies
        assert 2 == runtime.connections
        assert 1 == harness.hooked.runs
        await wait_until(lambda: bool(harness.records))
        assert [(Status.OK, b"changed ping")] == harness.hooked.told
        record = harness.records[0]
        assert (b"ping", b"changed ping", b"changed ping", Status.OK) == (
            record.request,
            record.forwarded,
            record.reply,
            record.status,
        )

    async def test_refused_then_answered_with_a_trailers_only_error_passes_the_error_on(
        self, harness: Harness
    ) -> None:
        runtime, method = await harness.start(lambda n: REFUSE if n <= 3 else ERROR)
        result = await harness.call(method)

        assert grpc.StatusCode.NOT_FOUND == code_of(result)
        assert isinstance(result, grpc.RpcError)
        assert "no such sandbox" == result.details()
        assert 4 == len(runtime.bodies)
        await wait_until(lambda: bool(harness.records))
        assert [(Status.NOT_FOUND, None)] == harness.hooked.told
        record = harness.records[0]
        assert (Status.NOT_FOUND, "no such sandbox", None, b"changed ping") == (
            record.status,
            record.message,
            record.reply,
            record.forwarded,
        )

    async def test_being_resent_while_the_relay_drains_is_answered(self, harness: Harness) -> None:
        """SIGTERM's drain (GOAWAY to callers, wait for calls in flight) mid-resend: the call still gets
        its answer and the drain ends."""
        runtime, method = await harness.start(lambda n: REFUSE if n <= 40 else ECHO)
        async with trio.open_nursery() as calls:
            results: list[bytes | grpc.RpcError] = []

            async def call() -> None:
                results.append(await harness.call(method))

            calls.start_soon(call)
            await wait_until(lambda: len(runtime.bodies) >= 2)
            harness.relay.start_draining()
            with trio.fail_after(LIVENESS_LIMIT):
                await harness.relay.wait_drained()
        assert [b"changed ping"] == results
        assert 41 == len(runtime.bodies)
        assert 1 == harness.hooked.runs


class TestAHandedOverCall:
    async def test_whose_request_came_compressed_goes_upstream_uncompressed(self, harness: Harness) -> None:
        """The interceptor read it decompressed and changed it; the runtime gets one plain message, with
        no grpc-encoding (nor the caller's grpc-accept-encoding)."""
        runtime, method = await harness.start(lambda n: ECHO)
        result = await harness.call(method, compression=grpc.Compression.Gzip)

        assert b"changed ping" == result
        assert [grpc_message(b"changed ping")] == runtime.bodies
        (headers,) = runtime.headers
        assert b"grpc-encoding" not in headers
        assert b"grpc-accept-encoding" not in headers
        await wait_until(lambda: bool(harness.records))
        assert (b"ping", b"changed ping", b"changed ping") == (
            harness.records[0].request,
            harness.records[0].forwarded,
            harness.records[0].reply,
        )

    async def test_its_caller_cancels_while_the_runtime_works_is_reset_upstream(
        self, harness: Harness
    ) -> None:
        """The runtime never answers; kubelet gives up (RST_STREAM): the runtime's stream is reset
        (CANCEL), the watcher told CANCELLED (nothing kept), no call left."""
        runtime, method = await harness.start(lambda n: SILENT)
        future = method.future(b"ping", timeout=LIVENESS_LIMIT)
        await wait_until(lambda: bool(runtime.bodies))
        future.cancel()

        await wait_until(lambda: bool(runtime.resets))
        assert [h2.errors.ErrorCodes.CANCEL] == runtime.resets
        with trio.fail_after(LIVENESS_LIMIT):
            await harness.relay.wait_idle()
        await wait_until(lambda: bool(harness.hooked.told))
        assert [(Status.CANCELLED, None)] == harness.hooked.told
        assert 1 == len(runtime.bodies)

    @pytest.mark.parametrize("hand_over", [True, False], ids=["handed over", "forwarded"])
    async def test_refused_counts_every_attempts_time_as_backend_time(
        self, harness: Harness, hand_over: bool
    ) -> None:
        """As a forward does (Relay.unary counts its attempts): the runtime took a second to refuse the
        first attempt, then answered; the record's backend time has that second, not only the last
        attempt's."""
        harness.hooked.hand_over = hand_over
        runtime, method = await harness.start(lambda n: SLOW_REFUSE if n == 1 else ECHO)
        result = await harness.call(method)

        assert b"changed ping" == result
        assert 2 == len(runtime.bodies)
        await wait_until(lambda: bool(harness.records))
        assert harness.records[0].backend_seconds >= 1.0

    async def test_large_is_sent_whole_under_flow_control(self, harness: Harness) -> None:
        """A 3 MiB request (far beyond HTTP/2's initial 64 KiB windows) handed over, changed: the runtime
        gets every byte (it answers their count)."""
        runtime, method = await harness.start(lambda n: ECHO)
        big = bytes(range(256)) * (3 * 4096)
        result = await harness.call(method, request=big)

        framed = grpc_message(b"changed " + big)
        assert b"%d bytes" % len(framed) == result
        assert [framed] == runtime.bodies
        await wait_until(lambda: bool(harness.records))
        assert [(Status.OK, result)] == harness.hooked.told
        assert (big, b"changed " + big) == (harness.records[0].request, harness.records[0].forwarded)
