"""The hook store's start-up: how long calls at hook points wait for store recovery, and what a call gets
whose pod or container has no record because recovery left it out or has not finished.

:class:`StoreGate` is the gate every intercepted call passes (:func:`krproxy.forward.runtime_interceptors`):
until the store is recovered from the runtime a call waits, but never longer than the start-up grace
(``--recovery-grace``, :data:`DEFAULT_RECOVERY_GRACE`, counted from :meth:`StoreGate.start`). Why calls wait
is logged once (``hook_calls_wait_for_store``, with recovery's last error), and the end of the grace once
(``recovery_grace_over``). After the grace a call goes on against the store as it is: RunPodSandbox and
CreateContainer carry their pod's config and run their hooks, required servers (flags and annotations) as
ever; a call on an existing pod or container the store lacks meets :func:`refusal`'s rule, as a record
recovery left out does (:mod:`krproxy.hooks.listing`).

The rule (:func:`refusal`) for a call at *points* on a record that is missing for such a reason:

- refused, nothing forwarded, when a ``--required-hook-server`` is required at one of the points (the
  promise that required servers hold from the first call after any restart: a call that cannot run their
  hooks must not pass unhooked), or a registered plugin with ``failure-policy: Fail`` hooks a Pre point
  there (its hook cannot run without the record, which is that plugin failing). UNAVAILABLE while recovery
  has not finished (kubelet's retry may find the record), FAILED_PRECONDITION for a record left out (it
  will not come back until the runtime's record changes); the message names recovery and the reason;
- otherwise forwarded without hooks, as for any id the store does not know: Ignore plugins would let the
  call go on had their hook failed, and Post hooks never hold a call. A pod's own ``required-plugins``
  annotation lives in the record that is missing and cannot be honoured: a record krproxy cannot read
  asks for nothing beyond the flags.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import trio

from krproxy import log
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks.listing import Unusable
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import FailurePolicy, PluginRegistration
from krproxy.hooks.required import Requirements

__all__ = ["DEFAULT_RECOVERY_GRACE", "StoreGate", "refusal"]

LOGGER = logging.getLogger("krproxy.hooks.startup")

#: Seconds after start that a call at a hook point waits for store recovery (``--recovery-grace``): as long
#: as the required servers' start-up grace, well inside kubelet's 2-minute runtime request timeout.
DEFAULT_RECOVERY_GRACE = 10.0


class StoreGate:
    """Whether the store reflects the runtime; what intercepted calls wait on until it does.

    Without :meth:`start` (tests that build a bare :class:`~krproxy.hooks.runtime.HookRuntime`) a call
    waits until :meth:`set`, unbounded.
    """

    def __init__(self) -> None:
        self._event = trio.Event()
        #: The event's state as a plain attribute: every watched and intercepted call reads it.
        self.recovered = False
        self._deadline: float | None = None
        self._grace = 0.0
        self._last_error = ""
        self._told_wait = self._told_over = False
        #: The records recovery left out, by id (:mod:`krproxy.hooks.listing`).
        self.left_out: Mapping[str, Unusable] = {}

    def start(self, grace: float) -> None:
        """Count the grace from now (trio time): the daemon calls this as recovery starts."""
        self._grace = grace
        self._deadline = trio.current_time() + grace

    def failed(self, error: str) -> None:
        """Recovery's last attempt failed with *error* (what the log says calls wait for)."""
        self._last_error = error

    def leave_out(self, records: Mapping[str, Unusable]) -> None:
        """The records recovery could not use, by id (before :meth:`set`)."""
        self.left_out = dict(records)

    def set(self) -> None:
        """The store is recovered."""
        self.recovered = True
        self._event.set()

    def is_set(self) -> bool:
        return self.recovered

    @property
    def grace_over(self) -> bool:
        return self._deadline is not None and trio.current_time() >= self._deadline

    async def wait(self) -> None:
        """Return once the store is recovered or the grace is over."""
        if self._event.is_set():
            return
        if self._deadline is None:
            await self._event.wait()
            return
        if not self._told_wait and not self.grace_over:
            self._told_wait = True
            log.warning(
                LOGGER,
                "hook_calls_wait_for_store",
                reason="the hook store is not recovered from the runtime yet",
                last_error=self._last_error or "none yet (recovery under way)",
                grace_left=round(max(0.0, self._deadline - trio.current_time()), 3),
            )
        with trio.move_on_at(self._deadline):
            await self._event.wait()
            return
        if not self._told_over:
            self._told_over = True
            log.warning(
                LOGGER,
                "recovery_grace_over",
                grace=self._grace,
                last_error=self._last_error or "none (recovery still under way)",
                effect="calls at hook points go on with the store as it is; a call on a pod or container it "
                "lacks is refused where a required server or a Fail plugin needs its record (docs/hooks.md)",
            )

    def missing(self, ident: str) -> tuple[Status, str] | None:
        """Why the record of *ident*, which the store lacks, is missing, with the status a refusal gets;
        None if recovery has nothing to do with it (an id the runtime did not list: unknown, as ever)."""
        unusable = self.left_out.get(ident)
        if unusable is not None:
            return Status.FAILED_PRECONDITION, f"store recovery left its record out: {unusable.reason}"
        if not self._event.is_set():
            error = f" (last attempt: {self._last_error})" if self._last_error else ""
            return Status.UNAVAILABLE, f"the hook store is not recovered from the runtime yet{error}"
        return None


def refusal(
    missing: tuple[Status, str],
    kind: str,
    ident: str,
    points: tuple[HookPoint, ...],
    *,
    requirements: Requirements | None,
    plugins_for: Callable[[HookPoint], Sequence[PluginRegistration]],
) -> GRPCError | None:
    """The error a call at *points* on the *kind* (``"pod"``, ``"container"``) *ident* gets, whose record is
    *missing* (:meth:`StoreGate.missing`), or None if it is forwarded without hooks (the module's rule)."""
    status, reason = missing
    needs: list[str] = []
    if requirements is not None:
        needs += [
            f"required hook server {s.name} ({p.value})"
            for s in requirements.servers
            for p in points
            if p in s.points
        ]
    for point in points:
        if point.value.startswith("Pre"):
            needs += [
                f"hook server {p.name} (failure-policy Fail, {point.value})"
                for p in plugins_for(point)
                if p.failure_policy is FailurePolicy.FAIL
            ]
    if not needs:
        return None
    return GRPCError(
        status,
        f"krproxy: {kind} {ident} has no record ({reason}); {', '.join(dict.fromkeys(needs))} "
        "needs it: refused, nothing was forwarded",
    )
