"""Between NRI's pods and containers and the hook core's records; hook answers as NRI adjustments.

Pure and synchronous. NRI hands a plugin the pod and the container with every event, so the hook requests
are built from the event itself (:func:`pod_from_nri`, :func:`container_from_nri`), as CRI mode builds them
from the CRI request. The event's messages are upb messages (:mod:`krproxy.nri.wire`: decoded in
microseconds where betterproto2 took milliseconds); an unset sub-message reads as an empty one, so an
unset value reads as 0 or "". A container's pod cgroup parent is the one containerd put it under (its
``cgroups_path``), which need not be its pod's. What the hook servers changed is then expressed the way
NRI can apply it:

* at CreateContainer, a ``ContainerAdjustment`` (:func:`adjustment`): annotations and environment variables
  set or removed (NRI's ``-key`` marks a removal), resources and ``oom_score_adj`` set;
* at UpdateContainer, a ``ContainerUpdate`` of the container being updated (:func:`resources_update`),
  which NRI merges into the update it was asked to make.

Only fields that changed are sent: NRI gives each field to the one plugin that sets it and refuses a second
one, so claiming untouched fields would break other NRI plugins. What NRI cannot do is listed by name in
the ``not_applied`` part of each result (the caller logs it and counts it): a pod's labels, annotations and
cgroup parent (the pod exists by the time NRI tells a plugin about it), a container's pod cgroup parent, a
cpuset or unified key cleared (NRI only sets values), hugepage limits, annotations and ``oom_score_adj`` at an
update, and ``oom_score_adj`` at creation with NRI 0.6.1.

Some changes NRI would apply, but otherwise than the runtime applies the same answer in proxy mode; they
are withheld and listed too, with why (:func:`why_not_applied`):

* an env var or annotation whose name begins with ``-``: NRI reads that as its removal mark (``-FOO``
  removes ``FOO``, from what the NRI plugins before set, and an annotation ``-x`` removes ``x`` from the
  container's OCI spec), where proxy mode gives the container the name as written (measured on containerd
  1.7.24 and 2.1.9);
* the memory swap limit: NRI's spec generator (0.6.1 to 0.12, as read) sets the swap limit to the memory
  limit whenever an adjustment sets one and never reads the adjustment's swap, and containerd drops an
  update's swap (``LinuxResources.ToCRI``); proxy mode's swap lands in ``memory.memsw.limit_in_bytes``.
  Sending it would only claim the field from other NRI plugins. A swap equal to a memory limit sent with
  it is what NRI gives anyway, and is not listed;
* with containerd's ``restrict_oom_score_adj`` (:mod:`krproxy.nri.cri_settings`), an ``oom_score_adj``
  below the one containerd chose: containerd keeps a container at or above its own, NRI's adjustment
  would go around that.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from krproxy.hooks.model import ContainerInfo, FrozenMap, PodInfo, Resources
from krproxy.nri.versions import SWAP_IGNORED
from krproxy.nri.wire import entries
from krproxy.proto.nri.pkg.api import v1alpha1 as api

__all__ = [
    "CANNOT",
    "OOM_RESTRICTED",
    "REMOVAL_MARK",
    "SWAP",
    "Adjusted",
    "adjustment",
    "another_pod_named",
    "cgroup_parent_of",
    "container_from_nri",
    "envs_from_nri",
    "pod_changes",
    "pod_from_nri",
    "resources_from_nri",
    "resources_update",
    "why_not_applied",
]

#: Why a change is not applied, unless :func:`why_not_applied` knows better.
CANNOT = "NRI cannot make these changes at this event"
#: Why a name beginning with ``-`` is withheld.
REMOVAL_MARK = (
    "NRI reads a name beginning with '-' as its removal mark (it would remove the name without the '-', "
    "not set this one, as proxy mode does): rename the key in the hook server's answer"
)
#: Why an ``oom_score_adj`` below the runtime's is withheld (:mod:`krproxy.nri.cri_settings`).
OOM_RESTRICTED = (
    "containerd's restrict_oom_score_adj keeps a container's oom_score_adj at or above containerd's own, "
    "and NRI's adjustment would go around it: a value below containerd's own is sent as containerd's own "
    "(when krproxy cannot read that, a value below the one containerd chose is withheld)"
)
#: Why a swap limit is withheld.
SWAP = f"{SWAP_IGNORED} (containerd drops an update's): use proxy mode for a swap limit of its own"
_SWAP_FIELD = "memory_swap_limit_in_bytes"


def why_not_applied(field: str) -> str:
    """Why the change named ``field`` (as :class:`Adjusted` and :func:`resources_update` name them) is not
    applied: :data:`REMOVAL_MARK`, :data:`SWAP`, or :data:`CANNOT` for every other."""
    if field.startswith(("env[-", "annotations[-")):
        return REMOVAL_MARK
    if field == _SWAP_FIELD:
        return SWAP
    if field == "oom_score_adj lowered":
        return OOM_RESTRICTED
    return CANNOT


def pod_from_nri(pod: Any | None) -> PodInfo:
    """The pod (an upb ``PodSandbox``) as the hook core sees it. NRI has no sandbox attempt counter:
    ``attempt`` stays 0."""
    if pod is None:
        return PodInfo()
    return PodInfo(
        name=pod.name,
        uid=pod.uid,
        namespace=pod.namespace,
        runtime_handler=pod.runtime_handler,
        labels=entries(pod.labels),
        annotations=entries(pod.annotations),
        cgroup_parent=pod.linux.cgroup_parent,
    )


#: Where NRI keeps each scalar of :class:`Resources` (all but ``oom_score_adj``, which lives beside the
#: resources in NRI's ``LinuxContainer``): the record field, the part of ``LinuxResources`` (``cpu`` or
#: ``memory``), the part's field, and the optional wrapper a value is set in (None: a plain string). Read
#: by :func:`resources_from_nri`, written by :func:`resources_update`.
_NRI_SCALARS: tuple[tuple[str, str, str, type[Any] | None], ...] = (
    ("cpu_period", "cpu", "period", api.OptionalUInt64),
    ("cpu_quota", "cpu", "quota", api.OptionalInt64),
    ("cpu_shares", "cpu", "shares", api.OptionalUInt64),
    ("cpuset_cpus", "cpu", "cpus", None),
    ("cpuset_mems", "cpu", "mems", None),
    ("memory_limit_in_bytes", "memory", "limit", api.OptionalInt64),
    ("memory_swap_limit_in_bytes", "memory", "swap", api.OptionalInt64),
)


def resources_from_nri(resources: Any | None, oom_score_adj: Any | None = None) -> Resources:
    """CRI-style resources from NRI's (upb ``LinuxResources``; ``oom_score_adj``, an ``OptionalInt``, lives
    beside them in NRI's ``LinuxContainer``)."""
    oom = oom_score_adj.value if oom_score_adj is not None else 0
    if resources is None:
        return Resources(oom_score_adj=oom)
    scalars: dict[str, Any] = {}
    for field, part, name, wrapper in _NRI_SCALARS:
        value = getattr(getattr(resources, part), name)
        scalars[field] = value if wrapper is None else value.value
    return Resources(
        **scalars,
        oom_score_adj=oom,
        hugepage_limits=[(h.page_size, h.limit) for h in resources.hugepage_limits],
        unified=entries(resources.unified),
    )


def envs_from_nri(env: Iterable[str]) -> FrozenMap[str, str]:
    """``KEY=value`` strings as a map (a later duplicate wins, first-seen order kept), as CRI mode does."""
    out: dict[str, str] = {}
    for item in env:
        key, _, value = item.partition("=")
        out[key] = value
    return FrozenMap(out)


def cgroup_parent_of(cgroups_path: str, container_id: str) -> str | None:
    """The cgroup parent containerd put a container under, from its OCI spec's ``cgroupsPath`` (NRI's
    ``LinuxContainer.cgroups_path``), as containerd's ``getCgroupsPath`` writes it: ``PARENT/ID``
    (cgroupfs) or ``SLICE:cri-containerd:ID`` (systemd, the parent's last slice only); None when it is
    neither (or empty)."""
    if ":" in cgroups_path:
        parts = cgroups_path.split(":")
        return parts[0] if len(parts) == 3 and parts[0] and parts[2] == container_id else None
    parent, sep, name = cgroups_path.rpartition("/")
    return (parent or "/") if sep and name == container_id else None


def _container_cgroup_parent(pod_parent: str, cgroups_path: str, container_id: str) -> str:
    """The pod cgroup parent a container hook is shown: where containerd put the container. That is the
    CreateContainer request's ``sandbox_config`` cgroup parent, which containerd 1.7.24 and 2.1.9 take
    even when it is not the pod's (another pod's config, the parent sent again): the pod's own when the
    container's ``cgroupsPath`` names the same cgroup (or names none)."""
    parent = cgroup_parent_of(cgroups_path, container_id)
    if parent is None:
        return pod_parent
    if ":" in cgroups_path:  # a slice name: the same cgroup as a pod parent ending in that slice
        same = parent == posixpath.basename(pod_parent.rstrip("/"))
    else:
        same = parent == (posixpath.normpath(pod_parent) if pod_parent else "")
    return pod_parent if same else parent


def container_from_nri(pod: Any | None, container: Any | None) -> ContainerInfo:
    """The container (upb ``PodSandbox`` and ``Container``) as the hook core sees it, with its pod, and as
    the pod cgroup parent the one containerd put it under (:func:`cgroup_parent_of`). NRI has no attempt
    counter: ``attempt`` stays 0."""
    pod_info = pod_from_nri(pod)
    if container is None:
        return ContainerInfo(pod=pod_info, pod_cgroup_parent=pod_info.cgroup_parent)
    linux = container.linux
    return ContainerInfo(
        pod_sandbox_id=container.pod_sandbox_id,
        pod=pod_info,
        name=container.name,
        id=container.id,
        annotations=entries(container.annotations),
        resources=resources_from_nri(linux.resources, linux.oom_score_adj),
        envs=envs_from_nri(container.env),
        pod_cgroup_parent=_container_cgroup_parent(pod_info.cgroup_parent, linux.cgroups_path, container.id),
    )


#: The OCI spec annotations containerd names a container's pod by, written from the CreateContainer
#: request's ``sandbox_config`` (not from the pod containerd stored).
SANDBOX_NAME = "io.kubernetes.cri.sandbox-name"
SANDBOX_NAMESPACE = "io.kubernetes.cri.sandbox-namespace"
SANDBOX_UID = "io.kubernetes.cri.sandbox-uid"


def another_pod_named(info: ContainerInfo) -> str | None:
    """What is wrong when a created container's spec names another pod than its sandbox (``None``: nothing).
    containerd 1.7 and 2.1 create the container in the sandbox kubelet's ``pod_sandbox_id`` names but write
    the request's ``sandbox_config`` name, namespace and uid into the spec (measured on 2.1.9: a uid alone
    differing lands there too), while NRI gives the hooks the stored pod; proxy mode refuses such a create
    (:func:`krproxy.hooks._reading.same_pod`). Empty names (a config without metadata) pass for no other
    pod; a spec without the uid annotation is judged by name and namespace."""
    name = info.annotations.get(SANDBOX_NAME, "")
    namespace = info.annotations.get(SANDBOX_NAMESPACE, "")
    uid = info.annotations.get(SANDBOX_UID)
    pod = info.pod
    if not pod.named_otherwise(name, namespace, uid):
        return None
    return (
        f"CreateContainer for pod {pod.namespace}/{pod.name} (uid {pod.uid!r}) carries the sandbox_config of"
        f" {namespace}/{name} (uid {uid!r}): send the config the pod sandbox was run with"
    )


@attrs.frozen
class Adjusted:
    """What NRI will apply (``None``: nothing) and what it cannot or would apply otherwise than proxy mode,
    by field name (:func:`why_not_applied` says why)."""

    adjust: api.ContainerAdjustment | None
    not_applied: tuple[str, ...] = ()


def resources_update(before: Resources, after: Resources) -> tuple[api.LinuxResources | None, list[str]]:
    """The fields of ``after`` that differ from ``before``, as NRI resources; and what NRI cannot set (a swap
    limit: see the module)."""
    out = api.LinuxResources()
    cpu, memory = api.LinuxCpu(), api.LinuxMemory()
    parts = {"cpu": cpu, "memory": memory}
    not_applied: list[str] = []
    for field, part, name, wrapper in _NRI_SCALARS:
        new = getattr(after, field)
        if new == getattr(before, field):
            continue
        if field == _SWAP_FIELD:
            limit = after.memory_limit_in_bytes
            if new != limit or limit == before.memory_limit_in_bytes:  # else NRI's own swap is this one
                not_applied.append(field)
            continue
        if wrapper is not None:
            setattr(parts[part], name, wrapper(value=new))
        elif new:
            setattr(parts[part], name, new)
        else:  # a cpuset: NRI sets strings, it cannot clear one
            not_applied.append(f"{field} cleared")
    for key, value in after.unified.items():
        if before.unified.get(key) != value:
            out.unified[key] = value
    not_applied += [f"unified[{key}] removed" for key in before.unified if key not in after.unified]
    if after.hugepage_limits != before.hugepage_limits:
        not_applied.append("hugepage_limits")
    if cpu != api.LinuxCpu():
        out.cpu = cpu
    if memory != api.LinuxMemory():
        out.memory = memory
    return (out if out != api.LinuxResources() else None), not_applied


def _map_changes(
    name: str, before: Mapping[str, str], after: Mapping[str, str], not_applied: list[str]
) -> dict[str, str]:
    """Set keys whose value changed; ``-key`` (NRI's removal mark) for keys that went away. A changed key
    that begins with ``-`` would read as a removal mark: it is listed in ``not_applied`` as
    ``name[key]``, not sent."""
    changes: dict[str, str] = {}
    for key, value in after.items():
        if before.get(key) == value:
            continue
        if key.startswith("-"):
            not_applied.append(f"{name}[{key}]")
        else:
            changes[key] = value
    changes.update({f"-{key}": "" for key in before if key not in after})
    return changes


def adjustment(
    before: ContainerInfo,
    after: ContainerInfo,
    *,
    oom_score_adj: bool = True,
    restrict_oom_score_adj: bool = False,
    runtime_oom_score_adj: int | None = None,
) -> Adjusted:
    """What the hook servers changed between ``before`` and ``after`` at PreCreateContainer, as NRI's adjustment.

    ``oom_score_adj``: whether the runtime's NRI has that adjustment field (0.8 does; 0.6.1, containerd 1.7's,
    does not and would drop it unseen): without it a changed ``oom_score_adj`` is listed as not applied.
    ``restrict_oom_score_adj``: containerd's setting of that name (:mod:`krproxy.nri.cri_settings`): then
    containerd keeps a container at or above its own ``oom_score_adj`` (``runtime_oom_score_adj``, the
    containerd process's; when unknown, ``before``'s bounds it, the one containerd chose, at or above its
    own). A value below that bound is sent raised to it (nothing when that is ``before``'s) and listed as
    ``oom_score_adj lowered``, as proxy mode's containerd would have raised it.
    """
    not_applied: list[str] = []
    adjust = api.ContainerAdjustment(
        annotations=_map_changes("annotations", before.annotations, after.annotations, not_applied)
    )
    envs = _map_changes("env", before.envs, after.envs, not_applied)
    adjust.env = [api.KeyValue(key=key, value=value) for key, value in envs.items()]
    if after.pod_cgroup_parent != before.pod_cgroup_parent:
        not_applied.append("pod_cgroup_parent")
    if after.resources is not None and before.resources is not None:
        resources, missing = resources_update(before.resources, after.resources)
        not_applied += missing
        linux = api.LinuxContainerAdjustment(resources=resources)
        if after.resources.oom_score_adj != before.resources.oom_score_adj:
            value = after.resources.oom_score_adj
            if restrict_oom_score_adj:
                floor = (
                    before.resources.oom_score_adj if runtime_oom_score_adj is None else runtime_oom_score_adj
                )
                if value < floor:
                    not_applied.append("oom_score_adj lowered")
                    value = floor
            if value != before.resources.oom_score_adj:
                if oom_score_adj:
                    linux.oom_score_adj = api.OptionalInt(value=value)
                else:
                    not_applied.append("oom_score_adj")
        if linux != api.LinuxContainerAdjustment():
            adjust.linux = linux
    return Adjusted(adjust if adjust != api.ContainerAdjustment() else None, tuple(not_applied))


def pod_changes(before: PodInfo, after: PodInfo) -> tuple[str, ...]:
    """The fields a pod hook changed; NRI can apply none of them (the pod exists when NRI reports it)."""
    changed = [
        f"labels[{k}]"
        for k in set(before.labels) | set(after.labels)
        if before.labels.get(k) != after.labels.get(k)
    ]
    changed += [
        f"annotations[{k}]"
        for k in set(before.annotations) | set(after.annotations)
        if before.annotations.get(k) != after.annotations.get(k)
    ]
    if before.cgroup_parent != after.cgroup_parent:
        changed.append("cgroup_parent")
    return tuple(sorted(changed))
