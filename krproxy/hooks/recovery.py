"""Rebuilding the hook store from the runtime after a proxy restart.

``ListPodSandbox`` and ``ListContainers`` name every pod and container; a ``verbose``
status call for each adds what the lists lack (cgroup parent, resources, envs — see
:mod:`krproxy.hooks.convert`). A status call that fails (the object vanished meanwhile,
or the runtime does not support verbose) falls back to the list item, so one odd entry
never blocks recovery. Containers whose sandbox is not listed are skipped with a log line.

Status calls run :data:`CONCURRENCY` at a time: enough to hide per-call latency, few enough
not to crowd out kubelet's own calls to the runtime while the proxy starts.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import attrs
import grpclib.client

from krproxy import log
from krproxy.hooks import convert
from krproxy.hooks.model import ContainerInfo, PodInfo
from krproxy.proto.runtime import v1 as cri

LOGGER = logging.getLogger("krproxy.hooks.recovery")

#: Status calls in flight at once during recovery.
CONCURRENCY = 16

#: Per-call timeout of recovery's CRI calls, in seconds.
CALL_TIMEOUT = 30.0

T = TypeVar("T")


@attrs.frozen
class Recovered:
    """What recovery rebuilt, and how."""

    pods: dict[str, PodInfo]
    containers: dict[str, ContainerInfo]
    seconds: float
    fallbacks: int  # entries rebuilt from list items only, their status call having failed
    orphans: int  # containers skipped because their sandbox was not listed


async def _bounded(jobs: list[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    semaphore = asyncio.Semaphore(limit)

    async def run(job: Callable[[], Awaitable[T]]) -> T:
        async with semaphore:
            return await job()

    return list(await asyncio.gather(*(run(job) for job in jobs)))


async def recover(runtime_socket: str) -> Recovered:
    """Read every pod and container from the runtime at ``runtime_socket``.

    Must run on the asyncio loop. Raises if the runtime cannot be listed at all (the
    caller retries); individual status failures only reduce what is recovered.
    """
    started = time.perf_counter()
    channel = grpclib.client.Channel(path=runtime_socket)
    stub = cri.RuntimeServiceStub(channel)
    fallbacks = 0
    try:
        sandboxes = (await stub.list_pod_sandbox(cri.ListPodSandboxRequest(), timeout=CALL_TIMEOUT)).items
        containers = (
            await stub.list_containers(cri.ListContainersRequest(), timeout=CALL_TIMEOUT)
        ).containers

        async def pod(sandbox: cri.PodSandbox) -> PodInfo:
            nonlocal fallbacks
            try:
                answer = await stub.pod_sandbox_status(
                    cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox.id, verbose=True), timeout=CALL_TIMEOUT
                )
            except Exception:  # vanished or unsupported: the list item still tells the essentials
                fallbacks += 1
                return convert.pod_from_sandbox(sandbox)
            if answer.status is None:
                fallbacks += 1
                return convert.pod_from_sandbox(sandbox)
            return convert.pod_from_status(answer.status, answer.info)

        pod_infos = await _bounded([functools.partial(pod, s) for s in sandboxes], CONCURRENCY)
        pods = {s.id: info for s, info in zip(sandboxes, pod_infos, strict=True)}

        listed = [c for c in containers if c.pod_sandbox_id in pods]
        orphans = len(containers) - len(listed)

        async def container(item: cri.Container) -> ContainerInfo:
            nonlocal fallbacks
            owner = pods[item.pod_sandbox_id]
            try:
                answer = await stub.container_status(
                    cri.ContainerStatusRequest(container_id=item.id, verbose=True), timeout=CALL_TIMEOUT
                )
            except Exception:
                fallbacks += 1
                return convert.container_from_list(item, owner)
            if answer.status is None:
                fallbacks += 1
                return convert.container_from_list(item, owner)
            return convert.container_from_status(answer.status, item.pod_sandbox_id, owner, answer.info)

        container_infos = await _bounded([functools.partial(container, c) for c in listed], CONCURRENCY)
    finally:
        channel.close()
    if orphans:
        log.event(LOGGER, "recovery_orphans", level=logging.WARNING, containers=orphans)
    return Recovered(
        pods=pods,
        containers={c.id: info for c, info in zip(listed, container_infos, strict=True)},
        seconds=time.perf_counter() - started,
        fallbacks=fallbacks,
        orphans=orphans,
    )
