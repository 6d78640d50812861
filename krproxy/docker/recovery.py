"""Rebuilding the hook store from dockerd after a proxy restart (the reference's ``failOver``).

``GET /containers/json?all=1`` names every container; ``GET /containers/{id}/json`` (inspect)
gives what the store keeps: sandboxes (label ``io.kubernetes.docker.type=podsandbox``) become
pod records, the others container records of their sandbox (label ``io.kubernetes.sandbox.id``),
with current resources, cgroup parent and envs (:mod:`krproxy.docker.convert`). ``GET /info``
tells the cgroup driver. Containers not made by kubelet (no ``io.kubernetes.docker.type``
label) are left out; so is a container that vanished between list and inspect.

The reference panics when any of this fails; the daemon retries instead
(:func:`krproxy.docker.server.serve`), so a proxy started before dockerd waits for it.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from typing import Any

import attrs
import trio

from krproxy import log
from krproxy.docker import client, convert
from krproxy.hooks.model import ContainerInfo, PodInfo

__all__ = ["CONCURRENCY", "Recovered", "recover"]

LOGGER = logging.getLogger("krproxy.docker.recovery")

#: Inspect calls in flight at once: hides per-call latency without crowding out kubelet's calls.
CONCURRENCY = 16


@attrs.frozen
class Recovered:
    """What recovery rebuilt."""

    pods: dict[str, PodInfo]
    containers: dict[str, ContainerInfo]
    cgroup_driver: str
    seconds: float
    vanished: int  # listed, but gone before inspect
    orphans: int  # containers whose sandbox is not among the listed ones (kept, pod from their name)


async def recover(socket_path: str) -> Recovered:
    """Read every kubelet container from the dockerd at *socket_path*.

    Raises:
        OSError, h11.RemoteProtocolError, client.DockerError: dockerd cannot be asked.
    """
    started = time.perf_counter()
    info = await client.get_json(socket_path, "/info")
    driver = info.get("CgroupDriver") if isinstance(info, dict) else None
    driver = driver if isinstance(driver, str) and driver else "cgroupfs"
    listed = await client.get_json(socket_path, "/containers/json?all=1")
    summaries = [s for s in (listed if isinstance(listed, list) else []) if isinstance(s, dict)]
    kubelet = [
        s["Id"]
        for s in summaries
        if isinstance(s.get("Id"), str) and convert.SANDBOX_TYPE_LABEL in convert.labels_of(s)
    ]
    inspected: dict[str, dict[str, Any]] = {}
    limiter = trio.CapacityLimiter(CONCURRENCY)

    async def inspect(ident: str) -> None:
        async with limiter:
            try:
                document = await client.get_json(socket_path, f"/containers/{urllib.parse.quote(ident)}/json")
            except client.DockerError as err:
                log.warning(LOGGER, "inspect_failed", id=ident, error=str(err))
                return
        if isinstance(document, dict):
            inspected[ident] = document

    async with trio.open_nursery() as nursery:
        for ident in kubelet:
            nursery.start_soon(inspect, ident)

    pods: dict[str, PodInfo] = {}
    containers: dict[str, ContainerInfo] = {}
    ordered = [(i, inspected[i]) for i in kubelet if i in inspected]
    for ident, document in ordered:
        if convert.is_sandbox(convert.labels_of(document.get("Config"))):
            pods[ident] = convert.pod_from_inspect(document, driver)
    orphans = 0
    for ident, document in ordered:
        labels = convert.labels_of(document.get("Config"))
        if convert.is_sandbox(labels):
            continue
        pod = pods.get(labels.get(convert.SANDBOX_ID_LABEL, ""))
        if pod is None:
            orphans += 1
            name = convert.parse_k8s_name(str(document.get("Name", "")))
            pod = (
                convert.pod_from_name(name)
                if name is not None
                else PodInfo(runtime_handler=convert.RUNTIME_HANDLER)
            )
        containers[ident] = convert.container_from_inspect(document, pod)
    return Recovered(
        pods,
        containers,
        driver,
        time.perf_counter() - started,
        vanished=len(kubelet) - len(inspected),
        orphans=orphans,
    )
