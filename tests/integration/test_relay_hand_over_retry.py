"""Tests of createlat5's hand-over: the relay's resend of a handed-over call the runtime refused, against
callers that give up, a runtime that restarts (GOAWAY, a new connection), a runtime's trailers-only
errors, and a relay that drains.

The runtime is handover_support's scripted one: it answers each stream as its script says.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import pytest
import trio

import krproxy.relay.intercepted as local_module
from krproxy.grpcstatus import Status
from krproxy.h2 import events as ev
from krproxy.relay._input import Reader
from krproxy.relay.rpc import grpc_message
from tests.integration.handover_support import ECHO, ERROR, GOAWAY, REFUSE, SILENT, SLOW_REFUSE, Harness
from tests.integration.support import LIVENESS_LIMIT, wait_until


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
            await harness.relay.transport.wait_idle()
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

    async def test_waiting_to_be_resent_past_its_deadline_is_not_sent(
        self, harness: Harness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The pause before a resend made 4 s long: the caller's 2 s deadline passes during it, and the
        runtime (refused once) never gets the request again: a create nobody waits for."""
        monkeypatch.setattr(local_module, "REFUSED_PAUSE", 4.0)
        runtime, method = await harness.start(lambda n: REFUSE)
        result = await harness.call(method, timeout=2.0)

        assert grpc.StatusCode.DEADLINE_EXCEEDED == code_of(result)
        await trio.sleep(4.0)  # past the pause's end
        assert [grpc_message(b"changed ping")] == runtime.bodies
        assert 0 == harness.relay.transport.in_flight

    async def test_is_not_sent_again_once_its_caller_cancelled(self, harness: Harness) -> None:
        runtime, method = await harness.start(lambda n: REFUSE)
        future = method.future(b"ping", timeout=LIVENESS_LIMIT)
        await wait_until(lambda: len(runtime.bodies) >= 3)
        future.cancel()

        with trio.fail_after(LIVENESS_LIMIT):
            await harness.relay.transport.wait_idle()
        sent = await settled(lambda: len(runtime.bodies))
        assert sent < 200
        await wait_until(lambda: bool(harness.hooked.told))
        assert [(Status.CANCELLED, None)] == harness.hooked.told
        assert 1 == harness.hooked.runs

    async def test_is_resent_on_a_new_connection_after_goaway(self, harness: Harness) -> None:
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

    async def test_is_resent_when_a_write_fails_before_the_goaway(
        self, harness: Harness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """containerd restarted: GOAWAY (nothing processed), then closed. The relay writes to it (a PING
        here; in CI it was an acknowledgement) before it handles the GOAWAY, and the write fails
        (EPIPE). The GOAWAY is still read: the call goes to a new connection, not back as UNAVAILABLE
        ("send failed: connection closed by peer", seen once in a CI run)."""
        on_goaway = Reader._on_goaway
        forced: list[bool] = []

        def write_first(reader: Reader, event: ev.GoAwayReceived) -> None:
            if not forced:
                forced.append(True)
                runtime.threads[1].join(LIVENESS_LIMIT)  # the first connection's server: closed
                reader.ep.h2.send_ping(b"krtest\x00\x00")
                reader.ep.try_send()
            on_goaway(reader, event)

        monkeypatch.setattr(Reader, "_on_goaway", write_first)
        runtime, method = await harness.start(lambda n: GOAWAY if n == 1 else ECHO)
        result = await harness.call(method)

        assert [True] == forced
        assert b"changed ping" == result
        assert 2 == runtime.connections
        assert 1 == harness.hooked.runs

    async def test_refused_then_trailers_only_error_passes_it_on(self, harness: Harness) -> None:
        """Refused then answered with a trailers only error passes the error on."""
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
            harness.relay.transport.start_draining()
            with trio.fail_after(LIVENESS_LIMIT):
                await harness.relay.transport.wait_drained()
        assert [b"changed ping"] == results
        assert 41 == len(runtime.bodies)
        assert 1 == harness.hooked.runs


class TestAHandedOverCall:
    async def test_compressed_request_goes_upstream_uncompressed(self, harness: Harness) -> None:
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

    async def test_cancelled_while_the_runtime_works_is_reset_upstream(self, harness: Harness) -> None:
        """The runtime never answers; kubelet gives up (RST_STREAM): the runtime's stream is reset
        (CANCEL), the watcher told CANCELLED (nothing kept), no call left."""
        runtime, method = await harness.start(lambda n: SILENT)
        future = method.future(b"ping", timeout=LIVENESS_LIMIT)
        await wait_until(lambda: bool(runtime.bodies))
        future.cancel()

        await wait_until(lambda: bool(runtime.resets))
        assert [h2.errors.ErrorCodes.CANCEL] == runtime.resets
        with trio.fail_after(LIVENESS_LIMIT):
            await harness.relay.transport.wait_idle()
        await wait_until(lambda: bool(harness.hooked.told))
        assert [(Status.CANCELLED, None)] == harness.hooked.told
        assert 1 == len(runtime.bodies)

    @pytest.mark.parametrize("hand_over", [True, False], ids=["handed over", "forwarded"])
    async def test_refused_counts_every_attempts_time_as_backend_time(
        self, harness: Harness, hand_over: bool
    ) -> None:
        """As a forward does (Transport.unary counts its attempts): the runtime took a second to refuse the
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
