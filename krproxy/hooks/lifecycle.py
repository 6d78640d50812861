"""One hook lifecycle: the per-point sequence, written once for the CRI, Docker and NRI front ends.

At a hook point every front end does the same thing with records (:mod:`krproxy.hooks.model`)::

    front end: wire format → record
    here:      skip label? → record → hook request (:mod:`krproxy.hooks.encode`) → chain of hook servers
               (:class:`~krproxy.hooks.dispatch.Dispatcher`: validate, merge) → merged record
    front end: merged record → its wire format (only if it changed), forward
    here:      the store keeps the record (:meth:`Lifecycle.keep`)

What differs per point is data, in :data:`POINTS`: the encoder of its request, the merge rule of its answer
and what the store keeps once the runtime took the call. What differs per front end is only its wire format
(CRI protobuf in :mod:`krproxy.hooks.runtime`, Docker JSON in :mod:`krproxy.docker.hooks`, NRI events in
:mod:`krproxy.nri._events`) and its way of failing a call (a gRPC status, HTTP 500, an error for NRI).

Adding a hook point: a :class:`~krproxy.hooks.points.HookPoint` member (its RPC, in ``points.py``), one
:data:`POINTS` entry, and in each front end that has the event, the call of :meth:`Lifecycle.pre` (or
:meth:`Lifecycle.post`) and :meth:`Lifecycle.keep` where it translates that event.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, Protocol, TypeVar

import attrs

from krproxy.hooks import encode, merge
from krproxy.hooks.merge import Merged
from krproxy.hooks.model import ContainerInfo, PodInfo, PodResize, evolve
from krproxy.hooks.outcomes import ChainResult
from krproxy.hooks.points import HookPoint, Stage
from krproxy.hooks.required import NOTHING_NEEDED, Needed
from krproxy.hooks.store import HookStore

__all__ = ["POINTS", "Chain", "Lifecycle", "PointSpec", "keep_answer"]

R = TypeVar("R")


def keep_answer(record: R, answer: Any) -> Merged[R]:
    """Post hooks: the answer is ignored."""
    return Merged(record)


def _put_pod(store: HookStore, ident: str, pod: PodInfo) -> None:
    store.put_pod(ident, pod)


def _put_container(store: HookStore, ident: str, info: ContainerInfo) -> None:
    store.put_container(ident, evolve(info, id=ident))


def _update_container(store: HookStore, ident: str, info: ContainerInfo) -> None:
    store.update_container(ident, info)


def _resize_pod(store: HookStore, ident: str, resize: PodResize) -> None:
    store.resize_pod(ident, resize.pod.resources, resize.pod.overhead)


@attrs.frozen
class PointSpec:
    """What is particular to one hook point.

    Attributes:
        encode: the record → its hook request (:mod:`krproxy.hooks.encode`).
        merge: folds a hook server's answer into the record (post points: :func:`keep_answer`).
        keep: what the store keeps of the record once the runtime took the call (by the runtime's id of the
            pod or container); None: nothing (post points, whose store entries the front ends drop).
    """

    encode: Callable[[Any], bytes]
    merge: Callable[[Any, Any], Merged[Any]]
    keep: Callable[[HookStore, str, Any], None] | None = None


#: Every hook point's encoder, merge rule and store step.
POINTS: Mapping[HookPoint, PointSpec] = {
    HookPoint.PRE_RUN_POD_SANDBOX: PointSpec(encode.pod_request, merge.merge_pod_info, _put_pod),
    HookPoint.POST_STOP_POD_SANDBOX: PointSpec(encode.pod_request, keep_answer),
    HookPoint.PRE_CREATE_CONTAINER: PointSpec(
        encode.container_request, merge.merge_container_info, _put_container
    ),
    HookPoint.PRE_START_CONTAINER: PointSpec(
        encode.container_request, merge.merge_container_info, _update_container
    ),
    HookPoint.POST_START_CONTAINER: PointSpec(encode.container_request, keep_answer),
    HookPoint.POST_STOP_CONTAINER: PointSpec(encode.container_request, keep_answer),
    HookPoint.PRE_UPDATE_CONTAINER_RESOURCES: PointSpec(
        encode.container_request, merge.merge_container_info, _update_container
    ),
    HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES: PointSpec(
        encode.pod_resize_request, merge.merge_pod_resize, _resize_pod
    ),
}


class Chain(Protocol):
    """:meth:`krproxy.hooks.dispatch.Dispatcher.run`."""

    def __call__(
        self,
        point: HookPoint,
        record: Any,
        to_request: Callable[[Any], Any],
        merge: Callable[[Any, Any], Merged[Any]],
        *,
        target: str = "",
        deadline: float | None = None,
        required: Collection[str] = (),
        hooked: Collection[str] = (),
    ) -> Awaitable[ChainResult[Any]]: ...


@attrs.define(eq=False)
class Lifecycle:
    """The store and the chain of hook servers, and the sequence that joins them at each hook point.

    Attributes:
        store: the pod and container records.
        chain: runs a hook point's servers (the dispatcher's ``run``).
        skip_label: pods with this label get no hooks (they are still stored).
    """

    store: HookStore
    chain: Chain
    skip_label: tuple[str, str]

    def skips(self, pod: PodInfo) -> bool:
        """Whether *pod* opted out of hooks (the skip label)."""
        return pod.has_label(*self.skip_label)

    async def pre(
        self,
        point: HookPoint,
        record: R,
        *,
        target: str,
        required: Needed = NOTHING_NEEDED,
        deadline: float | None = None,
        fold: Callable[[R, Any], Merged[R]] | None = None,
    ) -> R:
        """Run the pre hooks of *point* on *record*; the record as the hook servers left it (*record* itself
        when none changed anything). *fold* replaces the point's merge rule (Docker's pod answers).

        Raises:
            HookRejected, RequiredFailed, RequiredMissing: as :meth:`Dispatcher.run`.
        """
        assert point.stage is Stage.PRE, point
        spec = POINTS[point]
        chain = await self.chain(
            point,
            record,
            spec.encode,
            fold or spec.merge,
            target=target,
            deadline=deadline,
            required=required.names,
            hooked=required.hooked,
        )
        result: R = chain.value
        return record if result is record or result == record else result

    async def post(
        self, point: HookPoint, record: Any, *, target: str, deadline: float | None = None
    ) -> None:
        """Run the post hooks of *point* on *record*; their answers are ignored, their failures logged."""
        assert point.stage is Stage.POST, point
        await self.chain(point, record, POINTS[point].encode, keep_answer, target=target, deadline=deadline)

    def keep(self, point: HookPoint, ident: str, record: Any) -> None:
        """The store step of *point*: keep *record* (as merged) under the runtime's id *ident*."""
        step = POINTS[point].keep
        if step is not None:
            step(self.store, ident, record)
