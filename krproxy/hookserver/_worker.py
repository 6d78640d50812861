"""The app's worker thread: the served app's synchronous work, one job at a time, in order.

The served app (:class:`._app.HookServer`) keeps its state without locks, so whatever touches it —
hook calls, the policy watcher, tickers, retries — runs one at a time: in :class:`AppWorker`'s
thread, or on the event loop while the worker is idle (a stage of non-blocking functions, see
:mod:`._service`), the worker then held until that work ends (:meth:`AppWorker.hold`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import select
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar, cast

import outcome
import trio

from ._registry import WORKER_THREAD

T = TypeVar("T")


class AppWorker:
    """Runs the app's synchronous work one job at a time, in order, in a thread of its own.

    One thread for the app's whole life rather than ``trio.to_thread.run_sync`` per call: half the
    CPU per call (about 45 µs against 80-120 µs for a hop on a 2-core machine; measured with a
    no-op function, docs/plugin-authoring.md), and one job at a time is what the app's lock-free
    state needs anyway. Open it with ``async with AppWorker.open() as worker``.

    A hook call's job is queued with :meth:`submit`, from the connection's own task (the
    handlers are :class:`krproxy.rpc.UnaryJob` objects: no trio task, cancel scope or scheduler pass
    per call); the app's other work (tickers, the policy watcher) awaits :meth:`run`.

    The way back is cheap too: :meth:`submit` first waits for the job's byte on a second pipe
    (``poll``, :meth:`_wait_for`), the event loop's thread blocked for at most :attr:`wait_inline` seconds (not at all behind a job that has run
    that long already: a slow plugin function cost the loop that much for each call arriving
    meanwhile), and only a job still running then
    comes back through trio (``run_sync_soon``: a write to trio's wake-up socket, its read, a
    pass of the scheduler for the task that drains it). A hook call's job takes tens of
    microseconds, so most calls skip that: 5 system calls fewer per call (futex waits
    aside), about a tenth of the server's CPU per call (docs/performance.md). A job that hands
    work to the loop itself (an ``async def`` plugin function, :func:`._registry.call_hook`)
    lets the loop go first (:meth:`_Job.release_loop`).

    The thread sleeps on a pipe, not on the queue: the loop wakes it with ``os.write``, which
    lets go of the GIL before the system call, so the thread wakes to a free GIL instead of
    waking, finding the loop's thread holding it, and sleeping again until it is let go (a
    second wake-up of each thread per job). About 5-10 µs of CPU less per job
    (docs/performance.md). The way back is a pipe for the same reason: the thread's ``os.write``
    lets go of the GIL too, where releasing a lock the loop waited on did not (a hop 10-30 µs
    cheaper in a two-thread ping-pong, docs/performance.md).

    The loop knows whether the app is free (:attr:`idle`): every job it queued has come back to it
    (through :meth:`submit`'s own wait or ``done_late``) and nothing holds the app on the loop. Work
    the loop does itself while idle needs no hop at all; work that awaits on the loop marks the app
    :meth:`hold` until it ends, and jobs queued meanwhile wait behind a gate for :meth:`release`.
    """

    #: Seconds the event loop's thread waits for a job before handing the wait to trio. The
    #: loop serves nothing meanwhile, so it is kept well under the proxy's hook timeouts.
    wait_inline = 0.001

    def __init__(self, trio_token: trio.lowlevel.TrioToken) -> None:
        self._token = trio_token
        self._jobs: collections.deque[_Job | threading.Event | None] = collections.deque()  # atomic ends
        # A byte written after each put (never blocking: a full pipe already wakes the thread,
        # which then takes every job queued).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        # The way back: a byte the thread writes when the job the loop waits for ends (or lets
        # go), which the loop waits for with poll(); never blocking either side.
        try:
            self._answer_r, self._answer_w = os.pipe()
        except OSError:  # (out of fds: the wake pipe must not be left open)
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        os.set_blocking(self._answer_r, False)
        os.set_blocking(self._answer_w, False)
        self._answered = select.poll()
        self._answered.register(self._answer_r, select.POLLIN)
        self._thread = threading.Thread(target=self._work, name="krproxy-hookserver-app", daemon=True)
        #: When the job the thread runs began (time.monotonic), or None between jobs.
        self._running_since: float | None = None
        # The loop's own count (only its thread reads and writes it): jobs queued whose outcome has
        # not come back to the loop yet.
        self._outstanding = 0
        self._held = False  # the app is held by work on the loop (hold, release)
        self._gate: threading.Event | None = None  # queued before the jobs that wait for release

    @property
    def idle(self) -> bool:
        """Whether the app is free (from the loop's thread): no job of the worker's unfinished as far
        as the loop knows, nothing holding it on the loop. Work done on the loop's thread while idle,
        without an await, is one job like the worker's: nothing else can start meanwhile."""
        return self._outstanding == 0 and not self._held

    def hold(self) -> None:
        """Mark the app held by work on the loop that awaits (an ``async def`` stage's task) until
        :meth:`release`: jobs queued meanwhile run after it. Only while :attr:`idle`."""
        assert self.idle, "hold() while the app is busy"
        self._held = True

    def release(self) -> None:
        """The loop's work on the app has ended: jobs queued meanwhile go ahead."""
        self._held = False
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.set()

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls) -> AsyncIterator[AppWorker]:
        """A worker for this trio run; its thread ends when the block does (after its last job)."""
        worker = cls(trio.lowlevel.current_trio_token())
        try:
            worker._thread.start()
            try:
                yield worker
            finally:
                worker._put(None)
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(worker._thread.join)
        finally:
            for fd in (worker._wake_r, worker._wake_w, worker._answer_r, worker._answer_w):
                os.close(fd)

    def _put(self, job: _Job | threading.Event | None) -> None:
        self._jobs.append(job)
        try:  # noqa: SIM105 - suppress() is three Python calls more, on every hook call's path
            os.write(self._wake_w, b"j")
        except BlockingIOError:  # full: the thread has wake-ups enough
            pass

    def _work(self) -> None:
        WORKER_THREAD.trio_token = self._token
        jobs = self._jobs
        while True:
            os.read(self._wake_r, 4096)  # until something is queued; every pending wake-up
            while jobs:  # (one consumer: what it saw stays there)
                job = jobs.popleft()
                if job is None:
                    return
                if isinstance(job, threading.Event):  # a gate: the loop holds the app until it is set
                    job.wait()
                    continue
                self._do(job)

    def _do(self, job: _Job) -> None:
        WORKER_THREAD.release_loop = job.release_loop
        self._running_since = time.monotonic()
        result: outcome.Outcome[Any]
        try:  # (outcome.capture, one Python call fewer)
            result = outcome.Value(job.fn(*job.args))
        except BaseException as exc:  # the job's, handed to its caller as capture() would
            result = outcome.Error(exc)
        self._running_since = None
        WORKER_THREAD.release_loop = None
        with job.guard:
            job.result = result
            awaited = job.awaited
        if awaited:
            self._token.run_sync_soon(self._came_back, job.done_late, result)
        else:
            job.release_loop()

    def submit(
        self, done_late: Callable[[outcome.Outcome[T]], None], fn: Callable[..., T], *args: Any
    ) -> outcome.Outcome[T] | None:
        """Queue ``fn(*args)`` (after every job queued before it) from the event loop's thread,
        without a task: its outcome if it ended within :attr:`wait_inline`, else None and
        ``done_late(outcome)`` is called on the loop's thread once it ends (``run_sync_soon``)."""
        job = _Job(fn, args, done_late, self._answer_w)
        since = self._running_since
        gated = self._held
        if gated and self._gate is None:
            self._gate = threading.Event()
            self._put(self._gate)
        self._outstanding += 1
        self._put(job)
        if not gated and (since is None or time.monotonic() - since < self.wait_inline):
            self._wait_for(job)
        # (else the job waits behind one that has run longer than wait_inline already, or behind the
        # loop's own work: it would not be done before the wait ran out, while the loop served nothing)
        with job.guard:
            result = job.result
            job.awaited = result is None  # from here on the worker hands it to done_late
        if result is not None:
            self._outstanding -= 1
        return result

    def _came_back(self, done_late: Callable[[outcome.Outcome[T]], None], result: outcome.Outcome[T]) -> None:
        """A job's late outcome, on the loop's thread (``run_sync_soon``)."""
        self._outstanding -= 1
        done_late(result)

    def _wait_for(self, job: _Job) -> None:
        """Block the loop's thread until ``job`` ends or lets the loop go, at most
        :attr:`wait_inline` seconds. A byte read here may be a job's before it (one that ended
        just after the loop stopped waiting for it): then the wait goes on for the rest."""
        deadline = time.monotonic() + self.wait_inline
        wait_ms = self.wait_inline * 1000
        while self._answered.poll(wait_ms):
            try:  # noqa: SIM105 - (as in _put)
                os.read(self._answer_r, 4096)
            except BlockingIOError:  # (nothing left: read by an earlier wait)
                pass
            if job.released:
                return
            wait_ms = (deadline - time.monotonic()) * 1000
            if wait_ms <= 0:
                return

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the worker thread, after every job queued before it. A caller cancelled
        once the job is queued still waits for it to finish (the app's state stays whole)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        task = trio.lowlevel.current_task()
        result = self.submit(functools.partial(trio.lowlevel.reschedule, task), fn, *args)
        if result is None:  # wait_task_rescheduled unwraps the outcome the worker sends
            return cast(T, await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED))
        return cast(T, result.unwrap())


class _Job:
    """One job of an :class:`AppWorker` and how its result comes back."""

    __slots__ = ("answer_w", "args", "awaited", "done_late", "fn", "guard", "released", "result")

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        done_late: Callable[[outcome.Outcome[Any]], None],
        answer_w: int,
    ) -> None:
        self.fn = fn
        self.args = args
        self.done_late = done_late
        self.answer_w = answer_w  # the worker's answer pipe (AppWorker._wait_for)
        self.result: outcome.Outcome[Any] | None = None
        self.released = False  # the job ended or let the loop go: its byte is written
        self.guard = threading.Lock()  # result and awaited change together
        self.awaited = False  # the loop no longer waits for it: the result goes to done_late

    def release_loop(self) -> None:
        """Stop the event loop's thread waiting for this job (once; from the worker thread)."""
        if not self.released:
            self.released = True
            try:  # noqa: SIM105 - (as in AppWorker._put)
                os.write(self.answer_w, b"a")
            except BlockingIOError:  # full: the loop's poll sees bytes already
                pass
