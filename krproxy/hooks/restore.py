"""RestorePod (KEP-5823): a pod and its containers created from a checkpoint, hooked as if run and created.

RestorePod creates a pod sandbox and its containers with no RunPodSandbox and no CreateContainer, so
forwarded raw it would skip every PreRunPodSandbox and PreCreateContainer hook and every required hook
server. Here it runs the hooks those calls run, on what the request carries:

- PreRunPodSandbox on the restored sandbox config (``config``, with ``runtime_handler``), as for a
  RunPodSandbox of that config; the merged labels, annotations and cgroup parent go back into ``config``;
- then PreCreateContainer for each ``container_configs`` entry, in order, with the merged pod as its pod,
  as for a CreateContainer in that sandbox; the merged annotations, resources and envs go back into that
  entry (a container hook's change of the *pod's* cgroup parent is not: RestorePod has one sandbox config).

Required hook servers hold it at both points (UNAVAILABLE, nothing forwarded, while one is missing), the
skip label skips it, and without a change krproxy forwards the caller's bytes. Once the runtime answered,
the store keeps the pod under ``pod_sandbox_id`` and each ``restored_containers`` entry, matched to its
config by name, under its ``container_id``. Why no PreRestorePod point of its own: docs/hooks.md.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from krproxy import log
from krproxy.forward import Forward, Reply
from krproxy.grpcstatus import GRPCError
from krproxy.hooks import convert, writeback
from krproxy.hooks._reading import decode, decode_request, malformed
from krproxy.hooks.model import ContainerInfo, PodInfo
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1 as cri

if TYPE_CHECKING:
    from krproxy.hooks.runtime import HookRuntime

LOGGER = logging.getLogger("krproxy.hooks")

WHAT = "RestorePodRequest"
R = TypeVar("R")


async def restore_pod(hooks: HookRuntime, data: bytes, forward: Forward) -> Reply:
    """The RestorePod interceptor's work (module docstring)."""
    request = await decode_request(cri.RestorePodRequest, data, WHAT)
    with malformed(WHAT):
        config = request.config or cri.PodSandboxConfig()
        run = cri.RunPodSandboxRequest(config=config, runtime_handler=request.runtime_handler)
        pod = convert.pod_from_run_request(run)
    changed = False
    merged_pod = await _hooked(hooks, HookPoint.PRE_RUN_POD_SANDBOX, pod, pod, None, data)
    if merged_pod is not pod:
        with malformed(WHAT):
            config = request.config = writeback.apply_run_pod(run, merged_pod).config
        changed = True
    containers: list[ContainerInfo] = []
    for index, container_config in enumerate(list(request.container_configs)):
        with malformed(WHAT):
            create = cri.CreateContainerRequest(config=container_config, sandbox_config=config)
            info = convert.container_from_create_request(create, merged_pod)
        merged = await _hooked(hooks, HookPoint.PRE_CREATE_CONTAINER, info, merged_pod, info.name, data)
        if merged is not info:
            with malformed(WHAT):
                out = writeback.apply_create(create, merged).config
                assert out is not None  # apply_create always writes a config
                request.container_configs[index] = out
            changed = True
        containers.append(merged)
    if changed:
        with malformed(WHAT):
            data = bytes(request.SerializeToString())
    reply = await forward(data)
    keep_restored(hooks, merged_pod, containers, reply.message)
    return reply


async def _hooked(
    hooks: HookRuntime, point: HookPoint, record: R, pod: PodInfo, container: str | None, data: bytes
) -> R:
    """*record* as the pre hooks of *point* left it (the record itself when they changed nothing)."""
    target = f"restored pod {pod.namespace}/{pod.name}" + (f" container {container}" if container else "")
    merged, _ = await hooks.pre_hooks(
        point, record, pod=pod, container=container, target=target, data=data, rebuild=_unused, what=WHAT
    )
    return merged


def _unused(record: object) -> bytes:
    return b""  # the merged records are written into the RestorePod request by restore_pod


def keep_restored(hooks: HookRuntime, pod: PodInfo, containers: list[ContainerInfo], reply: bytes) -> None:
    """Store the restored pod and containers under the ids the runtime's RestorePod answer gives."""
    try:
        answer = decode(cri.RestorePodResponse, reply, "RestorePodResponse")
        pod_id = answer.pod_sandbox_id
        restored: list[Any] = list(answer.restored_containers)
    except GRPCError as err:  # the runtime's answer goes back as it is; the store just cannot learn from it
        log.warning(LOGGER, "restore_answer_unreadable", error=err.message)
        return
    if not pod_id:
        return
    hooks.lifecycle.keep(HookPoint.PRE_RUN_POD_SANDBOX, pod_id, pod)
    by_name = {info.name: info for info in containers}
    for entry in restored:
        info = by_name.get(entry.name)
        if info is None or not entry.container_id:
            log.event(
                LOGGER,
                "restored_container_unknown",
                level=logging.WARNING,
                pod=pod_id,
                container=entry.name,
                id=entry.container_id,
                reason="no container config of that name in the RestorePod request: kept without hooks' record",
            )
            continue
        hooks.lifecycle.keep(
            HookPoint.PRE_CREATE_CONTAINER, entry.container_id, attrs.evolve(info, pod_sandbox_id=pod_id)
        )
