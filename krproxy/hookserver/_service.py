"""gRPC glue: ``RuntimeHookService`` on a unix socket (:mod:`krproxy.rpc`), plus the registration file.

The app (:class:`HookServer`) is synchronous and keeps its state (pod cache, pending writes, the
policy) without locks. Everything that touches it — hook calls, the policy watcher, tickers,
retries — runs one at a time (:class:`._worker.AppWorker`). Where a hook call runs follows from its
stage's functions (:meth:`._registry.Registry.placement`):

- a blocking plain function among them (a plain ``def`` unless declared ``blocking=False``): the
  call in the worker thread, so a slow plugin function never stalls the event loop (the socket,
  other connections, the proxy's deadlines); its ``async def`` functions are handed back to the loop
  (:func:`._registry.call_hook`). Only reading the request (upb and the context's records, no app
  state) is done on the loop first, where its bytes arrived (:data:`READ_ON_LOOP_BELOW`);
- non-blocking plain functions only: on the event loop, in the step that read the request, when the
  app is idle (no hop to a thread and back: about half of such a server's CPU per call, docs/
  performance.md); each function timed (:class:`._registry.InlineWatch`);
- non-blocking and ``async def`` functions: in a task on the event loop, the app held meanwhile.

Either way the SDK's own file work (cgroup writes, retries of deferred ones) goes to a thread: on
the loop, a call whose finish would touch files (:meth:`HookServer.finish_touches_files`) finishes
in the worker (or, from a task that holds the app, in a thread of trio's). A call that finds the app
busy queues behind the work before it, in the worker, as before.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import attrs
import outcome
import trio

from krproxy import hugepages, log, rpc
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks.watcher import untrusted_reason

from . import _wire
from ._app import RETRY_INTERVAL, HookServer, Ticker
from ._context import ContainerContext, PodContext
from ._policywatch import PolicyWatcher
from ._registration import registration_json, remove_registration, write_registration
from ._registry import (
    WORKER_THREAD,
    FailurePolicy,
    HookFailedError,
    InlineWatch,
    Placement,
    RunResult,
    Stage,
    run_hooks_on_loop,
)
from ._worker import AppWorker as AppWorker

LOGGER = logging.getLogger("krproxy.hookserver")

#: A request for the worker is read on the loop's thread, where its bytes were read, when smaller
#: than this: the worker's job then starts from the records. Reading there rather than in the worker
#: halved a plain function's call after the server waited idle (docs/performance.md, "A blocking
#: stage's request read on the loop"); a larger one is read in the worker, not to hold up the loop.
READ_ON_LOOP_BELOW = 64 * 1024


@attrs.frozen
class _Level:
    """How a hook call of one level (pod, container) is read, finished and answered."""

    message: str  # the request's message type, for errors
    decode: Callable[[bytes], tuple[Any, Any]]  # the upb request and the plugins' record (_wire)
    context: Callable[[Any], Any]  # the call's context for the record
    finish: Callable[[Stage, Any, RunResult], None]  # the app's second half of the call
    reply: Callable[[Any, Any], bytes]  # the answer's bytes (_wire)


class HookService:
    """Answers every hook point by running the app's plugins for that stage, where the stage's
    functions say (see the module's notes).

    :meth:`handlers` is the route table for :class:`krproxy.rpc.Server`. Without a ``nursery`` a
    stage with ``async def`` functions runs in the worker (their tasks need one); ``watch`` times
    non-blocking plain functions on the loop.
    """

    def __init__(
        self,
        app: HookServer,
        worker: AppWorker,
        nursery: trio.Nursery | None = None,
        watch: InlineWatch | None = None,
    ) -> None:
        self.app = app
        self.worker = worker
        self.nursery = nursery
        self.watch = InlineWatch() if watch is None else watch
        self._pod = _Level(
            "PodSandboxHookRequest", _wire.pod_info, PodContext, app.finish_pod, _wire.pod_reply
        )
        self._container = _Level(
            "ContainerResourceHookRequest",
            _wire.container_info,
            ContainerContext,
            app.finish_container,
            _wire.container_reply,
        )

    def handlers(self) -> dict[str, rpc.Handler]:
        """One unary handler per hook point, by gRPC path: an :class:`rpc.UnaryJob`, so a call costs
        the event loop no task of its own (unless its stage awaits)."""
        return {
            stage.rpc_path: rpc.UnaryJob(
                functools.partial(self._start, self._pod if stage.is_pod_level else self._container, stage)
            )
            for stage in Stage
        }

    def _start(
        self,
        level: _Level,
        stage: Stage,
        request: bytes,
        done_late: Callable[[outcome.Outcome[bytes]], None],
    ) -> outcome.Outcome[bytes] | None:
        """Start a call (on the loop's thread, from the connection's task): its outcome if it has it
        already, else None and ``done_late(outcome)`` later."""
        placement = self.app.registry.placement(stage)
        if placement is Placement.WORKER or not self.worker.idle:
            return self._to_worker(level, stage, request, done_late)
        if placement is Placement.LOOP:
            try:
                return self._on_loop(level, stage, request, done_late)
            except Exception as exc:  # the call's answer (rpc reports it as submit's would)
                return outcome.Error(exc)
        if self.nursery is None:  # (no nursery for the task: the worker hands its awaits to the loop)
            return self._to_worker(level, stage, request, done_late)
        self.worker.hold()
        self.nursery.start_soon(self._in_task, level, stage, request, done_late)
        return None

    def _to_worker(
        self,
        level: _Level,
        stage: Stage,
        request: bytes,
        done_late: Callable[[outcome.Outcome[bytes]], None],
    ) -> outcome.Outcome[bytes] | None:
        """The call queued for the worker, its request read here first (reading touches no app
        state) unless it is of :data:`READ_ON_LOOP_BELOW` bytes or more: one that is no such message
        is then answered at once, with no job queued (another error reading it is raised to the
        server, which answers the call UNKNOWN, as from the worker)."""
        if len(request) >= READ_ON_LOOP_BELOW:
            return self.worker.submit(done_late, self._read_in_worker, level, stage, request)
        try:
            req, ctx = self._read(level, stage, request)
        except GRPCError as exc:
            return outcome.Error(exc)
        return self.worker.submit(done_late, self._in_worker, level, stage, req, ctx)

    def _read(self, level: _Level, stage: Stage, request: bytes) -> tuple[Any, Any]:
        """The upb request and the call's context; INVALID_ARGUMENT naming the message if the bytes are
        no such message."""
        try:
            req, info = level.decode(request)
        except _wire.DecodeError as exc:
            raise _not_a(stage, level.message, exc) from exc
        return req, level.context(info)

    def _finish(self, level: _Level, stage: Stage, req: Any, ctx: Any, result: RunResult) -> bytes:
        """The call's second half and its answer; a write the kernel refused is UNKNOWN with its message."""
        try:
            level.finish(stage, ctx, result)
            return level.reply(req, ctx)
        except OSError as exc:
            raise GRPCError(Status.UNKNOWN, str(exc)) from exc

    def _read_in_worker(self, level: _Level, stage: Stage, request: bytes) -> bytes:
        """The whole call, as a job of the worker's."""
        req, ctx = self._read(level, stage, request)
        return self._in_worker(level, stage, req, ctx)

    def _in_worker(self, level: _Level, stage: Stage, req: Any, ctx: Any) -> bytes:
        """The call once read: its stage, finish and answer, as a job of the worker's."""
        try:
            result = self.app.run_stage(stage, ctx)
        except HookFailedError as exc:
            raise GRPCError(Status.UNKNOWN, str(exc)) from exc
        return self._finish(level, stage, req, ctx, result)

    def _on_loop(
        self,
        level: _Level,
        stage: Stage,
        request: bytes,
        done_late: Callable[[outcome.Outcome[bytes]], None],
    ) -> outcome.Outcome[bytes] | None:
        """The call on the loop's thread, the app idle; the second half in the worker when it would
        touch files (the worker idle, so that is the next job: nothing runs in between)."""
        req, ctx = self._read(level, stage, request)
        try:
            result = self.app.run_stage(stage, ctx, self.watch.call)
        except HookFailedError as exc:
            raise GRPCError(Status.UNKNOWN, str(exc)) from exc
        if self.app.finish_touches_files(stage, ctx):
            return self.worker.submit(done_late, self._finish, level, stage, req, ctx, result)
        return outcome.Value(self._finish(level, stage, req, ctx, result))

    async def _in_task(
        self,
        level: _Level,
        stage: Stage,
        request: bytes,
        done_late: Callable[[outcome.Outcome[bytes]], None],
    ) -> None:
        """The call in a task of its own on the loop, holding the app until it ends. The caller's
        deadline does not cancel it (as a job in the worker runs on): its answer is then dropped."""
        try:
            answer: outcome.Outcome[bytes] = outcome.Value(await self._awaited(level, stage, request))
        except Exception as exc:
            answer = outcome.Error(exc)
        finally:
            self.worker.release()
        done_late(answer)

    async def _awaited(self, level: _Level, stage: Stage, request: bytes) -> bytes:
        req, ctx = self._read(level, stage, request)
        app = self.app
        try:
            result = await run_hooks_on_loop(
                app.registry.hooks(stage), ctx, app.plugin_failure_policy, where=stage.value, watch=self.watch
            )
        except HookFailedError as exc:
            raise GRPCError(Status.UNKNOWN, str(exc)) from exc
        if not app.finish_touches_files(stage, ctx):
            return self._finish(level, stage, req, ctx, result)
        token = trio.lowlevel.current_trio_token()
        return await trio.to_thread.run_sync(self._finish_in_thread, token, level, stage, req, ctx, result)

    def _finish_in_thread(
        self,
        token: trio.lowlevel.TrioToken,
        level: _Level,
        stage: Stage,
        req: Any,
        ctx: Any,
        result: RunResult,
    ) -> bytes:
        """:meth:`_finish` in a thread of trio's, the app held by the task that waits for it: as in the
        worker, an ``async def`` reconciler that a retry runs is handed to the loop."""
        WORKER_THREAD.trio_token = token
        try:
            return self._finish(level, stage, req, ctx, result)
        finally:
            WORKER_THREAD.trio_token = None


def _not_a(stage: Stage, expected: str, exc: Exception) -> GRPCError:
    """INVALID_ARGUMENT for bytes that are no ``expected``, saying what to send instead (upb's own
    text names only the message; an invalid UTF-8 string is the same error)."""
    return GRPCError(
        Status.INVALID_ARGUMENT,
        f"{stage.rpc_name}: the request is no {expected} ({exc}): send {stage.rpc_name} a "
        f"runtime.v1alpha1.{expected} as protos/runtime_hook_v1alpha1.proto defines it (Koordinator's "
        "hook protocol), its strings in UTF-8",
    )


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

    Order: policy loaded → socket listening → the process's heap advised onto huge pages
    (:func:`krproxy.hugepages.advise_heap`: the plugins imported and the server set up, before any
    proxy knows of it) → registration file written → ``started(path)`` (the registration path).
    On cancellation the registration file is removed first (so the proxy stops calling), then the
    server stops and the socket file is removed.
    """
    async with AppWorker.open() as worker, trio.open_nursery() as nursery:
        server = rpc.Server(HookService(app, worker, nursery).handlers())
        await run_background(app, options.policy_path, nursery, worker)
        await nursery.start(server.serve, options.socket)
        await hugepages.advise_heap("started")
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
