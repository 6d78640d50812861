"""Tests of the AppWorker's answer pipe (cb5bad6): the fds it opens are closed however the worker
ends, a byte left by a late job never hands one job's answer to another, a full pipe blocks no one,
and signals during the loop's poll neither end the wait early nor break the next one."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import pytest
import trio
import trio.lowlevel

from krproxy.hookserver._registry import Hook, call_hook
from krproxy.hookserver._service import AppWorker
from tests.integration.support import LIVENESS_LIMIT
from tests.unit.test_hookserver_appworker import CountingToken


def open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def slow(seconds: float, value: Any) -> Any:
    time.sleep(seconds)
    return value


def interrupt() -> None:
    raise KeyboardInterrupt


class Boom(Exception):
    pass


async def _end_normally() -> None:
    async with AppWorker.open() as worker:
        assert 1 == await worker.run(slow, 0, 1)


async def _body_raises() -> None:
    with pytest.raises(Boom):
        async with AppWorker.open() as worker:
            await worker.run(slow, 0, 1)
            raise Boom


async def _job_raises() -> None:
    with pytest.raises(Boom):
        async with AppWorker.open() as worker:
            await worker.run(slow, 0.01, 1)
            await worker.run(lambda: (_ for _ in ()).throw(Boom()))


async def _job_raises_keyboard_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt):
        async with AppWorker.open() as worker:
            await worker.run(interrupt)


async def _late_job_raises_keyboard_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt):
        async with AppWorker.open() as worker:
            await worker.run(lambda: slow(0.05, None) or interrupt())


async def _cancelled_while_a_job_runs() -> None:
    with trio.move_on_after(0.05) as scope:
        async with AppWorker.open() as worker, trio.open_nursery() as nursery:
            nursery.start_soon(worker.run, slow, 0.2, 1)
            await trio.sleep_forever()
    assert scope.cancelled_caught


async def _async_plugin_function() -> None:
    async def on_trio(ctx: object) -> None:
        await trio.lowlevel.checkpoint()

    async with AppWorker.open() as worker:
        await worker.run(call_hook, Hook.of("async-one", "", on_trio), object())


@pytest.mark.parametrize(
    "ending",
    [
        _end_normally,
        _body_raises,
        _job_raises,
        _job_raises_keyboard_interrupt,
        _late_job_raises_keyboard_interrupt,
        _cancelled_while_a_job_runs,
        _async_plugin_function,
    ],
)
def test_every_way_a_worker_ends_closes_its_four_fds(ending: Any) -> None:
    before = open_fds()
    for _ in range(3):
        trio.run(ending)
    assert open_fds() == before


def test_a_worker_failing_its_second_pipe_closes_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of fds (EMFILE) when the answer pipe is opened: the error reaches the caller, and the
    wake pipe, already open, is closed (a node short of fds would otherwise lose two more each try)."""
    real_pipe = os.pipe
    opened: list[tuple[int, int]] = []

    def pipe() -> tuple[int, int]:
        if opened:
            raise OSError(24, "Too many open files")
        opened.append(real_pipe())
        return opened[-1]

    async def main() -> None:
        monkeypatch.setattr(os, "pipe", pipe)
        async with AppWorker.open():
            pass

    before = open_fds()
    with pytest.raises(OSError, match="Too many open files"):
        trio.run(main)
    monkeypatch.undo()
    assert open_fds() == before


async def test_answers_never_cross_when_late_jobs_leave_bytes_behind() -> None:
    """Jobs that end around the inline wait's end (some within it, some just after, some through
    trio) and jobs queued from many tasks at once: each caller gets its own job's answer, in order."""
    rng = random.Random(8)
    got: dict[int, Any] = {}
    submitted: list[int] = []
    order: list[int] = []

    async def caller(i: int, seconds: float) -> None:
        await trio.lowlevel.checkpoint()
        submitted.append(i)  # run() queues the job before its first checkpoint
        got[i] = await worker.run(lambda: order.append(i) or slow(seconds, i))

    async with AppWorker.open() as worker:
        async with trio.open_nursery() as nursery:
            for i in range(600):
                nursery.start_soon(caller, i, rng.choice((0, 0, 0.0008, 0.001, 0.0012, 0.003)))
                if rng.random() < 0.3:
                    await trio.sleep(rng.choice((0, 0.0005, 0.002)))
        counting = CountingToken(worker._token)
        worker._token = counting  # type: ignore[assignment]
        worker.wait_inline = 5.0
        for i in range(600, 700):  # after all that, each quick job still comes back inline
            assert i == await worker.run(slow, 0, i)
        assert 0 == counting.handed_back
    assert got == {i: i for i in range(600)}
    assert order == submitted
    assert sorted(order) == list(range(600))


async def test_a_full_answer_pipe_blocks_neither_thread_nor_loop() -> None:
    """With the answer pipe full (thousands of late jobs' bytes never read), the thread's byte is
    dropped, not waited on: a quick job still comes back inline, an async plugin function still
    runs, and a job's answer is not taken for another's."""

    async def on_trio(ctx: object) -> None:
        await trio.lowlevel.checkpoint()

    async with AppWorker.open() as worker:
        assert not os.get_blocking(worker._answer_w)
        for _ in range(3):
            with pytest.raises(BlockingIOError):
                while True:
                    os.write(worker._answer_w, b"a" * 4096)
            counting = CountingToken(worker._token)
            worker._token = counting  # type: ignore[assignment]
            worker.wait_inline = 5.0
            with trio.fail_after(LIVENESS_LIMIT):
                assert "quick" == await worker.run(slow, 0.05, "quick")
                assert 0 == counting.handed_back
                await worker.run(call_hook, Hook.of("async-one", "", on_trio), object())
            assert 1 == counting.handed_back  # (an async plugin function's job always comes back so)
            worker._token = counting.token
            # full again, and this time the thread finds it full when its job ends
            with pytest.raises(BlockingIOError):
                while True:
                    os.write(worker._answer_w, b"a" * 4096)
            worker.wait_inline = 0.001
            with trio.fail_after(LIVENESS_LIMIT):
                assert "late" == await worker.run(slow, 0.05, "late")
            with trio.fail_after(LIVENESS_LIMIT):
                worker.wait_inline = 5.0
                assert "next" == await worker.run(slow, 0.05, "next")


async def test_signals_during_the_poll_neither_end_it_nor_lose_a_job() -> None:
    """SIGALRM every millisecond while the loop waits in poll(): the call is resumed (PEP 475) for
    the rest of the wait, so a 0.2 s job still comes back inline, not through trio."""
    alarms = 0

    def on_alarm(signum: int, frame: object) -> None:
        nonlocal alarms
        alarms += 1

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        async with AppWorker.open() as worker:
            counting = CountingToken(worker._token)
            worker._token = counting  # type: ignore[assignment]
            worker.wait_inline = 5.0
            signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
            try:
                assert "done" == await worker.run(slow, 0.2, "done")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            assert 0 == counting.handed_back
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert alarms > 10


async def test_a_signal_handler_raising_in_poll_keeps_next_answer() -> None:
    """An exception from a signal handler (as KeyboardInterrupt) comes out of the wait; the job still
    runs to its end (the app's state stays whole), and its byte does not answer the next job."""
    ran: list[str] = []

    def on_alarm(signum: int, frame: object) -> None:
        raise Boom

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        async with AppWorker.open() as worker:
            worker.wait_inline = 5.0
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            with pytest.raises(Boom):
                await worker.run(lambda: ran.append(slow(0.2, "first")))
            signal.setitimer(signal.ITIMER_REAL, 0)
            assert "second" == await worker.run(slow, 0.1, "second")
            assert ["first"] == ran
    finally:
        signal.signal(signal.SIGALRM, previous)
