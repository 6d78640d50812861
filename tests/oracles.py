"""Reference implementations the tests hold krproxy's fast paths against: CreateContainer read and
written with betterproto2, as the request path did before it moved to upb (:mod:`krproxy.hooks.rewrite`).

No daemon path uses these any more (RestorePod, the last, reads and writes with upb too): they are
kept, apart from the product package, as the readable statement of what a merged CreateContainer is,
which the upb reader and writer must agree with byte for byte (tests/unit/test_hooks_rewrite.py) and
the fuzzers merge with (tests/unit/test_fuzz_merge.py).
"""

from __future__ import annotations

from krproxy.hooks.convert import container_answer, envs_from_cri, resources_from_cri
from krproxy.hooks.merge import Merged, create_envs, merge_container_info
from krproxy.hooks.model import ContainerInfo, PodInfo
from krproxy.hooks.writeback import envs_to_cri, write_resources
from krproxy.proto.runtime import v1, v1alpha1


def container_from_create_request(request: v1.CreateContainerRequest, pod: PodInfo) -> ContainerInfo:
    """The container record of a betterproto2 CreateContainer request; *pod* is the stored record of its
    sandbox (:func:`krproxy.hooks.convert.container_from_wire_create` of the upb one)."""
    config = request.config or v1.ContainerConfig()
    meta = config.metadata or v1.ContainerMetadata()
    sandbox_linux = request.sandbox_config.linux if request.sandbox_config is not None else None
    return ContainerInfo(
        pod_sandbox_id=request.pod_sandbox_id,
        pod=pod,
        name=meta.name,
        attempt=meta.attempt,
        annotations=config.annotations,
        resources=resources_from_cri(config.linux.resources if config.linux is not None else None),
        envs=envs_from_cri(config.envs),
        pod_cgroup_parent=sandbox_linux.cgroup_parent if sandbox_linux is not None else "",
    )


def apply_create(request: v1.CreateContainerRequest, info: ContainerInfo) -> v1.CreateContainerRequest:
    """A copy of *request* carrying the container record: annotations, the whole ``config.linux.resources``,
    the pod cgroup parent (if non-empty) and ``config.envs`` rebuilt from the record's envs
    (:func:`krproxy.hooks.rewrite.create_request` of the upb one)."""
    out = v1.CreateContainerRequest.FromString(request.SerializeToString())  # a copy keeping unknown fields
    if out.config is None:
        out.config = v1.ContainerConfig()
    out.config.annotations = dict(info.annotations)
    if info.resources is not None:
        if out.config.linux is None:
            out.config.linux = v1.LinuxContainerConfig()
        if out.config.linux.resources is None:
            out.config.linux.resources = v1.LinuxContainerResources()
        write_resources(out.config.linux.resources, info.resources)
    if info.pod_cgroup_parent:
        if out.sandbox_config is None:
            out.sandbox_config = v1.PodSandboxConfig()
        if out.sandbox_config.linux is None:
            out.sandbox_config.linux = v1.LinuxPodSandboxConfig()
        out.sandbox_config.linux.cgroup_parent = info.pod_cgroup_parent
    out.config.envs = envs_to_cri(create_envs((kv.key for kv in out.config.envs), info.envs))
    return out


def merge_create_container(
    request: v1.CreateContainerRequest, response: v1alpha1.ContainerResourceHookResponse
) -> Merged[v1.CreateContainerRequest]:
    """Merge one PreCreateContainer answer into a CreateContainer request (read, merge, write back)."""
    merged = merge_container_info(
        container_from_create_request(request, PodInfo()), container_answer(response)
    )
    return Merged(apply_create(request, merged.value), merged.changes)
