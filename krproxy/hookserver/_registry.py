"""Which plugin function runs at which hook point, in which order, and what a failure does.

Like koordlet's ``hooks`` package: functions register per stage with a unique name; a stage
runs its functions sorted by name on one shared context; with :attr:`FailurePolicy.FAIL` the
first error stops the stage, with :attr:`FailurePolicy.IGNORE` it is logged and the rest run.
Reconcilers (for standalone mode and for re-applying a changed policy) register per level.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import attrs

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


PodHook = Callable[[PodContext], None]
ContainerHook = Callable[[ContainerContext], None]
Ctx = TypeVar("Ctx", PodContext, ContainerContext)


class DuplicateHookError(ValueError):
    """A function with this name is already registered for this stage (or level)."""


class HookFailedError(Exception):
    """A plugin function raised under :attr:`FailurePolicy.FAIL`."""

    def __init__(self, where: str, name: str, cause: BaseException) -> None:
        super().__init__(f"hook plugin {name!r} failed at {where}: {cause}")
        self.where = where
        self.name = name
        self.cause = cause


@attrs.frozen
class Hook(Generic[Ctx]):
    """One registered function. Strictly read-only."""

    name: str
    description: str
    fn: Callable[[Ctx], None] = attrs.field(hash=False)


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
        try:
            hook.fn(ctx)
        except Exception as exc:
            if policy is FailurePolicy.FAIL:
                raise HookFailedError(where, hook.name, exc) from exc
            log.event(
                LOGGER, "hook_failed", level=logging.WARNING, where=where, plugin=hook.name, error=repr(exc)
            )
            failed.append(hook.name)
    return RunResult(tuple(ran), tuple(failed))


@attrs.define
class Registry:
    """Per-stage hook functions and per-level reconcilers, each kept sorted by name."""

    _stages: dict[Stage, list[Hook[Any]]] = attrs.Factory(lambda: {s: [] for s in Stage})
    _levels: dict[Level, list[Hook[Any]]] = attrs.Factory(lambda: {lv: [] for lv in Level})

    def register(self, stage: Stage, name: str, description: str, fn: Callable[[Any], None]) -> None:
        _insert(self._stages[stage], Hook(name, description, fn), stage.value)

    def register_reconciler(
        self, level: Level, name: str, description: str, fn: Callable[[Any], None]
    ) -> None:
        _insert(self._levels[level], Hook(name, description, fn), level.value)

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
