"""OCI hooks.d files that run a recorder script, for the OCI hook tests (integration and e2e)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_hook_file(
    path: Path,
    script: Path,
    record: Path,
    label: str,
    when: dict[str, Any],
    stages: list[str],
    *,
    exit_code: int = 0,
    sleep: float | None = None,
    timeout: int | None = None,
    env: list[str] | None = None,
) -> Path:
    """Write ``path`` (atomically: a rename, as the proxy may read the directory at any moment): a
    hook running ``script record label exit_code [sleep]`` at ``stages`` when ``when`` matches."""
    args = [str(script), str(record), label, str(exit_code)]
    if sleep is not None:
        args.append(str(sleep))
    hook: dict[str, Any] = {"path": str(script), "args": args}
    if timeout is not None:
        hook["timeout"] = timeout
    if env is not None:
        hook["env"] = env
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps({"version": "1.0.0", "hook": hook, "when": when, "stages": stages}))
    os.replace(tmp, path)
    return path


class HookFiles:
    """Writes hooks.d files into ``low`` (or another directory) that run ``script``, which appends
    each call to ``record``. A subclass sets the three attributes."""

    low: Path
    script: Path
    record: Path

    def write(
        self,
        name: str,
        when: dict[str, Any],
        stages: list[str],
        *,
        label: str = "",
        exit_code: int = 0,
        sleep: float | None = None,
        timeout: int | None = None,
        directory: Path | None = None,
        env: list[str] | None = None,
    ) -> Path:
        """The hook file ``name`` (in ``directory``, default ``low``), its calls recorded under
        ``label`` (default: ``name``); see :func:`write_hook_file`."""
        return write_hook_file(
            (directory or self.low) / name,
            self.script,
            self.record,
            label or name,
            when,
            stages,
            exit_code=exit_code,
            sleep=sleep,
            timeout=timeout,
            env=env,
        )
