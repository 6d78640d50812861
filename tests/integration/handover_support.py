"""A scripted h2 runtime, an interceptor that hands its forward over, and a relay between them and a
grpcio caller: the hand-over tests' (test_relay_hand_over.py, test_relay_hand_over_retry.py) harness.

The runtime (a thread on a unix socket; every connection it accepts is served) answers the n-th
stream it is sent as its script says: refuse it (REFUSED_STREAM), send the answer's headers and then
refuse it, go away (GOAWAY saying no stream was processed, then close the connection), answer with an
error in a trailers-only block, stay silent, or echo the request.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import trio

from krproxy.calls import CallRecord
from krproxy.forward import Forward, Interceptor, Reply, Watch, Watcher
from krproxy.grpcstatus import Status
from krproxy.relay import Relay
from krproxy.relay.rpc import grpc_message
from tests.integration.support import LIVENESS_LIMIT, serve_relay

PATH = "/test.Echo/Hooked"
REFUSE, GOAWAY, ERROR, ECHO, SILENT = "refuse", "goaway", "error", "echo", "silent"
SLOW_REFUSE = "refuse after a second"  # (a runtime that took its time before refusing)
HEADERS_REFUSE = "answer's headers, then refuse"  # (a broken runtime)


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
        if action == HEADERS_REFUSE:
            conn.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
        if action in (REFUSE, SLOW_REFUSE, HEADERS_REFUSE):
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

    async def start(
        self, script: Callable[[int], str], interceptor: Interceptor | None = None, watch: Watch | None = None
    ) -> tuple[Runtime, grpc.UnaryUnaryMultiCallable]:
        """A relay in front of a :class:`Runtime` answering as *script* says, its one path intercepted by
        *interceptor* (:attr:`hooked` by default) and watched by *watch*, if given."""
        runtime = Runtime(str(self.short_tmp / "runtime.sock"), script)
        self.runtimes.append(runtime)
        relay = self.relay
        relay.transport.keep_messages = True
        relay.transport.observers.append(self.records.append)
        route = relay.route_to(str(self.short_tmp / "runtime.sock"), "runtime")
        interceptors = {PATH: interceptor or self.hooked}
        relay.configure(route, None, interceptors, [PATH], watches={PATH: watch} if watch else None)
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
