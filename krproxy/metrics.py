"""Prometheus metrics of the daemon (names prefixed ``krproxy_``).

Collected in a registry of our own (not prometheus-client's global one), so several daemons
in one test process never share counters.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from krproxy import __version__
from krproxy.calls import CallRecord
from krproxy.forward import known_routes
from krproxy.grpcstatus import Status
from krproxy.hooks.outcomes import Outcome
from krproxy.hooks.points import HookPoint
from krproxy.hooks.store import HookStore
from krproxy.hooks.validate import INVALID_ANSWER

if TYPE_CHECKING:
    from krproxy.hooks.guard import Guard

#: Latency buckets in seconds: from a fast local call (~0.3 ms) to kubelet's 2 min deadline.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120)


#: Method paths that get their own label; anything else is "unknown" (label values stay bounded).
_KNOWN_PATHS = frozenset(known_routes())


class Metrics:
    """The daemon's counters, gauges and histograms."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        #: observe_call's labelled series by (path, status), for the known paths (bounded).
        self._call_series: dict[tuple[str, Status], tuple[Counter, Histogram, Histogram]] = {}
        #: observe_hook's labelled series by (plugin, hook point, result): as many as the metrics' own
        #: children, which prometheus-client keeps for good anyway.
        self._hook_series: dict[tuple[str, HookPoint, str], tuple[Counter, Histogram]] = {}
        self.registration_errors = Counter(
            "krproxy_registration_errors_total",
            "Registration files found invalid, by file name.",
            ["file"],
            registry=r,
        )
        self.hook_calls = Counter(
            "krproxy_hook_calls_total",
            "Hook plugin calls by plugin, hook point and result (ok, failed, rejected).",
            ["plugin", "hook", "result"],
            registry=r,
        )
        self.hook_seconds = Histogram(
            "krproxy_hook_call_seconds",
            "Hook plugin call latency by plugin and hook point.",
            ["plugin", "hook"],
            buckets=BUCKETS,
            registry=r,
        )
        self.calls = Counter(
            "krproxy_calls_total",
            "CRI calls by method and status code (unknown method paths count as method=unknown).",
            ["method", "code"],
            registry=r,
        )
        self.call_seconds = Histogram(
            "krproxy_call_seconds",
            "Time a CRI call spent in the proxy, backend time included.",
            ["method"],
            buckets=BUCKETS,
            registry=r,
        )
        self.backend_seconds = Histogram(
            "krproxy_backend_seconds",
            "Time a CRI call waited for the runtime.",
            ["method"],
            buckets=BUCKETS,
            registry=r,
        )
        self.store_pods = Gauge("krproxy_store_pods", "Pods in the hook store.", registry=r)
        self.store_containers = Gauge("krproxy_store_containers", "Containers in the hook store.", registry=r)
        self.recovered = Gauge(
            "krproxy_store_recovered", "1 once the store was rebuilt from the runtime.", registry=r
        )
        self.backend_up = Gauge(
            "krproxy_backend_up",
            "1 when the last call reached the runtime at this socket, 0 after it was unreachable "
            "(NaN before the first call).",
            ["role", "endpoint"],
            registry=r,
        )
        self.recording = Gauge(
            "krproxy_recording", "1 while CRI calls are being recorded to a trace, else 0.", registry=r
        )
        self.in_flight = Gauge("krproxy_calls_in_flight", "CRI calls being handled now.", registry=r)
        self.plugins = Gauge(
            "krproxy_plugins_registered", "Plugins with a valid registration file.", registry=r
        )
        self.invalid_answers = Counter(
            "krproxy_hook_answers_invalid_total",
            "Pre-hook answers refused by validation, by plugin and hook point "
            "(each is also counted as a failed or rejected hook call).",
            ["plugin", "hook"],
            registry=r,
        )
        self.ready = Gauge(
            "krproxy_ready",
            "1 when the proxy listens, its store is recovered and every required hook server answers (/readyz).",
            registry=r,
        )
        self.nri_not_applied = Counter(
            "krproxy_nri_changes_not_applied_total",
            "Changes hook servers asked for that NRI cannot make at that event (krproxy nri), by hook and field.",
            ["hook", "field"],
            registry=r,
        )
        self.nri_call_seconds = Histogram(
            "krproxy_nri_call_seconds",
            "Time krproxy nri's handler takes for each of the runtime's NRI calls (from the decoded request to "
            "the answer ready; the runtime waits that long and the answer's trip, most calls on a pod's way "
            "to running), by method.",
            ["method"],
            buckets=BUCKETS,
            registry=r,
        )
        self.required_held = Counter(
            "krproxy_required_calls_held_total",
            "CRI calls refused (UNAVAILABLE, nothing forwarded) because a required hook server was not "
            "registered and answering, by server and hook point.",
            ["server", "hook"],
            registry=r,
        )
        self.required_up = Gauge(
            "krproxy_required_server_up",
            "1 while a --required-hook-server is registered and answering its probe, else 0.",
            ["server"],
            registry=r,
        )
        self.info = Info("krproxy_build", "The daemon's version.", registry=r)
        self.info.info({"version": __version__})

    def track_store(self, store: Callable[[], HookStore]) -> None:
        """Report the pods and containers of ``store()`` (read at each scrape: a daemon may replace
        its store, as NRI mode does at each Synchronize)."""
        self.store_pods.set_function(lambda: store().statistics().pods)
        self.store_containers.set_function(lambda: store().statistics().containers)

    def registration_error(self, name: str) -> None:
        """Count a registration file that could not be used (the hook directory watcher's ``on_error``)."""
        self.registration_errors.labels(name).inc()

    def track_required(self, guard: Guard) -> None:
        """Report each ``--required-hook-server``'s state (read at each scrape)."""
        for server in guard.requirements.servers:
            up = functools.partial(lambda name: float(guard.availability(name).up), server.name)
            self.required_up.labels(server.name).set_function(up)

    def required_call_held(self, server: str, point: HookPoint) -> None:
        """Count a call held back for a missing required hook server (the guard's ``held``)."""
        self.required_held.labels(server, point.value).inc()

    def forget_required_server(self, server: str) -> None:
        """Drop *server*'s held-call series (the guard's ``forget``: an annotated name it no longer
        tracks), so that the label set stays bounded as the guard's names are."""
        for point in HookPoint:
            with contextlib.suppress(KeyError):
                self.required_held.remove(server, point.value)

    def observe_call(self, record: CallRecord) -> None:
        series = self._call_series.get((record.path, record.status))
        if series is None:
            series = self._series_of(record.path, record.status)
        count, seconds, backend_seconds = series
        count.inc()
        seconds.observe(record.seconds)
        backend_seconds.observe(record.backend_seconds)

    def _series_of(self, path: str, status: Status) -> tuple[Counter, Histogram, Histogram]:
        """The labelled series a call of ``path`` ending with ``status`` counts in, kept: a
        ``labels()`` lookup costs more than the rest of :meth:`observe_call`, once per relayed
        call. Unknown paths share the "unknown" series and are not kept one by one (a caller
        may send any path)."""
        known = path in _KNOWN_PATHS
        method = path.rpartition("/")[2] if known else "unknown"
        series = (
            self.calls.labels(method, status.name),
            self.call_seconds.labels(method),
            self.backend_seconds.labels(method),
        )
        if known:
            self._call_series[(path, status)] = series
        return series

    def observe_hook(self, outcome: Outcome) -> None:
        key = (outcome.plugin, outcome.point, outcome.result)
        series = self._hook_series.get(key)
        if series is None:  # two labels() lookups cost more than the rest, once per plugin call
            series = self._hook_series[key] = (
                self.hook_calls.labels(outcome.plugin, outcome.point.value, outcome.result),
                self.hook_seconds.labels(outcome.plugin, outcome.point.value),
            )
        series[0].inc()
        series[1].observe(outcome.seconds)
        if outcome.detail.startswith(INVALID_ANSWER):
            self.invalid_answers.labels(outcome.plugin, outcome.point.value).inc()
