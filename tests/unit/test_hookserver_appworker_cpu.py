"""Tests of the AppWorker's thread kept on the event loop's CPU while the loop waits for a short job:
pinned only while the loop waits (a job that outlives the wait, lets the loop go, or is queued with no
wait runs on every CPU the process may use, read at that moment, so a cpuset change is followed), and
any refusal of the kernel's turns it off for good."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import trio

from krproxy.hookserver import _worker
from krproxy.hookserver._registry import Hook, call_hook
from krproxy.hookserver._service import AppWorker

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs"
)


def affinity() -> set[int]:
    return os.sched_getaffinity(0)


def later(seconds: float) -> set[int]:
    time.sleep(seconds)
    return os.sched_getaffinity(0)


async def test_a_short_job_runs_on_the_loops_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job the loop waits for runs with the worker on one CPU of the process's, the loop's."""
    async with AppWorker.open() as worker:
        monkeypatch.setattr(worker, "wait_inline", 5.0)
        seen = await worker.run(affinity)
    assert 1 == len(seen)
    assert seen <= os.sched_getaffinity(0)


async def test_a_job_outliving_the_wait_runs_on_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the loop stops waiting, the worker may use every CPU again, however long the job runs."""
    async with AppWorker.open() as worker:
        monkeypatch.setattr(worker, "wait_inline", 5.0)
        assert 1 == len(await worker.run(affinity))
        monkeypatch.setattr(worker, "wait_inline", 0.001)
        assert os.sched_getaffinity(0) == await worker.run(later, 0.1)


async def test_jobs_queued_without_a_wait_run_on_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job queued behind a slow one, or while the loop holds the app, is not waited for: unpinned."""
    async with AppWorker.open() as worker, trio.open_nursery() as nursery:
        monkeypatch.setattr(worker, "wait_inline", 5.0)
        assert 1 == len(await worker.run(affinity))
        worker.hold()
        seen: list[set[int]] = []

        async def queued() -> None:
            seen.append(await worker.run(affinity))

        nursery.start_soon(queued)
        await trio.sleep(0.05)
        worker.release()
        await trio.sleep(0.05)
        assert [os.sched_getaffinity(0)] == seen


async def test_a_job_letting_the_loop_go_runs_on_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that hands an ``async def`` function to the loop goes on unpinned once the loop is let go."""

    async def on_trio(ctx: object) -> None:
        await trio.sleep(0)

    def job() -> set[int]:
        call_hook(Hook.of("async", "", on_trio), object())
        return os.sched_getaffinity(0)

    async with AppWorker.open() as worker:
        monkeypatch.setattr(worker, "wait_inline", 5.0)
        assert 1 == len(await worker.run(affinity))
        with trio.fail_after(10):
            assert os.sched_getaffinity(0) == await worker.run(job)


async def test_the_worker_follows_the_loops_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpinned means the CPUs the loop's thread may use when the wait ends (a cpuset's change
    reaches every thread), not those of the worker's start."""
    everywhere = os.sched_getaffinity(0)
    one = {min(everywhere)}
    async with AppWorker.open() as worker:
        try:
            os.sched_setaffinity(0, one)
            monkeypatch.setattr(worker, "wait_inline", 5.0)
            assert one == await worker.run(affinity)
            monkeypatch.setattr(worker, "wait_inline", 0.001)
            assert one == await worker.run(later, 0.1)
        finally:
            os.sched_setaffinity(0, everywhere)
        assert everywhere == await worker.run(later, 0.1)


async def test_a_refusal_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``OSError`` from the kernel (a seccomp filter, a cpuset changing under it) ends the pinning:
    jobs run as before and the kernel is not asked again."""
    asked: list[Any] = []

    def refuse(tid: int, cpus: Any) -> None:
        asked.append(tid)
        raise PermissionError(1, "refused")

    async with AppWorker.open() as worker:
        monkeypatch.setattr(worker, "wait_inline", 5.0)
        monkeypatch.setattr(_worker.os, "sched_setaffinity", refuse)
        for i in range(5):
            assert i == await worker.run(lambda i=i: i)
        assert threading.current_thread() is threading.main_thread()
    assert 1 == len(asked)
