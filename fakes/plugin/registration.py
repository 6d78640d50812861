"""Registration files for the fake plugin, written atomically (temp file + rename).

The proxy polls the hook directory; writing to a hidden temp file (names starting with ``.`` are
never registration files) and renaming it into place means the proxy sees either the old file or
the whole new one, never a half-written one.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from typing import Any

from krproxy.hooks.points import HookPoint
from krproxy.hookserver._registration import write_atomic as write_atomic

ALL_HOOKS: tuple[HookPoint, ...] = tuple(HookPoint)


def registration_document(
    endpoint: str,
    hooks: Iterable[HookPoint | str] = ALL_HOOKS,
    *,
    failure_policy: str = "Ignore",
    timeout: str | float | None = None,
    order: int | None = None,
) -> dict[str, Any]:
    """The JSON document of a registration file (``timeout``/``order`` only when given)."""
    document: dict[str, Any] = {
        "remote-endpoint": endpoint,
        "failure-policy": failure_policy,
        "runtime-hooks": [h.value if isinstance(h, HookPoint) else h for h in hooks],
    }
    if timeout is not None:
        document["timeout"] = timeout
    if order is not None:
        document["order"] = order
    return document


def write_registration(
    hook_dir: str,
    name: str,
    endpoint: str,
    hooks: Iterable[HookPoint | str] = ALL_HOOKS,
    *,
    failure_policy: str = "Ignore",
    timeout: str | float | None = None,
    order: int | None = None,
) -> str:
    """Write ``hook_dir/<name>.json`` registering the plugin at *endpoint*; return its path.

    Creates *hook_dir* if needed.
    """
    os.makedirs(hook_dir, exist_ok=True)
    path = os.path.join(hook_dir, f"{name}.json")
    document = registration_document(
        endpoint, hooks, failure_policy=failure_policy, timeout=timeout, order=order
    )
    write_atomic(path, json.dumps(document, indent=2).encode() + b"\n")
    return path


def remove_registration(hook_dir: str, name: str) -> None:
    """Remove ``hook_dir/<name>.json`` if it exists."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(hook_dir, f"{name}.json"))
