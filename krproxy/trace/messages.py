"""Offline understanding of recorded CRI messages: decoding, IDs, normalisation, differences.

Nothing here runs on the proxy's request path. Messages are decoded with the generated
betterproto2 classes (:mod:`krproxy.proto.runtime.v1`) and rendered as proto-JSON-style
dicts with snake_case keys, which is what ``trace show --json`` prints and what replay compares.

IDs: a runtime assigns sandbox and container IDs, so a replay sees new ones. :class:`IdMap`
learns ``recorded -> new`` from replies (top-level ``*_id`` fields, e.g. RunPodSandbox's
``pod_sandbox_id``), :func:`rewrite_ids` substitutes the new IDs into later requests, and
:func:`normalise` maps them back in replies before comparing.

Volatile fields (:data:`VOLATILE`: timestamps, pids, addresses, usage counters, the verbose
``info`` map) differ between any two runs; normalised, a non-default value becomes
``"<volatile>"`` (a default one stays absent, so "set" vs "unset" is still compared).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import attrs
import betterproto2
from grpclib.const import Cardinality

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
    }
)

VOLATILE_MARK = "<volatile>"

Plain = dict[str, Any]


@attrs.frozen
class MethodTypes:
    """The request and reply classes of a CRI method."""

    request: type[betterproto2.Message]
    reply: type[betterproto2.Message]
    cardinality: Cardinality


@functools.cache
def _methods() -> dict[str, MethodTypes]:
    mapping = {**cri.RuntimeServiceBase().__mapping__(), **cri.ImageServiceBase().__mapping__()}
    return {
        path: MethodTypes(handler.request_type, handler.reply_type, handler.cardinality)
        for path, handler in mapping.items()
    }


def method_types(path: str) -> MethodTypes | None:
    """The message classes of ``path``; None for a method our protos do not know."""
    return _methods().get(path)


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


def _normalise_value(value: Any, back: Mapping[str, str], volatile: frozenset[str]) -> Any:
    if isinstance(value, dict):
        return {
            key: VOLATILE_MARK if key in volatile else _normalise_value(item, back, volatile)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_normalise_value(item, back, volatile) for item in value]
    if isinstance(value, str):
        return back.get(value, value)
    return value


def normalise(
    plain: Plain | None, back: Mapping[str, str] | None = None, volatile: frozenset[str] = VOLATILE
) -> Plain | None:
    """Blank volatile fields and map IDs back (``back``: target ID -> recorded ID)."""
    if plain is None:
        return None
    result: Plain = _normalise_value(plain, back or {}, volatile)
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


def differences(where: str, recorded: Any, actual: Any) -> Iterator[Difference]:
    """Every leaf where ``recorded`` and ``actual`` (plain JSON-like values) differ."""
    if isinstance(recorded, dict) and isinstance(actual, dict):
        for key in sorted(set(recorded) | set(actual)):
            yield from differences(_key(where, key), recorded.get(key), actual.get(key))
    elif isinstance(recorded, list) and isinstance(actual, list):
        for i in range(max(len(recorded), len(actual))):
            yield from differences(
                f"{where}[{i}]",
                recorded[i] if i < len(recorded) else None,
                actual[i] if i < len(actual) else None,
            )
    elif recorded != actual:
        yield Difference(where, recorded, actual)


def all_differences(pairs: Iterable[tuple[str, Any, Any]]) -> list[Difference]:
    return [d for where, recorded, actual in pairs for d in differences(where, recorded, actual)]
