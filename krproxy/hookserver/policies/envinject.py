"""Environment variables from a pod annotation.

The pod annotation ``hookserver.krproxy.io/env`` holds a JSON object of string values,
e.g. ``{"OMP_NUM_THREADS": "4"}``; every container of the pod is created with those
variables added (a variable the container already sets is overwritten). Only at
PreCreateContainer: a running container's environment cannot change, so standalone mode
cannot do this one.
"""

from __future__ import annotations

import json
import logging

from krproxy import log

from .._app import HookServer
from .._context import ContainerContext
from .._done import who
from .._features import FeatureStatus
from .._policy import NodePolicy
from .._registry import Stage

NAME = "envinject"
ANNOTATION = "hookserver.krproxy.io/env"
LOGGER = logging.getLogger("krproxy.hookserver.envinject")


def inject_env(ctx: ContainerContext) -> None:
    """Add the variables of the pod's env annotation to the container."""
    raw = ctx.request.pod.annotations.get(ANNOTATION)
    if raw is None:
        return
    try:
        envs = json.loads(raw)
    except ValueError:
        log.warning(LOGGER, "bad_env_annotation", pod=who(ctx.request.pod), value=raw)
        return
    if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
        log.warning(LOGGER, "bad_env_annotation", pod=who(ctx.request.pod), value=raw)
        return
    ctx.response.add_envs.update(envs)


def status(policy: NodePolicy | None) -> FeatureStatus:
    return FeatureStatus(
        NAME,
        True,
        f"from the pod annotation {ANNOTATION}, at PreCreateContainer (proxy mode only)",
        wanted=False,
    )


def install(app: HookServer) -> None:
    app.registry.register(
        Stage.PRE_CREATE_CONTAINER, NAME, f"container env from {ANNOTATION}", inject_env, blocking=False
    )
    app.feature(NAME, status)
