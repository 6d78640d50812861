"""Prometheus metrics of the daemon (names prefixed ``krproxy_``).

Collected in a registry of our own (not prometheus-client's global one), so several daemons
in one test process never share counters.
"""

from __future__ import annotations

import contextlib
import functools
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client import metrics as _prometheus_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

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

#: BUCKETS closed by +Inf, as prometheus-client's Histogram closes them, and their ``le`` labels.
_INF = float("inf")
_BOUNDS = (*BUCKETS, _INF)
_LE = tuple(floatToGoString(bound) for bound in _BOUNDS)  # type: ignore[no-untyped-call]  # (untyped upstream)


def _use_created() -> bool:
    """Whether prometheus-client exports ``_created`` series (its PROMETHEUS_DISABLE_CREATED_SERIES,
    or disable_created_metrics()), so that the series below follow its other metrics."""
    return bool(getattr(_prometheus_metrics, "_use_created", True))


class _PerCallCounter(Collector):
    """A labelled counter exported as prometheus-client's ``Counter`` exports one (the same samples:
    ``_total`` and ``_created`` per child, in the order the children were made), for the series every
    CRI call and hook call counts in. A child is a plain ``[value, created]`` list the caller adds to
    (``child[0] += 1``): prometheus-client's ``inc`` is six Python calls (its checks, a lock), and a
    call counts in several. Single writer: only the event loop's thread counts (a scrape only reads)."""

    def __init__(
        self, name: str, documentation: str, labelnames: tuple[str, ...], registry: CollectorRegistry
    ) -> None:
        self._name, self._documentation, self._labelnames = name, documentation, labelnames
        self._children: dict[tuple[str, ...], list[float]] = {}
        registry.register(self)

    def child(self, *labels: str) -> list[float]:
        """The series of *labels* (made at its first use, as ``Counter.labels`` makes it)."""
        cell = self._children.get(labels)
        if cell is None:
            cell = self._children[labels] = [0.0, time.time()]
        return cell

    def describe(self) -> Iterable[Metric]:
        return [Metric(self._name, self._documentation, "counter")]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self._name, self._documentation, "counter")
        created = _use_created()
        for labels, (value, since) in list(self._children.items()):
            names = dict(zip(self._labelnames, labels, strict=True))
            metric.samples.append(Sample(self._name + "_total", names, value))
            if created:
                metric.samples.append(Sample(self._name + "_created", dict(names), since))
        return [metric]


class _PerCallHistogram(Collector):
    """A labelled histogram (buckets :data:`BUCKETS`) exported as prometheus-client's ``Histogram``
    exports one (cumulative ``_bucket`` samples by ``le``, ``_count``, ``_sum``, ``_created``), counted
    in plain lists: a child is ``[counts a bucket, sum, created]`` that :func:`_observe` adds to with
    one C call (prometheus-client's ``observe`` is some eight Python calls). Single writer, as
    :class:`_PerCallCounter`."""

    def __init__(
        self, name: str, documentation: str, labelnames: tuple[str, ...], registry: CollectorRegistry
    ) -> None:
        self._name, self._documentation, self._labelnames = name, documentation, labelnames
        self._children: dict[tuple[str, ...], list[Any]] = {}
        registry.register(self)

    def child(self, *labels: str) -> list[Any]:
        """The series of *labels* (made at its first use)."""
        cell = self._children.get(labels)
        if cell is None:
            cell = self._children[labels] = [[0.0] * len(_BOUNDS), 0.0, time.time()]
        return cell

    def describe(self) -> Iterable[Metric]:
        return [Metric(self._name, self._documentation, "histogram")]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self._name, self._documentation, "histogram")
        created = _use_created()
        add = metric.samples.append
        name = self._name
        for labels, (counts, total, since) in list(self._children.items()):
            names = dict(zip(self._labelnames, labels, strict=True))
            acc = 0.0
            for le, count in zip(_LE, list(counts), strict=True):
                acc += count
                add(Sample(name + "_bucket", {**names, "le": le}, acc))
            add(Sample(name + "_count", dict(names), acc))
            add(Sample(name + "_sum", dict(names), total))
            if created:
                add(Sample(name + "_created", dict(names), since))
        return [metric]


def _observe(child: list[Any], amount: float) -> None:
    """Histogram.observe's rule on a :class:`_PerCallHistogram` child: the sum, and the first bucket
    whose bound is at least *amount* (none for NaN)."""
    child[1] += amount
    if amount <= _INF:
        child[0][bisect_left(_BOUNDS, amount)] += 1.0


class Metrics:
    """The daemon's counters, gauges and histograms."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        #: observe_call's labelled series by (path, status), for the known paths (bounded).
        self._call_series: dict[tuple[str, Status], tuple[list[float], list[Any], list[Any]]] = {}
        #: observe_hook's labelled series by (plugin, hook point, result): as many as the metrics' own
        #: children, which are kept for good anyway.
        self._hook_series: dict[tuple[str, HookPoint, str], tuple[list[float], list[Any]]] = {}
        self.registration_errors = Counter(
            "krproxy_registration_errors_total",
            "Registration files found invalid, by file name.",
            ["file"],
            registry=r,
        )
        # The series every CRI call and hook call counts in: exported as prometheus-client's Counter
        # and Histogram export theirs, counted without their calls (_PerCallCounter).
        self.hook_calls = _PerCallCounter(
            "krproxy_hook_calls",
            "Hook plugin calls by plugin, hook point and result (ok, failed, rejected).",
            ("plugin", "hook", "result"),
            r,
        )
        self.hook_seconds = _PerCallHistogram(
            "krproxy_hook_call_seconds",
            "Hook plugin call latency by plugin and hook point.",
            ("plugin", "hook"),
            r,
        )
        self.calls = _PerCallCounter(
            "krproxy_calls",
            "CRI calls by method and status code (unknown method paths count as method=unknown).",
            ("method", "code"),
            r,
        )
        self.call_seconds = _PerCallHistogram(
            "krproxy_call_seconds",
            "Time a CRI call spent in the proxy, backend time included.",
            ("method",),
            r,
        )
        self.backend_seconds = _PerCallHistogram(
            "krproxy_backend_seconds",
            "Time a CRI call waited for the runtime.",
            ("method",),
            r,
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
        count[0] += 1.0
        # _observe written out, twice (a call each saved, on every CRI call)
        amount = record.seconds
        seconds[1] += amount
        if amount <= _INF:
            seconds[0][bisect_left(_BOUNDS, amount)] += 1.0
        amount = record.backend_seconds
        backend_seconds[1] += amount
        if amount <= _INF:
            backend_seconds[0][bisect_left(_BOUNDS, amount)] += 1.0

    def _series_of(self, path: str, status: Status) -> tuple[list[float], list[Any], list[Any]]:
        """The labelled series a call of ``path`` ending with ``status`` counts in, kept: finding
        them costs more than the rest of :meth:`observe_call`, once per relayed call. Unknown paths
        share the "unknown" series and are not kept one by one (a caller may send any path)."""
        known = path in _KNOWN_PATHS
        method = path.rpartition("/")[2] if known else "unknown"
        series = (
            self.calls.child(method, status.name),
            self.call_seconds.child(method),
            self.backend_seconds.child(method),
        )
        if known:
            self._call_series[(path, status)] = series
        return series

    def observe_hook(self, outcome: Outcome) -> None:
        key = (outcome.plugin, outcome.point, outcome.result)
        series = self._hook_series.get(key)
        if series is None:  # found once per plugin, point and result
            series = self._hook_series[key] = (
                self.hook_calls.child(outcome.plugin, outcome.point.value, outcome.result),
                self.hook_seconds.child(outcome.plugin, outcome.point.value),
            )
        series[0][0] += 1.0
        _observe(series[1], outcome.seconds)
        if outcome.detail.startswith(INVALID_ANSWER):
            self.invalid_answers.labels(outcome.plugin, outcome.point.value).inc()
