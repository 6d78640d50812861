"""krproxy.metrics.Metrics.observe_call: the labelled series it keeps stay bounded whatever
method paths callers send."""

from __future__ import annotations

import random

from krproxy.grpcstatus import Status
from krproxy.metrics import Metrics
from tests.records import call_record

VERSION = "/runtime.v1.RuntimeService/Version"


def test_random_paths_from_a_hostile_caller_keep_no_series_each() -> None:
    """A caller may send any path: unknown ones share the "unknown" series and are not kept one
    by one (neither in the cache nor as label values), while known paths are counted by method."""
    metrics = Metrics()
    rng = random.Random(7)
    for _ in range(5000):
        path = "/x.Y/" + "".join(rng.choice("abcdefgh") for _ in range(12))
        metrics.observe_call(call_record(path, rng.choice(list(Status))))
    metrics.observe_call(call_record(VERSION))
    metrics.observe_call(call_record(VERSION))

    methods = {
        sample.labels["method"]
        for family in metrics.registry.collect()
        if family.name == "krproxy_calls"
        for sample in family.samples
    }
    assert {"unknown", "Version"} == methods
    assert [(VERSION, Status.OK)] == list(metrics._call_series)
    sample = metrics.registry.get_sample_value
    assert 5000 == sum(
        sample("krproxy_calls_total", {"method": "unknown", "code": status.name}) or 0 for status in Status
    )
    assert 2 == sample("krproxy_calls_total", {"method": "Version", "code": "OK"})
