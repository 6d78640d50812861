"""The registration file that tells the proxy where this hook server listens.

Same shape as koordlet's ``koordlet.json`` (Go ``json.Marshal`` of its HookServerConfig:
compact, keys in this order, no trailing newline)::

    {"remote-endpoint":"/var/run/koordlet/koordlet.sock","failure-policy":"Ignore","runtime-hooks":["PreRunPodSandbox"]}
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable

from ._registry import FailurePolicy, Stage


def registration_json(endpoint: str, failure_policy: FailurePolicy, stages: Iterable[Stage]) -> str:
    return json.dumps(
        {
            "remote-endpoint": endpoint,
            "failure-policy": failure_policy.value,
            "runtime-hooks": [s.value for s in stages],
        },
        separators=(",", ":"),
    )


def write_registration(hook_dir: str, name: str, content: str) -> str:
    """Write ``<hook_dir>/<name>.json`` atomically (temp file + rename); return its path.

    The temp name does not end in ``json``, so the proxy's directory scan never reads it half-written.
    """
    os.makedirs(hook_dir, mode=0o755, exist_ok=True)
    path = os.path.join(hook_dir, f"{name}.json")
    write_atomic(path, content.encode())
    return path


def write_atomic(path: str, content: bytes) -> None:
    """Replace ``path`` with ``content`` in one step: a hidden temp file beside it, fsynced, then renamed.

    The temp name (``.<name>.tmp``) starts with a dot, so a directory scan never reads it half-written.
    """
    directory, name = os.path.split(path)
    temp = os.path.join(directory, f".{name}.tmp")
    with open(temp, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


def remove_registration(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
