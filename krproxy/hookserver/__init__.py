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

Names are loaded from their module when first asked for: the pure modules (the contexts, the
cgroup paths, the policy and its rules) are imported through this package without trio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from krproxy._lazy import reexport

if TYPE_CHECKING:
    from krproxy.hookserver._app import HookServer as HookServer
    from krproxy.hookserver._app import PodCache as PodCache
    from krproxy.hookserver._app import PodTarget as PodTarget
    from krproxy.hookserver._app import Ticker as Ticker
    from krproxy.hookserver._cgroups import CgroupFile as CgroupFile
    from krproxy.hookserver._cgroups import cgroups_path_dir as cgroups_path_dir
    from krproxy.hookserver._cgroups import container_cgroup_candidates as container_cgroup_candidates
    from krproxy.hookserver._cgroups import container_cgroup_dir as container_cgroup_dir
    from krproxy.hookserver._cgroups import pod_cgroup_dir as pod_cgroup_dir
    from krproxy.hookserver._context import QOS_LABEL as QOS_LABEL
    from krproxy.hookserver._context import ContainerChanges as ContainerChanges
    from krproxy.hookserver._context import ContainerContext as ContainerContext
    from krproxy.hookserver._context import ContainerInfo as ContainerInfo
    from krproxy.hookserver._context import PodChanges as PodChanges
    from krproxy.hookserver._context import PodContext as PodContext
    from krproxy.hookserver._context import PodInfo as PodInfo
    from krproxy.hookserver._context import PodMeta as PodMeta
    from krproxy.hookserver._context import QoSClass as QoSClass
    from krproxy.hookserver._context import ResctrlGroup as ResctrlGroup
    from krproxy.hookserver._context import ResourceChanges as ResourceChanges
    from krproxy.hookserver._context import Resources as Resources
    from krproxy.hookserver._done import container_response as container_response
    from krproxy.hookserver._done import find_container_cgroup as find_container_cgroup
    from krproxy.hookserver._done import pod_response as pod_response
    from krproxy.hookserver._executor import Change as Change
    from krproxy.hookserver._executor import Executor as Executor
    from krproxy.hookserver._executor import PathOutsideRootError as PathOutsideRootError
    from krproxy.hookserver._features import FeatureStatus as FeatureStatus
    from krproxy.hookserver._features import NodeProbe as NodeProbe
    from krproxy.hookserver._policy import NodePolicy as NodePolicy
    from krproxy.hookserver._policy import PolicyError as PolicyError
    from krproxy.hookserver._policywatch import PolicyWatcher as PolicyWatcher
    from krproxy.hookserver._registration import registration_json as registration_json
    from krproxy.hookserver._registry import DuplicateHookError as DuplicateHookError
    from krproxy.hookserver._registry import FailurePolicy as FailurePolicy
    from krproxy.hookserver._registry import HookFailedError as HookFailedError
    from krproxy.hookserver._registry import Level as Level
    from krproxy.hookserver._registry import Registry as Registry
    from krproxy.hookserver._registry import Stage as Stage
    from krproxy.hookserver._registry import run_hooks as run_hooks
    from krproxy.hookserver._rules import Rules as Rules
    from krproxy.hookserver._service import HookService as HookService
    from krproxy.hookserver._service import ServeOptions as ServeOptions
    from krproxy.hookserver._service import serve as serve
    from krproxy.hookserver._standalone import PodSelector as PodSelector
    from krproxy.hookserver._standalone import run_standalone as run_standalone
    from krproxy.hookserver._standalone import targets_from_cri as targets_from_cri

_WHERE = {
    "HookServer": "_app",
    "PodCache": "_app",
    "PodTarget": "_app",
    "Ticker": "_app",
    "CgroupFile": "_cgroups",
    "cgroups_path_dir": "_cgroups",
    "container_cgroup_candidates": "_cgroups",
    "container_cgroup_dir": "_cgroups",
    "pod_cgroup_dir": "_cgroups",
    "QOS_LABEL": "_context",
    "ContainerChanges": "_context",
    "ContainerContext": "_context",
    "ContainerInfo": "_context",
    "PodChanges": "_context",
    "PodContext": "_context",
    "PodInfo": "_context",
    "PodMeta": "_context",
    "QoSClass": "_context",
    "ResctrlGroup": "_context",
    "ResourceChanges": "_context",
    "Resources": "_context",
    "container_response": "_done",
    "find_container_cgroup": "_done",
    "pod_response": "_done",
    "Change": "_executor",
    "Executor": "_executor",
    "PathOutsideRootError": "_executor",
    "FeatureStatus": "_features",
    "NodeProbe": "_features",
    "NodePolicy": "_policy",
    "PolicyError": "_policy",
    "PolicyWatcher": "_policywatch",
    "registration_json": "_registration",
    "DuplicateHookError": "_registry",
    "FailurePolicy": "_registry",
    "HookFailedError": "_registry",
    "Level": "_registry",
    "Registry": "_registry",
    "Stage": "_registry",
    "run_hooks": "_registry",
    "Rules": "_rules",
    "HookService": "_service",
    "ServeOptions": "_service",
    "serve": "_service",
    "PodSelector": "_standalone",
    "run_standalone": "_standalone",
    "targets_from_cri": "_standalone",
}

__all__ = sorted(_WHERE)

__getattr__ = reexport(__name__, _WHERE)
