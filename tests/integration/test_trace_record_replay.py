"""Record through the proxy, then replay: against a fresh fake, with a changed plugin, against `trace serve`."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import trio

from krproxy import cli, rpc
from krproxy.trace import load
from krproxy.trace.backend import TraceBackend
from krproxy.trace.replay import ChannelTransport, ReplayReport, replay
from tests.integration.support import wait_until
from tests.integration.test_trace_support import (
    CONTAINERD_GOLDEN,
    FAKE_GOLDEN,
    OtherLimitsPlugin,
    drive_lifecycle,
    in_thread,
    new_fake,
    start_node,
)

LIFECYCLE_CALLS = 18


@contextlib.asynccontextmanager
async def transport_to(socket: str) -> AsyncIterator[ChannelTransport]:
    """`trace replay`'s transport to ``socket``; call it in a worker thread (``in_thread``)."""
    async with rpc.Channel(socket) as channel:
        yield ChannelTransport(channel)


async def replay_against(socket: str, trace: Path | str) -> ReplayReport:
    records = load([str(trace)]).records
    async with transport_to(socket) as transport:
        return await in_thread(replay, records, transport, timeout=10)


async def record_lifecycle(nursery: trio.Nursery, sockdir: str, trace: str) -> None:
    node = await start_node(nursery, sockdir, fake=new_fake("recorded"), record=trace)
    channel = grpc.insecure_channel(f"unix://{node.proxy_socket}")
    try:
        await in_thread(drive_lifecycle, channel)
    finally:
        channel.close()
    assert node.daemon.recorder is not None
    await wait_until(lambda: node.daemon.recorder.statistics().recorded == LIFECYCLE_CALLS)  # type: ignore[union-attr]
    await node.daemon.recorder.flush()


class TestRecordAndReplay:
    async def test_recorded_trace_replays_identically(self, short_tmp: Path) -> None:
        """A lifecycle recorded through the proxy replays against a fresh fake with zero differences."""
        trace = str(short_tmp / "trace.krt")
        async with trio.open_nursery() as nursery:
            await record_lifecycle(nursery, str(short_tmp / "a"), trace)
            node = await start_node(nursery, str(short_tmp / "b"))
            report = await replay_against(node.proxy_socket, trace)
            nursery.cancel_scope.cancel()
        assert [] == list(report.lines())[:-1]
        assert (LIFECYCLE_CALLS, 0, 2) == (report.identical, report.different, len(report.ids))

    async def test_recording_holds_the_hook_decisions(self, short_tmp: Path) -> None:
        """The CreateContainer record carries the forwarded request and the plugin's field changes."""
        trace = str(short_tmp / "trace.krt")
        async with trio.open_nursery() as nursery:
            await record_lifecycle(nursery, str(short_tmp / "a"), trace)
            nursery.cancel_scope.cancel()
        (create,) = [r for r in load([trace]).records if r.method == "CreateContainer"]
        (hook,) = create.hooks
        assert ("limits", "PreCreateContainer", "ok") == (hook.plugin, hook.point, hook.result)
        assert "resources.cpuset_cpus" in {c.field for c in hook.changes}
        assert create.forwarded is not None and create.forwarded != create.request

    async def test_golden_fake_trace_replays_identically(self, short_tmp: Path) -> None:
        """The committed golden trace replays against a fresh fake behind the proxy with zero differences."""
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, str(short_tmp))
            report = await replay_against(node.proxy_socket, FAKE_GOLDEN)
            nursery.cancel_scope.cancel()
        assert "OK 18 calls: 18 identical, 0 different, 0 skipped; 2 ids mapped" == list(report.lines())[-1]

    async def test_changed_plugin_gives_a_readable_diff_and_exit_1(
        self, short_tmp: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """With a plugin that now sets another cpuset and annotation, `trace replay` prints where and exits 1."""
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, str(short_tmp), plugin=OtherLimitsPlugin())
            argv = ["trace", "replay", str(FAKE_GOLDEN), "--target", node.proxy_socket, "--progress", "never"]
            code = await in_thread(cli.main, argv)
            nursery.cancel_scope.cancel()
        out = capsys.readouterr().out
        assert 1 == code
        assert "call #8 /runtime.v1.RuntimeService/ContainerStatus: 2 difference(s)" in out
        assert (
            "    reply.status.annotations['demo.krproxy.io/limited-by']: "
            'recorded "demo-limits", replay "other-limits"'
        ) in out
        assert '    reply.status.resources.linux.cpuset_cpus: recorded "0-1", replay "2-3"' in out
        assert out.rstrip().endswith("MISMATCH 18 calls: 15 identical, 3 different, 0 skipped; 2 ids mapped")


class TestTraceServe:
    @pytest.mark.parametrize("golden", [FAKE_GOLDEN, CONTAINERD_GOLDEN], ids=["fake", "containerd"])
    async def test_proxy_in_front_of_a_served_trace(self, short_tmp: Path, golden: Path) -> None:
        """A trace served by `trace serve`, behind the proxy with the same plugin, replays identically."""
        records = load([str(golden)]).records
        backend = TraceBackend(records)
        backend_socket = str(short_tmp / "trace.sock")
        async with trio.open_nursery() as nursery:
            await nursery.start(rpc.Server({}, fallback=backend.fallback).serve, backend_socket)
            node = await start_node(nursery, str(short_tmp), backend_socket=backend_socket)
            report = await replay_against(node.proxy_socket, golden)
            nursery.cancel_scope.cancel()
        assert (LIFECYCLE_CALLS, 0) == (report.identical, report.different)
        assert 0 == backend.answers.statistics().missing

    async def test_unknown_method_is_unimplemented(self, short_tmp: Path, channel_to: object) -> None:
        """A method the trace does not hold is answered UNIMPLEMENTED, naming it."""
        backend = TraceBackend(load([str(FAKE_GOLDEN)]).records)
        socket = str(short_tmp / "trace.sock")
        async with trio.open_nursery() as nursery:
            await nursery.start(rpc.Server({}, fallback=backend.fallback).serve, socket)
            async with transport_to(socket) as transport:
                answer = await in_thread(transport, "/runtime.v1.RuntimeService/ExecSync", b"", 5)
            nursery.cancel_scope.cancel()
        assert ("UNIMPLEMENTED", "/runtime.v1.RuntimeService/ExecSync is not in the trace") == (
            answer.status.name,
            answer.message,
        )


class TestRecordingControl:
    async def test_toggle_off_and_on(self, short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
        """Calls made while recording is off are not in the trace; toggling logs each state."""
        caplog.set_level(logging.INFO, logger="krproxy.trace")
        trace = str(short_tmp / "trace.krt")
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, str(short_tmp), record=trace)
            recorder = node.daemon.recorder
            assert recorder is not None
            async with transport_to(node.proxy_socket) as transport:
                version = functools.partial(transport, "/runtime.v1.RuntimeService/Version", b"", 5)
                await in_thread(version)
                assert False is recorder.toggle()
                await in_thread(version)
                await in_thread(version)
                assert True is recorder.toggle()
                await in_thread(version)
            await recorder.flush()
            nursery.cancel_scope.cancel()
        assert 2 == len(load([trace]).records)
        states = [r.krproxy_fields["state"] for r in caplog.records if r.getMessage() == "recording"]  # type: ignore[attr-defined]
        assert ["on", "off", "on"] == states

    async def test_paused_start_records_nothing(self, short_tmp: Path) -> None:
        """With record_paused the file is not even created until recording is switched on."""
        trace = short_tmp / "trace.krt"
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, str(short_tmp), record=str(trace), record_paused=True)
            async with transport_to(node.proxy_socket) as transport:
                await in_thread(transport, "/runtime.v1.RuntimeService/Version", b"", 5)
            assert node.daemon.recorder is not None
            await node.daemon.recorder.flush()
            nursery.cancel_scope.cancel()
        assert not trace.exists()

    async def test_unwritable_file_leaves_the_proxy_serving(
        self, short_tmp: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A trace path that cannot be created turns recording off; calls still go through."""
        blocker = short_tmp / "file"
        blocker.write_text("not a directory")
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, str(short_tmp), record=str(blocker / "trace.krt"))
            async with transport_to(node.proxy_socket) as transport:
                answer = await in_thread(transport, "/runtime.v1.RuntimeService/Version", b"", 5)
            nursery.cancel_scope.cancel()
        assert "OK" == answer.status.name
        assert node.daemon.recorder is not None and not node.daemon.recorder.active
        assert any(r.getMessage() == "recording_failed" for r in caplog.records)


class TestTraceCli:
    def test_show_json_filters(self, capsys: pytest.CaptureFixture[str]) -> None:
        """`trace show --json --method` prints one decoded object per matching call."""
        assert 0 == cli.main(["trace", "show", str(FAKE_GOLDEN), "--method", "CreateContainer", "--json"])
        (line,) = capsys.readouterr().out.splitlines()
        obj = json.loads(line)
        assert ("default/trace", "app", "limits") == (obj["pod"], obj["container"], obj["hooks"][0]["plugin"])
        assert "0-1" == obj["forwarded"]["config"]["linux"]["resources"]["cpuset_cpus"]

    def test_corrupt_trace_exits_2_naming_the_record(
        self, short_tmp: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A damaged golden copy is refused by replay with the file, the record number and the reason,
        before anything is sent (``trace show`` lists the good records: tests/unit/test_trace_show.py)."""
        damaged = short_tmp / "damaged.krt"
        shutil.copyfile(FAKE_GOLDEN, damaged)
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
        assert 2 == cli.main(["trace", "replay", str(damaged), "--target", str(short_tmp / "none.sock")])
        err = capsys.readouterr().err
        assert f"krproxy trace: error: {damaged}: record " in err and "is corrupt: CRC mismatch" in err

    def test_torn_trace_is_listed_with_a_warning(
        self, short_tmp: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A copy cut mid-record lists every complete call and warns about the torn one."""
        torn = short_tmp / "torn.krt"
        data = FAKE_GOLDEN.read_bytes()
        torn.write_bytes(data[:-7])
        assert 0 == cli.main(["trace", "show", str(torn)])
        captured = capsys.readouterr()
        assert 1 + LIFECYCLE_CALLS - 1 == len(captured.out.splitlines())
        assert "torn last record 18" in captured.err

    def test_rotated_files_read_in_order(self, short_tmp: Path) -> None:
        """Several files are read in the order given, numbering restarting per file."""
        files = [str(FAKE_GOLDEN), str(FAKE_GOLDEN)]
        assert 2 * LIFECYCLE_CALLS == len(load(files).records)
        assert os.path.exists(files[0])
