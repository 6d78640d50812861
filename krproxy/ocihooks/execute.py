"""Running one hook program: state on stdin, output captured, timeout enforced on the process group.

Blocking (``subprocess``), standard library only; the proxy calls it from a worker thread.

The hook runs in a new session (so it is the leader of its own process group) with exactly the
environment of its ``env`` list, as runtimes do (no variable of ours leaks into it), and ``/`` as
its working directory. On timeout the whole group is SIGKILLed — a shell script's children too,
which a plain ``kill`` of the hook's PID would leave running and holding its pipes open.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import NamedTuple

from krproxy.ocihooks.model import HookCommand

#: Largest amount of stdout and of stderr kept per run (for the logs); the rest is dropped.
MAX_OUTPUT = 16 * 1024

#: Seconds a killed hook's pipes may stay open before we stop waiting for them.
REAP_GRACE = 2.0


class HookRun(NamedTuple):
    """The outcome of one run.

    Attributes:
        returncode: the exit status; negative for a signal; None if it never started.
        stdout / stderr: what it wrote (truncated to :data:`MAX_OUTPUT`), decoded leniently.
        seconds: wall time.
        timed_out: the timeout passed and the process group was killed.
        error: why it could not be started (not found, not executable), else None.
    """

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe(self) -> str:
        """A one-line account of a failure, for status messages and logs."""
        if self.error is not None:
            return self.error
        if self.timed_out:
            return f"timed out after {self.seconds:.1f}s (process group killed)"
        if self.returncode is not None and self.returncode < 0:
            what = f"killed by signal {-self.returncode}"
        else:
            what = f"exit status {self.returncode}"
        detail = self.stderr.strip() or self.stdout.strip()
        return f"{what}: {_tail(detail)}" if detail else what


def _tail(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else "..." + text[-limit:]


def _decode(data: bytes | None) -> str:
    return (data or b"")[:MAX_OUTPUT].decode(errors="replace")


def run_hook(command: HookCommand, state: bytes, *, timeout: float | None = None) -> HookRun:
    """Run ``command`` with ``state`` on stdin until it exits or its timeout passes.

    ``timeout`` (seconds) applies when the hook sets none; the hook's own ``timeout`` wins.
    """
    limit = float(command.timeout) if command.timeout is not None else timeout
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            command.argv,
            executable=command.path,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(entry.split("=", 1) for entry in command.env),
            cwd="/",
            start_new_session=True,
            close_fds=True,
        )
    except OSError as err:
        return HookRun(None, "", "", time.monotonic() - started, error=f"cannot run {command.path}: {err}")
    try:
        stdout, stderr = process.communicate(state, timeout=limit)
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        try:
            stdout, stderr = process.communicate(timeout=REAP_GRACE)
        except subprocess.TimeoutExpired:  # a grandchild escaped the group and holds the pipes
            process.kill()
            stdout, stderr = b"", b""
            process.wait()
        return HookRun(
            process.returncode, _decode(stdout), _decode(stderr), time.monotonic() - started, timed_out=True
        )
    return HookRun(process.returncode, _decode(stdout), _decode(stderr), time.monotonic() - started)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
