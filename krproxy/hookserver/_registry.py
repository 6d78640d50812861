"""Which plugin function runs at which hook point, in which order, and what a failure does.

Like koordlet's ``hooks`` package: functions register per stage with a unique name; a stage
runs its functions sorted by name on one shared context; with :attr:`FailurePolicy.FAIL` the
first error stops the stage, with :attr:`FailurePolicy.IGNORE` it is logged and the rest run.
Reconcilers (for standalone mode and for re-applying a changed policy) register per level.

A function is either plain (``def``) or a coroutine function (``async def``). The served SDK
(:mod:`._service`, :mod:`._standalone`) runs the app's work in a worker thread; there a plain
function is called directly and an ``async def`` one is run on the trio event loop
(``trio.from_thread.run``), so it may await trio or anyio. Called outside a served app (unit
tests calling :meth:`HookServer.handle_pod`), an ``async def`` function runs in a ``trio.run`` of
its own.
"""

from __future__ import annotations

import enum
import inspect
import logging
import threading
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

    @classmethod
    def of(cls, name: str, description: str, fn: Callable[[Any], Any]) -> Hook[Any]:
        return cls(name, description, fn, inspect.iscoroutinefunction(fn))


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
    token = getattr(WORKER_THREAD, "trio_token", None)
    if not hook.is_async:
        hook.fn(ctx)
    elif token is not None:
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


def run_hooks(hooks: Sequence[Hook[Ctx]], ctx: Ctx, policy: FailurePolicy, *, where: str) -> RunResult:
    """Run ``hooks`` in order on ``ctx``; raise :class:`HookFailedError` first under FAIL."""
    ran: list[str] = []
    failed: list[str] = []
    for hook in hooks:
        ran.append(hook.name)
        cause: BaseException
        try:
            call_hook(hook, ctx)
            continue
        except (SystemExit, KeyboardInterrupt) as exc:
            if getattr(WORKER_THREAD, "trio_token", None) is None:
                raise  # the caller's own thread (an app called in-process): its exit, its Ctrl-C
            # In the server's worker thread only the function itself raises them (sys.exit() in a
            # plugin, a library's KeyboardInterrupt): a function that failed, not the server's end.
            cause = exc
        except Exception as exc:
            cause = exc
        if policy is FailurePolicy.FAIL:
            raise HookFailedError(where, hook.name, cause) from cause
        log.warning(LOGGER, "hook_failed", where=where, plugin=hook.name, error=repr(cause))
        failed.append(hook.name)
    return RunResult(tuple(ran), tuple(failed))


@attrs.define
class Registry:
    """Per-stage hook functions and per-level reconcilers, each kept sorted by name."""

    _stages: dict[Stage, list[Hook[Any]]] = attrs.Factory(lambda: {s: [] for s in Stage})
    _levels: dict[Level, list[Hook[Any]]] = attrs.Factory(lambda: {lv: [] for lv in Level})

    def register(self, stage: Stage, name: str, description: str, fn: Callable[[Any], Any]) -> None:
        _insert(self._stages[stage], Hook.of(name, description, fn), stage.value)

    def register_reconciler(
        self, level: Level, name: str, description: str, fn: Callable[[Any], Any]
    ) -> None:
        _insert(self._levels[level], Hook.of(name, description, fn), level.value)

    def hooks(self, stage: Stage) -> tuple[Hook[Any], ...]:
        return tuple(self._stages[stage])

    def reconcilers(self, level: Level) -> tuple[Hook[Any], ...]:
        return tuple(self._levels[level])

    def stages(self, disabled: Sequence[Stage] = ()) -> tuple[Stage, ...]:
        """Stages with at least one function, minus ``disabled``, in declaration order."""
        return tuple(s for s in Stage if self._stages[s] and s not in disabled)


def _insert(hooks: list[Hook[Any]], hook: Hook[Any], where: str) -> None:
    if any(h.name == hook.name for h in hooks):
        raise DuplicateHookError(f"{hook.name!r} is already registered for {where}")
    hooks.append(hook)
    hooks.sort(key=lambda h: h.name)
