"""krproxy's SDK for runtime hook servers (the koordlet side of the hook protocol).

Write a hook server in a few lines::

    from krproxy.hookserver import ContainerContext, HookServer, Stage

    app = HookServer()

    @app.hook(Stage.PRE_CREATE_CONTAINER, name="hello-env", description="say hello")
    def hello_env(ctx: ContainerContext) -> None:
        ctx.response.add_envs["HELLO"] = ctx.request.pod.meta.name

Serve it with :func:`serve` (proxy mode) or :func:`run_standalone` (no proxy); the CLI in
:mod:`krproxy.hookserver.cli` does both with the built-in :mod:`~krproxy.hookserver.policies`.
See ``docs/plugin-authoring.md``.
"""

from __future__ import annotations

from ._app import HookServer as HookServer
from ._app import PodCache as PodCache
from ._app import PodTarget as PodTarget
from ._app import Ticker as Ticker
from ._cgroups import CgroupFile as CgroupFile
from ._cgroups import cgroups_path_dir as cgroups_path_dir
from ._cgroups import container_cgroup_candidates as container_cgroup_candidates
from ._cgroups import container_cgroup_dir as container_cgroup_dir
from ._cgroups import pod_cgroup_dir as pod_cgroup_dir
from ._context import QOS_LABEL as QOS_LABEL
from ._context import ContainerChanges as ContainerChanges
from ._context import ContainerContext as ContainerContext
from ._context import ContainerInfo as ContainerInfo
from ._context import PodChanges as PodChanges
from ._context import PodContext as PodContext
from ._context import PodInfo as PodInfo
from ._context import PodMeta as PodMeta
from ._context import QoSClass as QoSClass
from ._context import ResctrlGroup as ResctrlGroup
from ._context import ResourceChanges as ResourceChanges
from ._context import Resources as Resources
from ._done import container_response as container_response
from ._done import find_container_cgroup as find_container_cgroup
from ._done import pod_response as pod_response
from ._executor import Change as Change
from ._executor import Executor as Executor
from ._executor import PathOutsideRootError as PathOutsideRootError
from ._features import FeatureStatus as FeatureStatus
from ._features import NodeProbe as NodeProbe
from ._policy import NodePolicy as NodePolicy
from ._policy import PolicyError as PolicyError
from ._policy import PolicyWatcher as PolicyWatcher
from ._registration import registration_json as registration_json
from ._registry import DuplicateHookError as DuplicateHookError
from ._registry import FailurePolicy as FailurePolicy
from ._registry import HookFailedError as HookFailedError
from ._registry import Level as Level
from ._registry import Registry as Registry
from ._registry import Stage as Stage
from ._registry import run_hooks as run_hooks
from ._rules import Rules as Rules
from ._service import HookService as HookService
from ._service import ServeOptions as ServeOptions
from ._service import serve as serve
from ._standalone import PodSelector as PodSelector
from ._standalone import run_standalone as run_standalone
from ._standalone import targets_from_cri as targets_from_cri

__all__ = [
    "QOS_LABEL",
    "CgroupFile",
    "Change",
    "ContainerChanges",
    "ContainerContext",
    "ContainerInfo",
    "DuplicateHookError",
    "Executor",
    "FailurePolicy",
    "FeatureStatus",
    "HookFailedError",
    "HookServer",
    "HookService",
    "Level",
    "NodePolicy",
    "NodeProbe",
    "PathOutsideRootError",
    "PodCache",
    "PodChanges",
    "PodContext",
    "PodInfo",
    "PodMeta",
    "PodSelector",
    "PodTarget",
    "PolicyError",
    "PolicyWatcher",
    "QoSClass",
    "Registry",
    "ResctrlGroup",
    "ResourceChanges",
    "Resources",
    "Rules",
    "ServeOptions",
    "Stage",
    "Ticker",
    "cgroups_path_dir",
    "container_cgroup_candidates",
    "container_cgroup_dir",
    "container_response",
    "find_container_cgroup",
    "pod_cgroup_dir",
    "pod_response",
    "registration_json",
    "run_hooks",
    "run_standalone",
    "serve",
    "targets_from_cri",
]
