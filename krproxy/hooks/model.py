"""Frozen domain records for runtime hooks: what the proxy knows about a pod or a container.

These records are the sans-I/O core's vocabulary: what is known (:class:`PodInfo`, :class:`ContainerInfo`,
:class:`PodResize`) and what a hook server answered (:class:`PodAnswer`, :class:`ContainerAnswer`). They never
hold wire (betterproto2, upb) objects; wire messages are read into records by :mod:`krproxy.hooks.convert` and
records written into CRI requests by :mod:`krproxy.hooks.writeback` (betterproto2) and
:mod:`krproxy.hooks.rewrite` (upb).

Immutable mappings: every string map (labels, annotations, envs, cgroup v2 ``unified``) is a
:class:`FrozenMap` — a read-only, *hashable*, insertion-ordered ``Mapping``. Hashable so that records stay
usable as set members and dict keys (attrs frozen classes hash their fields); insertion-ordered so that an
environment keeps the order kubelet sent it in (see :func:`krproxy.hooks.merge.create_envs`). Equality
ignores order, like ``dict``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from typing import Any, Generic, TypeVar, final, overload

import attrs

__all__ = [
    "RESOURCE_SCALARS",
    "RESOURCE_STRINGS",
    "ContainerAnswer",
    "ContainerInfo",
    "FrozenMap",
    "PodAnswer",
    "PodInfo",
    "PodResize",
    "Resources",
    "evolve",
    "json_int",
    "json_str",
    "resource_scalar",
    "to_frozen_map",
]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
T = TypeVar("T")
R = TypeVar("R")


@final
class FrozenMap(Mapping[K, V], Generic[K, V]):
    """A read-only, hashable mapping that remembers insertion order.

    Strictly read-only: there is no way to change one after construction; :meth:`merged` returns a new one.
    Hashing requires hashable values.
    """

    __slots__ = ("_data", "_hash")

    _data: dict[K, V]
    _hash: int | None

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        self._data = dict(items)
        self._hash = None

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is FrozenMap:  # (the class is final: this is isinstance, without its call)
            return self._data == other._data
        if isinstance(other, Mapping):
            return self._data == dict(other.items())
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"

    def __contains__(self, key: object) -> bool:
        return key in self._data

    @overload
    def get(self, key: K, /) -> V | None: ...
    @overload
    def get(self, key: K, default: V | T, /) -> V | T: ...
    def get(self, key: K, default: object = None, /) -> object:
        """The dict's own ``get`` (Mapping's is two Python calls: itself and ``__getitem__``)."""
        return self._data.get(key, default)

    def keys(self) -> KeysView[K]:
        """The dict's own view (``dict(frozen_map)`` reads it)."""
        return self._data.keys()

    def items(self) -> ItemsView[K, V]:
        """The dict's own view (Mapping's would look each key up again)."""
        return self._data.items()

    def values(self) -> ValuesView[V]:
        """The dict's own view (Mapping's iterates the keys and looks each one up)."""
        return self._data.values()

    def merged(self, *others: Mapping[K, V]) -> FrozenMap[K, V]:
        """Return a copy with every key of *others* added or overwritten, in order (Koordinator's MergeMap)."""
        data = dict(self._data)
        for other in others:
            data.update(other._data if isinstance(other, FrozenMap) else other)
        return FrozenMap(data)


@overload
def to_frozen_map(value: None) -> FrozenMap[str, str]: ...
@overload
def to_frozen_map(value: Mapping[K, V] | Iterable[tuple[K, V]]) -> FrozenMap[K, V]: ...
def to_frozen_map(
    value: Mapping[K, V] | Iterable[tuple[K, V]] | None,
) -> FrozenMap[K, V] | FrozenMap[str, str]:
    """Converter: ``None`` → empty map; a FrozenMap is returned as is; anything else is copied."""
    if value is None:
        return FrozenMap()
    if isinstance(value, FrozenMap):
        return value
    return FrozenMap(value)


def _str_map(value: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> FrozenMap[str, str]:
    """The records' converter: :func:`to_frozen_map` written out (it runs for every map of every record
    built, several per hooked call; a FrozenMap, the usual value, is returned at the first test)."""
    if value.__class__ is FrozenMap:
        return value
    return FrozenMap() if value is None else FrozenMap(value)


def _hugepages(value: Iterable[tuple[str, int]] | None) -> tuple[tuple[str, int], ...]:
    if not value:  # none, the usual case: no generator to make
        return ()
    return tuple((str(size), int(limit)) for size, limit in value)


@attrs.frozen
class Resources:
    """Linux cgroup settings of a container (or pod), as CRI's ``LinuxContainerResources``.

    Zero and ``""`` mean "not set", except ``cpu_quota`` −1 (unlimited) and ``oom_score_adj`` where 0 is a value.

    Attributes:
        hugepage_limits: ``(page_size, limit)`` pairs in request order, e.g. ``(("2MB", 1 << 30),)``.
        unified: cgroup v2 ``unified`` key/values.
    """

    cpu_period: int = 0
    cpu_quota: int = 0
    cpu_shares: int = 0
    memory_limit_in_bytes: int = 0
    oom_score_adj: int = 0
    cpuset_cpus: str = ""
    cpuset_mems: str = ""
    hugepage_limits: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=_hugepages)
    unified: FrozenMap[str, str] = attrs.field(factory=FrozenMap, converter=_str_map)
    memory_swap_limit_in_bytes: int = 0


#: The fields of :class:`Resources` that hold one value (all but ``hugepage_limits`` and ``unified``), in the
#: order of CRI's message; the wire messages (CRI and hook protocol) use the same names.
RESOURCE_SCALARS = (
    "cpu_period",
    "cpu_quota",
    "cpu_shares",
    "memory_limit_in_bytes",
    "oom_score_adj",
    "cpuset_cpus",
    "cpuset_mems",
    "memory_swap_limit_in_bytes",
)
#: The fields of :data:`RESOURCE_SCALARS` that hold a string (Linux cpu lists), in the same order; the
#: others hold an int.
RESOURCE_STRINGS = ("cpuset_cpus", "cpuset_mems")


def json_int(value: object) -> int:
    """A JSON value read as an int: itself if it is one (not a bool), else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def json_str(value: object) -> str:
    """A JSON value read as a str: itself if it is one, else ``""``."""
    return value if isinstance(value, str) else ""


def resource_scalar(name: str, value: object) -> Any:
    """A value read from JSON (a Go-JSON CRI message, a Docker HostConfig) as the :class:`Resources` field
    *name* holds it: a str for a cpuset, an int (not a bool) for the others. Anything else (absent, null,
    another JSON type) reads as the field's zero: a malformed document costs that field, not the record.
    (Typed ``Any``, not ``int | str``: which of the two depends on *name*, so ``Resources(**…)`` takes it.)"""
    return json_str(value) if name in RESOURCE_STRINGS else json_int(value)


@attrs.frozen
class PodInfo:
    """What the proxy remembers about a pod sandbox (Koordinator's ``PodSandboxInfo``).

    Attributes:
        resources: pod-level resources; ``None`` in CRI mode (the reference only fills it for Docker) until a
            pod-level resize (UpdatePodSandboxResources) set them.
        overhead: pod overhead; ``None`` in CRI mode, likewise.
    """

    name: str = ""
    uid: str = ""
    namespace: str = ""
    attempt: int = 0
    runtime_handler: str = ""
    labels: FrozenMap[str, str] = attrs.field(factory=FrozenMap, converter=_str_map)
    annotations: FrozenMap[str, str] = attrs.field(factory=FrozenMap, converter=_str_map)
    cgroup_parent: str = ""
    resources: Resources | None = None
    overhead: Resources | None = None

    def has_label(self, key: str, value: str) -> bool:
        """Whether the pod carries label *key* with exactly *value* (used for the skip-hookserver opt-out)."""
        return self.labels.get(key) == value

    def named_otherwise(self, name: str, namespace: str, uid: str | None) -> bool:
        """Whether a CreateContainer's ``sandbox_config`` naming (*name*, *namespace*, *uid*) names another pod
        than this one: containerd writes those into the container's spec. Empty names (a config without
        metadata) name no pod; a *uid* of None (a spec without it) is not compared."""
        if not (name or namespace or uid):
            return False
        return not (name == self.name and namespace == self.namespace and uid in (None, self.uid))


@attrs.frozen
class ContainerInfo:
    """What the proxy remembers about a container (Koordinator's ``ContainerInfo``).

    Attributes:
        pod_sandbox_id: the sandbox the container belongs to.
        pod: the pod's record as it was when the container was created (gives the hook request's
            ``pod_meta``, ``pod_labels``, ``pod_annotations`` and ``pod_resources``).
        id: the runtime's container id; ``""`` before CreateContainer returned.
        resources: ``None`` when unknown (recovered from a runtime that does not report them).
        envs: environment, one value per name (later duplicates win), in first-seen order.
        pod_cgroup_parent: the pod's cgroup parent as seen by this container (CreateContainer's
            ``sandbox_config.linux.cgroup_parent``; a plugin may change it).
    """

    pod_sandbox_id: str = ""
    pod: PodInfo = attrs.field(factory=PodInfo)
    name: str = ""
    attempt: int = 0
    id: str = ""
    annotations: FrozenMap[str, str] = attrs.field(factory=FrozenMap, converter=_str_map)
    resources: Resources | None = None
    envs: FrozenMap[str, str] = attrs.field(factory=FrozenMap, converter=_str_map)
    pod_cgroup_parent: str = ""


@attrs.frozen
class PodResize:
    """A pod-level resize (CRI ``UpdatePodSandboxResources``) as PreUpdatePodSandboxResources hooks see it.

    Its own record type, not a :class:`PodInfo`, because an answer to it may change other things than a
    PreRunPodSandbox answer may (only ``resources``; see :func:`krproxy.hooks.merge.merge_pod_resize`).

    Attributes:
        pod_sandbox_id: the sandbox being resized.
        pod: the stored pod, with ``resources`` and ``overhead`` set to the ones requested (``None`` where the
            request carries none).
    """

    pod_sandbox_id: str
    pod: PodInfo


@attrs.frozen
class PodAnswer:
    """A hook server's answer at a pod hook point (the hook protocol's ``PodSandboxHookResponse``).

    What an answer leaves out changes nothing: the maps add or overwrite keys, an empty ``cgroup_parent``
    keeps the pod's, and ``resources`` is ``None`` when the answer carries none (the wire field has presence).
    Which fields a hook point applies: :func:`krproxy.hooks.merge.merge_pod_info` and
    :func:`krproxy.hooks.merge.merge_pod_resize`.
    """

    labels: FrozenMap[str, str] = attrs.field(factory=FrozenMap, converter=_str_map)
    annotations: FrozenMap[str, str] = attrs.field(factory=FrozenMap, converter=_str_map)
    cgroup_parent: str = ""
    resources: Resources | None = None


@attrs.frozen
class ContainerAnswer:
    """A hook server's answer at a container hook point (the hook protocol's ``ContainerResourceHookResponse``;
    its ``container_annotations``, ``container_resources`` and ``container_envs`` are ``annotations``,
    ``resources`` and ``envs`` here).

    As :class:`PodAnswer`: ``resources`` is ``None`` when the answer carries none, an empty
    ``pod_cgroup_parent`` keeps the container's, and an empty ``envs`` keeps the environment (proto3 cannot
    tell an empty map from an absent one). See :func:`krproxy.hooks.merge.merge_container_info`.
    """

    annotations: FrozenMap[str, str] = attrs.field(factory=FrozenMap, converter=_str_map)
    resources: Resources | None = None
    pod_cgroup_parent: str = ""
    envs: FrozenMap[str, str] = attrs.field(factory=FrozenMap, converter=_str_map)


#: Per record class: its fields' names and a reader of all their values at once (see :func:`evolve`).
_FIELDS: dict[type, tuple[tuple[str, ...], Callable[[Any], Any]]] = {}


def _fields_of(cls: type) -> tuple[tuple[str, ...], Callable[[Any], Any]]:
    fields = attrs.fields(cls)
    if len(fields) < 2 or not all(f.init and f.alias == f.name for f in fields):
        raise TypeError(f"{cls.__name__} is not a record of krproxy.hooks.model")
    names = tuple(f.name for f in fields)
    return names, operator.attrgetter(*names)


def evolve(record: R, **changes: Any) -> R:
    """``attrs.evolve`` for the records of this module: a copy of *record* with *changes* (field names; an
    unknown one raises TypeError, as attrs').

    The same result at a third of the calls: every field is read by one ``attrgetter`` made once per class,
    not ``attrs.fields`` and a ``getattr`` a field (about 18 calls a record with attrs'); the merge and the
    store make several copies on every hooked call. For records only, whose fields are all public and
    passed to ``__init__`` by their names (checked when a class is first seen).
    """
    cls: Any = record.__class__
    known = _FIELDS.get(cls)
    if known is None:
        known = _FIELDS[cls] = _fields_of(cls)
    names, read = known
    values = dict(zip(names, read(record), strict=True))
    values.update(changes)
    return cls(**values)  # type: ignore[no-any-return]
