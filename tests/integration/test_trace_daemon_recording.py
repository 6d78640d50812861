"""Tests of recording in the daemon (``krproxy serve --record``) as a node meets it: what /status
and the metrics say, a 4 MiB answer, many calls at once, calls cut by the caller's deadline or
reset, and a disk that blocks. Every server listens on a unix socket in the test's directory."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import pytest
import trio
from cri_api.v1 import api_pb2 as pb

from krproxy import rpc
from krproxy.daemon import Daemon
from krproxy.grpcstatus import GRPCError, Status
from krproxy.trace import load
from krproxy.trace.format import TraceRecord
from krproxy.trace.recorder import Recorder, TraceWriter
from tests.integration.support import (
    LIVENESS_LIMIT,
    ScriptedBackend,
    hang,
    start_proxy,
    start_scripted_backend,
    wait_until,
)

VERSION = "/runtime.v1.RuntimeService/Version"
LIST_CONTAINERS = "/runtime.v1.RuntimeService/ListContainers"


async def recording_proxy(nursery: trio.Nursery, sockdir: str, trace: str) -> tuple[ScriptedBackend, Daemon]:
    backend, _ = await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))
    daemon = await start_proxy(nursery, sockdir, record=trace)
    assert daemon.recorder is not None
    return backend, daemon


def recorder_of(daemon: Daemon) -> Recorder:
    assert daemon.recorder is not None
    return daemon.recorder


def of_path(records: Sequence[TraceRecord], path: str) -> list[TraceRecord]:
    return [r for r in records if r.path == path]


async def version(channel: rpc.Channel, request: bytes = b"\x0a\x02v1") -> bytes:
    return await channel.unary(VERSION, request, timeout=LIVENESS_LIMIT)


class TestWhatTheOperatorSees:
    async def test_status_and_metrics_follow_recording(
        self, nursery: trio.Nursery, sockdir: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """/status's ``recording`` and ``krproxy_recording`` say whether calls are recorded: on at
        start, off after SIGUSR1's toggle, on again, and off once the file cannot be written."""
        trace = os.path.join(sockdir, "trace.krt")
        _, daemon = await recording_proxy(nursery, sockdir, trace)
        recorder = recorder_of(daemon)
        view = daemon.admin_view
        assert view is not None

        def said() -> tuple[bool, float | None]:
            assert view is not None
            return view.status()["recording"], daemon.metrics.registry.get_sample_value("krproxy_recording")

        seen = [said()]
        recorder.toggle()
        seen.append(said())
        recorder.toggle()
        seen.append(said())
        # The file is replaced by a directory: the next write fails and recording turns off.
        async with rpc.Channel(daemon.config.listen) as channel:
            await version(channel)
            await recorder.flush()
            os.unlink(trace)
            os.mkdir(trace)
            await version(channel)
            await recorder.flush()
        seen.append(said())
        assert [(True, 1.0), (False, 0.0), (True, 1.0), (False, 0.0)] == seen
        assert any(r.getMessage() == "recording_failed" for r in caplog.records)


class TestWhatIsRecorded:
    async def test_a_4_mib_answer_is_recorded_whole(self, nursery: trio.Nursery, sockdir: str) -> None:
        """A ListContainers answer of 4 MiB (a node with many labelled containers) is in the trace
        byte for byte."""
        trace = os.path.join(sockdir, "trace.krt")
        backend, daemon = await recording_proxy(nursery, sockdir, trace)
        big = pb.ListContainersResponse(
            containers=[
                pb.Container(id=f"{n:064x}", labels={"krproxy.test/big": "x" * 4096}) for n in range(1024)
            ]
        ).SerializeToString()
        assert len(big) > 4 << 20

        async def big_answer(stream: rpc.Stream, messages: list[bytes]) -> None:
            await stream.send_message(big)

        backend.behaviours[LIST_CONTAINERS] = big_answer
        async with rpc.Channel(daemon.config.listen) as channel:
            reply = await channel.unary(LIST_CONTAINERS, b"", timeout=LIVENESS_LIMIT)
        assert big == reply
        recorder = recorder_of(daemon)
        await wait_until(lambda: recorder.statistics().recorded >= 1)
        await recorder.flush()
        (record,) = of_path(load([trace]).records, LIST_CONTAINERS)
        assert ("OK", big) == (record.status.name, record.reply)

    async def test_many_concurrent_calls_are_each_recorded_once(
        self, nursery: trio.Nursery, sockdir: str
    ) -> None:
        """300 calls at once on 3 connections: each request is in the trace exactly once, with its answer."""
        trace = os.path.join(sockdir, "trace.krt")
        _, daemon = await recording_proxy(nursery, sockdir, trace)
        sent = [b"\x0a\x04" + n.to_bytes(4, "big") for n in range(300)]
        async with (
            rpc.Channel(daemon.config.listen) as a,
            rpc.Channel(daemon.config.listen) as b,
            rpc.Channel(daemon.config.listen) as c,
            trio.open_nursery() as calls,
        ):
            for n, request in enumerate(sent):
                calls.start_soon(version, (a, b, c)[n % 3], request)
        recorder = recorder_of(daemon)
        await wait_until(lambda: recorder.statistics().recorded >= len(sent))
        await recorder.flush()
        records = of_path(load([trace]).records, VERSION)
        assert sorted(sent) == sorted(r.request for r in records)
        assert all(r.reply == r.request and r.status.name == "OK" for r in records)


class TestCutCalls:
    async def test_a_call_past_the_callers_deadline_is_recorded_once(
        self, nursery: trio.Nursery, sockdir: str
    ) -> None:
        """A runtime that never answers: the caller's 1 s deadline ends the call, and the trace holds
        it once, without a reply. Its status is DEADLINE_EXCEEDED when the proxy's own timer (from
        grpc-timeout) ends the call first, CANCELLED when the caller's RST_STREAM arrives first: the
        two race (under load the caller's reset won once in a full suite run)."""
        trace = os.path.join(sockdir, "trace.krt")
        backend, daemon = await recording_proxy(nursery, sockdir, trace)
        backend.behaviours[VERSION] = hang
        async with rpc.Channel(daemon.config.listen) as channel:
            with pytest.raises(GRPCError) as raised:
                await channel.unary(VERSION, b"\x0a\x01d", timeout=1)
        recorder = recorder_of(daemon)
        await wait_until(lambda: recorder.statistics().recorded >= 1)
        await recorder.flush()
        (record,) = of_path(load([trace]).records, VERSION)
        assert Status.DEADLINE_EXCEEDED == raised.value.status
        assert (b"\x0a\x01d", None) == (record.request, record.reply)
        assert record.status in (Status.DEADLINE_EXCEEDED, Status.CANCELLED)

    async def test_a_call_the_caller_resets_is_recorded_once(
        self, nursery: trio.Nursery, sockdir: str
    ) -> None:
        """The caller gives up on a call (RST_STREAM CANCEL): the trace holds it once, CANCELLED, no reply."""
        trace = os.path.join(sockdir, "trace.krt")
        backend, daemon = await recording_proxy(nursery, sockdir, trace)
        backend.behaviours[VERSION] = hang
        async with rpc.Channel(daemon.config.listen) as channel:
            with trio.move_on_after(LIVENESS_LIMIT) as scope:
                async with trio.open_nursery() as inner:
                    inner.start_soon(version, channel, b"\x0a\x01r")
                    await wait_until(lambda: VERSION in backend.started)
                    inner.cancel_scope.cancel()
            assert not scope.cancelled_caught
            recorder = recorder_of(daemon)
            await wait_until(lambda: recorder.statistics().recorded >= 1)
            # The connection goes on serving after the reset.
            backend.behaviours.pop(VERSION)
            assert b"\x0a\x01s" == await version(channel, b"\x0a\x01s")
        await wait_until(lambda: recorder.statistics().recorded >= 2)
        await recorder.flush()
        records = of_path(load([trace]).records, VERSION)
        assert [(b"\x0a\x01r", "CANCELLED", None), (b"\x0a\x01s", "OK", b"\x0a\x01s")] == [
            (r.request, r.status.name, r.reply) for r in records
        ]


class TestBlockedDisk:
    async def test_calls_are_answered_while_the_disk_blocks(
        self,
        nursery: trio.Nursery,
        sockdir: str,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """A write that does not return (a hung NFS, a stuck disk) does not hold calls up: they are
        answered, records wait in memory up to the recorder's bound, the rest are dropped and
        counted (event=recording_dropped), and what waited is written once the disk comes back."""
        caplog.set_level(logging.INFO, logger="krproxy.trace")
        trace = os.path.join(sockdir, "trace.krt")
        _, daemon = await recording_proxy(nursery, sockdir, trace)
        recorder = recorder_of(daemon)
        disk_back = threading.Event()
        blocked = threading.Event()
        real_write = TraceWriter.write

        def stuck_write(self: TraceWriter, frames: Sequence[bytes]) -> int:
            blocked.set()
            disk_back.wait(2 * LIVENESS_LIMIT)
            return real_write(self, frames)

        monkeypatch.setattr(TraceWriter, "write", stuck_write)
        try:
            async with rpc.Channel(daemon.config.listen) as channel:
                await version(channel, b"\x0a\x01\x00")
                await wait_until(blocked.is_set)  # the flush of that first record is stuck
                recorder.max_pending = 1000  # room for a few Version records
                with trio.fail_after(LIVENESS_LIMIT):
                    answers = [await version(channel, b"\x0a\x01" + bytes([n])) for n in range(1, 21)]
                assert [b"\x0a\x01" + bytes([n]) for n in range(1, 21)] == answers
        finally:
            disk_back.set()
        stats = recorder.statistics()
        assert stats.dropped > 0
        await recorder.flush()
        written = of_path(load([trace]).records, VERSION)
        assert 21 == len(written) + stats.dropped
        assert any(r.getMessage() == "recording_dropped" for r in caplog.records)


class TestStopWithABlockedDisk:
    async def test_a_stuck_write_does_not_hold_the_stop_forever(
        self, sockdir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """SIGTERM while a trace write hangs (a dead NFS server): the daemon still stops, after a
        bounded wait for the trace, and says what it gave up (event=recording_abandoned). A stop
        that waits on the disk for good keeps a socket-activated successor from taking kubelet's
        calls until systemd kills it. The writes finish once the disk answers again."""
        trace = os.path.join(sockdir, "trace.krt")
        disk_back = threading.Event()
        blocked = threading.Event()
        finished: list[int] = []
        real_write = TraceWriter.write

        def stuck_write(self: TraceWriter, frames: Sequence[bytes]) -> int:
            blocked.set()
            disk_back.wait(LIVENESS_LIMIT + 10)
            try:
                return real_write(self, frames)
            finally:
                finished.append(len(frames))

        monkeypatch.setattr(TraceWriter, "write", stuck_write)
        recorder: Recorder | None = None
        try:
            async with trio.open_nursery() as runtime:
                await start_scripted_backend(runtime, os.path.join(sockdir, "backend.sock"))
                with trio.move_on_after(LIVENESS_LIMIT) as scope:
                    async with trio.open_nursery() as nursery:  # ends when the daemon has stopped
                        daemon = await start_proxy(nursery, sockdir, record=trace)
                        recorder = recorder_of(daemon)
                        async with rpc.Channel(daemon.config.listen) as channel:
                            await version(channel, b"\x0a\x011")
                            await wait_until(blocked.is_set)
                            await version(channel, b"\x0a\x012")  # pending behind the stuck write
                        daemon.request_shutdown()
                stopped = not scope.cancelled_caught
                runtime.cancel_scope.cancel()
        finally:
            disk_back.set()
        # The periodic write and the stop's own, abandoned, end on their own once the disk is back.
        await wait_until(lambda: 2 == len(finished))
        assert recorder is not None
        recorder._writer.close()
        assert stopped, "the daemon did not stop while the trace write hung"
        assert any(r.getMessage() == "recording_abandoned" for r in caplog.records)
        assert [b"\x0a\x011", b"\x0a\x012"] == [r.request for r in of_path(load([trace]).records, VERSION)]
