"""What plugins see: the request (read-only) and the changes they ask for (mutable).

Plugins never touch wire types. A hook request is turned into a :class:`PodInfo` or
:class:`ContainerInfo` (frozen) with :meth:`from_proto`; the plugin edits the ``response``
part of a :class:`PodContext` / :class:`ContainerContext`; the "done" step in ``_done``
turns the changes into the echoed hook response and into cgroup/resctrl writes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, ItemsView, Iterator, KeysView, Mapping, ValuesView
from types import MappingProxyType
from typing import Any

import attrs

from krproxy.proto.runtime import v1 as cri
from krproxy.proto.runtime import v1alpha1 as hook

#: Koordinator's pod label carrying the QoS class.
QOS_LABEL = "koordinator.sh/qosClass"


class QoSClass(enum.Enum):
    """Koordinator's QoS classes. Pods without the label count as LS."""

    LSE = "LSE"
    LSR = "LSR"
    LS = "LS"
    BE = "BE"
    SYSTEM = "SYSTEM"

    @classmethod
    def from_labels(cls, labels: Mapping[str, str]) -> QoSClass:
        try:
            return cls(labels.get(QOS_LABEL, "LS"))
        except ValueError:
            return cls.LS


def _frozen_map(value: Mapping[str, str] | None) -> Mapping[str, str]:
    if value.__class__ is LazyMap:  # read-only already, and its dict read once when first used
        return value
    return MappingProxyType(dict(value or {}))


class LazyMap(Mapping[str, str]):
    """A read-only map of a hook request whose dict is read (``read()``) the first time it is used.

    The served SDK decodes a request's labels, annotations and envs only for the plugins that look at
    them (``_wire``: decoding a kubelet-sized request's 64 entries was about half its call's job); to a
    plugin it is the ``mappingproxy`` the record otherwise holds: the same methods, ``==`` with any
    mapping, ``|``, ``copy()``, the ``repr`` and the ``str``.
    """

    __slots__ = ("_dict", "_read", "_source")

    def __init__(self, read: Callable[[Any], dict[str, str]], source: Any) -> None:
        """The map ``read(source)`` gives (the function and its argument, not a partial of them:
        one Python call fewer per map, four maps per hook call)."""
        self._read = read
        self._source = source
        self._dict: dict[str, str] | None = None

    @property
    def _items(self) -> dict[str, str]:
        got = self._dict
        if got is None:  # (two threads reading it at once read the same dict twice)
            got = self._dict = self._read(self._source)
        return got

    def __getitem__(self, key: str) -> str:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def keys(self) -> KeysView[str]:  # the dict's own views, as mappingproxy gives them
        return self._items.keys()

    def items(self) -> ItemsView[str, str]:
        return self._items.items()

    def values(self) -> ValuesView[str]:
        return self._items.values()

    def __reversed__(self) -> Iterator[str]:
        return reversed(self._items)

    def __or__(self, other: Any) -> Any:
        return self._items | other

    def __ror__(self, other: Any) -> Any:
        return other | self._items

    def __repr__(self) -> str:
        return f"mappingproxy({self._items!r})"

    def __str__(self) -> str:  # a mappingproxy's str is its dict's (format() and f-strings too)
        return str(self._items)

    def copy(self) -> dict[str, str]:
        return dict(self._items)


@attrs.frozen
class PodMeta:
    """Identifies a pod."""

    name: str = ""
    namespace: str = ""
    uid: str = ""
    attempt: int = 0

    @classmethod
    def from_proto(cls, meta: hook.PodSandboxMetadata | None) -> PodMeta:
        if meta is None:
            return cls()
        return cls(name=meta.name, namespace=meta.namespace, uid=meta.uid, attempt=meta.attempt)


@attrs.frozen
class Resources:
    """A snapshot of a container's (or pod's) cgroup settings as the request carried them."""

    cpu_period: int = 0
    cpu_quota: int = 0
    cpu_shares: int = 0
    memory_limit: int = 0
    oom_score_adj: int = 0
    cpuset_cpus: str = ""
    cpuset_mems: str = ""

    @classmethod
    def from_proto(cls, res: hook.LinuxContainerResources | cri.LinuxContainerResources | None) -> Resources:
        """From the hook protocol's or the CRI's LinuxContainerResources (same fields)."""
        if res is None:
            return cls()
        return cls(
            cpu_period=res.cpu_period,
            cpu_quota=res.cpu_quota,
            cpu_shares=res.cpu_shares,
            memory_limit=res.memory_limit_in_bytes,
            oom_score_adj=res.oom_score_adj,
            cpuset_cpus=res.cpuset_cpus,
            cpuset_mems=res.cpuset_mems,
        )


@attrs.frozen
class PodInfo:
    """A pod as the hook request (or the CRI runtime, in standalone mode) describes it.

    Attributes:
        cgroup_parent: the pod's own cgroup as kubelet passes it to the runtime
            (cgroupfs ``/kubepods/besteffort/pod<uid>`` or systemd ``kubepods-…-pod<uid>.slice``).
        resources: at ``PreUpdatePodSandboxResources`` (pod-level resize), the pod resources kubelet
            asks for; at ``PostStopPodSandbox`` those of the pod's last resize (None if it was never
            resized); None at ``PreRunPodSandbox`` in CRI mode. In a container context: the pod's last
            resize's (the request's ``pod_resources``), or None.
        overhead: likewise, the pod overhead (RuntimeClass ``overhead``) sent with a resize.
    """

    meta: PodMeta = attrs.field(factory=PodMeta)
    labels: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_map)
    annotations: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_map)
    cgroup_parent: str = ""
    runtime_handler: str = ""
    resources: Resources | None = None
    overhead: Resources | None = None

    @classmethod
    def from_proto(cls, req: hook.PodSandboxHookRequest) -> PodInfo:
        return cls(
            meta=PodMeta.from_proto(req.pod_meta),
            labels=req.labels,
            annotations=req.annotations,
            cgroup_parent=req.cgroup_parent,
            runtime_handler=req.runtime_handler,
            resources=Resources.from_proto(req.resources) if req.resources is not None else None,
            overhead=Resources.from_proto(req.overhead) if req.overhead is not None else None,
        )

    @property
    def qos_class(self) -> QoSClass:
        return QoSClass.from_labels(self.labels)


@attrs.frozen
class ContainerInfo:
    """A container and the pod it belongs to. ``id`` is empty before CreateContainer answered.

    Attributes:
        cgroup_path: the container's cgroup as the runtime gave it to the OCI runtime
            (``linux.cgroupsPath``: a path, or systemd's ``<slice>:<prefix>:<id>``), when known —
            standalone mode reads it from the runtime's verbose container status; the hook
            protocol does not carry it, so "" in hook calls (the SDK then looks for the runtime's
            naming under the pod's cgroup).
    """

    pod: PodInfo
    name: str = ""
    id: str = ""
    attempt: int = 0
    annotations: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_map)
    resources: Resources = attrs.field(factory=Resources)
    envs: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_map)
    cgroup_path: str = ""

    @classmethod
    def from_proto(cls, req: hook.ContainerResourceHookRequest) -> ContainerInfo:
        pod = PodInfo(
            meta=PodMeta.from_proto(req.pod_meta),
            labels=req.pod_labels,
            annotations=req.pod_annotations,
            cgroup_parent=req.pod_cgroup_parent,
            resources=Resources.from_proto(req.pod_resources) if req.pod_resources is not None else None,
        )
        meta = req.container_meta
        return cls(
            pod=pod,
            name=meta.name if meta else "",
            id=meta.id if meta else "",
            attempt=meta.attempt if meta else 0,
            annotations=req.container_annotations,
            resources=Resources.from_proto(req.container_resources),
            envs=req.container_envs,
        )


@attrs.frozen
class ResctrlGroup:
    """Put a pod's (or container's) tasks into the resctrl group ``name`` with ``schemata``."""

    name: str
    schemata: tuple[str, ...] = ()


@attrs.define
class ResourceChanges:
    """Settings a plugin asks for (koordlet's ``Resources``); ``None`` means "leave alone".

    ``cpuset``, ``cfs_quota``, ``cpu_shares`` and ``memory_limit`` of a container go into the
    hook response (the runtime applies them); everything else is written by the executor.
    """

    cpu_shares: int | None = None
    cfs_quota: int | None = None
    cpuset: str | None = None
    memory_limit: int | None = None
    cpu_bvt: int | None = None
    cpu_idle: int | None = None
    resctrl: ResctrlGroup | None = None


@attrs.define
class PodChanges:
    """What plugins ask for at a pod-level stage.

    At ``PreUpdatePodSandboxResources`` only ``resources`` matters: its ``cpu_shares``, ``cfs_quota``,
    ``cpuset`` and ``memory_limit`` change the resources the runtime is sent (the other settings are
    written to the pod's cgroup); labels, annotations and ``cgroup_parent`` are ignored by the proxy there.
    """

    labels: dict[str, str] = attrs.Factory(dict)
    annotations: dict[str, str] = attrs.Factory(dict)
    cgroup_parent: str | None = None
    resources: ResourceChanges = attrs.Factory(ResourceChanges)


@attrs.define
class ContainerChanges:
    annotations: dict[str, str] = attrs.Factory(dict)
    resources: ResourceChanges = attrs.Factory(ResourceChanges)
    add_envs: dict[str, str] = attrs.Factory(dict)


@attrs.define
class PodContext:
    """The shared context of one pod-level hook call; plugins edit ``response``."""

    request: PodInfo
    response: PodChanges = attrs.Factory(PodChanges)


@attrs.define
class ContainerContext:
    """The shared context of one container-level hook call; plugins edit ``response``."""

    request: ContainerInfo
    response: ContainerChanges = attrs.Factory(ContainerChanges)
