"""Tests of the SDK's AppWorker (e3a822d: the loop waits up to ``wait_inline`` on a lock for a quick job;
bbbd565: the thread sleeps on a pipe): every job runs once, in order, and its caller gets its own result
or error, whichever way it comes back (the lock, or trio when the wait ran out, the two racing); a job that
raises or blocks for a while leaves the worker serving; a caller cancelled with its job queued still sees
the job done; the worker's end runs every job queued before it."""

from __future__ import annotations

import random
import threading
import time

import outcome
import pytest
import trio

from krproxy.hookserver._registry import Hook, call_hook
from krproxy.hookserver._service import AppWorker
from tests.ticks import Ticks


class Boom(Exception):
    pass


def job(i: int, seconds: float, log: list[int]) -> int:
    log.append(i)
    if seconds:
        time.sleep(seconds)
    if i % 7 == 3:
        raise Boom(i)
    return i * 10


@pytest.mark.parametrize("wait_inline", [0.0, 0.00002, 0.001, 5.0])
async def test_each_caller_gets_its_own_result_either_way(
    monkeypatch: pytest.MonkeyPatch, wait_inline: float
) -> None:
    """Many callers, jobs of 0 to 1 ms, the inline wait at the jobs' length so that the lock and trio
    race: each job runs once, in the order queued, and each caller gets its job's value or error."""
    rng = random.Random(wait_inline)
    log: list[int] = []
    got: dict[int, object] = {}
    waiting: set[trio.lowlevel.Task] = set()

    async def call(worker: AppWorker, i: int, seconds: float) -> None:
        waiting.add(trio.lowlevel.current_task())
        try:
            got[i] = await worker.run(job, i, seconds, log)
        except Boom as err:
            got[i] = err.args[0]
        finally:
            waiting.discard(trio.lowlevel.current_task())

    async def rescue() -> None:
        """A caller the worker never wakes waits uncancellably (as run's callers do): fail, not hang."""
        await trio.sleep(60)
        for task in waiting:
            trio.lowlevel.reschedule(
                task, outcome.Error(AssertionError(f"never woken ({len(log)} jobs ran)"))
            )

    async with AppWorker.open() as worker, trio.open_nursery() as outer:
        outer.start_soon(rescue)
        monkeypatch.setattr(worker, "wait_inline", wait_inline)
        async with trio.open_nursery() as nursery:
            for i in range(300):
                nursery.start_soon(call, worker, i, rng.choice([0.0, 0.0, 0.00002, 0.0005, 0.001]))
                if i % 5 == 0:
                    await trio.lowlevel.checkpoint()
        outer.cancel_scope.cancel()
    assert sorted(log) == list(range(300))  # each once
    assert {i: i if i % 7 == 3 else i * 10 for i in range(300)} == got


async def test_a_job_that_raises_or_blocks_leaves_the_worker_serving() -> None:
    """A job that raises (quick or slow) and one that blocks a second while twenty calls arrive: the
    twenty are served after it, in order, and the worker goes on; the loop serves meanwhile."""
    order: list[int] = []
    ticks = Ticks(0.01)

    async with AppWorker.open() as worker, trio.open_nursery() as outer:
        outer.start_soon(ticks.run)
        with pytest.raises(Boom):
            await worker.run(job, 3, 0, [])
        with pytest.raises(Boom):
            await worker.run(job, 10, 0.05, [])  # 10 % 7 == 3
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(worker.run, time.sleep, 1.0)
                await trio.sleep(0.1)
                before = ticks.count
                for i in range(20):
                    nursery.start_soon(worker.run, order.append, i)
                    await trio.sleep(0.01)
                assert ticks.count > before  # the loop was not held while the slow job ran
        assert list(range(20)) == order
        assert 42 == await worker.run(lambda: 42)
        outer.cancel_scope.cancel()


async def test_a_caller_cancelled_with_a_queued_job_sees_it_done() -> None:
    """The job queued behind a slow one is not dropped when its caller is cancelled: it runs, once,
    after the slow one, and the caller returns when it is done (the app's state stays whole)."""
    ran: list[str] = []
    returned: list[object] = []

    async def caller(scope_box: list[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            scope_box.append(scope)
            returned.append(await worker.run(ran.append, "queued"))
            await trio.lowlevel.checkpoint()  # the cancellation shows at the next checkpoint
            returned.append("not cancelled")

    async with AppWorker.open() as worker:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(worker.run, time.sleep, 0.5)
                await trio.sleep(0.1)
                box: list[trio.CancelScope] = []
                nursery.start_soon(caller, box)
                await trio.sleep(0.05)
                assert [] == ran  # queued behind the slow job
                box[0].cancel()
        assert ["queued"] == ran
        assert [None] == returned
        assert "after" == await worker.run(lambda: "after")


async def test_the_end_of_the_worker_runs_every_job_queued_before_it() -> None:
    """The block ends (its nursery cancelled) with jobs queued behind a slow one: each still runs before
    the thread ends, and the block does not hang."""
    done: list[int] = []
    with trio.fail_after(30):
        async with AppWorker.open() as worker:
            thread = worker._thread
            async with trio.open_nursery() as nursery:
                nursery.start_soon(worker.run, time.sleep, 0.5)
                await trio.sleep(0.1)
                for i in range(10):
                    nursery.start_soon(worker.run, done.append, i)
                await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
    assert list(range(10)) == sorted(done)  # (tasks started together start in any order)
    assert not thread.is_alive()


async def test_an_async_plugin_function_raising_returns_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An async plugin function that raises comes back as its error."""

    async def fails(ctx: object) -> None:
        await trio.lowlevel.checkpoint()
        raise Boom("async")

    seen: list[str] = []

    async def fine(ctx: object) -> None:
        seen.append(threading.current_thread().name)

    async with AppWorker.open() as worker:
        for wait_inline in (0.0, 0.001, 5.0):
            monkeypatch.setattr(worker, "wait_inline", wait_inline)
            with trio.fail_after(10), pytest.raises(Boom, match="async"):
                await worker.run(call_hook, Hook.of("fails", "", fails), object())
            with trio.fail_after(10):
                await worker.run(call_hook, Hook.of("fine", "", fine), object())
    assert [threading.main_thread().name] * 3 == seen  # on the loop's thread


async def test_the_loop_does_not_wait_inline_behind_a_slow_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The inline wait is for a job done within ``wait_inline``: behind one that has run longer already,
    the loop would sit out the whole wait serving nothing (1 ms a call: 200 calls arriving while a plugin
    function was slow held the loop about 240 ms). Here wait_inline is 4 s, made so once the slow job
    runs; the slow job ends when the loop tells it to, which a loop held 4 s by the call queued at 4.5 s
    never does before the job gives up at 6.5 s."""
    released: list[bool] = []
    busy = threading.Event()
    release = threading.Event()

    def slow() -> None:
        busy.set()
        released.append(release.wait(6.5))

    async with AppWorker.open() as worker, trio.open_nursery() as nursery:
        nursery.start_soon(worker.run, slow)
        await trio.to_thread.run_sync(busy.wait, 20)  # the worker is in the slow job (the loop free)
        monkeypatch.setattr(worker, "wait_inline", 4.0)
        await trio.sleep(4.5)
        nursery.start_soon(worker.run, lambda: None)  # queued behind it
        await trio.sleep(0.1)  # the queued call has run up to its wait
        release.set()
        assert "after" == await worker.run(lambda: "after")
    assert [True] == released
