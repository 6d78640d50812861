"""Required hook servers on the request path: probe them, hold back calls that need a missing one.

A :class:`Guard` knows every required server's :class:`~krproxy.hooks.required.Availability`:

- **not registered**: no valid ``<name>.json`` in the hook directory;
- **socket unreachable**: registered, but its socket is absent or refuses connections;
- **not answering**: it accepts the connection but no gRPC answer comes within :data:`PROBE_TIMEOUT`
  (or the connection ends first);
- **up**: it answered the probe (:meth:`~krproxy.hooks.dispatch.Dispatcher.probe`: a call of a method no
  hook server has; any gRPC status is an answer).

:meth:`Guard.run` probes every ``--required-hook-server`` server at start and again every
:data:`PROBE_INTERVAL` while one is not up, every :data:`UP_INTERVAL` otherwise, and at once when the
hook directory changes or a required server's hook call fails: what /readyz, ``krproxy status`` and the
metrics show. The log says once when a server goes missing and once when it is back.

:meth:`Guard.admit` is asked before a hooked call does anything: for each required server not up it
probes again, whatever the last probe said (so a server that just came back is seen by kubelet's very
next retry; calls at the same moment share one probe); during the
start-up grace it then waits for the server (within the call's deadline); after that it refuses
the call with UNAVAILABLE naming the server and what is missing, and counts it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

import trio

from krproxy import calls, log
from krproxy.hooks.dispatch import Dispatcher
from krproxy.hooks.outcomes import Outcome, RequiredMissing
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import Registry
from krproxy.hooks.required import Availability, Needed, Requirements, State, needed
from krproxy.relay.rpc import UpstreamError

__all__ = ["Guard", "GuardMetrics", "RequiredMissing", "counted_guard"]

LOGGER = logging.getLogger("krproxy.hooks.required")

#: Seconds a probe waits for an answer: a server that answers at all does so in milliseconds, and a
#: call held by an on-demand probe must keep most of kubelet's deadline.
PROBE_TIMEOUT = 1.0
#: Seconds between probes while a required server is not up (what /readyz and the metrics show).
PROBE_INTERVAL = 1.0
#: Seconds between probes of servers that are up; a call that finds one gone is refused and re-probes.
UP_INTERVAL = 5.0
#: Most names pods' annotations required that the guard keeps a state for (besides the flags' servers,
#: always kept): beyond it the least recently needed is forgotten (its state, its metric series), so
#: many pods naming distinct servers cannot grow memory without limit. A forgotten name needed again is
#: probed again, as a name seen for the first time.
MAX_ANNOTATED_SERVERS = 256
#: Seconds kept before the call's deadline when waiting during the start-up grace, so that kubelet gets
#: our UNAVAILABLE (which names the server) rather than its own DEADLINE_EXCEEDED.
DEADLINE_MARGIN = 0.1


class GuardMetrics(Protocol):
    """What :func:`counted_guard` tells the metrics (:class:`krproxy.metrics.Metrics` has it)."""

    def required_call_held(self, server: str, point: HookPoint) -> None: ...
    def forget_required_server(self, server: str) -> None: ...
    def track_required(self, guard: Guard) -> None: ...


def counted_guard(
    requirements: Requirements, dispatcher: Dispatcher, hook_dir: str, metrics: GuardMetrics
) -> Guard:
    """A :class:`Guard` whose held calls and forgotten servers are counted in *metrics*, which reports its
    servers' states: the one every daemon (CRI and NRI mode) runs."""
    guard = Guard(
        requirements,
        dispatcher,
        hook_dir,
        held=metrics.required_call_held,
        forget=metrics.forget_required_server,
    )
    metrics.track_required(guard)
    return guard


class Guard:
    """Required servers' availability, kept current by :meth:`run`; :meth:`admit` gates hooked calls.

    ``held(name, point)`` is told each time a call is held back for *name* at *point* (the metric), and
    ``forget(name)`` when an annotated name is no longer tracked (:data:`MAX_ANNOTATED_SERVERS`).
    Use in the trio thread the dispatcher runs in.
    """

    def __init__(
        self,
        requirements: Requirements,
        dispatcher: Dispatcher,
        hook_dir: str,
        *,
        held: Callable[[str, HookPoint], None] = lambda name, point: None,
        forget: Callable[[str], None] = lambda name: None,
        max_annotated: int = MAX_ANNOTATED_SERVERS,
    ) -> None:
        self.requirements = requirements
        self._dispatcher = dispatcher
        self._hook_dir = hook_dir
        self._held = held
        self._forget = forget
        self._max_annotated = max_annotated
        self._forgotten = 0  # annotated names dropped at the bound, for the log
        self._flagged = frozenset(s.name for s in requirements.servers)
        self._states: dict[str, Availability] = {}  # the flags' servers first, then annotated, oldest first
        self._probing: dict[str, trio.Event] = {}
        self._suspects: set[str] = set()  # failed a hook call: probed in the next round
        self._unhooked: set[tuple[str, HookPoint]] = set()  # logged as registered without a point
        self._changed = trio.Event()  # set (and replaced) whenever a state changes
        self._wake = trio.Event()  # set to make run() probe at once
        # Construct inside trio, when the daemon starts: the grace counts from here.
        self._grace_end = trio.current_time() + requirements.startup_grace
        for server in requirements.servers:
            self._states[server.name] = Availability()

    # -- what operators see -------------------------------------------------------------

    def availability(self, name: str) -> Availability:
        return self._states.get(name, Availability())

    def states(self) -> dict[str, Availability]:
        """Every server known to be required (flags, and annotated names seen on calls) by name."""
        return dict(self._states)

    def missing(self) -> list[tuple[str, Availability]]:
        """The ``--required-hook-server`` servers that are not up (for /readyz and ``krproxy status``)."""
        servers = self.requirements.servers
        return [(s.name, self.availability(s.name)) for s in servers if not self.availability(s.name).up]

    # -- keeping states current -----------------------------------------------------------

    def publish(self, registry: Registry) -> None:
        """The hook directory changed: probe again at once (after the dispatcher took *registry*)."""
        self._unhooked.clear()
        self._wake.set()

    def observe(self, outcome: Outcome) -> None:
        """A plugin call's outcome: a required server that answered is up; one that failed is probed again."""
        if outcome.plugin not in self._states:
            return
        if outcome.result == "ok":
            self._set(outcome.plugin, Availability(State.UP))
        else:
            self._suspects.add(outcome.plugin)
            self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Probe the required servers until cancelled; reports started after the first round."""
        await self._probe_all()
        task_status.started()
        while True:
            interval = PROBE_INTERVAL if self.missing() else UP_INTERVAL
            with trio.move_on_after(interval):
                await self._wake.wait()
            self._wake = trio.Event()
            await self._probe_all()

    async def _probe_all(self) -> None:
        # The flags' servers, and servers that just failed a hook call; other names pods annotate are
        # probed when a call needs them.
        names = {s.name for s in self.requirements.servers} | self._suspects
        self._suspects = set()
        async with trio.open_nursery() as nursery:
            for name in sorted(names):
                nursery.start_soon(self._probe_now, name)

    async def _probe_now(self, name: str) -> None:
        """Probe *name*, or wait for the probe of it already under way (many calls at once share one)."""
        running = self._probing.get(name)
        if running is not None:
            await running.wait()
            return
        done = self._probing[name] = trio.Event()
        try:
            self._set(name, await self._probe(name))
        finally:
            del self._probing[name]
            done.set()

    async def _probe(self, name: str) -> Availability:
        registry = self._dispatcher.registry
        plugin = next((p for p in registry.plugins.values() if p.name == name), None)
        file = os.path.join(self._hook_dir, f"{name}.json")
        if plugin is None:
            error = registry.error_for(f"{name}.json")
            return Availability(State.MISSING, error if error else f"no {file}")
        try:
            await self._dispatcher.probe(plugin, PROBE_TIMEOUT)
        except TimeoutError:  # before OSError, its base class
            return Availability(
                State.NOT_ANSWERING, f"no answer within {PROBE_TIMEOUT:g}s at {plugin.endpoint}"
            )
        except OSError as err:
            return Availability(State.UNREACHABLE, f"{plugin.endpoint}: {err.strerror or err}")
        except UpstreamError as err:
            return Availability(State.NOT_ANSWERING, f"{plugin.endpoint}: {err}")
        return Availability(State.UP)

    def _set(self, name: str, availability: Availability) -> None:
        if name in self._flagged:
            before = self._states.get(name, Availability())
        else:  # most recently needed last
            before = self._states.pop(name, Availability())
            self._bound()
        self._states[name] = availability
        if before == availability:
            return
        if availability.up:
            if before.state is not State.UNKNOWN:
                log.event(LOGGER, "required_server_back", server=name)
            else:
                log.event(LOGGER, "required_server_up", server=name)
        elif before.up or before.state is State.UNKNOWN:
            log.warning(
                LOGGER,
                "required_server_missing",
                server=name,
                state=availability.state.name.lower(),
                detail=availability.detail,
            )
        self._changed.set()
        self._changed = trio.Event()

    def _touch(self, names: Sequence[str]) -> None:
        """*names* were needed now: annotated ones the guard knows move to the most recently needed end
        (a name found up is not probed, so :meth:`_set` would not move it)."""
        for name in names:
            if name not in self._flagged and name in self._states:
                self._states[name] = self._states.pop(name)

    def _bound(self) -> None:
        """Make room for one annotated name: forget the least recently needed beyond the bound."""
        annotated = [n for n in self._states if n not in self._flagged]
        for name in annotated[: max(0, len(annotated) - self._max_annotated + 1)]:
            del self._states[name]
            self._suspects.discard(name)
            self._forget(name)
            self._forgotten += 1
            if self._forgotten in (1, 10, 100) or self._forgotten % 1000 == 0:
                log.warning(
                    LOGGER,
                    "required_names_bound",
                    bound=self._max_annotated,
                    forgotten=self._forgotten,
                    server=name,
                    hint="pods annotate more distinct hook server names than krproxy tracks; the least "
                    "recently needed is forgotten and probed anew when needed again",
                )

    # -- the request path -----------------------------------------------------------------

    async def require(
        self,
        point: HookPoint,
        annotations: Mapping[str, str],
        container: str | None,
        *,
        met: Collection[str] = (),
        deadline: float | None = None,
    ) -> Needed:
        """What a call at *point* needs (:func:`~krproxy.hooks.required.needed`), once :meth:`admit` let it
        in and the dispatcher's registry would call each server where it must
        (:meth:`~krproxy.hooks.dispatch.Dispatcher.check_required`); pass the result to the chain.

        Raises:
            AnnotationError: the pod's annotations do not parse.
            RequiredMissing: a server is not up, or not registered for *point* where it must be.
        """
        need = needed(self.requirements, point, annotations, container, met=met)
        await self.admit(point, need.names, deadline=deadline)
        try:
            self._dispatcher.check_required(point, need.names, need.hooked)
        except RequiredMissing as refusal:
            for name, availability in refusal.missing:
                self._held(name, point)
                if availability.state is State.NOT_HOOKED and (name, point) not in self._unhooked:
                    self._unhooked.add((name, point))  # once per registry: a file to fix, not an outage
                    log.warning(
                        LOGGER,
                        "required_server_not_hooked",
                        server=name,
                        hook=point.value,
                        detail=availability.detail,
                    )
            raise
        return need

    async def admit(self, point: HookPoint, names: Sequence[str], *, deadline: float | None = None) -> None:
        """Return once every server in *names* is up; else raise :class:`RequiredMissing`.

        Servers not up are probed again first. Within the start-up grace the call then waits for them
        (until the grace ends). ``deadline`` (trio time; default: the current CRI call's, see
        :func:`krproxy.calls.current_deadline`) bounds both, less :data:`DEADLINE_MARGIN`, so the caller
        gets this refusal rather than its own timeout (NRI drops a plugin that misses its deadline).
        """
        if not names:
            return
        self._touch(names)
        missing = [n for n in names if not self.availability(n).up]
        if not missing:
            return
        if deadline is None:
            deadline = calls.current_deadline()
        limit = math.inf if deadline is None else deadline - DEADLINE_MARGIN
        with trio.move_on_at(limit):
            missing = await self._recheck(missing)
            if missing and trio.current_time() < self._grace_end:
                with trio.move_on_at(self._grace_end):
                    while missing:
                        with trio.move_on_after(PROBE_INTERVAL):
                            await self._changed.wait()
                        missing = await self._recheck(missing)
        if missing:
            for name in missing:
                self._held(name, point)
            raise RequiredMissing(point, [(n, self.availability(n)) for n in missing])

    async def _recheck(self, names: Sequence[str]) -> list[str]:
        """Probe *names* again (sharing probes under way); those still not up."""
        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(self._probe_now, name)
        return [n for n in names if not self.availability(n).up]
