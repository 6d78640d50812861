"""Offline understanding of recorded CRI messages: decoding, IDs, normalisation, differences.

Nothing here runs on the proxy's request path. Messages are decoded with the generated
betterproto2 classes (:mod:`krproxy.proto.runtime.v1`) and rendered as proto-JSON-style
dicts with snake_case keys, which is what ``trace show --json`` prints and what replay compares.

IDs: a runtime assigns sandbox and container IDs, so a replay sees new ones. :class:`IdMap`
learns ``recorded -> new`` from replies (top-level ``*_id`` fields, e.g. RunPodSandbox's
``pod_sandbox_id``), :func:`rewrite_ids` substitutes the new IDs into later requests, and
:func:`normalise` maps them back in replies before comparing.

Volatile fields (:data:`VOLATILE`: timestamps, pids, addresses, usage counters, the verbose
``info`` map; :data:`VOLATILE_FIELDS`: a metric sample's ``value``) differ between any two runs; normalised, a non-default value becomes
``"<volatile>"`` (a default one stays absent, so "set" vs "unset" is still compared); the
sample times of stats (:data:`SAMPLE_TIMES`) are removed whole.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import attrs
import betterproto2

from krproxy import protowire
from krproxy.grpcstatus import Cardinality
from krproxy.methods import Method, cri_methods
from krproxy.proto.runtime import v1 as cri

#: Field names whose values differ between runs by nature.
VOLATILE: frozenset[str] = frozenset(
    {
        "created_at",
        "started_at",
        "finished_at",
        "timestamp",
        "pid",
        "ip",
        "additional_ips",
        "info",
        "usage_core_nano_seconds",
        "usage_nano_cores",
        "working_set_bytes",
        "available_bytes",
        "usage_bytes",
        "rss_bytes",
        "page_faults",
        "major_page_faults",
        "used_bytes",
        "inodes_used",
        "inodes_free",
        "capacity_bytes",
        "swap_available_bytes",
        "swap_usage_bytes",
        "commit_memory_bytes",
        "rx_bytes",
        "rx_errors",
        "rx_packets_dropped",
        "tx_bytes",
        "tx_errors",
        "tx_packets_dropped",
        "process_count",
        "psi",
    }
)

VOLATILE_MARK = "<volatile>"

#: ``(message, field)`` -> why: volatile fields whose name is too common to blank everywhere
#: (:data:`VOLATILE` goes by name alone: ``value`` is also ``Image.uid.value``). Normalised like
#: :data:`VOLATILE` where the decoded reply's message types are known (:func:`normalise` with ``shape``).
VOLATILE_FIELDS: Mapping[tuple[str, str], str] = {
    (
        "Metric",
        "value",
    ): "a sample of a counter or gauge (CPU time, memory, network bytes): differs between runs",
}

#: Volatile down to their presence: removed from both sides, so neither value nor "set vs unset"
#: is compared. A stats sample's ``timestamp`` says when the runtime sampled, and whether it had
#: sampled yet when asked (containerd fills a writable layer's usage from a collector that runs
#: every few seconds, so the same call answers with or without it depending on timing).
SAMPLE_TIMES: frozenset[str] = frozenset({"timestamp"})

Plain = dict[str, Any]


#: The request and reply classes of a CRI method, and its cardinality.
MethodTypes = Method


def method_types(path: str) -> MethodTypes | None:
    """The message classes of ``path``; None for a method our protos do not know."""
    return cri_methods().get(path)


def is_replayable(path: str) -> bool:
    """Whether a recorded call can be sent again as one request and one reply (known unary method)."""
    types = method_types(path)
    return types is not None and types.cardinality is Cardinality.UNARY_UNARY


def decode(path: str, data: bytes | None, *, reply: bool = False) -> betterproto2.Message | None:
    """Decode a request (or reply) of ``path``; None if absent, unknown or undecodable."""
    types = method_types(path)
    if data is None or types is None:
        return None
    try:
        # betterproto2 reads bytes cut short (a varint or a field's length running past the end) as
        # the fields before the cut, or as an empty message: such bytes are no message of ``path``.
        for _ in protowire.fields(data):
            pass
    except protowire.DecodeError:
        return None
    try:
        return (types.reply if reply else types.request).parse(data)
    except Exception:  # any decoding failure means "not decodable" here
        return None


def to_plain(message: betterproto2.Message) -> Plain:
    """A message as a JSON-ready dict: snake_case keys, enums by name, int64 as strings."""
    return message.to_dict(casing=betterproto2.Casing.SNAKE)


# --- which pod and container a call is about -----------------------------------------------------


@attrs.frozen
class Subjects:
    """The sandbox and container a call concerns (empty when none or many)."""

    pod_sandbox_id: str = ""
    container_id: str = ""


def subjects(request: betterproto2.Message | None, reply: betterproto2.Message | None) -> Subjects:
    """Read the sandbox and container IDs from a call's request, or from its reply (Run/Create)."""
    pod = container = ""
    for message in (request, reply):
        if message is None:
            continue
        pod = pod or str(getattr(message, "pod_sandbox_id", "") or "")
        container = container or str(getattr(message, "container_id", "") or "")
    return Subjects(pod, container)


def pod_name(request: betterproto2.Message | None) -> str:
    """``namespace/name`` of the pod a RunPodSandbox request creates; "" for other requests."""
    config = getattr(request, "config", None)
    metadata = getattr(config, "metadata", None)
    if isinstance(request, cri.RunPodSandboxRequest) and metadata is not None:
        return f"{metadata.namespace}/{metadata.name}"
    return ""


def container_name(request: betterproto2.Message | None) -> str:
    """The name of the container a CreateContainer request creates; "" for other requests."""
    if isinstance(request, cri.CreateContainerRequest) and request.config and request.config.metadata:
        return str(request.config.metadata.name)
    return ""


# --- IDs across a replay ------------------------------------------------------------------------------


def _is_id_field(name: str) -> bool:
    return name == "id" or name.endswith("_id")


@attrs.define
class IdMap:
    """Recorded IDs and the IDs the replay target assigned instead."""

    new: dict[str, str] = attrs.field(factory=dict)

    def learn(self, recorded: betterproto2.Message | None, actual: betterproto2.Message | None) -> None:
        """Pair the top-level ID fields of a recorded reply and the target's reply."""
        if recorded is None or actual is None:
            return
        for field in dataclasses.fields(cast(Any, recorded)):
            if not _is_id_field(field.name):
                continue
            old, new = getattr(recorded, field.name), getattr(actual, field.name, None)
            if isinstance(old, str) and isinstance(new, str) and old and new and old not in self.new:
                self.new[old] = new

    def reverse(self) -> dict[str, str]:
        return {new: old for old, new in self.new.items() if new != old}


def _replace_ids(message: betterproto2.Message, mapping: Mapping[str, str]) -> bool:
    changed = False
    for field in dataclasses.fields(cast(Any, message)):
        value = getattr(message, field.name)
        if isinstance(value, betterproto2.Message):
            changed |= _replace_ids(value, mapping)
        elif isinstance(value, str):
            if _is_id_field(field.name) and value in mapping:
                setattr(message, field.name, mapping[value])
                changed = True
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, betterproto2.Message):
                    changed |= _replace_ids(item, mapping)
                elif isinstance(item, str) and field.name.endswith("_ids") and item in mapping:
                    value[i] = mapping[item]
                    changed = True
    return changed


def rewrite_ids(path: str, request: bytes, ids: IdMap) -> bytes:
    """``request`` with recorded IDs replaced by the target's; the same bytes if nothing changed."""
    if not ids.new:
        return request
    message = decode(path, request)
    if message is None or not _replace_ids(message, ids.new):
        return request
    return bytes(message)


# --- normalisation and differences -------------------------------------------------------------------


def _normalise_value(
    value: Any, back: Mapping[str, str], volatile: frozenset[str], shape: type[betterproto2.Message] | None
) -> Any:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if key in SAMPLE_TIMES:
                continue
            if key in volatile or (shape is not None and (shape.__name__, key) in VOLATILE_FIELDS):
                out[key] = VOLATILE_MARK
                continue
            child = _field_shape(shape, key)[0] if shape is not None else None
            out[key] = _normalise_value(item, back, volatile, child)
        return out
    if isinstance(value, list):
        return [_normalise_value(item, back, volatile, shape) for item in value]
    if isinstance(value, str):
        return back.get(value, value)
    return value


def normalise(
    plain: Plain | None,
    back: Mapping[str, str] | None = None,
    volatile: frozenset[str] = VOLATILE,
    shape: type[betterproto2.Message] | None = None,
) -> Plain | None:
    """Blank volatile fields and map IDs back (``back``: target ID -> recorded ID). ``shape``, the
    message class ``plain`` was made from, lets :data:`VOLATILE_FIELDS` be blanked too."""
    if plain is None:
        return None
    result: Plain = _normalise_value(plain, back or {}, volatile, shape)
    return result


def normalise_text(text: str | None, back: Mapping[str, str]) -> str | None:
    """A status message with target IDs replaced by the recorded ones."""
    if not text:
        return text
    for new, old in back.items():
        text = text.replace(new, old)
    return text


@attrs.frozen
class Difference:
    """One place where the replay's answer differs from the recorded one.

    Attributes:
        where: a path into the answer, e.g. ``reply.status.annotations["a/b"]``.
        recorded: the recorded value (None: absent).
        actual: the replayed value (None: absent).
    """

    where: str
    recorded: Any
    actual: Any

    def describe(self) -> str:
        return f"{self.where}: recorded {_show(self.recorded)}, replay {_show(self.actual)}"


def _show(value: Any) -> str:
    if value is None:
        return "(absent)"
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 200 else text[:197] + "..."


def _key(where: str, key: str) -> str:
    return f"{where}.{key}" if key.isidentifier() else f"{where}[{key!r}]"


# --- repeated fields whose order the runtime does not define ----------------------------------------


@attrs.frozen
class Unordered:
    """A repeated field of a reply compared as a multiset: its order carries no meaning.

    Attributes:
        key: dotted paths into an element whose values name it (its ID where it has one); the
            elements of each name are compared with each other. Empty for scalars: the value
            is its own name.
        why: why the order is not defined.
    """

    key: tuple[str, ...]
    why: str


_FROM_A_STORE = "the runtime lists its store (containerd: a map), in an order that changes between calls"
_BY_NAME = "one entry per name; readers look entries up by it"

#: ``(message, field)`` -> how the repeated field is compared, for every repeated field of a
#: unary reply whose order CRI does not define or gives no effect. docs/trace-format.md lists them.
UNORDERED: Mapping[tuple[str, str], Unordered] = {
    ("ListImagesResponse", "images"): Unordered(("id",), _FROM_A_STORE),
    ("ListContainersResponse", "containers"): Unordered(("id",), _FROM_A_STORE),
    ("ListPodSandboxResponse", "items"): Unordered(("id",), _FROM_A_STORE),
    ("ListContainerStatsResponse", "stats"): Unordered(("attributes.id",), _FROM_A_STORE),
    ("ListPodSandboxStatsResponse", "stats"): Unordered(("attributes.id",), _FROM_A_STORE),
    ("LinuxPodSandboxStats", "containers"): Unordered(("attributes.id",), _FROM_A_STORE),
    ("WindowsPodSandboxStats", "containers"): Unordered(("attributes.id",), _FROM_A_STORE),
    ("PodSandboxStatusResponse", "containers_statuses"): Unordered(("id",), _FROM_A_STORE),
    ("ListPodSandboxMetricsResponse", "pod_metrics"): Unordered(("pod_sandbox_id",), _FROM_A_STORE),
    ("PodSandboxMetrics", "container_metrics"): Unordered(("container_id",), _FROM_A_STORE),
    ("RestorePodResponse", "restored_containers"): Unordered(("container_id",), _FROM_A_STORE),
    ("Image", "repo_tags"): Unordered((), "the names the image store holds for the image, a set"),
    ("Image", "repo_digests"): Unordered((), "the digests the image store holds for the image, a set"),
    ("ListMetricDescriptorsResponse", "descriptors"): Unordered(("name",), _BY_NAME),
    ("PodSandboxMetrics", "metrics"): Unordered(
        ("name", "label_values"), "one sample per metric and label values, looked up by both"
    ),
    ("ContainerMetrics", "metrics"): Unordered(
        ("name", "label_values"), "one sample per metric and label values, looked up by both"
    ),
    ("RuntimeStatus", "conditions"): Unordered(("type",), "kubelet looks conditions up by type"),
    ("StatusResponse", "runtime_handlers"): Unordered(("name",), _BY_NAME + " (containerd: from a map)"),
    ("ImageFsInfoResponse", "image_filesystems"): Unordered(
        ("fs_id.mountpoint",), "one entry per file system (containerd 2.x: per snapshotter, from a map)"
    ),
    ("ImageFsInfoResponse", "container_filesystems"): Unordered(
        ("fs_id.mountpoint",), "one entry per file system (containerd 2.x: per snapshotter, from a map)"
    ),
    ("NetworkUsage", "interfaces"): Unordered(("name",), _BY_NAME),
    ("WindowsNetworkUsage", "interfaces"): Unordered(("name",), _BY_NAME),
    ("LinuxContainerResources", "hugepage_limits"): Unordered(
        ("page_size",), "one limit per page size; their order has no effect"
    ),
    ("WindowsContainerResources", "affinity_cpus"): Unordered(
        ("cpu_group",), "one mask per CPU group; their order has no effect"
    ),
    ("LinuxContainerUser", "supplemental_groups"): Unordered((), "a set of group IDs"),
}

_ECHO = "what the caller configured, in its order, and the order takes effect"

#: ``(message, field)`` -> why its order is meaningful: these repeated fields of replies stay
#: compared position by position. Every repeated field of a unary reply is in exactly one of
#: :data:`UNORDERED` and this table (a test walks the protos).
ORDERED: Mapping[tuple[str, str], str] = {
    ("ContainerStatus", "mounts"): _ECHO + ": a later mount covers an earlier one",
    ("Mount", "mount_options"): _ECHO + ": a later option overrides an earlier one",
    ("Mount", "uid_mappings"): _ECHO + ": written to the uid_map as given",
    ("Mount", "gid_mappings"): _ECHO + ": written to the gid_map as given",
    ("UserNamespace", "uids"): _ECHO + ": written to the uid_map as given",
    ("UserNamespace", "gids"): _ECHO + ": written to the gid_map as given",
    ("Metric", "label_values"): "value i belongs to the descriptor's label key i",
    ("MetricDescriptor", "label_keys"): "fixes the order of every sample's label values",
    ("PodSandboxNetworkStatus", "additional_ips"): "the runtime's order of address families (and volatile)",
}


@functools.cache
def _field_shape(shape: type[betterproto2.Message], name: str) -> tuple[Any, Unordered | None]:
    """The message class of field ``name`` of ``shape`` (elements, if repeated) and its rule."""
    proto = cast(Any, shape)._betterproto
    meta = proto.meta_by_field_name.get(name)
    if meta is None or meta.map_meta is not None:
        return None, None
    child = proto.cls_by_field.get(name)
    if not (isinstance(child, type) and issubclass(child, betterproto2.Message)):
        child = None
    rule = UNORDERED.get((shape.__name__, name)) if meta.repeated else None
    return child, rule


def _pick(element: Any, path: str) -> Any:
    for part in path.split("."):
        element = element.get(part) if isinstance(element, dict) else None
    return element


def element_name(element: Any, key: tuple[str, ...]) -> str:
    """How a difference names an element of an unordered list, e.g. ``id="sha256:1a2b"``."""
    if not key:
        return _show(element)
    return " ".join(f"{path}={_show(_pick(element, path))}" for path in key)


def _canonical(value: Any, shape: Any) -> Any:
    """``value`` with every list of :data:`UNORDERED` inside it sorted: equal multisets, equal values."""
    if isinstance(value, dict):
        result = {}
        for key, item in value.items():
            child, rule = _field_shape(shape, key) if shape is not None else (None, None)
            if rule is not None and isinstance(item, list):
                result[key] = sorted((_canonical(i, child) for i in item), key=_text)
            else:
                result[key] = _canonical(item, child)
        return result
    if isinstance(value, list):
        return [_canonical(item, shape) for item in value]
    return value


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _unordered_differences(
    where: str, recorded: list[Any], actual: list[Any], rule: Unordered, shape: Any
) -> Iterator[Difference]:
    """Elements are grouped by name; within a name, equal elements (nested unordered lists compared
    as multisets too) pair off, and the rest are compared in their order. Linear in the elements
    (plus sorting), also when many share a name."""
    groups: dict[str, tuple[list[Any], list[Any]]] = {}
    for side, items in enumerate((recorded, actual)):
        for item in items:
            groups.setdefault(element_name(item, rule.key), ([], []))[side].append(item)
    for name in sorted(groups):
        left, right = groups[name]
        if len(left) <= 1 and len(right) <= 1:  # the usual case: one element per name
            yield from differences(f"{where}[{name}]", next(iter(left), None), next(iter(right), None), shape)
            continue
        by_value: dict[str, list[int]] = {}
        for index, item in enumerate(right):
            by_value.setdefault(_text(_canonical(item, shape)), []).append(index)
        rest = []
        for item in left:
            same = by_value.get(_text(_canonical(item, shape)))
            if same:
                same.pop()
            else:
                rest.append(item)
        others = [right[index] for index in sorted(i for indices in by_value.values() for i in indices)]
        for left_item, right_item in itertools.zip_longest(rest, others):
            yield from differences(f"{where}[{name}]", left_item, right_item, shape)


def differences(
    where: str, recorded: Any, actual: Any, shape: type[betterproto2.Message] | None = None
) -> Iterator[Difference]:
    """Every leaf where ``recorded`` and ``actual`` (plain JSON-like values) differ.

    ``shape`` is the message class the values were rendered from, if known: its repeated
    fields listed in :data:`UNORDERED` are compared as multisets, element by element matched
    by name, and a difference inside an element is reported under that element's name (e.g.
    ``reply.images[id="sha256:1a2b"].size``); an element on one side only is reported whole.
    Other lists are compared position by position.
    """
    if isinstance(recorded, dict) and isinstance(actual, dict):
        for key in sorted(set(recorded) | set(actual)):
            child, rule = _field_shape(shape, key) if shape is not None else (None, None)
            left, right = recorded.get(key), actual.get(key)
            if rule is not None and isinstance(left, list | None) and isinstance(right, list | None):
                yield from _unordered_differences(_key(where, key), left or [], right or [], rule, child)
            else:
                yield from differences(_key(where, key), left, right, child)
    elif isinstance(recorded, list) and isinstance(actual, list):
        for i, (left, right) in enumerate(itertools.zip_longest(recorded, actual)):
            yield from differences(f"{where}[{i}]", left, right, shape)
    elif recorded != actual:
        yield Difference(where, recorded, actual)


def all_differences(
    pairs: Iterable[tuple[str, Any, Any, type[betterproto2.Message] | None]],
) -> list[Difference]:
    """The differences of each ``(where, recorded, actual, shape)`` (see :func:`differences`)."""
    return [
        d for where, recorded, actual, shape in pairs for d in differences(where, recorded, actual, shape)
    ]
