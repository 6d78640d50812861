"""gRPC glue: ``RuntimeHookService`` on a unix socket (:mod:`krproxy.rpc`), plus the registration file.

The app (:class:`HookServer`) is synchronous and keeps its state (pod cache, pending writes, the
policy) without locks. Everything that touches it — hook calls, the policy watcher, tickers,
retries — runs through one :class:`AppWorker`: one at a time, in a worker thread, so a slow
plugin function or cgroup write never stalls the event loop (the socket, other connections,
the proxy's deadlines), and ``async def`` plugin functions are handed back to the trio loop
(see :func:`._registry.call_hook`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import select
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar, cast

import attrs
import outcome
import trio

from krproxy import log, rpc
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks.watcher import untrusted_reason

from . import _wire
from ._app import RETRY_INTERVAL, HookServer, Ticker
from ._policywatch import PolicyWatcher
from ._registration import registration_json, remove_registration, write_registration
from ._registry import WORKER_THREAD, FailurePolicy, HookFailedError, Stage

LOGGER = logging.getLogger("krproxy.hookserver")

T = TypeVar("T")
R = TypeVar("R")  # the request's record
C = TypeVar("C")  # the call's context


def _answer(
    stage: Stage,
    request: bytes,
    message: str,
    decode: Callable[[bytes], tuple[Any, R]],
    run: Callable[[Stage, R], C],
    reply: Callable[[Any, C], bytes],
) -> bytes:
    """One hook call's answer: ``request`` decoded (else INVALID_ARGUMENT naming ``message``), the
    plugins run on its record, the reply encoded; a plugin's failure is UNKNOWN with its message."""
    try:
        req, info = decode(request)
    except _wire.DecodeError as exc:
        raise _not_a(stage, message, exc) from exc
    try:
        return reply(req, run(stage, info))
    except (HookFailedError, OSError) as exc:
        raise GRPCError(Status.UNKNOWN, str(exc)) from exc


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
    """

    #: Seconds the event loop's thread waits for a job before handing the wait to trio. The
    #: loop serves nothing meanwhile, so it is kept well under the proxy's hook timeouts.
    wait_inline = 0.001

    def __init__(self, trio_token: trio.lowlevel.TrioToken) -> None:
        self._token = trio_token
        self._jobs: collections.deque[_Job | None] = collections.deque()  # append, popleft: atomic
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

    def _put(self, job: _Job | None) -> None:
        self._jobs.append(job)
        with contextlib.suppress(BlockingIOError):  # full: the thread has wake-ups enough
            os.write(self._wake_w, b"j")

    def _work(self) -> None:
        WORKER_THREAD.trio_token = self._token
        jobs = self._jobs
        while True:
            os.read(self._wake_r, 4096)  # until something is queued; every pending wake-up
            while jobs:  # (one consumer: what it saw stays there)
                job = jobs.popleft()
                if job is None:
                    return
                self._do(job)

    def _do(self, job: _Job) -> None:
        WORKER_THREAD.release_loop = job.release_loop
        self._running_since = time.monotonic()
        result = outcome.capture(job.fn, *job.args)
        self._running_since = None
        WORKER_THREAD.release_loop = None
        with job.guard:
            job.result = result
            awaited = job.awaited
        if awaited:
            self._token.run_sync_soon(job.done_late, result)
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
        self._put(job)
        if since is None or time.monotonic() - since < self.wait_inline:
            self._wait_for(job)
        # (else the job waits behind one that has run longer than wait_inline already: it would not be
        # done before the wait ran out, while the loop served nothing)
        with job.guard:
            result = job.result
            job.awaited = result is None  # from here on the worker hands it to done_late
        return result

    def _wait_for(self, job: _Job) -> None:
        """Block the loop's thread until ``job`` ends or lets the loop go, at most
        :attr:`wait_inline` seconds. A byte read here may be a job's before it (one that ended
        just after the loop stopped waiting for it): then the wait goes on for the rest."""
        deadline = time.monotonic() + self.wait_inline
        wait_ms = self.wait_inline * 1000
        while self._answered.poll(wait_ms):
            with contextlib.suppress(BlockingIOError):  # (nothing left: read by an earlier wait)
                os.read(self._answer_r, 4096)
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
            with contextlib.suppress(BlockingIOError):  # full: the loop's poll sees bytes already
                os.write(self.answer_w, b"a")


class HookService:
    """Answers every hook point by running the app's plugins for that stage.

    :meth:`handlers` is the route table for :class:`krproxy.rpc.Server`.
    """

    def __init__(self, app: HookServer, worker: AppWorker) -> None:
        self.app = app
        self.worker = worker

    def handlers(self) -> dict[str, rpc.Handler]:
        """One unary handler per hook point, by gRPC path: an :class:`rpc.UnaryJob` whose work is
        the worker's job, so a call costs the event loop no task of its own."""
        return {
            stage.rpc_path: rpc.UnaryJob(
                functools.partial(self._start, self._pod if stage.is_pod_level else self._container, stage)
            )
            for stage in Stage
        }

    # In the worker thread, decoding and encoding too (upb, ``_wire``: with betterproto2 they took
    # as much CPU as the rest of the call).

    def _pod(self, stage: Stage, request: bytes) -> bytes:
        return _answer(
            stage, request, "PodSandboxHookRequest", _wire.pod_info, self.app.run_pod, _wire.pod_reply
        )

    def _container(self, stage: Stage, request: bytes) -> bytes:
        return _answer(
            stage,
            request,
            "ContainerResourceHookRequest",
            _wire.container_info,
            self.app.run_container,
            _wire.container_reply,
        )

    def _start(
        self,
        answer: Callable[[Stage, bytes], bytes],
        stage: Stage,
        request: bytes,
        done_late: Callable[[outcome.Outcome[bytes]], None],
    ) -> outcome.Outcome[bytes] | None:
        return self.worker.submit(done_late, answer, stage, request)


def _not_a(stage: Stage, expected: str, exc: Exception) -> GRPCError:
    return GRPCError(Status.INVALID_ARGUMENT, f"{stage.rpc_name}: the request is no {expected}: {exc}")


@attrs.frozen
class ServeOptions:
    """Where and how to serve.

    Attributes:
        socket: the unix socket to listen on.
        hook_dir: the proxy's registration directory (``/etc/runtime/hookserver.d``).
        name: the registration file is ``<hook_dir>/<name>.json``.
        endpoint: the socket path as the proxy sees it (differs when we run in a container);
            defaults to ``socket``.
        failure_policy: what the proxy does when this server fails (written in the file).
        policy_path: the node policy file to watch, if any.
        disabled_stages: stages not to register even though plugins exist for them.
    """

    socket: str
    hook_dir: str
    name: str = "krproxy-hookserver"
    endpoint: str | None = None
    failure_policy: FailurePolicy = FailurePolicy.IGNORE
    policy_path: str | None = None
    disabled_stages: tuple[Stage, ...] = ()


async def run_background(
    app: HookServer, policy_path: str | None, nursery: trio.Nursery, worker: AppWorker
) -> None:
    """Start the policy watcher (ready once the first look is done) and the app's tickers, each
    running its work through ``worker``."""
    if policy_path is not None:
        await nursery.start(_watch_policy, PolicyWatcher(policy_path, app.set_policy), worker)
    if app.policy is None:  # no (valid) policy yet: the features' status without one
        await worker.run(app.report_features)
    for ticker in app.tickers:
        nursery.start_soon(_tick_forever, app, ticker, worker)
    nursery.start_soon(_retry_forever, app, worker)


async def _watch_policy(
    watcher: PolicyWatcher,
    worker: AppWorker,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """:meth:`PolicyWatcher.run`, each look (and the re-apply a change causes) on the worker."""
    await worker.run(watcher.poll)
    task_status.started()
    while True:
        await trio.sleep(watcher.interval)
        await worker.run(watcher.poll)


async def _retry_forever(app: HookServer, worker: AppWorker) -> None:
    """Settings whose cgroup did not exist at their hook call are retried until it does."""
    while True:
        await trio.sleep(RETRY_INTERVAL)
        if app.pending:
            await worker.run(app.retry_pending)


async def _tick_forever(app: HookServer, ticker: Ticker, worker: AppWorker) -> None:
    while True:
        await trio.sleep(ticker.interval)
        await worker.run(app.tick, ticker)


#: Stages a server registers even without plugin functions for them: its pod cache (the targets
#: of a re-apply) forgets pods and containers only when the proxy tells it they stopped.
LIFECYCLE_STAGES = (Stage.POST_STOP_POD_SANDBOX, Stage.POST_STOP_CONTAINER)


def registered_stages(app: HookServer, options: ServeOptions) -> tuple[Stage, ...]:
    """The stages written into the registration file: those with plugin functions, plus the
    lifecycle stages, minus the disabled ones; in declaration order."""
    wanted = set(app.registry.stages(options.disabled_stages)) | set(LIFECYCLE_STAGES)
    return tuple(s for s in Stage if s in wanted and s not in options.disabled_stages)


def warn_if_refused(path: str) -> None:
    """Log ``registration_refused`` when krproxy, running as root, will refuse the registration file at
    ``path`` for its owner or mode (docs/plugin-authoring.md): krproxy logs that too, but on its side; a
    hook server run as non-root otherwise looked registered and was never called."""
    reason = untrusted_reason(os.stat(path), uid=0, gid=0)
    if reason is not None:
        log.warning(
            LOGGER,
            "registration_refused",
            registration=path,
            reason=f"krproxy refuses a registration file {reason}",
            fix="run this hook server as root (krproxy trusts only files root could write), or, on a test "
            "node, start krproxy with --insecure-registration-files",
        )


async def serve(
    app: HookServer, options: ServeOptions, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``app`` on ``options.socket`` until cancelled (inside ``trio.run``).

    Order: policy loaded → socket listening → registration file written → ``started(path)``
    (the registration path). On cancellation the registration file is removed first (so
    the proxy stops calling), then the server stops and the socket file is removed.
    """
    async with AppWorker.open() as worker, trio.open_nursery() as nursery:
        server = rpc.Server(HookService(app, worker).handlers())
        await run_background(app, options.policy_path, nursery, worker)
        await nursery.start(server.serve, options.socket)
        content = registration_json(
            options.endpoint or options.socket, options.failure_policy, registered_stages(app, options)
        )
        path = write_registration(options.hook_dir, options.name, content)
        log.event(LOGGER, "hookserver_started", socket=options.socket, registration=path)
        warn_if_refused(path)
        try:
            task_status.started(path)
            await trio.sleep_forever()
        finally:
            remove_registration(path)
            nursery.cancel_scope.cancel()
            log.event(LOGGER, "hookserver_stopped", socket=options.socket, registration_removed=path)
