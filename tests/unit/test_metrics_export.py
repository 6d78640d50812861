"""krproxy.metrics counts the series of every CRI call and hook call itself (_PerCallCounter,
_PerCallHistogram): what it exports must be what prometheus-client's Counter and Histogram export
for the same observations, line by line (the oracle below), the ``_created`` times aside."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import metrics as prometheus_metrics

from krproxy.calls import CallRecord
from krproxy.grpcstatus import Status
from krproxy.hooks.outcomes import Outcome
from krproxy.hooks.points import HookPoint
from krproxy.hooks.validate import INVALID_ANSWER
from krproxy.metrics import BUCKETS, Metrics
from tests.records import call_record

CREATE = "/runtime.v1.RuntimeService/CreateContainer"
VERSION = "/runtime.v1.RuntimeService/Version"

#: Seconds at and around the bucket bounds, below the first and above the last.
SECONDS = [0.0, -0.001, 0.0001, *BUCKETS, 0.0005000001, 0.0999, 130.0, float("inf")]


def _observations() -> tuple[list[CallRecord], list[Outcome]]:
    records = [
        call_record(path, status, seconds, seconds / 2)
        for i, seconds in enumerate(SECONDS)
        for path, status in [(CREATE, Status.OK), (VERSION, Status.OK), ("/x.Y/Z", Status(i % 3))]
    ]
    outcomes = [
        Outcome(plugin, point, result, seconds, INVALID_ANSWER if result == "rejected" else "")
        for seconds in SECONDS
        for plugin in ("a", "b")
        for point, result in [
            (HookPoint.PRE_CREATE_CONTAINER, "ok"),
            (HookPoint.PRE_CREATE_CONTAINER, "rejected"),
            (HookPoint.POST_STOP_CONTAINER, "failed"),
        ]
    ]
    return records, outcomes


def _oracle(records: list[CallRecord], outcomes: list[Outcome]) -> str:
    """The five families as prometheus-client's own metrics export them."""
    r = CollectorRegistry()
    hook_calls = Counter("krproxy_hook_calls_total", "x", ["plugin", "hook", "result"], registry=r)
    hook_seconds = Histogram(
        "krproxy_hook_call_seconds", "x", ["plugin", "hook"], buckets=BUCKETS, registry=r
    )
    calls = Counter("krproxy_calls_total", "x", ["method", "code"], registry=r)
    call_seconds = Histogram("krproxy_call_seconds", "x", ["method"], buckets=BUCKETS, registry=r)
    backend_seconds = Histogram("krproxy_backend_seconds", "x", ["method"], buckets=BUCKETS, registry=r)
    for record in records:
        method = record.path.rpartition("/")[2] if record.path != "/x.Y/Z" else "unknown"
        calls.labels(method, record.status.name).inc()
        call_seconds.labels(method).observe(record.seconds)
        backend_seconds.labels(method).observe(record.backend_seconds)
    for outcome in outcomes:
        hook_calls.labels(outcome.plugin, outcome.point.value, outcome.result).inc()
        hook_seconds.labels(outcome.plugin, outcome.point.value).observe(outcome.seconds)
    return generate_latest(r).decode()


FAMILIES = (
    "krproxy_hook_calls",
    "krproxy_hook_call_seconds",
    "krproxy_calls",
    "krproxy_call_seconds",
    "krproxy_backend_seconds",
)


def _samples(text: str) -> list[str]:
    """The sample lines of FAMILIES, ``_created`` values blanked (HELP texts are each metric's own)."""
    lines = []
    for line in text.splitlines():
        if line.startswith("#"):
            if line.startswith("# TYPE") and line.split()[2].removesuffix("_total") in FAMILIES:
                lines.append(line)
            continue
        name = line.split("{")[0].split(" ")[0]
        if any(name.startswith(f + "_") for f in FAMILIES) and not name.startswith("krproxy_calls_in_flight"):
            lines.append(re.sub(r"(_created\{.*\}) \S+$", r"\1 T", line))
    return lines


@pytest.mark.parametrize("created", [True, False], ids=["created", "no-created"])
def test_exported_as_prometheus_client_exports(created: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sample line of the per-call families, in order, with and without _created series."""
    monkeypatch.setattr(prometheus_metrics, "_use_created", created)
    records, outcomes = _observations()
    metrics = Metrics()
    for record in records:
        metrics.observe_call(record)
    for outcome in outcomes:
        metrics.observe_hook(outcome)

    got = _samples(generate_latest(metrics.registry).decode())
    assert _samples(_oracle(records, outcomes)) == got
    assert any("_bucket" in line for line in got)
    assert any("_created" in line for line in got) is created


def test_sample_values_as_before() -> None:
    """get_sample_value (the admin status, tests) reads the series by their exported names."""
    metrics = Metrics()
    metrics.observe_call(call_record(CREATE, Status.OK, 0.003, 0.001))
    sample = metrics.registry.get_sample_value

    assert 1.0 == sample("krproxy_calls_total", {"method": "CreateContainer", "code": "OK"})
    assert 1.0 == sample("krproxy_call_seconds_bucket", {"method": "CreateContainer", "le": "0.005"})
    assert 0.0 == sample("krproxy_call_seconds_bucket", {"method": "CreateContainer", "le": "0.0025"})
    assert 0.001 == sample("krproxy_backend_seconds_sum", {"method": "CreateContainer"})
