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
from krproxy.hooks import convert, rewrite, wire
from krproxy.hooks._reading import decode, decode_request, malformed
from krproxy.hooks.model import ContainerInfo, PodInfo
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1 as cri

if TYPE_CHECKING:
    from krproxy.hooks.runtime import HookRuntime

LOGGER = logging.getLogger("krproxy.hooks")

WHAT = "RestorePodRequest"

#: RestorePod's request in upb, as CreateContainer's (:mod:`krproxy.hooks.rewrite`): maps read as their
#: entries, which keep presence, so a request written back keeps what was not changed as it came.
RestorePodRequest = wire.message_class(WHAT, writing=True)
R = TypeVar("R")


async def restore_pod(hooks: HookRuntime, data: bytes, forward: Forward) -> Reply:
    """The RestorePod interceptor's work (module docstring)."""
    request = await decode_request(RestorePodRequest, data, WHAT)
    with malformed(WHAT):
        pod = convert.pod_from_wire_config(request.config, request.runtime_handler)
    changed = False
    merged_pod = await _hooked(hooks, HookPoint.PRE_RUN_POD_SANDBOX, pod, pod, None, data)
    if merged_pod is not pod:
        with malformed(WHAT):
            rewrite.write_pod_config(request.config, merged_pod)
        changed = True
    containers: list[ContainerInfo] = []
    for container_config in request.container_configs:
        with malformed(WHAT):
            create = _create_request(container_config, request)
            info = convert.container_from_wire_create(create, merged_pod)
        merged = await _hooked(hooks, HookPoint.PRE_CREATE_CONTAINER, info, merged_pod, info.name, data)
        if merged is not info:
            with malformed(WHAT):
                rewrite.write_create(create, merged)
                container_config.CopyFrom(create.config)
            changed = True
        containers.append(merged)
    if changed:
        with malformed(WHAT):
            data = bytes(request.SerializeToString())
    reply = await forward(data)
    keep_restored(hooks, merged_pod, containers, reply.message)
    return reply


def _create_request(container_config: Any, request: Any) -> Any:
    """The CreateContainer (upb, :data:`krproxy.hooks.rewrite.CreateContainerRequest`) that creating
    *container_config* in the restored sandbox would send: that config, the sandbox's config beside it."""
    create = rewrite.CreateContainerRequest()
    create.config.CopyFrom(container_config)
    if request.HasField("config"):
        create.sandbox_config.CopyFrom(request.config)
    return create


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
