"""krproxy.hookserver._worker: the loop knows when the app is idle (every job it queued came back, nothing
held), and work holding the app on the loop (:meth:`AppWorker.hold`) keeps jobs queued meanwhile waiting
until it ends, in order."""

from __future__ import annotations

import threading

import outcome
import pytest
import trio

from krproxy.hookserver._worker import AppWorker
from tests.integration.support import LIVENESS_LIMIT


class Outcomes:
    """``done_late`` for submitted jobs: their outcomes, and :meth:`wait` for a number of them."""

    def __init__(self) -> None:
        self.got: list[outcome.Outcome[object]] = []
        self._changed = trio.Event()

    def __call__(self, result: outcome.Outcome[object]) -> None:
        self.got.append(result)
        self._changed.set()

    async def wait(self, count: int) -> None:
        while len(self.got) < count:
            self._changed = trio.Event()
            await self._changed.wait()


async def test_idle_until_a_job_comes_back() -> None:
    """Idle at first; a quick job answered within the inline wait leaves it idle; a job still running
    makes it busy until its outcome has come back to the loop (``done_late``)."""
    release = threading.Event()
    came_back = Outcomes()
    async with AppWorker.open() as worker:
        assert worker.idle
        assert "quick" == await worker.run(lambda: "quick")
        assert worker.idle
        result = worker.submit(came_back, lambda: release.wait(LIVENESS_LIMIT) and "slow")
        assert result is None  # (the job waits for release: longer than the inline wait)
        assert not worker.idle
        release.set()
        with trio.fail_after(LIVENESS_LIMIT):
            await came_back.wait(1)
        assert [outcome.Value("slow")] == came_back.got
        assert worker.idle


async def test_a_job_queued_while_held_waits_for_release() -> None:
    """While the app is held on the loop, a job queued does not start (the worker waits at a gate, and
    the loop does not sit out its inline wait for it); jobs queued meanwhile run in order once it is
    released, and the worker is idle again when they are back."""
    ran: list[str] = []
    came_back = Outcomes()
    async with AppWorker.open() as worker:
        worker.hold()
        assert not worker.idle
        with pytest.raises(AssertionError):
            worker.hold()  # once at a time
        assert worker.submit(came_back, ran.append, "first") is None
        assert worker.submit(came_back, ran.append, "second") is None
        await trio.sleep(0.05)  # the worker's thread had every chance to run them
        assert [] == ran
        worker.release()
        with trio.fail_after(LIVENESS_LIMIT):
            await came_back.wait(2)
            await worker.run(ran.append, "third")
        assert ["first", "second", "third"] == ran
        assert worker.idle


async def test_hold_and_release_without_jobs_leave_it_idle() -> None:
    """Held and released with nothing queued meanwhile, the worker needs no gate and is idle again."""
    async with AppWorker.open() as worker:
        worker.hold()
        worker.release()
        assert worker.idle
        assert 1 == await worker.run(lambda: 1)


async def test_the_worker_ends_after_a_release_at_shutdown() -> None:
    """A job queued while held is still run when the hold ends as the worker closes (the task holding it
    releases in its ``finally``): the worker's end waits for it, nothing hangs."""
    ran: list[int] = []
    with trio.fail_after(LIVENESS_LIMIT):
        async with AppWorker.open() as worker:
            worker.hold()
            worker.submit(lambda _: None, ran.append, 1)
            worker.release()
    assert [1] == ran
