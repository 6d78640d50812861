"""The recorder's disk calls run in the order they were queued, whether or not their callers still
wait: a periodic flush cancelled by the daemon's stop has taken records off the pending list, and
its write must still happen, before the stop's close (else the daemon exits with them unwritten)."""

from __future__ import annotations

import os
import threading

import trio
import trio.testing

from krproxy.trace import load
from krproxy.trace.recorder import Recorder
from tests.unit.test_trace_format import call


async def test_a_cancelled_callers_call_still_runs_before_the_next(tmp_path: object) -> None:
    """A call whose caller was cancelled still runs before the next."""
    recorder = Recorder(os.path.join(str(tmp_path), "trace.krt"))
    order: list[str] = []
    release = threading.Event()

    def first() -> None:
        release.wait(10)
        order.append("first")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(recorder._in_thread, first)
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as cancelled:
            cancelled.cancel()  # the caller goes away at its first checkpoint, as at the stop
            await recorder._in_thread(lambda: order.append("write"))
        release.set()
        await recorder._in_thread(lambda: order.append("close"))
    assert ["first", "write", "close"] == order


async def test_records_of_a_flush_the_stop_cancels_are_in_the_file(tmp_path: object) -> None:
    """The stop comes while the periodic flush's write waits for the disk: run() ends only once that
    write is done (within its stop limit), and every record is in the file."""
    path = os.path.join(str(tmp_path), "trace.krt")
    recorder = Recorder(path, flush_interval=0.01, stop_flush_limit=30)
    writer = recorder._writer
    disk = threading.Event()
    write = writer.write

    def slow_write(frames: list[bytes]) -> int:
        disk.wait(10)
        return write(frames)

    writer.write = slow_write  # type: ignore[method-assign]
    records = [call(n) for n in range(20)]
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        for record in records:
            recorder.observe(record)
        await trio.sleep(0.2)  # the periodic flush has taken them and waits for the disk
        nursery.cancel_scope.cancel()
        threading.Timer(0.3, disk.set).start()
    assert [r.request for r in records] == [r.request for r in load([path]).records]
