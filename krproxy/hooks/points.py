"""The eight runtime hook points, their stage, the CRI call each runs on and its hook-protocol RPC.

All routing facts live in this one table (koord-runtime-proxy's mapping, see DESIGN.md, plus
krproxy's extension PreUpdatePodSandboxResources, the pod-level resize of KEP-5419):

==========================  ===========================  =====
CRI method                  hook points (in call order)   stage
==========================  ===========================  =====
RunPodSandbox               PreRunPodSandbox             pre
StopPodSandbox              PostStopPodSandbox           post
CreateContainer             PreCreateContainer           pre
StartContainer              PreStartContainer,           pre,
                            PostStartContainer           post
StopContainer               PostStopContainer            post
UpdateContainerResources    PreUpdateContainerResources  pre
UpdatePodSandboxResources   PreUpdatePodSandboxResources pre
==========================  ===========================  =====

PreUpdatePodSandboxResources is not in Koordinator's protocol: only hook servers whose registration
file lists it are called there (:data:`EXTENSIONS`), so existing servers never see the new RPC.
"""

from __future__ import annotations

import enum
import functools

__all__ = [
    "CRI_RUNTIME_SERVICE",
    "EXTENSIONS",
    "HOOK_SERVICE",
    "UNSUPPORTED_HOOK_NAMES",
    "HookPoint",
    "Stage",
    "hook_points_for",
]

#: gRPC service name of the CRI runtime API the proxy intercepts.
CRI_RUNTIME_SERVICE = "runtime.v1.RuntimeService"
#: gRPC service name of the hook protocol plugins implement.
HOOK_SERVICE = "runtime.v1alpha1.RuntimeHookService"

#: Hook names koordlet's framework knows and may list in its registration file, but that no proxy calls:
#: koordlet's PreRemoveRunPodSandbox stage is only driven through NRI. Registrations naming these are
#: accepted (with a warning) and the names are never called; any other unknown name is an error.
UNSUPPORTED_HOOK_NAMES = frozenset({"PreRemoveRunPodSandbox"})


class Stage(enum.Enum):
    """Whether a hook runs before the runtime acts (may change the request) or after (answer ignored)."""

    PRE = "pre"
    POST = "post"


class HookPoint(enum.Enum):
    """A hook point; the value is the name used in registration files (``runtime-hooks``)."""

    PRE_RUN_POD_SANDBOX = "PreRunPodSandbox"
    POST_STOP_POD_SANDBOX = "PostStopPodSandbox"
    PRE_CREATE_CONTAINER = "PreCreateContainer"
    PRE_START_CONTAINER = "PreStartContainer"
    POST_START_CONTAINER = "PostStartContainer"
    POST_STOP_CONTAINER = "PostStopContainer"
    PRE_UPDATE_CONTAINER_RESOURCES = "PreUpdateContainerResources"
    PRE_UPDATE_POD_SANDBOX_RESOURCES = "PreUpdatePodSandboxResources"

    # Dispatch reads stage, rpc_path and is_pod_level on every hook call: each is worked out once and
    # then kept on the member (cached_property: a plain attribute read after the first).

    #: Members hash as objects, by identity (they compare by identity): Enum's ``__hash__`` is a Python
    #: call on every look-up keyed by a hook point (the points' specs, the registry's plugins, metrics).
    __hash__ = object.__hash__

    @functools.cached_property
    def stage(self) -> Stage:
        """PRE for ``Pre*`` hooks, POST for ``Post*`` hooks."""
        return Stage.PRE if self.value.startswith("Pre") else Stage.POST

    @property
    def cri_method(self) -> str:
        """The CRI RuntimeService method this hook runs on, e.g. ``"StartContainer"``."""
        return _CRI_METHOD[self]

    @property
    def cri_path(self) -> str:
        """The gRPC path of that CRI method, e.g. ``"/runtime.v1.RuntimeService/StartContainer"``."""
        return f"/{CRI_RUNTIME_SERVICE}/{self.cri_method}"

    @property
    def rpc_name(self) -> str:
        """The hook-protocol RPC name, e.g. ``"PreRunPodSandboxHook"``."""
        return f"{self.value}Hook"

    @functools.cached_property
    def rpc_path(self) -> str:
        """The hook-protocol gRPC path, e.g. ``"/runtime.v1alpha1.RuntimeHookService/PreRunPodSandboxHook"``."""
        return f"/{HOOK_SERVICE}/{self.rpc_name}"

    @functools.cached_property
    def is_pod_level(self) -> bool:
        """True if the hook speaks PodSandboxHookRequest/Response, False for ContainerResourceHook*."""
        return self in (
            HookPoint.PRE_RUN_POD_SANDBOX,
            HookPoint.POST_STOP_POD_SANDBOX,
            HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES,
        )

    @classmethod
    def from_name(cls, name: str) -> HookPoint | None:
        """The hook point called *name* (as in registration files), or None if there is none."""
        try:
            return cls(name)
        except ValueError:
            return None


_CRI_METHOD: dict[HookPoint, str] = {
    HookPoint.PRE_RUN_POD_SANDBOX: "RunPodSandbox",
    HookPoint.POST_STOP_POD_SANDBOX: "StopPodSandbox",
    HookPoint.PRE_CREATE_CONTAINER: "CreateContainer",
    HookPoint.PRE_START_CONTAINER: "StartContainer",
    HookPoint.POST_START_CONTAINER: "StartContainer",
    HookPoint.POST_STOP_CONTAINER: "StopContainer",
    HookPoint.PRE_UPDATE_CONTAINER_RESOURCES: "UpdateContainerResources",
    HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES: "UpdatePodSandboxResources",
}

#: Hook points krproxy adds to Koordinator's protocol (RPCs koordlet and koord-runtime-proxy do not know).
EXTENSIONS = frozenset({HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES})


def hook_points_for(cri_method: str) -> tuple[HookPoint, ...]:
    """The hook points that run on *cri_method* (a bare name like ``"StartContainer"`` or a full gRPC path),
    pre hooks first; empty for methods that are forwarded untouched."""
    prefix = f"/{CRI_RUNTIME_SERVICE}/"
    if cri_method.startswith("/"):
        if not cri_method.startswith(prefix):
            return ()
        cri_method = cri_method.removeprefix(prefix)
    name = cri_method
    points = [p for p in HookPoint if p.cri_method == name]
    return tuple(sorted(points, key=lambda p: p.stage is Stage.POST))
