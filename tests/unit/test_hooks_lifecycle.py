"""The shared hook lifecycle (krproxy.hooks.lifecycle): every hook point is one POINTS entry, and the
sequence calls the chain with that entry's encoder and merge rule."""

from __future__ import annotations

from typing import Any

import pytest

from krproxy.hooks import encode, merge
from krproxy.hooks.lifecycle import POINTS, Lifecycle, keep_answer
from krproxy.hooks.merge import Merged
from krproxy.hooks.model import ContainerInfo, PodInfo, PodResize, Resources
from krproxy.hooks.outcomes import ChainResult
from krproxy.hooks.points import HookPoint, Stage
from krproxy.hooks.store import HookStore


class FakeChain:
    """Records each call; answers the record with ``answer`` applied (the record itself when None)."""

    def __init__(self, answer: Any = None) -> None:
        self.calls: list[tuple[HookPoint, Any, Any, Any, str]] = []
        self.answer = answer

    async def __call__(self, point: HookPoint, record: Any, to_request: Any, fold: Any, **kw: Any) -> Any:
        self.calls.append((point, record, to_request, fold, kw.get("target", "")))
        to_request(record)  # the request must encode
        return ChainResult(self.answer if self.answer is not None else record, [])


def test_every_hook_point_has_one_entry() -> None:
    """Adding a HookPoint without its POINTS entry fails here."""
    assert set(HookPoint) == set(POINTS)


def test_post_points_ignore_answers_and_keep_nothing() -> None:
    for point, spec in POINTS.items():
        if point.stage is Stage.POST:
            assert spec.merge is keep_answer and spec.keep is None, point
        else:
            assert spec.merge is not keep_answer and spec.keep is not None, point


async def test_pre_returns_the_record_itself_when_unchanged() -> None:
    pod = PodInfo(name="p", labels={"a": "b"})
    chain = FakeChain(PodInfo(name="p", labels={"a": "b"}))  # equal, not the same object
    lifecycle = Lifecycle(HookStore(), chain, ("skip", "true"))

    assert pod is await lifecycle.pre(HookPoint.PRE_RUN_POD_SANDBOX, pod, target="t")
    [(point, record, to_request, fold, target)] = chain.calls
    assert (HookPoint.PRE_RUN_POD_SANDBOX, pod, encode.pod_request, merge.merge_pod_info, "t") == (
        point,
        record,
        to_request,
        fold,
        target,
    )


async def test_pre_fold_overrides_the_merge_rule() -> None:
    chain = FakeChain()
    lifecycle = Lifecycle(HookStore(), chain, ("skip", "true"))

    def fold(record: PodInfo, answer: Any) -> Merged[PodInfo]:
        return Merged(record)

    await lifecycle.pre(HookPoint.PRE_RUN_POD_SANDBOX, PodInfo(), target="", fold=fold)

    assert fold is chain.calls[0][3]


async def test_post_uses_the_points_encoder() -> None:
    chain = FakeChain()
    lifecycle = Lifecycle(HookStore(), chain, ("skip", "true"))
    info = ContainerInfo(name="c")

    await lifecycle.post(HookPoint.POST_STOP_CONTAINER, info, target="c1")

    assert [(HookPoint.POST_STOP_CONTAINER, info, encode.container_request, keep_answer, "c1")] == chain.calls


async def test_pre_refuses_a_post_point() -> None:
    lifecycle = Lifecycle(HookStore(), FakeChain(), ("skip", "true"))
    with pytest.raises(AssertionError):
        await lifecycle.pre(HookPoint.POST_STOP_CONTAINER, ContainerInfo(), target="")


def test_keep_stores_what_each_point_made() -> None:
    store = HookStore()
    lifecycle = Lifecycle(store, FakeChain(), ("skip", "true"))
    pod = PodInfo(name="p")
    lifecycle.keep(HookPoint.PRE_RUN_POD_SANDBOX, "sb", pod)
    lifecycle.keep(
        HookPoint.PRE_CREATE_CONTAINER, "c1", ContainerInfo(pod_sandbox_id="sb", pod=pod, name="c")
    )
    assert pod == store.get_pod("sb")
    stored = store.get_container("c1")
    assert stored is not None and "c1" == stored.id  # the runtime's id goes into the record

    started = ContainerInfo(pod_sandbox_id="sb", pod=pod, name="c", id="c1", annotations={"x": "y"})
    lifecycle.keep(HookPoint.PRE_START_CONTAINER, "c1", started)
    assert started == store.get_container("c1")

    resized = Resources(cpu_shares=7)
    lifecycle.keep(
        HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES,
        "sb",
        PodResize("sb", PodInfo(name="p", resources=resized)),
    )
    stored_pod = store.get_pod("sb")
    assert stored_pod is not None and resized == stored_pod.resources

    lifecycle.keep(HookPoint.POST_STOP_CONTAINER, "c1", started)  # post points keep nothing
    assert store.get_container("c1") is not None


def test_skips_by_label() -> None:
    lifecycle = Lifecycle(HookStore(), FakeChain(), ("skip", "true"))
    assert lifecycle.skips(PodInfo(labels={"skip": "true"}))
    assert not lifecycle.skips(PodInfo(labels={"skip": "false"}))
