"""cpuset from Koordinator's scheduling result.

The scheduler records the CPUs it bound a pod to in the pod annotation
``scheduling.koordinator.sh/resource-status`` (JSON ``{"cpuset": "0-3"}``). Every container
of such a pod gets ``cpuset_cpus`` from it, and its CFS quota unset (−1) — a pod with
dedicated CPUs should not also be throttled (koordlet does the same, issue #489).

Runs at PreCreateContainer and PreUpdateContainerResources (into the hook response, so the
runtime applies it) and as a container reconciler (written directly by the executor).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

from krproxy import gojson, log

from .._app import HookServer
from .._cgroups import CgroupFile
from .._context import ContainerContext
from .._features import FeatureStatus, NodeProbe
from .._policy import NodePolicy
from .._registry import Level, Stage

NAME = "cpuset"
ANNOTATION = "scheduling.koordinator.sh/resource-status"
LOGGER = logging.getLogger("krproxy.hookserver.cpuset")


def cpuset_from_annotations(annotations: Mapping[str, str]) -> str | None:
    """The cpuset in the resource-status annotation, or None (absent, empty or unparsable), read as
    koordlet reads it (:func:`cpuset_of`)."""
    raw = annotations.get(ANNOTATION)
    if raw is None:
        return None
    try:
        cpuset = cpuset_of(gojson.loads(raw.encode()))
    except (ValueError, RecursionError):
        log.warning(LOGGER, "bad_resource_status", value=raw)
        return None
    return cpuset or None


#: The range of Go's int32, ``CPUSharedPool``'s ``socket`` and ``node``.
_INT32 = range(-(2**31), 2**31)


def cpuset_of(status: object) -> str:
    """The ``CPUSet`` Koordinator's ``ResourceStatus`` holds once Go's ``encoding/json`` has read
    *status* (:func:`krproxy.gojson.loads`) into it, as koordlet does: keys folded as Go folds names
    (``CPUSet`` is ``cpuset``), the last string of several winning, a ``null`` leaving it as it was.
    ``ValueError`` where Go refuses the value, ``cpuSharedPools`` included (koordlet then sets no cpuset):
    a wrong type anywhere in the struct, a pool's number that is no int32."""
    if status is None:
        return ""
    if not isinstance(status, gojson.Object):
        raise ValueError("the resource status is not a JSON object")
    cpuset = ""
    for key, value in status.members:
        name = gojson.fold_name(key)
        if name == "cpuset" and value is not None:
            if not isinstance(value, str):
                raise ValueError("cpuset is not a string")
            cpuset = value
        elif name == "cpusharedpools" and value is not None:
            if not isinstance(value, list):
                raise ValueError("cpuSharedPools is not an array")
            for pool in value:
                _check_pool(pool)
    return cpuset


def _check_pool(pool: object) -> None:
    """``ValueError`` unless Go reads *pool* into a ``CPUSharedPool`` (``socket`` and ``node`` int32)."""
    if pool is None:
        return
    if not isinstance(pool, gojson.Object):
        raise ValueError("a cpuSharedPools entry is not a JSON object")
    for key, value in pool.members:
        if gojson.fold_name(key) not in ("socket", "node") or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value not in _INT32:
            raise ValueError(f"{key} is not an int32")


def set_cpuset(ctx: ContainerContext) -> None:
    """Container cpuset (and unlimited CFS quota) from the pod's resource-status annotation."""
    cpuset = cpuset_from_annotations(ctx.request.pod.annotations)
    if cpuset is not None:
        ctx.response.resources.cpuset = cpuset
        ctx.response.resources.cfs_quota = -1


def status(probe: NodeProbe, policy: NodePolicy | None) -> FeatureStatus:
    """Needs no policy; in the hook answer it always works, the reconciler needs cpuset.cpus."""
    if not probe.has(CgroupFile.CPUSET_CPUS):
        return FeatureStatus(
            NAME,
            True,
            f"in hook answers only: {probe.missing(CgroupFile.CPUSET_CPUS)}, so the reconciler cannot correct it",
            mode="hook",
            wanted=False,
        )
    return FeatureStatus(
        NAME, True, f"from the pod annotation {ANNOTATION}", mode="hook+reconcile", wanted=False
    )


def install(app: HookServer) -> None:
    description = "container cpuset from scheduling.koordinator.sh/resource-status"
    app.registry.register(Stage.PRE_CREATE_CONTAINER, NAME, description, set_cpuset, blocking=False)
    app.registry.register(Stage.PRE_UPDATE_CONTAINER_RESOURCES, NAME, description, set_cpuset, blocking=False)
    app.registry.register_reconciler(Level.CONTAINER, NAME, description, set_cpuset)
    app.feature(NAME, functools.partial(status, app.probe))
