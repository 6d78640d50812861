"""The "done" step: plugin changes → echoed hook response + files for the executor.

The response always starts as an echo of the request, because the proxy merges answers
field by field and *always* overwrites ``cpuset_cpus``/``cpuset_mems``/``oom_score_adj``
with what we return (hook-semantics 2.4): a server that answered only its changes would
wipe those. CRI-expressible container settings (cpuset, cfs quota, shares, memory limit) go
into the response; the rest (group identity, cpu.idle, resctrl) is written by the executor.
Pod-level resources are written by the executor too: the proxy ignores them in CRI mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import attrs

from krproxy import log
from krproxy.proto.runtime import v1alpha1 as hook

from ._cgroups import CgroupFile, cgroups_path_dir, container_cgroup_candidates, pod_cgroup_dir, scale_quota
from ._context import ContainerContext, ContainerInfo, PodContext, PodInfo, ResourceChanges
from ._executor import CgroupWriteError, Change, Executor

LOGGER = logging.getLogger("krproxy.hookserver")

#: cpu.shares for a BE pod when neither cpu.bvt_warp_ns nor cpu.idle exists (kernel minimum).
FALLBACK_BE_SHARES = 2


@attrs.frozen
class Write:
    """One planned cgroup write."""

    file: CgroupFile
    value: int | str


def _copy_resources(res: hook.LinuxContainerResources | None) -> hook.LinuxContainerResources | None:
    return None if res is None else hook.LinuxContainerResources.FromString(res.SerializeToString())


def _with_cri_changes(
    res: hook.LinuxContainerResources | None, changes: ResourceChanges
) -> hook.LinuxContainerResources | None:
    cri = (changes.cpuset, changes.cfs_quota, changes.cpu_shares, changes.memory_limit)
    if all(v is None for v in cri):
        return res
    res = res if res is not None else hook.LinuxContainerResources()
    if changes.cpuset is not None:
        res.cpuset_cpus = changes.cpuset
    if changes.cfs_quota is not None:
        res.cpu_quota = changes.cfs_quota
    if changes.cpu_shares is not None:
        res.cpu_shares = changes.cpu_shares
    if changes.memory_limit is not None:
        res.memory_limit_in_bytes = changes.memory_limit
    return res


def pod_response(req: hook.PodSandboxHookRequest, ctx: PodContext) -> hook.PodSandboxHookResponse:
    """Echo ``req`` with the plugins' label, annotation, cgroup parent and CRI-expressible resource changes
    applied (the proxy takes the resources only from a PreUpdatePodSandboxResources answer)."""
    changes = ctx.response
    return hook.PodSandboxHookResponse(
        labels={**req.labels, **changes.labels},
        annotations={**req.annotations, **changes.annotations},
        cgroup_parent=changes.cgroup_parent if changes.cgroup_parent else req.cgroup_parent,
        resources=_with_cri_changes(_copy_resources(req.resources), changes.resources),
    )


def container_response(
    req: hook.ContainerResourceHookRequest, ctx: ContainerContext
) -> hook.ContainerResourceHookResponse:
    """Echo ``req`` with annotations, CRI-expressible resources and added envs applied."""
    changes = ctx.response
    return hook.ContainerResourceHookResponse(
        container_annotations={**req.container_annotations, **changes.annotations},
        container_resources=_with_cri_changes(_copy_resources(req.container_resources), changes.resources),
        pod_cgroup_parent=req.pod_cgroup_parent,
        container_envs={**req.container_envs, **changes.add_envs},
    )


def plan_writes(
    changes: ResourceChanges, *, include_cri: bool, has: Callable[[CgroupFile], bool]
) -> list[Write]:
    """The cgroup writes for ``changes``; ``has(file)`` says whether the kernel offers a file.

    Group identity fallback (documented in ``policies.groupidentity``): without
    ``cpu.bvt_warp_ns``, a negative bvt (BE) becomes ``cpu.idle=1`` where that exists, else
    ``cpu.shares=2``; a non-negative bvt becomes ``cpu.idle=0`` where that exists.
    """
    writes: list[Write] = []
    if changes.cpu_bvt is not None:
        if has(CgroupFile.CPU_BVT):
            writes.append(Write(CgroupFile.CPU_BVT, changes.cpu_bvt))
        elif has(CgroupFile.CPU_IDLE) and changes.cpu_idle is None:
            writes.append(Write(CgroupFile.CPU_IDLE, 1 if changes.cpu_bvt < 0 else 0))
        elif changes.cpu_bvt < 0 and changes.cpu_shares is None:
            writes.append(Write(CgroupFile.CPU_SHARES, FALLBACK_BE_SHARES))
    if changes.cpu_idle is not None:
        writes.append(Write(CgroupFile.CPU_IDLE, changes.cpu_idle))
    if include_cri:
        for file, value in (
            (CgroupFile.CPU_SHARES, changes.cpu_shares),
            (CgroupFile.CFS_QUOTA, changes.cfs_quota),
            (CgroupFile.CPUSET_CPUS, changes.cpuset),
            (CgroupFile.MEMORY_LIMIT, changes.memory_limit),
        ):
            if value is not None:
                writes.append(Write(file, value))
    return writes


class CgroupMissingError(FileNotFoundError):
    """The cgroup does not exist (yet): nothing was written. Pod cgroups appear when the runtime
    starts the sandbox, after PreRunPodSandbox; the hook server retries them (``HookServer.retry_pending``)."""


def who(pod: PodInfo, container: str = "") -> str:
    """``namespace/name`` of a pod (``/container`` added), for messages."""
    name = f"{pod.meta.namespace}/{pod.meta.name}" if pod.meta.name else pod.cgroup_parent
    return f"{name}/{container}" if container else name


def apply(
    executor: Executor,
    cgroup_dir: str,
    changes: ResourceChanges,
    *,
    include_cri: bool,
    pod: str = "",
    tried: Sequence[str] = (),
) -> list[Change]:
    """Write ``changes`` for ``cgroup_dir``; a file the kernel lacks is logged and skipped.

    Raises:
        CgroupMissingError: ``cgroup_dir`` does not exist (nothing written); the message names
            every directory ``tried`` for it.
        CgroupWriteError: the kernel refused a value; names ``pod``, the file and the value.
    """
    done: list[Change] = []

    def has(file: CgroupFile) -> bool:
        return executor.has(cgroup_dir, file)

    writes = plan_writes(changes, include_cri=include_cri, has=has)
    if (writes or changes.resctrl is not None) and not executor.cgroup_exists(cgroup_dir):
        where = f"at any of {', '.join(tried)}" if len(tried) > 1 else cgroup_dir
        raise CgroupMissingError(f"pod {pod}: no cgroup {where} under {executor.cgroup_root} yet")
    for write in writes:
        try:
            change = executor.set(cgroup_dir, write.file, write.value)
        except CgroupWriteError as exc:
            raise exc.for_pod(pod) from exc.cause
        except FileNotFoundError as exc:
            log.event(
                LOGGER,
                "cgroup_write_skipped",
                pod=pod,
                file=write.file.name.lower(),
                value=write.value,
                reason=str(exc),
            )
            continue
        if change is not None:
            done.append(change)
    if changes.resctrl is not None:
        done += executor.resctrl_group(changes.resctrl.name, changes.resctrl.schemata)
        done += executor.resctrl_add_tasks(changes.resctrl.name, executor.pids(cgroup_dir))
    return done


def apply_pod(executor: Executor, ctx: PodContext, *, include_cri: bool = True) -> list[Change]:
    """Pod-level settings go through the executor (proxy and standalone alike); with ``include_cri``
    false (a pod-level resize, whose answer carries them to the runtime) all but the CRI-expressible ones."""
    if not ctx.request.cgroup_parent:
        return []
    return apply(
        executor,
        pod_cgroup_dir(ctx.request.cgroup_parent),
        ctx.response.resources,
        include_cri=include_cri,
        pod=who(ctx.request),
    )


def writes_something(changes: ResourceChanges, *, include_cri: bool) -> bool:
    """Whether :func:`apply` may write anything for ``changes`` (False: it would write nothing and
    raise nothing, wherever the cgroup is)."""
    if changes.cpu_bvt is not None or changes.cpu_idle is not None or changes.resctrl is not None:
        return True
    cri = (changes.cpu_shares, changes.cfs_quota, changes.cpuset, changes.memory_limit)
    return include_cri and any(value is not None for value in cri)


def container_writes_something(ctx: ContainerContext, *, include_cri: bool) -> bool:
    """Whether :func:`apply_container` may touch the node's files for ``ctx`` (False: it returns at once)."""
    info = ctx.request
    if not info.id or not (info.pod.cgroup_parent or info.cgroup_path):
        return False
    return writes_something(ctx.response.resources, include_cri=include_cri)


def find_container_cgroup(executor: Executor, info: ContainerInfo) -> tuple[str, tuple[str, ...]]:
    """The container's cgroup directory, and the directories looked at for it.

    The runtime's own path when known (``info.cgroup_path``, OCI ``linux.cgroupsPath``); else the
    first of :func:`container_cgroup_candidates` that exists on the node (containerd, CRI-O, Docker;
    systemd and cgroupfs drivers), or the likeliest when none does yet.
    """
    if info.cgroup_path:
        cgroup_dir = cgroups_path_dir(info.cgroup_path)
        return cgroup_dir, (cgroup_dir,)
    tried = container_cgroup_candidates(info.pod.cgroup_parent, info.id)
    found = next((c for c in tried if executor.cgroup_exists(c)), tried[0])
    return found, tried


def apply_container(executor: Executor, ctx: ContainerContext, *, include_cri: bool) -> list[Change]:
    """Container-level settings; ``include_cri`` is False when the response carries them."""
    if not container_writes_something(ctx, include_cri=include_cri):
        return []  # the usual call: no need to look for the container's cgroup on the node
    info = ctx.request
    cgroup_dir, tried = find_container_cgroup(executor, info)
    return apply(
        executor,
        cgroup_dir,
        ctx.response.resources,
        include_cri=include_cri,
        pod=who(info.pod, info.name),
        tried=tried,
    )


def _quota(text: str | None) -> int:
    """A v1 ``cpu.cfs_quota_us`` value; unlimited (-1) and unreadable count as unlimited."""
    try:
        value = int(text or "-1")
    except ValueError:
        return -1
    return value


def _above(a: int, b: int) -> bool:
    """Whether quota ``a`` is more than quota ``b`` (-1 is unlimited)."""
    return (a < 0 <= b) or (0 <= b < a)


def _exceeds(child: int, child_period: int, parent: int, parent_period: int) -> bool:
    """Whether cgroup v1 refuses quota ``child`` under ``parent`` (an unlimited child is allowed).
    The kernel compares shares of a CPU, quota / period (``tg_cfs_schedulable_down``)."""
    return parent >= 0 and child >= 0 and child * parent_period > parent * child_period


def order_quota_writes(
    executor: Executor, pod: PodContext, containers: Sequence[ContainerContext]
) -> tuple[list[ContainerContext], list[ContainerContext]]:
    """Containers to write before the pod and after it, so cgroup v1 accepts every quota.

    cgroup v1 refuses a child's ``cpu.cfs_quota_us`` above its parent's and a parent's below a
    child's, each taken as a share of a CPU (quota / period: the two may have different periods). When the pod's quota is set, each container's is kept at or below it (its own limit
    — a plugin's value, else the one kubelet gave it — capped by the pod's; a container capped
    earlier gets its own limit back when the pod's rises). Containers whose quota goes down are
    written first (lower the child before the parent), the others — and those that go from
    unlimited to a limit — after (raise the parent first).
    cgroup v2 has no such rule (``cpu.max`` limits nest), so there the pod simply goes first.
    """
    quota = pod.response.resources.cfs_quota
    if executor.cgroup_version != 1 or quota is None or not pod.request.cgroup_parent:
        return [], list(containers)
    pod_period = executor.cfs_period(pod_cgroup_dir(pod.request.cgroup_parent))
    before: list[ContainerContext] = []
    after: list[ContainerContext] = []
    for ctx in containers:
        if not ctx.request.id:
            after.append(ctx)
            continue
        cgroup_dir = find_container_cgroup(executor, ctx.request)[0]
        try:
            current = _quota(executor.read(cgroup_dir, CgroupFile.CFS_QUOTA))
        except OSError:
            current = -1
        period = executor.cfs_period(cgroup_dir)
        own = ctx.response.resources.cfs_quota
        if own is None:
            own = ctx.request.resources.cpu_quota if ctx.request.resources.cpu_quota > 0 else -1
            if own < 0 and _exceeds(current, period, quota, pod_period):
                own = current  # kubelet's limit unknown here: cap what the file holds
        # Quotas are µs per period, each cgroup's own: the container's cap is the pod's share.
        capped = scale_quota(quota, period, pod_period) if _exceeds(own, period, quota, pod_period) else own
        if capped != current and (capped >= 0 or current >= 0):
            ctx.response.resources.cfs_quota = capped
        # Lowered from a limit: before the pod (capped < current <= the pod's old quota). From
        # unlimited: after it (the new value may be above the pod's old quota; an unlimited child
        # is accepted under any parent meanwhile).
        (before if current >= 0 and _above(current, capped) else after).append(ctx)
    return before, after
