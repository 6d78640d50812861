"""Plugin registration files (``hookserver.d/*.json``): parsing, validation, and the :class:`Registry` value.

A file registers one hook server (plugin). Keys (koord-runtime-proxy's, plus two of ours):

``remote-endpoint`` (required)
    The plugin's unix socket path, with or without ``unix://`` (``unix:`` also accepted). Must be absolute.
    Without one (missing, empty, relative, another scheme such as ``tcp://``) the plugin is registered
    unusable, with a warning: each call to it fails, and its failure-policy says what the CRI call does,
    as koord-runtime-proxy's failed dial does (:attr:`PluginRegistration.unusable`).
``failure-policy``
    ``Fail`` or ``Ignore`` (the value case-sensitive); absent, ``null`` or ``""`` means Ignore. *Stricter
    than the reference*, which treats every unknown string as Ignore: a typo such as ``"fail"`` must not
    turn a Fail plugin into an Ignore one, so an unknown string is read as Fail, with a warning. (Refusing
    the file would be worse than either: its plugin never called at all.)
``runtime-hooks``
    Hook names (:class:`~krproxy.hooks.points.HookPoint` values). A name koordlet knows but no proxy calls
    (``PreRemoveRunPodSandbox``, see :data:`~krproxy.hooks.points.UNSUPPORTED_HOOK_NAMES`) is accepted with a
    warning and never called, so koordlet's real files load; any other unknown name (a newer koordlet's, a
    typo) too, as the reference never calls it either, with a warning naming it: refusing the file would
    leave the plugin's other hooks uncalled.
    Absent or empty is allowed, with a warning: the plugin is registered but never called (koordlet writes
    the list of its enabled stages, which can be empty). Duplicates are ignored.
``timeout`` (ours)
    Per-call deadline: a number of seconds or a Go-style duration string (``"2s"``, ``"500ms"``, ``"1m30s"``).
    Default 2 s; must be > 0 and ≤ 5 min. (The reference has no per-hook timeout.)
``order`` (ours)
    Integer priority, default 0. Plugins registered for the same hook are called in ascending
    ``(order, file name)`` order, each seeing the previous one's result.

The bytes are read as koord-runtime-proxy's Go decoder reads them, so that a file registers the same
plugin for both (:mod:`krproxy.gojson`): keys fold as Go folds names (``Failure-Policy`` is
``failure-policy``), a key given twice counts by its last value (a ``null`` leaves a string or number
as it was), and what Go refuses (a wrong type under any spelling, a BOM, UTF-16, ``NaN``) is an error.
Other keys are ignored with a warning (forward compatibility). Every problem raises
:class:`RegistrationError`; nothing else escapes :func:`parse_registration`, whatever the bytes.

Which files count (:func:`is_registration_file`): names ending in ``.json`` that do not start with ``.``
(editor swap/temp files such as ``.koordlet.json.swp`` or ``.koordlet.json`` written-then-renamed are skipped).
The reference takes every name ending in ``json`` (``HasSuffix "json"``, so ``foojson`` too); we require the dot.
"""

from __future__ import annotations

import enum
import json
import math
import posixpath
import re
from typing import Any

import attrs

from krproxy import gojson
from krproxy.hooks.model import FrozenMap
from krproxy.hooks.points import UNSUPPORTED_HOOK_NAMES, HookPoint

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_TIMEOUT",
    "FailurePolicy",
    "PluginRegistration",
    "RegistrationError",
    "Registry",
    "is_registration_file",
    "parse_duration",
    "parse_registration",
]

#: Per-call deadline when a file sets none: well under kubelet's 2 min runtime-request-timeout, and ample
#: for koordlet, which answers in milliseconds.
DEFAULT_TIMEOUT = 2.0
#: Upper bound for ``timeout``: beyond this kubelet's own deadline would fire first anyway.
MAX_TIMEOUT = 300.0

_KNOWN_KEYS = ("remote-endpoint", "failure-policy", "runtime-hooks", "timeout", "order")
#: Each known key by its folded name (:func:`krproxy.gojson.fold_name`).
_FOLDED_KEYS = {gojson.fold_name(key): key for key in _KNOWN_KEYS}
#: The types koord-runtime-proxy's ``RuntimeHookConfig`` decodes each of its keys into (ours are ours).
_GO_TYPES: dict[str, type] = {"remote-endpoint": str, "failure-policy": str, "runtime-hooks": list}
_GO_KINDS = {
    "remote-endpoint": "a string",
    "failure-policy": "a string",
    "runtime-hooks": "an array of hook names",
}
_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION_PART = r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)"
_DURATION = re.compile(f"(?:{_DURATION_PART})+")


class RegistrationError(Exception):
    """A registration file is malformed; the message names the file and the problem."""

    def __init__(self, file: str, problem: str) -> None:
        super().__init__(f"{file}: {problem}")
        self.file = file
        self.problem = problem


class FailurePolicy(enum.Enum):
    """What a failing pre hook does to the CRI call: FAIL rejects it, IGNORE logs and goes on unmodified."""

    FAIL = "Fail"
    IGNORE = "Ignore"


@attrs.frozen
class PluginRegistration:
    """One valid registration file.

    Attributes:
        name: the file name without ``.json`` (``koordlet`` for ``hookserver.d/koordlet.json``).
        file: the file as given to :func:`parse_registration` (the :class:`Registry` key).
        endpoint: absolute unix socket path (``unix://`` stripped); as written if :attr:`unusable`.
        unusable: why no socket can be dialed at ``remote-endpoint`` (missing, another scheme, relative),
            or None. Such a plugin is registered and each call to it fails as an unreachable server's
            (:mod:`krproxy.hooks.dispatch`), as koord-runtime-proxy's calls to it fail: refusing its file
            would let calls a Fail plugin should hold pass unhooked.
        hooks: the hook points to call, in file order.
        timeout: per-call deadline in seconds.
        order: priority; plugins run in ascending ``(order, file name)``.
        warnings: notes about accepted oddities (unknown keys, unsupported hook names, no hooks).
    """

    name: str
    file: str
    endpoint: str
    failure_policy: FailurePolicy = FailurePolicy.IGNORE
    hooks: tuple[HookPoint, ...] = ()
    timeout: float = DEFAULT_TIMEOUT
    order: int = 0
    warnings: tuple[str, ...] = ()
    unusable: str | None = None

    @property
    def sort_key(self) -> tuple[int, str, str]:
        """The ordering key among plugins: ``(order, file name, file)``."""
        return (self.order, posixpath.basename(self.file), self.file)

    def handles(self, point: HookPoint) -> bool:
        """Whether this plugin registered *point*."""
        return point in self.hooks


def is_registration_file(file: str) -> bool:
    """Whether a directory entry named *file* (a name or a path) is a registration file."""
    name = posixpath.basename(file)
    return name.endswith(".json") and not name.startswith(".") and name != ".json"


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def parse_duration(value: str) -> float | None:
    """Seconds in a Go-style duration string (``"2s"``, ``"500ms"``, ``"1m30s"``), or None if it is not one."""
    if not _DURATION.fullmatch(value):
        return None
    return sum(float(number) * _DURATION_UNITS[unit] for number, unit in re.findall(_DURATION_PART, value))


def _endpoint(value: object) -> tuple[str, str | None]:
    """The socket path of *value* (a string or None, :func:`_fields`), and None; or *value* as it is and
    why no unix socket can be dialed there."""
    if value is None:
        return "", "remote-endpoint is missing"
    assert isinstance(value, str)
    if not value:
        return value, "remote-endpoint is empty"
    if value.startswith("unix://"):
        path = value.removeprefix("unix://")
    elif value.startswith("unix:"):
        path = value.removeprefix("unix:")
    elif "://" in value or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", value):
        return value, f"remote-endpoint {value!r} is not a unix socket (only unix:// is supported)"
    else:
        path = value
    if not path:
        return value, f"remote-endpoint {value!r} has an empty socket path"
    if not path.startswith("/"):
        return value, f"remote-endpoint {value!r} is not an absolute socket path"
    if "\0" in path:
        return value, f"remote-endpoint {value!r} contains a NUL character"
    return path, None


def _failure_policy(value: object, warnings: list[str]) -> FailurePolicy:
    """The policy; *value* is a string or None (:func:`_fields`). An unknown string is read as Fail."""
    if value is None or value == "":
        return FailurePolicy.IGNORE
    assert isinstance(value, str)
    try:
        return FailurePolicy(value)
    except ValueError:
        warnings.append(
            f"failure-policy {json.dumps(value)} is not Fail or Ignore: read as Fail (a call fails when this "
            "hook server does; koord-runtime-proxy reads it as Ignore): write Fail or Ignore"
        )
        return FailurePolicy.FAIL


def _hooks(file: str, value: object, warnings: list[str]) -> tuple[HookPoint, ...]:
    """The hook points; *value* is a list or None (:func:`_fields`)."""
    if value is None:
        warnings.append("runtime-hooks is missing: the plugin is never called")
        return ()
    assert isinstance(value, list)
    points: dict[HookPoint, None] = {}
    for item in value:
        if item is None:  # (Go reads it as "", a hook no proxy calls)
            warnings.append("runtime-hooks: null is no hook name and is ignored")
            continue
        if not isinstance(item, str):
            raise RegistrationError(file, f"runtime-hooks must hold hook names (strings), not {_kind(item)}")
        point = HookPoint.from_name(item)
        if point is not None:
            points[point] = None
        elif item in UNSUPPORTED_HOOK_NAMES:
            warnings.append(f"runtime-hooks: {item} is not supported by this proxy and is never called")
        else:
            known = ", ".join(p.value for p in HookPoint)
            warnings.append(
                f"runtime-hooks: unknown hook {json.dumps(item)} is never called (known: {known})"
            )
    if not points:
        warnings.append("runtime-hooks lists no supported hook: the plugin is never called")
    return tuple(points)


def _timeout(file: str, value: object) -> float:
    if value is None:
        return DEFAULT_TIMEOUT
    seconds: float | None
    if isinstance(value, bool):
        seconds = None
    elif isinstance(value, (int, float)):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf
    elif isinstance(value, str):
        seconds = parse_duration(value)
    else:
        seconds = None
    if seconds is None:
        raise RegistrationError(
            file, f'timeout {json.dumps(value)} is not a number of seconds or a duration like "2s" or "500ms"'
        )
    if not (0 < seconds <= MAX_TIMEOUT):  # also rejects NaN
        raise RegistrationError(file, f"timeout {json.dumps(value)} is not in (0s, 5m]")
    return seconds


def _order(file: str, value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise RegistrationError(file, f"order must be an integer, not {json.dumps(value)}")
    return value


def _fields(file: str, document: gojson.Object, warnings: list[str]) -> dict[str, Any]:
    """Each known key's value as koord-runtime-proxy's Go decoder reads the object: a key is the field
    its name folds to (``Failure-Policy`` is ``failure-policy``), and every key naming a field is read
    in turn, the last winning, except that a ``null`` leaves a string or number as it was (a list it
    empties). A value of the wrong type under any of them makes Go refuse the whole file; so does this.
    A field spelt otherwise, or given more than once, gets a warning."""
    values: dict[str, Any] = {}
    spellings: dict[str, list[str]] = {}
    for key, value in document.members:
        name = _FOLDED_KEYS.get(gojson.fold_name(key))
        if name is None:
            warnings.append(f"unknown key {json.dumps(key)} ignored")
            continue
        spellings.setdefault(name, []).append(key)
        if value is None:
            if name == "runtime-hooks":
                values.pop(name, None)
            continue
        wanted = _GO_TYPES.get(name)
        if wanted is not None and not isinstance(value, wanted):
            raise RegistrationError(file, f"{name} must be {_GO_KINDS[name]}, not {_kind(value)}")
        values[name] = value
    for name, keys in spellings.items():
        if keys == [name]:
            continue
        written = ", ".join(map(json.dumps, keys))
        counted = " (the last counts, as koord-runtime-proxy reads it)" if len(keys) > 1 else ""
        warnings.append(f"{name} is written {written}{counted}: write it once, as {json.dumps(name)}")
    return values


def parse_registration(file: str, content: bytes) -> PluginRegistration:
    """Parse the registration file *file* (a name or path, used in messages) with contents *content*.

    The bytes are read as koord-runtime-proxy reads them (:mod:`krproxy.gojson`, :func:`_fields`).

    Raises:
        RegistrationError: whatever is wrong with the file; the only exception this raises.
    """
    try:
        document: Any = gojson.loads(content)
    except RecursionError:
        raise RegistrationError(file, "not valid JSON: nested too deeply") from None
    except ValueError as exc:  # includes json.JSONDecodeError
        raise RegistrationError(file, f"not valid JSON: {exc}") from None
    if not isinstance(document, gojson.Object):
        raise RegistrationError(file, f"top level must be a JSON object, not {_kind(document)}")
    warnings: list[str] = []
    fields = _fields(file, document, warnings)
    endpoint, unusable = _endpoint(fields.get("remote-endpoint"))
    if unusable is not None:
        warnings.append(f"{unusable}: every call to this hook server fails, as its failure-policy says")
    policy = _failure_policy(fields.get("failure-policy"), warnings)
    hooks = _hooks(file, fields.get("runtime-hooks"), warnings)
    timeout = _timeout(file, fields.get("timeout"))
    order = _order(file, fields.get("order"))
    return PluginRegistration(
        name=posixpath.basename(file).removesuffix(".json"),
        file=file,
        endpoint=endpoint,
        unusable=unusable,
        failure_policy=policy,
        hooks=hooks,
        timeout=timeout,
        order=order,
        warnings=tuple(warnings),
    )


@attrs.frozen
class Registry:
    """The registered plugins: a pure value; :meth:`apply` returns a new one.

    Attributes:
        plugins: valid registrations by file.
        errors: the last error message per file whose newest version is malformed (that file's previous
            valid version, if any, stays in *plugins*).
    """

    plugins: FrozenMap[str, PluginRegistration] = attrs.field(factory=FrozenMap)
    errors: FrozenMap[str, str] = attrs.field(factory=FrozenMap)
    # plugins_for's answers: every hooked call asks, and a registry never changes (evolve makes a new one).
    _by_point: dict[HookPoint, tuple[PluginRegistration, ...]] = attrs.field(
        factory=dict, init=False, eq=False, repr=False
    )

    def apply(self, file: str, content: bytes | None) -> Registry:
        """The registry after *file* changed to *content* (``None``: the file was deleted).

        A malformed new version keeps the previous valid one and records the error; a valid one replaces it
        and clears the error; a deletion removes both. Files that are not registration files are ignored.
        """
        if not is_registration_file(file):
            return self
        plugins = dict(self.plugins)
        errors = dict(self.errors)
        if content is None:
            plugins.pop(file, None)
            errors.pop(file, None)
        else:
            try:
                plugins[file] = parse_registration(file, content)
            except RegistrationError as exc:
                errors[file] = str(exc)
            else:
                errors.pop(file, None)
        return Registry(FrozenMap(plugins), FrozenMap(errors))

    def record_error(self, file: str, problem: str) -> Registry:
        """The registry after *file* could not be used for a reason outside its content (e.g. unreadable, too
        large): like a malformed version, the previous valid version stays and the error is recorded as
        ``"<file>: <problem>"``."""
        return attrs.evolve(self, errors=self.errors.merged({file: str(RegistrationError(file, problem))}))

    def ordered(self) -> tuple[PluginRegistration, ...]:
        """All registrations in call order: ascending ``(order, file name)``."""
        return tuple(sorted(self.plugins.values(), key=lambda p: p.sort_key))

    def plugins_for(self, point: HookPoint) -> tuple[PluginRegistration, ...]:
        """The registrations that handle *point*, in call order."""
        found = self._by_point.get(point)
        if found is None:
            found = self._by_point[point] = tuple(p for p in self.ordered() if p.handles(point))
        return found

    def error_for(self, file: str) -> str | None:
        """The error message of *file*'s newest version, or None if it is valid (or unknown)."""
        return self.errors.get(file)
