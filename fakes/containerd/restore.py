"""The fake's RestorePod (KEP-5823): a pod sandbox and its containers created from the request's configs.

The checkpoint archive is not read: ``checkpoint_path`` must name an existing file (checked, as a real
runtime must open it first), and what is restored is what the request says — a READY sandbox from
``config`` (with ``runtime_handler``) and, in order, a CREATED container from each ``container_configs``
entry in it, as RunPodSandbox and CreateContainer would make them (same checks, ids and events). The
answer names the sandbox and each container by its config's name. All or nothing: if a container cannot
be created, the sandbox and the containers made so far are removed and the error is the answer.
docs/testing.md says what the fake does; real containerd (1.6, 1.7, 2.1) answers UNIMPLEMENTED.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from krproxy.fakes.containerd.records import Code, CriError
from krproxy.proto.runtime import v1 as cri

if TYPE_CHECKING:
    from krproxy.fakes.containerd.state import RuntimeState


def restore_pod(state: RuntimeState, request: cri.RestorePodRequest) -> cri.RestorePodResponse:
    """RestorePod on *state* (module docstring)."""
    path = request.checkpoint_path
    if not path:
        raise CriError(Code.INVALID_ARGUMENT, "checkpoint_path must not be empty")
    if not os.path.isfile(path):
        raise CriError(Code.NOT_FOUND, f'failed to open checkpoint archive "{path}": no such file')
    config = request.config or cri.PodSandboxConfig()
    run = cri.RunPodSandboxRequest(config=config, runtime_handler=request.runtime_handler)
    pod_id = state.run_pod_sandbox(run).pod_sandbox_id
    restored = []
    try:
        for container in request.container_configs:
            create = cri.CreateContainerRequest(
                pod_sandbox_id=pod_id, config=container, sandbox_config=config
            )
            container_id = state.create_container(create).container_id
            name = container.metadata.name if container.metadata is not None else ""
            restored.append(cri.RestoredContainer(name=name, container_id=container_id))
    except CriError:
        state.remove_pod_sandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id))
        raise
    return cri.RestorePodResponse(pod_sandbox_id=pod_id, restored_containers=restored)
