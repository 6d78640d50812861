"""Which plugin function runs at which hook point, in which order, and what a failure does.

Like koordlet's ``hooks`` package: functions register per stage with a unique name; a stage
runs its functions sorted by name on one shared context; with :attr:`FailurePolicy.FAIL` the
first error stops the stage, with :attr:`FailurePolicy.IGNORE` it is logged and the rest run.
Reconcilers (for standalone mode and for re-applying a changed policy) register per level.

A function is either plain (``def``) or a coroutine function (``async def``), and a plain one is
*blocking* (the default) or declared non-blocking (``blocking=False``). Where the served SDK
(:mod:`._service`) runs a stage follows from its functions (:meth:`Registry.placement`): a stage
with a blocking function runs in the app's worker thread, where a plain function is called directly
and an ``async def`` one is handed to the trio event loop (``trio.from_thread.run``); a stage of
non-blocking and ``async def`` functions only runs on the event loop itself, with no thread
(:func:`run_hooks_on_loop`), each non-blocking plain function timed (:class:`InlineWatch`: one that
takes longer than :data:`SLOW_INLINE` is logged, since the loop served nothing meanwhile). Called
outside a served app (unit tests calling :meth:`HookServer.handle_pod`), an ``async def`` function
runs in a ``trio.run`` of its own.
"""

from __future__ import annotations

import enum
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import attrs
import trio

from krproxy import log
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import FailurePolicy as RegistrationFailurePolicy

from ._context import ContainerContext, PodContext

LOGGER = logging.getLogger("krproxy.hookserver")


#: The hook points a plugin function can run at — the proxy's own enum; values are the names
#: used in registration files.
Stage = HookPoint


class Level(enum.Enum):
    """What a reconciler works on."""

    POD = "pod"
    CONTAINER = "container"


#: FAIL stops at the first failing plugin function (the call fails), IGNORE logs and goes on —
#: the same two values as a registration file's ``failure-policy``.
FailurePolicy = RegistrationFailurePolicy


PodHook = Callable[[PodContext], "Awaitable[None] | None"]
ContainerHook = Callable[[ContainerContext], "Awaitable[None] | None"]
Ctx = TypeVar("Ctx", PodContext, ContainerContext)


class DuplicateHookError(ValueError):
    """A function with this name is already registered for this stage (or level)."""


class HookFailedError(Exception):
    """A plugin function raised under :attr:`FailurePolicy.FAIL`."""

    def __init__(self, where: str, name: str, cause: BaseException) -> None:
        text = str(cause) if isinstance(cause, Exception) else repr(cause)  # SystemExit(3), not 3
        super().__init__(f"hook plugin {name!r} failed at {where}: {text}")
        self.where = where
        self.name = name
        self.cause = cause


@attrs.frozen
class Hook(Generic[Ctx]):
    """One registered function. Strictly read-only."""

    name: str
    description: str
    fn: Callable[[Ctx], Awaitable[None] | None] = attrs.field(hash=False)
    is_async: bool = attrs.field(default=False, hash=False)
    #: Whether the function may block (a plain function unless declared ``blocking=False``; never
    #: an ``async def`` one, which runs on the event loop anyway).
    blocking: bool = attrs.field(default=True, hash=False)

    @classmethod
    def of(
        cls, name: str, description: str, fn: Callable[[Any], Any], *, blocking: bool | None = None
    ) -> Hook[Any]:
        """``fn`` registered as ``name``; ``blocking`` None (the default) means True for a plain
        function. Raises TypeError for an ``async def`` function declared blocking: it runs on the
        event loop, so a blocking call in it stalls the loop whatever it declares."""
        is_async = inspect.iscoroutinefunction(fn)
        if is_async and blocking:
            raise TypeError(
                f"{name!r} is an async def function, which runs on the event loop: it cannot be "
                "declared blocking=True (make it a plain def to run it in the worker thread)"
            )
        return cls(name, description, fn, is_async, not is_async if blocking is None else blocking)


class Placement(enum.Enum):
    """Where the served SDK runs a stage's functions (:meth:`Registry.placement`)."""

    #: At least one blocking function: the whole stage in the app's worker thread.
    WORKER = "worker"
    #: Non-blocking plain functions only (or none): called on the event loop, in the call's own step.
    LOOP = "loop"
    #: Non-blocking and ``async def`` functions: on the event loop, in a task of the call's.
    TASK = "task"


#: In the SDK's worker thread (:class:`krproxy.hookserver._service.AppWorker`), ``trio_token`` is
#: the trio run an ``async def`` plugin function is handed to, and ``release_loop`` (when set)
#: what stops that run's thread waiting for the current job before the function is handed over.
WORKER_THREAD = threading.local()


class AsyncHookOnEventLoopError(RuntimeError):
    """An ``async def`` plugin function was called from the event loop's own thread."""


def _in_trio_thread() -> bool:
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


def call_hook(hook: Hook[Ctx], ctx: Ctx) -> None:
    """Run one plugin function on ``ctx``, awaiting it on trio if it is ``async def``."""
    if not hook.is_async:
        hook.fn(ctx)
        return
    token = getattr(WORKER_THREAD, "trio_token", None)
    if token is not None:
        release_loop = getattr(WORKER_THREAD, "release_loop", None)
        if release_loop is not None:  # the loop may be waiting for this job: it must run the hook
            release_loop()
        trio.from_thread.run(hook.fn, ctx, trio_token=token)  # type: ignore[arg-type]
    elif _in_trio_thread():
        raise AsyncHookOnEventLoopError(
            f"async plugin function {hook.name!r} cannot run from the event loop's thread: the app's "
            "hook calls block; serve it with krproxy.hookserver.serve (which runs them in a worker "
            "thread), or call them with trio.to_thread.run_sync"
        )
    else:
        trio.run(hook.fn, ctx)  # type: ignore[arg-type]


@attrs.frozen
class RunResult:
    """Names of the functions that ran and of those that failed (and were ignored)."""

    ran: tuple[str, ...]
    failed: tuple[str, ...]


def run_hooks(
    hooks: Sequence[Hook[Ctx]],
    ctx: Ctx,
    policy: FailurePolicy,
    *,
    where: str,
    call: Callable[[Hook[Ctx], Ctx], None] = call_hook,
) -> RunResult:
    """Run ``hooks`` in order on ``ctx`` (each through ``call``, by default :func:`call_hook`);
    raise :class:`HookFailedError` first under FAIL."""
    ran: list[str] = []
    failed: list[str] = []
    served = call is not call_hook or getattr(WORKER_THREAD, "trio_token", None) is not None
    for hook in hooks:
        ran.append(hook.name)
        try:
            call(hook, ctx)
        except (SystemExit, KeyboardInterrupt) as exc:
            if not served:
                raise  # the caller's own thread (an app called in-process): its exit, its Ctrl-C
            _failed(hook, exc, policy, where, failed)
        except Exception as exc:
            _failed(hook, exc, policy, where, failed)
    return RunResult(tuple(ran), tuple(failed))


async def run_hooks_on_loop(
    hooks: Sequence[Hook[Ctx]], ctx: Ctx, policy: FailurePolicy, *, where: str, watch: InlineWatch
) -> RunResult:
    """:func:`run_hooks` on the event loop, for a stage of :attr:`Placement.TASK`: an ``async def``
    function awaited, a non-blocking plain one called through ``watch``. SystemExit and
    KeyboardInterrupt from a function are its failure, as in the worker thread (the served
    process's own signals are caught by its signal watcher, not raised into plugin code)."""
    ran: list[str] = []
    failed: list[str] = []
    for hook in hooks:
        ran.append(hook.name)
        try:
            if hook.is_async:
                await hook.fn(ctx)  # type: ignore[misc]
            else:
                watch.call(hook, ctx)
        except (SystemExit, KeyboardInterrupt, Exception) as exc:
            _failed(hook, exc, policy, where, failed)
    return RunResult(tuple(ran), tuple(failed))


def _failed(
    hook: Hook[Any], cause: BaseException, policy: FailurePolicy, where: str, failed: list[str]
) -> None:
    """``hook`` raised ``cause``: under FAIL the stage stops with :class:`HookFailedError`, under
    IGNORE it is logged and noted in ``failed``."""
    if policy is FailurePolicy.FAIL:
        raise HookFailedError(where, hook.name, cause) from cause
    log.warning(LOGGER, "hook_failed", where=where, plugin=hook.name, error=repr(cause))
    failed.append(hook.name)


#: Seconds a non-blocking plain function may take on the event loop before it is logged
#: (``inline_hook_slow``): the loop served no other call, connection or deadline meanwhile. Far above
#: what a function that only computes takes (microseconds), far below the proxy's hook timeouts.
SLOW_INLINE = 0.01


@attrs.define
class InlineWatch:
    """Calls non-blocking plain functions on the event loop and logs, once per function, one that took
    longer than :attr:`limit` seconds (``inline_hook_slow`` at warning level: it blocked the loop; it
    should be declared blocking). It cannot interrupt the function: the call only goes on late.

    Attributes:
        clock: seconds, for the durations (a test's fake clock).
        limit: the duration logged.
    """

    clock: Callable[[], float] = attrs.field(default=time.perf_counter, hash=False)
    limit: float = SLOW_INLINE
    _warned: set[str] = attrs.Factory(set)

    def call(self, hook: Hook[Ctx], ctx: Ctx) -> None:
        """``hook.fn(ctx)`` (a non-blocking plain function), timed."""
        start = self.clock()
        try:
            hook.fn(ctx)
        finally:
            took = self.clock() - start
            if took > self.limit and hook.name not in self._warned:
                self._warned.add(hook.name)
                log.warning(
                    LOGGER,
                    "inline_hook_slow",
                    plugin=hook.name,
                    took_ms=round(took * 1000, 1),
                    limit_ms=round(self.limit * 1000, 1),
                    fix="a function declared blocking=False runs on the event loop, which serves nothing "
                    "while it runs: drop blocking=False (it then runs in the worker thread)",
                )


@attrs.define
class Registry:
    """Per-stage hook functions and per-level reconcilers, each kept sorted by name."""

    _stages: dict[Stage, list[Hook[Any]]] = attrs.Factory(lambda: {s: [] for s in Stage})
    _levels: dict[Level, list[Hook[Any]]] = attrs.Factory(lambda: {lv: [] for lv in Level})
    # Per stage, its functions and their placement as hooks() and placement() give them: read on
    # every hook call, so worked out when the stage changes (register()), not per call.
    _plans: dict[Stage, tuple[tuple[Hook[Any], ...], Placement]] = attrs.Factory(
        lambda: {s: _plan(()) for s in Stage}
    )

    def register(
        self,
        stage: Stage,
        name: str,
        description: str,
        fn: Callable[[Any], Any],
        *,
        blocking: bool | None = None,
    ) -> None:
        """Run ``fn`` at ``stage`` as ``name``; ``blocking`` as :meth:`Hook.of` takes it."""
        hooks = self._stages[stage]
        _insert(hooks, Hook.of(name, description, fn, blocking=blocking), stage.value)
        self._plans[stage] = _plan(tuple(hooks))

    def register_reconciler(
        self, level: Level, name: str, description: str, fn: Callable[[Any], Any]
    ) -> None:
        _insert(self._levels[level], Hook.of(name, description, fn), level.value)

    def hooks(self, stage: Stage) -> tuple[Hook[Any], ...]:
        return self._plans[stage][0]

    def reconcilers(self, level: Level) -> tuple[Hook[Any], ...]:
        return tuple(self._levels[level])

    def placement(self, stage: Stage) -> Placement:
        """Where the served SDK runs ``stage`` (see :class:`Placement`)."""
        return self._plans[stage][1]

    def stages(self, disabled: Sequence[Stage] = ()) -> tuple[Stage, ...]:
        """Stages with at least one function, minus ``disabled``, in declaration order."""
        return tuple(s for s in Stage if self._stages[s] and s not in disabled)


def _plan(hooks: tuple[Hook[Any], ...]) -> tuple[tuple[Hook[Any], ...], Placement]:
    """A stage's functions and where they run: the worker if one blocks, else a task on the loop if
    one is ``async def``, else the loop itself (none: the loop)."""
    if any(h.blocking for h in hooks):
        return hooks, Placement.WORKER
    return hooks, Placement.TASK if any(h.is_async for h in hooks) else Placement.LOOP


def _insert(hooks: list[Hook[Any]], hook: Hook[Any], where: str) -> None:
    if any(h.name == hook.name for h in hooks):
        raise DuplicateHookError(f"{hook.name!r} is already registered for {where}")
    hooks.append(hook)
    hooks.sort(key=lambda h: h.name)
