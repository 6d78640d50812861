"""Required hook servers: which servers a CRI call needs, and what is said when one is missing (pure).

Two sources say a hook server is required:

- the operator, with ``--required-hook-server NAME[=Point,Point...]`` (:func:`parse_required_server`):
  NAME is the registration file's name without ``.json``; without points, every hook point;
- the pod, with NRI's annotation ``required-plugins.noderesource.dev`` (a list of names), in NRI's three
  forms (:func:`effective_annotation`): ``<key>/container.<name>`` for one container, else
  ``<key>/pod`` or the bare ``<key>`` for the whole pod. krproxy requires the pod-scoped names at
  PreRunPodSandbox and the effective names of a container at PreCreateContainer (NRI checks only
  container creation).

A pod or container carrying the tolerate-missing annotation (NRI's ``tolerate_missing_plugins_annotation``
setting names its key; no key: none) with a true value (Go's ``strconv.ParseBool`` spellings) needs no
required server at all, as under NRI's default validator.

:func:`required_names` decides; the I/O around it (probing, waiting, answering UNAVAILABLE) is
:mod:`krproxy.hooks.guard`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Collection, Iterable, Mapping, Sequence

import attrs

from krproxy.hooks.points import HookPoint

__all__ = [
    "DEFAULT_STARTUP_GRACE",
    "MAX_ANNOTATED_NAMES",
    "MAX_NAME_BYTES",
    "NOTHING_NEEDED",
    "REQUIRED_PLUGINS_ANNOTATION",
    "AnnotationError",
    "Availability",
    "Needed",
    "RequiredServer",
    "Requirements",
    "State",
    "effective_annotation",
    "hooked_names",
    "missing_message",
    "needed",
    "parse_bool",
    "parse_name_list",
    "parse_required_server",
    "required_names",
    "tolerates_missing",
]

#: NRI's annotation naming the plugins a pod or container requires (nri pkg/plugin RequiredPluginsAnnotation).
REQUIRED_PLUGINS_ANNOTATION = "required-plugins.noderesource.dev"

#: Most hook server names one annotation may list: a pod needing more is refused (INVALID_ARGUMENT), so
#: one call never has krproxy probe and track thousands of names.
MAX_ANNOTATED_NAMES = 32
#: Longest hook server name an annotation may list, in bytes: a registration file's name is the hook
#: server's name plus ``.json``, at most 255 bytes (NAME_MAX), so a longer name can never be registered.
MAX_NAME_BYTES = 250

#: Seconds after start during which a call at a required point waits for a missing required server
#: instead of failing at once: long enough for a hook server that survived krproxy's restart to be
#: found and probed (milliseconds), short enough that kubelet's call (2 min deadline) is not held long.
DEFAULT_STARTUP_GRACE = 10.0


class AnnotationError(ValueError):
    """A pod's required-plugins or tolerate-missing annotation does not parse; the message says how to fix it."""


@attrs.frozen
class RequiredServer:
    """One ``--required-hook-server``: the hook server ``name`` must be there at each of ``points``."""

    name: str
    points: frozenset[HookPoint] = frozenset(HookPoint)

    def describe(self) -> str:
        if self.points == frozenset(HookPoint):
            return self.name
        return f"{self.name}=" + ",".join(p.value for p in HookPoint if p in self.points)


def parse_required_server(text: str) -> RequiredServer:
    """``NAME`` or ``NAME=Point,Point``, as given to ``--required-hook-server``.

    Raises:
        ValueError: an empty name, a name with ``/`` or ending in ``.json``, or an unknown or empty point
            list; the message says what is wrong and what would be right.
    """
    name, sep, points_text = text.partition("=")
    name = name.strip()
    if not name:
        raise ValueError(
            f"{text!r} has an empty name; give the registration file's name without .json, e.g. koordlet"
        )
    if "/" in name or name.endswith(".json") or name.startswith("."):
        raise ValueError(
            f"{name!r} is not a registration name: give the file's name without directory and without "
            f".json (koordlet for /etc/runtime/hookserver.d/koordlet.json)"
        )
    if not sep:
        return RequiredServer(name)
    points: set[HookPoint] = set()
    for item in points_text.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"{text!r}: empty hook point; write NAME=PreRunPodSandbox,PreCreateContainer")
        point = HookPoint.from_name(item)
        if point is None:
            known = ", ".join(p.value for p in HookPoint)
            raise ValueError(f"{text!r}: unknown hook point {item!r} (known: {known})")
        points.add(point)
    return RequiredServer(name, frozenset(points))


def _merged(servers: Iterable[RequiredServer]) -> tuple[RequiredServer, ...]:
    """One entry per name (points of repeated flags added up), in first-seen order."""
    points: dict[str, frozenset[HookPoint]] = {}
    for server in servers:
        points[server.name] = points.get(server.name, frozenset()) | server.points
    return tuple(RequiredServer(name, p) for name, p in points.items())


@attrs.frozen
class Requirements:
    """What the daemon's flags say about required hook servers.

    Attributes:
        servers: the ``--required-hook-server`` flags, one per name.
        annotation: the annotation key pods name required servers with; empty: annotations are ignored.
        tolerate_annotation: the annotation key that exempts a pod or container; empty: none does.
        startup_grace: seconds after start during which a call waits for a missing required server.
    """

    servers: tuple[RequiredServer, ...] = attrs.field(default=(), converter=_merged)
    annotation: str = REQUIRED_PLUGINS_ANNOTATION
    tolerate_annotation: str = ""
    startup_grace: float = attrs.field(default=DEFAULT_STARTUP_GRACE, validator=attrs.validators.ge(0))

    @property
    def active(self) -> bool:
        """Whether anything can ever be required (else the guard has nothing to do)."""
        return bool(self.servers) or bool(self.annotation)


def effective_annotation(annotations: Mapping[str, str], key: str, container: str | None) -> str | None:
    """The value of annotation *key* for *container* (None: for the pod), NRI's way: the
    ``<key>/container.<name>`` form first, then ``<key>/pod``, then ``<key>``; None if none is set."""
    keys = [f"{key}/container.{container}"] if container is not None else []
    for candidate in [*keys, f"{key}/pod", key]:
        value = annotations.get(candidate)
        if value is not None:
            return value
    return None


_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


def parse_bool(value: str) -> bool | None:
    """Go's ``strconv.ParseBool``: the spellings NRI accepts for the tolerate annotation; None for others."""
    return True if value in _TRUE else False if value in _FALSE else None


def _unquote(item: str) -> str:
    if len(item) >= 2 and item[0] == item[-1] and item[0] in "\"'":
        return item[1:-1]
    return item


def parse_name_list(value: str) -> tuple[str, ...] | None:
    """The plugin names of a required-plugins annotation, or None if *value* is not a list of names.

    NRI reads the value as YAML into a list of strings, so besides JSON (``["a", "b"]``) a YAML flow
    list (``[ a, b ]``) and a block list (``- a`` lines) are accepted; empty, ``null`` and ``~`` are no
    names. Names may not contain commas, brackets or quotes.
    """
    text = value.strip()
    if text in ("", "null", "~", "[]"):
        return ()
    try:
        document = json.loads(text)
    except ValueError:
        document = None
    else:
        if isinstance(document, list) and all(isinstance(n, str) and n for n in document):
            return tuple(document)
        return None
    if text.startswith("[") and text.endswith("]"):
        items = [_unquote(i.strip()) for i in text[1:-1].split(",")]
    elif text.startswith("-"):
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not all(line.startswith("- ") or line == "-" for line in lines):
            return None
        items = [_unquote(line[1:].strip()) for line in lines]
    else:
        return None
    if not all(items) or any(c in i for i in items for c in "[]{},\"'"):
        return None
    return tuple(items)


def _annotated(annotations: Mapping[str, str], key: str, container: str | None) -> tuple[str, ...]:
    value = effective_annotation(annotations, key, container)
    if value is None:
        return ()
    names = parse_name_list(value)
    if names is None:
        raise AnnotationError(
            f"annotation {key} {value!r} is not a list of hook server names; "
            f"write a JSON list such as '[\"koordlet\"]'"
        )
    names = tuple(dict.fromkeys(names))
    if len(names) > MAX_ANNOTATED_NAMES:
        raise AnnotationError(
            f"annotation {key} lists {len(names)} hook servers; at most {MAX_ANNOTATED_NAMES} are accepted "
            f"(list only the hook servers this pod cannot run without)"
        )
    for name in names:
        try:
            size = len(name.encode())
        except UnicodeEncodeError:  # JSON's \u escape of half a surrogate pair: no file or message holds it
            raise AnnotationError(
                f"annotation {key} lists a hook server name that is not valid UTF-8 ({name[:40]!r}); write "
                f"its characters, or both halves of a \\u surrogate pair"
            ) from None
        if size > MAX_NAME_BYTES:
            raise AnnotationError(
                f"annotation {key} lists a hook server name of {size} bytes ({name[:40]!r}...); "
                f"a registration file's name is at most {MAX_NAME_BYTES} bytes before .json"
            )
    return names


def _mentions(annotations: Mapping[str, str], key: str) -> bool:
    """Whether *annotations* hold any form :func:`effective_annotation` reads of *key* (empty: none)."""
    if not key:
        return False
    prefix = key + "/"
    return any(name == key or name.startswith(prefix) for name in annotations)


def tolerates_missing(annotations: Mapping[str, str], key: str, container: str | None) -> bool:
    """Whether the tolerate-missing annotation *key* (empty: none) exempts the pod or container.

    Raises:
        AnnotationError: the value is not a boolean.
    """
    if not key:
        return False
    value = effective_annotation(annotations, key, container)
    if value is None:
        return False
    flag = parse_bool(value)  # as NRI's validator: strconv.ParseBool, no surrounding space allowed
    if flag is None:
        raise AnnotationError(f'annotation {key} {value!r} is not a boolean; write "true" or "false"')
    return flag


def required_names(
    requirements: Requirements, point: HookPoint, annotations: Mapping[str, str], container: str | None
) -> tuple[str, ...]:
    """The hook servers a call at *point* needs, flags' first, without repeats.

    *annotations* are the pod's; *container* is the container's name at a container's hook point, None
    at a pod's. Annotated names count at PreRunPodSandbox (pod-scoped forms) and PreCreateContainer
    (the container's effective form); the tolerate-missing annotation, when true, clears everything.

    Raises:
        AnnotationError: an annotation that matters here does not parse (the pod must not slip through
            because its requirement is misspelt, as under NRI, which fails the container too).
    """
    if tolerates_missing(annotations, requirements.tolerate_annotation, container):
        return ()
    names = [s.name for s in requirements.servers if point in s.points]
    if requirements.annotation and point in (HookPoint.PRE_RUN_POD_SANDBOX, HookPoint.PRE_CREATE_CONTAINER):
        scope = None if point is HookPoint.PRE_RUN_POD_SANDBOX else container
        names += _annotated(annotations, requirements.annotation, scope)
    return tuple(dict.fromkeys(names))


def hooked_names(
    requirements: Requirements, point: HookPoint, annotations: Mapping[str, str], container: str | None
) -> tuple[str, ...]:
    """Those of :func:`required_names` that must be *called* at *point*, not only be up: servers whose
    ``--required-hook-server`` lists *point* by name, and the names a container's annotation requires at
    PreCreateContainer (NRI's validator refuses a container that a required plugin did not process). A
    server flagged without points is required wherever its registration file has it called, and a pod's
    names at PreRunPodSandbox only need to be up (NRI never sees that point).

    Raises:
        AnnotationError: as :func:`required_names`.
    """
    if tolerates_missing(annotations, requirements.tolerate_annotation, container):
        return ()
    every = frozenset(HookPoint)
    names = [s.name for s in requirements.servers if point in s.points and s.points != every]
    if requirements.annotation and point is HookPoint.PRE_CREATE_CONTAINER:
        names += _annotated(annotations, requirements.annotation, container)
    return tuple(dict.fromkeys(names))


@attrs.frozen
class Needed:
    """The required hook servers of one call at one hook point.

    Attributes:
        names: must be registered and answering (:func:`required_names`); one failing the call refuses it.
        hooked: of those, the ones that must be registered for the point itself (:func:`hooked_names`).
    """

    names: tuple[str, ...] = ()
    hooked: tuple[str, ...] = ()


#: A call that needs no hook server.
NOTHING_NEEDED = Needed()


def needed(
    requirements: Requirements,
    point: HookPoint,
    annotations: Mapping[str, str],
    container: str | None,
    *,
    met: Collection[str] = (),
) -> Needed:
    """:func:`required_names` and :func:`hooked_names` of one call, less the names in *met* (krproxy's
    own NRI plugin name, in NRI mode).

    Raises:
        AnnotationError: as :func:`required_names`.
    """
    tolerate = requirements.tolerate_annotation
    if not requirements.servers and not (
        _mentions(annotations, requirements.annotation) or (tolerate and _mentions(annotations, tolerate))
    ):
        return NOTHING_NEEDED  # the usual call: no flag, no annotation of ours (one pass over the keys)
    names = required_names(requirements, point, annotations, container)
    hooked = hooked_names(requirements, point, annotations, container)
    return Needed(tuple(n for n in names if n not in met), tuple(n for n in hooked if n not in met))


class State(enum.Enum):
    """Where a required hook server stands, as last probed."""

    UNKNOWN = "not probed yet"
    MISSING = "not registered"
    UNREACHABLE = "registered but its socket is unreachable"
    NOT_ANSWERING = "registered but not answering"
    NOT_HOOKED = "registered, but not for this hook point"
    UP = "registered and answering"


@attrs.frozen
class Availability:
    """A required server's state and the detail that goes into messages (the file, socket or cause)."""

    state: State = State.UNKNOWN
    detail: str = ""

    @property
    def up(self) -> bool:
        return self.state is State.UP

    def describe(self) -> str:
        return f"{self.state.value} ({self.detail})" if self.detail else self.state.value


def missing_message(point: HookPoint, missing: Sequence[tuple[str, Availability]]) -> str:
    """The UNAVAILABLE message for a call held back at *point* (kubelet shows it in the pod's events)."""
    what = "; ".join(f"required hook server {name} is {a.describe()}" for name, a in missing)
    return (
        f"{what}: {point.value} needs it, so the call was not forwarded to the runtime; "
        "kubelet's retry goes through once it is registered and answering"
    )
