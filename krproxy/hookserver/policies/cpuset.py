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
import json
import logging
from collections.abc import Mapping

from krproxy import log

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
    """The cpuset in the resource-status annotation, or None (absent or unparsable)."""
    raw = annotations.get(ANNOTATION)
    if raw is None:
        return None
    try:
        status = json.loads(raw)
    except ValueError:
        log.warning(LOGGER, "bad_resource_status", value=raw)
        return None
    cpuset = status.get("cpuset") if isinstance(status, dict) else None
    return cpuset if isinstance(cpuset, str) and cpuset else None


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
