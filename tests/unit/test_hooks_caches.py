"""Tests of last session's per-call caches and shortcuts in the hooks (9fad37e): each must answer what the
uncached reading answers, whatever the state did before it was asked.

- ``Registry.plugins_for`` keeps its answer per point: every way the registrations change (a file added,
  replaced by another version, made malformed, deleted, an error recorded, the dispatcher switching
  registries) must give a registry whose answers are those of its plugins now, not of its past.
- ``Metrics.observe_hook`` keeps its labelled series: what it counts must be what is exported, per plugin,
  point and result, and it never keeps a series the metrics do not have.
- ``required.needed`` answers NOTHING_NEEDED without parsing when no flag and no annotation of ours is
  there: at every hook point, for pods and any container name, with annotation keys that are near misses
  (case, whitespace, another separator), it must give what ``required_names`` and ``hooked_names`` give.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.hooks import dispatch
from krproxy.hooks.outcomes import Outcome
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import PluginRegistration, Registry
from krproxy.hooks.required import (
    REQUIRED_PLUGINS_ANNOTATION,
    AnnotationError,
    RequiredServer,
    Requirements,
    hooked_names,
    needed,
    required_names,
)
from krproxy.metrics import Metrics
from tests.fuzz import examples

POINTS = list(HookPoint)


def uncached(registry: Registry, point: HookPoint) -> tuple[PluginRegistration, ...]:
    return tuple(p for p in registry.ordered() if p.handles(point))


def registration(points: list[HookPoint], order: int, endpoint: str) -> bytes:
    return json.dumps(
        {"remote-endpoint": endpoint, "runtime-hooks": [p.value for p in points], "order": order}
    ).encode()


FILES = [f"hookserver.d/{name}.json" for name in ("a", "b", "c")]
changes = st.one_of(
    st.tuples(
        st.sampled_from(FILES),
        st.builds(
            registration,
            st.lists(st.sampled_from(POINTS), max_size=4),
            st.integers(-2, 2),
            st.sampled_from(["/run/a.sock", "/run/b.sock"]),
        ),
    ),
    st.tuples(st.sampled_from(FILES), st.sampled_from([None, b"{not json", b'{"remote-endpoint": 5}'])),
    st.tuples(st.sampled_from(FILES), st.just("error")),
)


@settings(max_examples=examples(200))
@given(steps=st.lists(st.tuples(changes, st.lists(st.sampled_from(POINTS), max_size=3)), max_size=12))
def test_plugins_for_follows_every_change_of_the_registrations(steps: list[Any]) -> None:
    """After each change, asked first at some points (filling the cache) and then at all: the answer of
    the registry the dispatcher holds is the uncached one, and registries left behind keep theirs."""
    dispatcher: Any = dispatch.Dispatcher.__new__(dispatch.Dispatcher)
    dispatcher.registry = Registry()
    history: list[tuple[Registry, dict[HookPoint, tuple[PluginRegistration, ...]]]] = []
    for (file, content), asked in steps:
        for point in asked:
            dispatcher.plugins_for(point)
        before = dispatcher.registry
        history.append((before, {p: uncached(before, p) for p in POINTS}))
        if content == "error":
            registry = before.record_error(file, "unreadable")
        else:
            registry = before.apply(file, content)
        dispatcher.registry = registry  # as Dispatcher.publish does (its route upkeep aside)
        for point in asked:
            assert uncached(registry, point) == dispatcher.plugins_for(point)
        for point in POINTS:
            assert uncached(registry, point) == dispatcher.plugins_for(point)
    for old, answers in history:
        for point in POINTS:
            assert answers[point] == old.plugins_for(point)


def test_a_re_registered_plugin_is_called_at_its_new_points() -> None:
    """A plugin that re registers other points is called at its new points only."""
    registry = Registry().apply(FILES[0], registration([HookPoint.PRE_CREATE_CONTAINER], 0, "/run/a.sock"))
    assert [FILES[0]] == [p.file for p in registry.plugins_for(HookPoint.PRE_CREATE_CONTAINER)]
    registry = registry.apply(FILES[0], registration([HookPoint.PRE_RUN_POD_SANDBOX], 0, "/run/a.sock"))
    assert () == registry.plugins_for(HookPoint.PRE_CREATE_CONTAINER)
    assert [FILES[0]] == [p.file for p in registry.plugins_for(HookPoint.PRE_RUN_POD_SANDBOX)]
    registry = registry.apply(FILES[0], None)
    assert () == registry.plugins_for(HookPoint.PRE_RUN_POD_SANDBOX)


RESULTS = ["ok", "failed", "rejected"]


@settings(max_examples=examples(100))
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["koordlet", "a", 'we"ird\n', ""]),
            st.sampled_from(POINTS),
            st.sampled_from(RESULTS),
            st.floats(0, 3),
        ),
        max_size=30,
    )
)
def test_observe_hook_counts_in_the_exported_series(calls: list[tuple[str, HookPoint, str, float]]) -> None:
    metrics = Metrics()
    counts: dict[tuple[str, str, str], int] = {}
    seconds: dict[tuple[str, str], float] = {}
    for plugin, point, result, took in calls:
        metrics.observe_hook(Outcome(plugin, point, result, took))
        counts[plugin, point.value, result] = counts.get((plugin, point.value, result), 0) + 1
        seconds[plugin, point.value] = seconds.get((plugin, point.value), 0.0) + took
    sample = metrics.registry.get_sample_value
    for (plugin, point_name, result), count in counts.items():
        labels = {"plugin": plugin, "hook": point_name, "result": result}
        assert count == sample("krproxy_hook_calls_total", labels)
    for (plugin, point_name), total in seconds.items():
        got = sample("krproxy_hook_call_seconds_sum", {"plugin": plugin, "hook": point_name})
        assert got is not None and abs(total - got) < 1e-9
    assert len(metrics._hook_series) == len(counts)


KEY = REQUIRED_PLUGINS_ANNOTATION
TOLERATE = "tolerate.example/ok"
key_forms = st.sampled_from(
    [
        KEY,
        f"{KEY}/pod",
        f"{KEY}/container.app",
        f"{KEY}/container.",
        f"{KEY}/container.a/b",
        f"{KEY}/",
        f"{KEY}//pod",
        f"{KEY}/Pod",
        KEY.upper(),
        f" {KEY}",
        f"{KEY} ",
        f"{KEY}.pod",
        f"{KEY}x",
        KEY[:-1],
        TOLERATE,
        f"{TOLERATE}/pod",
        f"{TOLERATE}/container.app",
        f"{TOLERATE}x",
        "other",
        "",
    ]
)
values = st.sampled_from(['["koordlet"]', "[k, l]", "true", "false", "True", "not a list", "", "null"])


def full(
    requirements: Requirements, point: HookPoint, annotations: dict[str, str], container: str | None
) -> Any:
    try:
        return (
            required_names(requirements, point, annotations, container),
            hooked_names(requirements, point, annotations, container),
        )
    except AnnotationError as err:
        return str(err)


@settings(max_examples=examples(300))
@given(
    annotations=st.dictionaries(key_forms, values, max_size=4),
    point=st.sampled_from(POINTS),
    container=st.sampled_from([None, "app", "", "a/b", "APP"]),
    annotation=st.sampled_from([KEY, ""]),
    tolerate=st.sampled_from([TOLERATE, ""]),
    servers=st.sampled_from([(), (RequiredServer("koordlet", frozenset({HookPoint.PRE_CREATE_CONTAINER})),)]),
)
def test_needed_is_the_full_reading_at_every_point(
    annotations: dict[str, str],
    point: HookPoint,
    container: str | None,
    annotation: str,
    tolerate: str,
    servers: tuple[RequiredServer, ...],
) -> None:
    requirements = Requirements(servers=servers, annotation=annotation, tolerate_annotation=tolerate)
    try:
        got = needed(requirements, point, annotations, container)
        answer: Any = (got.names, got.hooked)
    except AnnotationError as err:
        answer = str(err)
    assert full(requirements, point, annotations, container) == answer
