"""Rebuilding the hook store from the runtime after a proxy restart.

``ListPodSandbox`` and ``ListContainers`` name every pod and container; a ``verbose``
status call for each adds what the lists lack (cgroup parent, resources, envs — see
:mod:`krproxy.hooks.convert`). A status call that fails (the object vanished meanwhile,
or the runtime does not support verbose) falls back to the list item, so one odd entry
never blocks recovery. Containers whose sandbox is not listed are skipped with a log line.

Each list answer is read item by item, as the runtime's decoder reads it (:mod:`krproxy.hooks.listing`): a
record krproxy cannot use is left out (and the containers of a pod left out with it) and reported in
:attr:`Recovered.left_out`; one whose strings are not UTF-8 is kept, read with U+FFFD, and reported in
:attr:`Recovered.repaired`. Only an answer whose framing does not decode fails recovery (which is retried).

Status calls run :data:`CONCURRENCY` at a time: enough to hide per-call latency, few enough
not to crowd out kubelet's own calls to the runtime while the proxy starts.

Answers travel as bytes and are decoded with upb (:mod:`krproxy.hooks.wire`), not betterproto2:
a node's thousands of status answers would otherwise cost seconds of pure-Python decoding. The
``*_from_wire_*`` functions of :mod:`krproxy.hooks.convert` build the same records from them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import attrs

from krproxy import log
from krproxy.hooks import convert, listing, wire
from krproxy.hooks.listing import Unusable
from krproxy.hooks.model import ContainerInfo, PodInfo

LOGGER = logging.getLogger("krproxy.hooks.recovery")

#: Status calls in flight at once during recovery.
CONCURRENCY = 16

#: Per-call timeout of recovery's CRI calls, in seconds.
CALL_TIMEOUT = 30.0

#: The largest answer recovery reads: kubelet's receive limit (grpc-go's 16 MiB default, which is
#: containerd's send limit too), so a list kubelet cannot read is not read here either. The caller
#: refuses a larger answer before reading it: splitting 16 MiB of tiny fields in Python holds the
#: event loop for seconds, long enough for a new kubelet connection's 5 s handshake to time out.
MAX_ANSWER = 16 * 1024 * 1024

A = TypeVar("A")
T = TypeVar("T")


@attrs.frozen
class Recovered:
    """What recovery rebuilt, and how."""

    pods: dict[str, PodInfo]
    containers: dict[str, ContainerInfo]
    seconds: float
    fallbacks: int  # entries rebuilt from list items only, their status call having failed
    orphans: int  # containers skipped because their sandbox was not listed
    #: Records left out (unusable as they came), and of containers whose pod was; by id.
    left_out: dict[str, Unusable] = attrs.field(factory=dict)
    #: Records kept with strings read with U+FFFD (:mod:`krproxy.hooks.listing`).
    repaired: tuple[Unusable, ...] = ()


#: Makes one unary CRI call: ``call(path, request bytes) -> reply bytes``; an error status raises.
UnaryCall = Callable[[str, bytes], Awaitable[bytes]]


async def _map_bounded(fn: Callable[[A], Awaitable[T]], items: Sequence[A], limit: int) -> list[T]:
    """``[await fn(item) for item in items]``, with up to *limit* calls in flight (as many worker tasks)."""
    results: dict[int, T] = {}
    todo = iter(enumerate(items))

    async def work() -> None:
        for index, item in todo:
            results[index] = await fn(item)

    async with anyio.create_task_group() as workers:
        for _ in range(min(limit, len(items))):
            workers.start_soon(work)
    return [results[index] for index in range(len(items))]


async def recover(call: UnaryCall) -> Recovered:
    """Read every pod and container from the runtime that ``call`` reaches.

    Runs on trio or asyncio, whichever ``call`` needs. Raises if the runtime cannot be listed
    at all (the caller retries); individual status failures only reduce what is recovered.
    """
    started = time.perf_counter()

    async def _call(path: str, request: Any) -> bytes:
        return await call(path, request.SerializeToString())

    fallbacks = 0
    pods_listed = listing.read_list(
        await _call(wire.LIST_POD_SANDBOX, wire.ListPodSandboxRequest()), "PodSandbox", "pod"
    )
    containers_listed = listing.read_list(
        await _call(wire.LIST_CONTAINERS, wire.ListContainersRequest()), "Container", "container"
    )
    sandboxes, containers = pods_listed.items, containers_listed.items
    left_out = {u.id: u for u in pods_listed.left_out + containers_listed.left_out}

    def status(name: str, data: bytes) -> Any:
        read = listing.read(data, name)  # unusable: the list item, which was usable, stands in
        return read.message

    async def pod(sandbox: Any) -> PodInfo:
        nonlocal fallbacks
        try:
            request = wire.PodSandboxStatusRequest(pod_sandbox_id=sandbox.id, verbose=True)
            answer = status("PodSandboxStatusResponse", await _call(wire.POD_SANDBOX_STATUS, request))
        except Exception:  # vanished or unsupported: the list item still tells the essentials
            fallbacks += 1
            return convert.pod_from_wire_sandbox(sandbox)
        if answer is None or not answer.HasField("status"):
            fallbacks += 1
            return convert.pod_from_wire_sandbox(sandbox)
        return convert.pod_from_wire_status(answer.status, wire.entries(answer.info))

    pod_infos = await _map_bounded(pod, sandboxes, CONCURRENCY)
    pods = {s.id: info for s, info in zip(sandboxes, pod_infos, strict=True)}

    listed = [c for c in containers if c.pod_sandbox_id in pods]
    for item in containers:
        owner = left_out.get(item.pod_sandbox_id)
        if item.pod_sandbox_id not in pods and owner is not None and owner.kind == "pod":
            left_out[item.id] = Unusable("container", item.id, f"its pod {owner.id} was left out")
    orphans = len(containers) - len(listed) - sum(1 for c in containers if c.id in left_out)

    async def container(item: Any) -> ContainerInfo:
        nonlocal fallbacks
        owner = pods[item.pod_sandbox_id]
        try:
            request = wire.ContainerStatusRequest(container_id=item.id, verbose=True)
            answer = status("ContainerStatusResponse", await _call(wire.CONTAINER_STATUS, request))
        except Exception:
            fallbacks += 1
            return convert.container_from_wire_list(item, owner)
        if answer is None or not answer.HasField("status"):
            fallbacks += 1
            return convert.container_from_wire_list(item, owner)
        return convert.container_from_wire_status(
            answer.status, item.pod_sandbox_id, owner, wire.entries(answer.info)
        )

    container_infos = await _map_bounded(container, listed, CONCURRENCY)
    if orphans:
        log.warning(LOGGER, "recovery_orphans", containers=orphans)
    return Recovered(
        pods=pods,
        containers={c.id: info for c, info in zip(listed, container_infos, strict=True)},
        seconds=time.perf_counter() - started,
        fallbacks=fallbacks,
        orphans=orphans,
        left_out=left_out,
        repaired=tuple(pods_listed.repaired + containers_listed.repaired),
    )
