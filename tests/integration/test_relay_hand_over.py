"""An interceptor hands its last step to the relay (``forward.hand_over``): its request goes upstream from
the call's own stream, the runtime's answer is relayed as a watched call's, and the watcher is told its end.

Its hooks have run, so a runtime refusing the call unprocessed (REFUSED_STREAM) is not passed to the caller,
whose retry would run them again: the relay sends the same bytes again, a bounded number of times. A watched
call (no hook ran) is refused to the caller as a passthrough call is.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest
import trio

import krproxy.relay._local as local_module
from krproxy.calls import CallRecord
from krproxy.forward import Forward, Interceptor, Reply, Watch, Watcher
from krproxy.grpcstatus import Status
from krproxy.relay import Relay
from krproxy.relay.rpc import grpc_message
from tests.integration.support import LIVENESS_LIMIT, serve_relay, wait_until

PATH = "/test.Echo/Hooked"


class Runtime:
    """An h2 server on a unix socket that refuses the first *refuse* streams (REFUSED_STREAM) and echoes
    the others' request message; ``bodies`` holds each stream's request as it came."""

    def __init__(self, path: str, refuse: int, answer_first: bool = False) -> None:
        self.refuse = refuse
        self.answer_first = answer_first  # send the answer's HEADERS before refusing (a broken runtime)
        self.bodies: list[bytes] = []
        self.refused = 0
        self.accepted: socket.socket | None = None
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        self.accepted = sock
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        bodies: dict[int, bytes] = {}
        with sock:
            while True:
                try:
                    data = sock.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        bodies[event.stream_id] = bodies.get(event.stream_id, b"") + event.data
                        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, h2.events.StreamEnded):
                        body = bodies.pop(event.stream_id, b"")
                        self.bodies.append(body)
                        if self.refused < self.refuse:
                            self.refused += 1
                            if self.answer_first:
                                conn.send_headers(
                                    event.stream_id,
                                    [(":status", "200"), ("content-type", "application/grpc")],
                                )
                            conn.reset_stream(event.stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
                            continue
                        conn.send_headers(
                            event.stream_id, [(":status", "200"), ("content-type", "application/grpc")]
                        )
                        conn.send_data(event.stream_id, body)
                        conn.send_headers(event.stream_id, [("grpc-status", "0")], end_stream=True)
                try:
                    sock.sendall(conn.data_to_send())
                except OSError:  # the relay went away first
                    return

    def close(self) -> None:
        self.listener.close()
        if self.accepted is not None:
            with contextlib.suppress(OSError):
                self.accepted.shutdown(socket.SHUT_RDWR)  # its thread's recv returns
        self.thread.join(5)


class Hooked:
    """An interceptor that runs its "hooks" (counted), changes the request and hands the forward over."""

    def __init__(self) -> None:
        self.runs = 0
        self.told: list[tuple[Status, bytes | None]] = []

    async def __call__(self, path: str, request: bytes, forward: Forward) -> Reply:
        self.runs += 1
        await trio.lowlevel.checkpoint()  # as a plugin call would wait
        watcher: Watcher = lambda status, reply: self.told.append((status, reply))  # noqa: E731
        reply: Reply = forward.hand_over(b"changed " + request, watcher)  # type: ignore[attr-defined]
        return reply


@attrs.define
class Setup:
    """A relay in front of :class:`Runtime`, its one path intercepted by *interceptor* (and watched by
    *watch*, if given), and its records."""

    relay: Relay
    nursery: trio.Nursery
    short_tmp: Path
    channel_to: Callable[[str], grpc.Channel]
    runtimes: list[Runtime] = attrs.field(factory=list)
    records: list[CallRecord] = attrs.field(factory=list)

    async def call(
        self, interceptor: Interceptor, refuse: int, *, answer_first: bool = False, watch: Watch | None = None
    ) -> tuple[Runtime, bytes | grpc.RpcError]:
        """One call of ``b"ping"``, the runtime refusing its first *refuse* streams: the runtime, and the
        answer or the error the caller got."""
        runtime = Runtime(str(self.short_tmp / "runtime.sock"), refuse, answer_first)
        self.runtimes.append(runtime)
        relay = self.relay
        relay.keep_messages = True
        relay.observers.append(self.records.append)
        route = relay.route_to(str(self.short_tmp / "runtime.sock"), "runtime")
        relay.configure(route, None, {PATH: interceptor}, [PATH], watches={PATH: watch} if watch else None)
        listen = await serve_relay(self.nursery, relay, str(self.short_tmp / "relay.sock"))
        method = self.channel_to(listen).unary_unary(
            PATH, request_serializer=None, response_deserializer=None
        )
        try:
            with trio.fail_after(LIVENESS_LIMIT):
                call = functools.partial(method, b"ping", timeout=LIVENESS_LIMIT)
                answer: bytes = await trio.to_thread.run_sync(call)
                return runtime, answer
        except grpc.RpcError as err:
            return runtime, err


@pytest.fixture
def setup(
    relay: Relay, nursery: trio.Nursery, short_tmp: Path, channel_to: Callable[[str], grpc.Channel]
) -> Iterator[Setup]:
    made = Setup(relay, nursery, short_tmp, channel_to)
    yield made
    for runtime in made.runtimes:
        runtime.close()


async def test_a_handed_over_call_the_runtime_refuses_is_sent_again_without_running_its_hooks_again(
    setup: Setup,
) -> None:
    hooked = Hooked()
    runtime, answer = await setup.call(hooked, refuse=2)

    assert b"changed ping" == answer
    await wait_until(lambda: bool(setup.records))
    assert 1 == hooked.runs
    assert [grpc_message(b"changed ping")] * 3 == runtime.bodies  # refused twice, the same bytes each time
    assert [(Status.OK, b"changed ping")] == hooked.told
    record = setup.records[0]
    assert (b"ping", b"changed ping", b"changed ping", 1, Status.OK) == (
        record.request,
        record.forwarded,
        record.reply,
        record.replies,
        record.status,
    )


async def test_a_handed_over_call_the_runtime_always_refuses_ends_unavailable(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not forever, even without a deadline; the watcher is told the failure (and keeps nothing)."""
    monkeypatch.setattr(local_module, "_REFUSED_ATTEMPTS", 3)
    hooked = Hooked()
    runtime, err = await setup.call(hooked, refuse=1000)

    assert isinstance(err, grpc.RpcError)
    assert grpc.StatusCode.UNAVAILABLE == err.code()
    assert "runtime refused the call 3 times" in (err.details() or "")
    assert (1, 3) == (hooked.runs, len(runtime.bodies))
    await wait_until(lambda: bool(hooked.told))
    assert [(Status.UNAVAILABLE, None)] == hooked.told


async def test_a_handed_over_call_refused_after_its_answer_began_is_not_sent_again(setup: Setup) -> None:
    """The caller already has the answer's header block: a second attempt would send it another. The call
    fails as a relayed one does (grpc-go's status for the reset), and the runtime sees it once."""
    hooked = Hooked()
    runtime, err = await setup.call(hooked, refuse=1, answer_first=True)

    assert isinstance(err, grpc.RpcError)
    assert grpc.StatusCode.UNAVAILABLE == err.code()
    assert (1, 1) == (hooked.runs, len(runtime.bodies))


async def test_a_watched_call_the_runtime_refuses_is_refused_to_the_caller(setup: Setup) -> None:
    """No hook ran: the caller gets the refusal (grpc-go sends the call again; this client, retries off,
    reports UNAVAILABLE), and the relay does not send it again itself."""
    told: list[tuple[Status, bytes | None]] = []

    async def intercept(path: str, request: bytes, forward: Forward) -> Reply:
        raise AssertionError("a watched call reaches no interceptor")

    def watch(request: bytes) -> Watcher:
        return lambda status, reply: told.append((status, reply))

    runtime, err = await setup.call(intercept, refuse=1, watch=watch)

    assert isinstance(err, grpc.RpcError)
    assert grpc.StatusCode.UNAVAILABLE == err.code()
    assert [grpc_message(b"ping")] == runtime.bodies
    await wait_until(lambda: bool(told))
    assert [(Status.UNAVAILABLE, None)] == told
