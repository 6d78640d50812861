"""What the hook side of a hooked CreateContainer costs in calls: each step of the bench's request
(krproxy.bench.merge's, a plugin adding an annotation) against a budget, in Python and C function calls
as cProfile counts them (sys.setprofile: load-independent, unlike time); and what a watched one (no hook
server to call) runs before it goes upstream.

The budgets are the counts when they were set, with a little room (other versions of attrs, upb or
Python count a few differently); a change that adds layers to these steps fails here first. The
figures before the cuts that set them are in their commits (git log -S'CALL_BUDGETS')."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

import pytest

from krproxy.bench.merge import ANSWERS, bench_request
from krproxy.forward import RUNTIME_PREFIX
from krproxy.grpcstatus import Status
from krproxy.hooks import answers, convert, encode, merge, rewrite, validate
from krproxy.hooks.dispatch import Dispatcher
from krproxy.hooks.model import FrozenMap, PodInfo
from krproxy.hooks.registration import Registry
from krproxy.hooks.required import Requirements
from krproxy.hooks.runtime import HookRuntime
from krproxy.hooks.store import HookStore
from krproxy.proto.runtime import v1, v1alpha1

#: Calls a step may make at most: the counts when set (19, 56, 20, 14, 41, 6, 28), and 2 or 3 more.
CALL_BUDGETS = {
    "record": 22,
    "request": 59,
    "answer": 23,
    "check": 17,
    "merge": 44,
    "compare": 8,
    "rewrite": 31,
}


def calls_of(work: Callable[[], object]) -> int:
    """The Python and C function calls *work* makes (itself not counted). The garbage collector is kept
    out of the count: a collection falling inside it runs the finalizers and weakref callbacks of what
    earlier tests left behind, which counted as the step's (45 calls for merge's 41 in a full run)."""
    count = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    gc.collect()
    gc.disable()
    try:
        sys.setprofile(profile)
        try:
            work()
        finally:
            sys.setprofile(None)
    finally:
        gc.enable()
    return count - 2  # the lambda's own call and setprofile's


DATA = bench_request()
POD = PodInfo(name="bench", namespace="bench", uid="bench-0")
REPLY = bytes(ANSWERS["annotation"].SerializeToString())
DECODED = rewrite.CreateContainerRequest.FromString(DATA)
RECORD = convert.container_from_wire_create(DECODED, POD)
ANSWER = answers.read(v1alpha1.ContainerResourceHookResponse, REPLY)
MERGED = merge.merge_container_info(RECORD, ANSWER).value

STEPS: dict[str, Callable[[], object]] = {
    "record": lambda: convert.container_from_wire_create(DECODED, POD),
    "request": lambda: encode.container_request(RECORD),
    "answer": lambda: answers.read(v1alpha1.ContainerResourceHookResponse, REPLY),
    "check": lambda: validate.check_answer(RECORD, ANSWER),
    "merge": lambda: merge.merge_container_info(RECORD, ANSWER),
    "compare": lambda: MERGED != RECORD,
    "rewrite": lambda: rewrite.create_request(rewrite.CreateContainerRequest.FromString(DATA), MERGED),
}


@pytest.mark.parametrize("step", STEPS)
def test_within_budget(step: str) -> None:
    """Each step of the hooked CreateContainer makes no more calls than its budget."""
    assert calls_of(STEPS[step]) <= CALL_BUDGETS[step]


def test_the_steps_do_the_work() -> None:
    """The steps measured are the real ones: the answer's annotation reaches the rewritten request."""
    data = rewrite.create_request(rewrite.CreateContainerRequest.FromString(DATA), MERGED)
    rewritten = rewrite.CreateContainerRequest.FromString(data)

    assert "1" == dict((e.key, e.value) for e in rewritten.config.annotations)["bench"]
    assert MERGED != RECORD


class _Guard:
    """The daemon's guard as a watch reads it: the default requirements (the annotation, no flags)."""

    requirements = Requirements()


def _no_plugin_runtime() -> HookRuntime:
    """A recovered runtime with no plugin registered and the bench's pod stored."""
    store = HookStore()
    store.put_pod("0" * 64, POD)
    hooks = HookRuntime(store, Dispatcher(None), ("skip", "true"), _Guard())  # type: ignore[arg-type]
    hooks.mark_recovered()
    return hooks


#: What a watched CreateContainer (no hook server to call) may run before it goes upstream, its watch: the
#: count when set (22; 29 while the watch read the skip label and the point's plugins twice, 48 while it
#: built the container's record), 1 for the check that the request's sandbox_config names the stored pod
#: (``same_pod``), and 2 more.
WATCH_BUDGET = 25


def test_watched_create_within_budget() -> None:
    """The watch of a CreateContainer with no plugin makes no more calls than its budget."""
    watch = _no_plugin_runtime().watches()[RUNTIME_PREFIX + "CreateContainer"]
    watch(DATA)  # the registry reads the point's plugins once, then keeps them

    assert calls_of(lambda: watch(DATA)) <= WATCH_BUDGET


def test_watched_create_keeps_its_record() -> None:
    """The watch measured is the real one: its watcher, told the runtime's OK answer, stores the container."""
    hooks = _no_plugin_runtime()
    watcher = hooks.watches()[RUNTIME_PREFIX + "CreateContainer"](DATA)
    assert watcher is not None

    watcher(Status.OK, bytes(v1.CreateContainerResponse(container_id="c" * 64)))

    stored = hooks.store.get_container("c" * 64)
    assert stored is not None and ("c0", POD) == (stored.name, stored.pod)


#: What the watch of a CreateContainer with a plugin at its point (hooks to run: the interceptor's) may run on
#: the caller's reader when no stored pod carries the skip label: the count when set (8; 44 while it read the
#: pod's id and record to look for the label), and 2 more.
HOOKED_WATCH_BUDGET = 10


def _plugin_runtime(*pods: tuple[str, PodInfo]) -> HookRuntime:
    """A recovered runtime with one plugin at PreCreateContainer and *pods* stored."""
    store = HookStore()
    for sandbox_id, pod in pods:
        store.put_pod(sandbox_id, pod)
    dispatcher = Dispatcher(None)  # type: ignore[arg-type]
    registration = b'{"remote-endpoint": "/run/p.sock", "runtime-hooks": ["PreCreateContainer"]}'
    dispatcher.publish(Registry().apply("p.json", registration))
    hooks = HookRuntime(store, dispatcher, ("skip", "true"), _Guard())  # type: ignore[arg-type]
    hooks.mark_recovered()
    return hooks


def test_hooked_create_watch_within_budget() -> None:
    """The watch of a CreateContainer whose hooks run says so within its budget, no pod skipping hooks."""
    watch = _plugin_runtime(("0" * 64, POD)).watches()[RUNTIME_PREFIX + "CreateContainer"]

    assert None is watch(DATA)  # (the registry reads the point's plugins once, then keeps them)
    assert calls_of(lambda: watch(DATA)) <= HOOKED_WATCH_BUDGET


def test_hooked_create_watch_finds_a_skipping_pod() -> None:
    """The same watch still gives a watcher for the pod that carries the skip label, and only for it."""
    skipping = PodInfo(name="bench", namespace="bench", uid="bench-0", labels=FrozenMap({"skip": "true"}))
    hooks = _plugin_runtime(("0" * 64, skipping))
    watch = hooks.watches()[RUNTIME_PREFIX + "CreateContainer"]
    assert watch(DATA) is not None

    hooks.store.put_pod("0" * 64, POD)
    assert None is watch(DATA)
