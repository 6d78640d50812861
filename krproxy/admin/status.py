"""What the admin endpoint reports: readiness and the ``/status`` document (docs/operations.md).

:class:`View` is what the server (:mod:`krproxy.admin.server`) reads; :class:`AdminView` is
``krproxy serve``'s, reading the relay and the hook machinery through :class:`HookState`, a
protocol, so that the endpoint of ``krproxy nri`` (another :class:`View`) does not import the
proxy's interceptors.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from krproxy import __version__
from krproxy.config import ProxyConfig
from krproxy.forward import Backend
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import Registry
from krproxy.hooks.store import HookStore
from krproxy.metrics import Metrics

if TYPE_CHECKING:
    from krproxy.hooks.guard import Guard


class _Registered(Protocol):
    @property
    def registry(self) -> Registry: ...


class HookState(Protocol):
    """What the endpoint reads of the hook machinery (``krproxy serve``'s ``HookRuntime``)."""

    @property
    def recovered(self) -> bool: ...

    @property
    def guard(self) -> Guard | None: ...

    @property
    def dispatcher(self) -> _Registered: ...

    @property
    def store(self) -> HookStore: ...


class Relaying(Protocol):
    """What the endpoint reads of the relay."""

    @property
    def draining(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...


def _backend_state(reachable: bool | None) -> str:
    return {None: "unknown", True: "up", False: "down"}[reachable]


class View(Protocol):
    """What the endpoint reads: ``krproxy serve``'s :class:`AdminView`, or ``krproxy nri``'s view."""

    metrics: Metrics
    address: str

    def readiness(self) -> tuple[bool, list[str]]: ...

    def status(self) -> dict[str, Any]: ...


@attrs.define(eq=False)
class AdminView:
    """The daemon's parts the endpoint reports on, read live on each request.

    Attributes:
        backends: ``(role, backend)``; the runtime and, if it is another socket, the image service.
        listening: set by the daemon once the proxy socket accepts calls.
        address: ``HOST:PORT`` the endpoint listens on (the real port when 0 was asked for).
    """

    config: ProxyConfig
    relay: Relaying
    hooks: HookState
    metrics: Metrics
    backends: Sequence[tuple[str, Backend]]
    listening: bool = False
    address: str = ""
    started: float = attrs.field(factory=time.time)
    _clock_start: float = attrs.field(factory=time.monotonic)

    def readiness(self) -> tuple[bool, list[str]]:
        """Whether the proxy is ready for kubelet, and if not, why."""
        reasons: list[str] = []
        if self.relay.draining:
            reasons.append("shutting down")
        elif not self.listening:
            reasons.append("the proxy socket is not accepting calls yet")
        if not self.hooks.recovered:
            down = [b.path for _, b in self.backends if b.reachable is False]
            suffix = f" (runtime unreachable: {', '.join(down)})" if down else ""
            reasons.append("the store is not recovered from the runtime yet" + suffix)
        reasons += required_reasons(self.hooks.guard)
        return not reasons, reasons

    def status(self) -> dict[str, Any]:
        """The ``/status`` document (see docs/operations.md)."""
        ready, reasons = self.readiness()
        registry = self.hooks.dispatcher.registry
        stats = self.hooks.store.statistics()
        return {
            "version": __version__,
            "pid": os.getpid(),
            "ready": ready,
            "reasons": reasons,
            "listening": self.listening,
            "draining": self.relay.draining,
            "listen": self.config.listen,
            "admin_address": self.address,
            "started": self.started,
            "uptime_seconds": round(time.monotonic() - self._clock_start, 3),
            "in_flight": self.relay.in_flight,
            "recording": self.metrics.registry.get_sample_value("krproxy_recording") == 1.0,
            "backends": [
                {
                    "role": role,
                    "endpoint": backend.path,
                    "state": _backend_state(backend.reachable),
                    "last_error": backend.last_error if backend.reachable is False else "",
                }
                for role, backend in self.backends
            ],
            "store": {"recovered": self.hooks.recovered, "pods": stats.pods, "containers": stats.containers},
            "hook_dir": self.config.hook_dir,
            **registry_status(registry),
            "required_servers": required_status(self.hooks.guard),
        }


def required_reasons(guard: Guard | None) -> list[str]:
    """The /readyz reason naming the ``--required-hook-server`` servers that are not up, if any."""
    missing = guard.missing() if guard is not None else []
    if not missing:
        return []
    described = ", ".join(f"{name} {a.describe()}" for name, a in missing)
    return [f"required hook servers missing (calls at their hook points are refused): {described}"]


def required_status(guard: Guard | None) -> list[dict[str, Any]]:
    """The ``required_servers`` part of a ``/status`` document: the ``--required-hook-server`` servers,
    then names pods' annotations required (``declared`` false), each with its state as last probed."""
    if guard is None:
        return []
    points = {s.name: [p.value for p in HookPoint if p in s.points] for s in guard.requirements.servers}
    return [
        {
            "name": name,
            "declared": name in points,
            "hooks": points.get(
                name, [HookPoint.PRE_RUN_POD_SANDBOX.value, HookPoint.PRE_CREATE_CONTAINER.value]
            ),
            "state": availability.state.name.lower(),
            "detail": availability.detail,
        }
        for name, availability in sorted(guard.states().items(), key=lambda i: (i[0] not in points, i[0]))
    ]


def registry_status(registry: Registry) -> dict[str, Any]:
    """The ``plugins`` and ``registration_errors`` parts of a ``/status`` document."""
    return {
        "plugins": [
            {
                "name": p.name,
                "file": p.file,
                "endpoint": p.endpoint,
                "hooks": [h.value for h in p.hooks],
                "failure_policy": p.failure_policy.value,
                "timeout": p.timeout,
                "order": p.order,
                "warnings": list(p.warnings),
            }
            for p in registry.ordered()
        ],
        "registration_errors": dict(sorted(registry.errors.items())),
    }


def _up(backend: Backend) -> float:
    # NaN until the first call: neither up nor down, so an alert on == 0 stays quiet.
    return float("nan") if backend.reachable is None else float(backend.reachable)


def wire_metrics(view: AdminView) -> None:
    """Point the metrics that are read at scrape time (gauges) at the live daemon."""
    metrics = view.metrics
    metrics.in_flight.set_function(lambda: view.relay.in_flight)
    metrics.plugins.set_function(lambda: len(view.hooks.dispatcher.registry.plugins))
    metrics.ready.set_function(lambda: view.readiness()[0])
    for role, backend in view.backends:
        metrics.backend_up.labels(role, backend.path).set_function(functools.partial(_up, backend))
