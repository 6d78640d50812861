"""The SDK's AppWorker: jobs in its thread, results back without trio's wake-up when they are quick."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import trio
import trio.lowlevel

from krproxy.hookserver._registry import Hook, call_hook
from krproxy.hookserver._service import AppWorker


class CountingToken:
    """A trio token that counts the results handed back through trio (``run_sync_soon``)."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self.token = token
        self.handed_back = 0

    def run_sync_soon(self, fn: Any, *args: Any) -> None:
        self.handed_back += 1
        self.token.run_sync_soon(fn, *args)


def slow(seconds: float, value: str) -> str:
    time.sleep(seconds)
    return value


def fail(message: str) -> None:
    raise ValueError(message)


async def test_quick_jobs_return_without_trio_slow_ones_through_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job done within ``wait_inline`` is taken from the lock (no ``run_sync_soon``); a longer
    one comes back through trio; both with their result or their error, run in the worker thread."""
    async with AppWorker.open() as worker:
        counting = CountingToken(worker._token)
        worker._token = counting  # type: ignore[assignment]
        monkeypatch.setattr(worker, "wait_inline", 5.0)  # quick, however loaded the machine
        assert "worker" == await worker.run(
            lambda: "worker" if threading.current_thread() is worker._thread else ""
        )
        with pytest.raises(ValueError, match="quick"):
            await worker.run(fail, "quick")
        assert 0 == counting.handed_back
        monkeypatch.setattr(worker, "wait_inline", 0.001)
        assert "slow" == await worker.run(slow, 0.2, "slow")
        with pytest.raises(ValueError, match="late"):
            await worker.run(lambda: slow(0.2, "") + str(fail("late")))
        assert 2 == counting.handed_back


async def test_a_job_awaiting_an_async_function_lets_the_loop_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ``async def`` plugin function runs on the loop the job was sent from: the loop stops
    waiting on the lock at once (it would otherwise sit out ``wait_inline`` before running it)."""
    ran: list[bool] = []

    async def on_trio(ctx: object) -> None:
        await trio.lowlevel.checkpoint()
        ran.append(True)

    hook = Hook.of("async-one", "", on_trio)
    async with AppWorker.open() as worker:
        # Two minutes: a run that waited inline would sit them out, one that did not takes a
        # moment however loaded the machine (the bound is half of it; it was 5 s of 10 s).
        monkeypatch.setattr(worker, "wait_inline", 120.0)
        started = time.monotonic()
        await worker.run(call_hook, hook, object())
        elapsed = time.monotonic() - started
    assert [True] == ran
    assert elapsed < 60.0  # not the two minutes of wait_inline


async def test_jobs_behind_a_slow_one_run_in_order_with_a_full_pipe() -> None:
    """The loop wakes the thread with a byte on a pipe that never blocks it: once the pipe is
    full the bytes are dropped, and the thread, woken by those already there, takes every job
    queued, so none waits for a wake-up that never comes."""
    done: list[int] = []
    async with AppWorker.open() as worker:
        assert not os.get_blocking(worker._wake_w)  # a flood of jobs never blocks the loop
        with pytest.raises(BlockingIOError):
            while True:  # fill the pipe as a flood of queued jobs would
                os.write(worker._wake_w, b"x" * 4096)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker.run, slow, 0.2, "slow")
            await trio.sleep(0.05)  # the slow job is running: the rest queue behind it
            for i in range(50):
                nursery.start_soon(worker.run, done.append, i)
                await trio.lowlevel.checkpoint()  # queued in this order
        with trio.fail_after(10):  # never stuck: every pending byte is read in turn
            assert "after" == await worker.run(slow, 0, "after")
    assert done == list(range(50))


async def test_a_byte_left_by_an_earlier_job_does_not_end_a_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The thread writes a byte to the answer pipe when the job the loop waits for ends; a job that
    ended just after the loop stopped waiting for it leaves its byte there. The next wait reads it,
    sees its own job still running and waits on: the job still comes back without trio."""
    async with AppWorker.open() as worker:
        counting = CountingToken(worker._token)
        worker._token = counting  # type: ignore[assignment]
        monkeypatch.setattr(worker, "wait_inline", 5.0)
        os.write(worker._answer_w, b"a")  # as the late job's byte
        assert "slow" == await worker.run(slow, 0.1, "slow")
        assert 0 == counting.handed_back
        with pytest.raises(BlockingIOError):  # the stale byte and the job's own were both read
            os.read(worker._answer_r, 1)
