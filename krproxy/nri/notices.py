"""NRI's events without an answer of their own, and NRI 0.12's dedicated method of each.

A runtime before NRI 0.12 sends all of them as ``StateChange``; 0.12 calls the method here with its
request message (and falls back to ``StateChange`` for a plugin that answers it Unimplemented). The
fake NRI runtime calls them and the SDK's NRI stub serves them, from this one table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from krproxy.proto.nri.pkg.api import v1alpha1 as api

__all__ = ["NOTICE_METHODS"]

#: Event -> (NRI 0.12's method, its request message).
NOTICE_METHODS: Mapping[api.Event, tuple[str, type[Any]]] = {
    api.Event.RUN_POD_SANDBOX: ("RunPodSandbox", api.RunPodSandboxRequest),
    api.Event.STOP_POD_SANDBOX: ("StopPodSandbox", api.StopPodSandboxRequest),
    api.Event.REMOVE_POD_SANDBOX: ("RemovePodSandbox", api.RemovePodSandboxRequest),
    api.Event.POST_UPDATE_POD_SANDBOX: ("PostUpdatePodSandbox", api.PostUpdatePodSandboxRequest),
    api.Event.POST_CREATE_CONTAINER: ("PostCreateContainer", api.PostCreateContainerRequest),
    api.Event.START_CONTAINER: ("StartContainer", api.StartContainerRequest),
    api.Event.POST_START_CONTAINER: ("PostStartContainer", api.PostStartContainerRequest),
    api.Event.POST_UPDATE_CONTAINER: ("PostUpdateContainer", api.PostUpdateContainerRequest),
    api.Event.REMOVE_CONTAINER: ("RemoveContainer", api.RemoveContainerRequest),
}
