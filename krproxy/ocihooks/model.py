"""Hook files in the OCI hooks schema 1.0.0: parsing, directory precedence, ``when`` matching.

Pure and synchronous (no I/O besides what the caller passes in), standard library only — the
runc wrapper imports this on every ``runc create`` — so the types are ``NamedTuple``s rather
than attrs classes.

A hook file (podman's ``oci-hooks(5)``, which CRI-O follows)::

    {"version": "1.0.0",
     "hook": {"path": "/usr/libexec/oci/hooks.d/my-hook", "args": ["my-hook", "prestart"],
              "env": ["A=1"], "timeout": 5},
     "when": {"annotations": {"^com\\\\.example\\\\.gpu$": "^true$"}},
     "stages": ["prestart", "poststop"]}

Semantics we follow, as those documents and podman's matcher define them (stated in our words):

- ``when`` must set at least one condition, and the hook applies only when *every* condition
  that is set holds (they are ANDed).
- ``always: true`` holds; ``always: false`` never does (so it disables the hook).
- ``annotations`` is a map of regular expressions: each (key, value) pair must be matched by at
  least one of the container's annotations (key matched by the key pattern *and* its value by the
  value pattern).
- ``commands`` is a list of regular expressions; it holds when any one of them matches the
  container's ``process.args[0]`` (the command path as configured, not resolved).
- ``hasBindMounts: true`` holds when the caller asked for host-to-container bind mounts;
  ``hasBindMounts: false`` never holds (it is not "has no bind mounts").
- Patterns are searched, not anchored (Go's ``regexp.MatchString``); write ``^...$`` to anchor.
  They are POSIX extended regexps upstream; Python's ``re`` accepts that common subset.
- Several directories: a file in a later (preferred) directory masks the same-named file of an
  earlier one, and matching hooks run in the order of their file names compared lower-cased.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

#: Only this schema version is read (the 0.1.0 schema is deprecated upstream).
SCHEMA_VERSION = "1.0.0"

#: OCI runtime-spec hook stages, in the order a container goes through them.
STAGES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop")

#: The stages that run before the container's process starts (a failure there fails the start).
PRE_START_STAGES = ("prestart", "createRuntime", "createContainer")

_WHEN_KEYS = ("always", "annotations", "commands", "hasBindMounts")


class InvalidHookFile(ValueError):
    """A hook file that does not follow the schema; the message says what is wrong."""


class HookCommand(NamedTuple):
    """The program to run: the runtime-spec hook entry (``path``, ``args``, ``env``, ``timeout``).

    ``args`` is the whole argv (``args[0]`` included), as in the runtime spec; empty means
    ``[path]``. ``env`` is the whole environment. ``timeout`` is in seconds, None for none.
    """

    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None

    @property
    def argv(self) -> list[str]:
        return list(self.args) if self.args else [self.path]

    def to_spec(self) -> dict[str, Any]:
        """The entry as it goes into a runtime spec's ``hooks.<stage>`` list.

        ``env`` is always written, empty when the file has none: runc runs a hook without ``env``
        in its own environment (containerd-shim's, the wrapper's ``KRPROXY_*`` included), whereas
        the hook file promises ``env`` is the whole environment, as at the proxy.
        """
        entry: dict[str, Any] = {"path": self.path}
        if self.args:
            entry["args"] = list(self.args)
        entry["env"] = list(self.env)
        if self.timeout is not None:
            entry["timeout"] = self.timeout
        return entry


class Container(NamedTuple):
    """What ``when`` is evaluated against.

    Attributes:
        annotations: the container's annotations.
        command: ``process.args[0]``; None when unknown (then ``commands`` cannot hold).
        has_bind_mounts: whether the caller asked for host-to-container bind mounts.
    """

    annotations: Mapping[str, str]
    command: str | None
    has_bind_mounts: bool


class When(NamedTuple):
    """The conditions of one hook; unset ones are None / empty."""

    always: bool | None = None
    annotations: tuple[tuple[re.Pattern[str], re.Pattern[str]], ...] = ()
    commands: tuple[re.Pattern[str], ...] = ()
    has_bind_mounts: bool | None = None

    def matches(self, container: Container) -> bool:
        """True if every condition that is set holds for ``container``."""
        if self.always is not None and not self.always:
            return False
        if self.has_bind_mounts is not None and not (self.has_bind_mounts and container.has_bind_mounts):
            return False
        for key_pattern, value_pattern in self.annotations:
            if not any(
                key_pattern.search(key) and value_pattern.search(value)
                for key, value in container.annotations.items()
            ):
                return False
        if self.commands:
            if container.command is None:
                return False
            return any(pattern.search(container.command) for pattern in self.commands)
        return True

    @property
    def needs_command(self) -> bool:
        return bool(self.commands)


class HookFile(NamedTuple):
    """One valid hook file.

    Attributes:
        name: the file name (what masks and orders files).
        source: the full path it was read from (for logs).
        command: the hook program.
        when: the conditions.
        stages: the stages it runs at, in :data:`STAGES` order.
    """

    name: str
    source: str
    command: HookCommand
    when: When
    stages: tuple[str, ...]

    def applies(self, stage: str, container: Container) -> bool:
        return stage in self.stages and self.when.matches(container)


def is_hook_file(name: str) -> bool:
    """Whether the directory entry ``name`` is a hook file: ``*.json``, not hidden. The proxy's
    watcher selects by the same rule (krproxy.hooks.registration.is_registration_file), kept apart
    so that the wrapper need not import the daemon's modules."""
    return name.endswith(".json") and not name.startswith(".")


def sort_key(name: str) -> tuple[str, str]:
    """Hook files run in the order of their names compared lower-cased (ties: exact name)."""
    return (name.lower(), name)


def parse_hook_file(name: str, content: bytes, source: str = "") -> HookFile:
    """Validate one file's content.

    Raises:
        InvalidHookFile: with a message naming the first problem found.
    """
    try:
        doc = json.loads(content)
    except (ValueError, UnicodeDecodeError) as err:
        raise InvalidHookFile(f"not valid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise InvalidHookFile("the file must hold a JSON object")
    version = doc.get("version")
    if version != SCHEMA_VERSION:
        raise InvalidHookFile(
            f"version must be {SCHEMA_VERSION!r}, got {version!r} (the 0.1.0 schema is not supported)"
        )
    return HookFile(
        name=name,
        source=source or name,
        command=_parse_command(doc.get("hook")),
        when=_parse_when(doc.get("when")),
        stages=_parse_stages(doc.get("stages")),
    )


def _string_list(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise InvalidHookFile(f"{what} must be a list of strings")
    return tuple(value)


def _parse_command(hook: Any) -> HookCommand:
    if not isinstance(hook, dict):
        raise InvalidHookFile("missing required object 'hook'")
    path = hook.get("path")
    if not isinstance(path, str) or not path:
        raise InvalidHookFile("missing required string hook.path")
    if not path.startswith("/"):
        raise InvalidHookFile(f"hook.path must be absolute, got {path!r}")
    env = _string_list(hook.get("env"), "hook.env")
    for entry in env:
        if "=" not in entry:
            raise InvalidHookFile(f"hook.env entries must be NAME=VALUE, got {entry!r}")
    timeout = hook.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0):
        raise InvalidHookFile(f"hook.timeout must be a positive integer (seconds), got {timeout!r}")
    return HookCommand(path, _string_list(hook.get("args"), "hook.args"), env, timeout)


def _compile(pattern: Any, what: str) -> re.Pattern[str]:
    if not isinstance(pattern, str):
        raise InvalidHookFile(f"{what} must be a string (a regular expression), got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as err:
        raise InvalidHookFile(f"{what} {pattern!r} is not a valid regular expression: {err}") from None


def _optional_bool(when: dict[str, Any], key: str) -> bool | None:
    value = when.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidHookFile(f"when.{key} must be true or false, got {value!r}")
    return value


def _parse_when(when: Any) -> When:
    if not isinstance(when, dict):
        raise InvalidHookFile("missing required object 'when'")
    if not any(when.get(key) is not None for key in _WHEN_KEYS):
        raise InvalidHookFile(f"'when' must set at least one of {', '.join(_WHEN_KEYS)}")
    annotations = when.get("annotations")
    if annotations is not None and not isinstance(annotations, dict):
        raise InvalidHookFile("when.annotations must be an object of key pattern -> value pattern")
    commands = _string_list(when.get("commands"), "when.commands")
    return When(
        always=_optional_bool(when, "always"),
        annotations=tuple(
            (_compile(key, "when.annotations key"), _compile(value, f"when.annotations[{key!r}]"))
            for key, value in (annotations or {}).items()
        ),
        commands=tuple(_compile(command, "when.commands entry") for command in commands),
        has_bind_mounts=_optional_bool(when, "hasBindMounts"),
    )


def _parse_stages(stages: Any) -> tuple[str, ...]:
    names = _string_list(stages, "stages")
    if not names:
        raise InvalidHookFile("missing required list 'stages' (at least one stage)")
    for stage in names:
        if stage not in STAGES:
            raise InvalidHookFile(f"unknown stage {stage!r} (known: {', '.join(STAGES)})")
    return tuple(stage for stage in STAGES if stage in names)


#: What a directory scan found for one file name: the valid file, or the error text.
Entry = HookFile | str


def effective(layers: Sequence[Mapping[str, Entry]]) -> list[HookFile]:
    """The hook files in force, in run order, given each directory's files (earliest first).

    A later layer's file masks an earlier one's of the same name — even when the later file is
    invalid: then neither runs (running the file an operator tried to replace would be worse).
    """
    winners: dict[str, Entry] = {}
    for layer in layers:
        winners.update(layer)
    return sorted(
        (entry for entry in winners.values() if isinstance(entry, HookFile)),
        key=lambda hook: sort_key(hook.name),
    )


def select(hooks: Sequence[HookFile], stage: str, container: Container) -> list[HookFile]:
    """The hooks to run at ``stage`` for ``container``, in run order (``hooks`` is already sorted)."""
    return [hook for hook in hooks if hook.applies(stage, container)]


def state_document(
    container_id: str,
    status: str,
    annotations: Mapping[str, str],
    *,
    pid: int | None = None,
    bundle: str | None = None,
) -> bytes:
    """The OCI state JSON a hook reads on stdin (runtime-spec "State"); unknown fields are left out."""
    state: dict[str, Any] = {"ociVersion": OCI_VERSION, "id": container_id, "status": status}
    if pid is not None:
        state["pid"] = pid
    if bundle is not None:
        state["bundle"] = bundle
    state["annotations"] = dict(annotations)
    return json.dumps(state).encode()


#: The runtime-spec version our state documents claim (the one runc 1.1 implements).
OCI_VERSION = "1.0.2"
