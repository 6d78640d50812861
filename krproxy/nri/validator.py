"""Whether containerd's NRI default validator requires ``krproxy nri`` itself (pure, but for reading files).

containerd 2.2 and later (NRI 0.10 and later) can refuse every container that a list of NRI plugins did
not see: the default validator's ``required_plugins``, in containerd's configuration::

    [plugins.'io.containerd.nri.v1.nri'.default_validator]
      enable = true
      required_plugins = ['krproxy']

With krproxy's NRI name there (``krproxy`` or ``50-krproxy``: NRI's validator knows each plugin by both),
containerd creates no container while ``krproxy nri`` is not registered; without it, containers are
created without krproxy's hook servers whenever krproxy is down or re-registering. The runtime does not
tell a plugin its validator configuration (NRI's Configure carries none), so the only source is the
configuration file, given with ``--containerd-config``: :func:`check_containerd_config` reads it as
containerd does (files in ``imports``, globbed when they have a ``*``, relative to the file naming them,
imported files' own imports read after them, each file once, merged in that order over the main file key
by key, a list replaced whole but ``disabled_plugins`` added up: what ``containerd config dump`` shows of
2.3.4) and says what it finds (:class:`ValidatorCheck`).
"""

from __future__ import annotations

import enum
import glob
import logging
import os
import tomllib
from collections.abc import Mapping
from typing import Any

import attrs

from krproxy import log

__all__ = [
    "NRI_PLUGIN_KEY",
    "ConfigError",
    "ValidatorCheck",
    "Verdict",
    "check_containerd_config",
    "load_config",
]

#: containerd's NRI plugin, the key of its table under ``[plugins]`` (configuration version 2 and later).
NRI_PLUGIN_KEY = "io.containerd.nri.v1.nri"


class ConfigError(ValueError):
    """The configuration file cannot be read or parsed; the message names the file and the fix."""


class Verdict(enum.Enum):
    """What containerd's configuration says about krproxy's own registration."""

    NOT_CHECKED = "not checked (give krproxy nri --containerd-config PATH)"
    REQUIRED = "required: containerd creates no container while krproxy nri is not registered"
    NOT_REQUIRED = "not required: containerd creates containers while krproxy nri is down"
    NRI_DISABLED = "NRI is disabled in containerd's configuration"


@attrs.frozen
class ValidatorCheck:
    """The verdict, the files read, and why (the setting that decided it), for the log and ``status``."""

    verdict: Verdict = Verdict.NOT_CHECKED
    files: tuple[str, ...] = ()
    reason: str = ""
    #: The validator's ``tolerate_missing_plugins_annotation`` ("" when none): pods with it set true are
    #: created without krproxy too.
    tolerate_annotation: str = ""

    @property
    def required(self) -> bool | None:
        """True or False when the configuration was read; None when not checked."""
        return None if self.verdict is Verdict.NOT_CHECKED else self.verdict is Verdict.REQUIRED

    def describe(self) -> str:
        return f"{self.verdict.value} ({self.reason})" if self.reason else self.verdict.value


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise ConfigError(
            f"cannot read containerd's configuration {path}: {err.strerror or err}; give the file containerd "
            "runs with (containerd -c PATH, default /etc/containerd/config.toml), mounted into krproxy's pod"
        ) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML ({err}); is it containerd's configuration?") from None


def _merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    """*other* over *into*, key by key; tables merged, anything else (lists too) replaced."""
    for key, value in other.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _imports(path: str, document: Mapping[str, Any]) -> list[str]:
    """The files *path*'s ``imports`` name, as containerd's ``resolveImports``: relative to *path*'s
    directory; globbed only when it has a ``*`` (then as Go's ``filepath.Glob``: dot files match too)."""
    patterns = document.get("imports", [])
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ConfigError(f"{path}: imports must be a list of paths or globs")
    files: list[str] = []
    for pattern in patterns:
        pattern = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), pattern))
        if "*" in pattern:  # Go's order: each directory's names sorted, so by components, not strings
            files += sorted(glob.glob(pattern, include_hidden=True), key=lambda f: f.split(os.sep))
        else:
            files.append(pattern)
    return files


def load_config(path: str) -> tuple[dict[str, Any], list[str], set[str]]:
    """*path* and the files it imports, merged as containerd's ``LoadConfigWithPlugins`` does: each file's
    imports queued after those already waiting (imported files' own imports too), a file read once (at
    its first place); the merged document, the files in the order read, and the union of their
    ``disabled_plugins`` (containerd appends those lists rather than replacing them).

    Raises:
        ConfigError: a file cannot be read or is not TOML."""
    document: dict[str, Any] = {}
    files: list[str] = []
    disabled: set[str] = set()
    seen: set[str] = set()
    pending = [path]
    while pending:
        current = pending.pop(0)
        key = os.path.abspath(current)
        if key in seen:
            continue
        seen.add(key)
        loaded = _load(current)
        files.append(current)
        names = loaded.get("disabled_plugins", [])
        if isinstance(names, list):
            disabled.update(n for n in names if isinstance(n, str))
        _merge(document, loaded)
        pending += _imports(current, loaded)
    return document, files, disabled


def _nri_table(document: Mapping[str, Any]) -> Mapping[str, Any] | None:
    plugins = document.get("plugins")
    table = plugins.get(NRI_PLUGIN_KEY) if isinstance(plugins, Mapping) else None
    return table if isinstance(table, Mapping) else None


def check_containerd_config(path: str, plugin_name: str, plugin_index: str) -> ValidatorCheck:
    """Whether the containerd configuration at *path* (with its imports) requires the NRI plugin
    *plugin_index*-*plugin_name*.

    Raises:
        ConfigError: a file cannot be read or is not TOML; the message says which and what to give.
    """
    document, files, disabled = load_config(path)
    read = tuple(files)
    if NRI_PLUGIN_KEY in disabled:
        return ValidatorCheck(Verdict.NRI_DISABLED, read, f"disabled_plugins lists {NRI_PLUGIN_KEY!r}")
    table = _nri_table(document)
    if table is not None and table.get("disable") is True:
        return ValidatorCheck(Verdict.NRI_DISABLED, read, f"[plugins.'{NRI_PLUGIN_KEY}'] disable = true")
    validator = table.get("default_validator") if table is not None else None
    if not isinstance(validator, Mapping):
        return ValidatorCheck(
            Verdict.NOT_REQUIRED,
            read,
            f"no [plugins.'{NRI_PLUGIN_KEY}'.default_validator] (containerd 2.2 and later have one)",
        )
    if validator.get("enable") is not True:
        return ValidatorCheck(Verdict.NOT_REQUIRED, read, "default_validator.enable is not true")
    required = validator.get("required_plugins", [])
    names = {plugin_name, f"{plugin_index}-{plugin_name}"}
    tolerate = validator.get("tolerate_missing_plugins_annotation", "")
    tolerate = tolerate if isinstance(tolerate, str) else ""
    listed = [n for n in required if n in names] if isinstance(required, list) else []
    if not listed:
        return ValidatorCheck(
            Verdict.NOT_REQUIRED,
            read,
            f"default_validator.required_plugins = {required!r} names neither {plugin_name!r} nor "
            f"'{plugin_index}-{plugin_name}'",
            tolerate,
        )
    return ValidatorCheck(
        Verdict.REQUIRED, read, f"default_validator.required_plugins lists {listed[0]!r}", tolerate
    )


def log_validator_check(path: str, plugin_name: str, plugin_index: str) -> ValidatorCheck:
    """:func:`check_containerd_config` of ``path`` (if given; else not checked), logged as
    ``nri_runtime_validator`` (a warning unless krproxy is required or nothing was checked).

    Raises:
        ConfigError: the file cannot be read or parsed.
    """
    check = check_containerd_config(path, plugin_name, plugin_index) if path else ValidatorCheck()
    log.event(
        logging.getLogger("krproxy.nri"),
        "nri_runtime_validator",
        level=logging.INFO if check.verdict in (Verdict.REQUIRED, Verdict.NOT_CHECKED) else logging.WARNING,
        required={True: "yes", False: "no", None: "unknown"}[check.required],
        plugin=f"{plugin_index}-{plugin_name}",
        detail=check.describe(),
        files=",".join(check.files),
        tolerate_annotation=check.tolerate_annotation,
    )
    return check
