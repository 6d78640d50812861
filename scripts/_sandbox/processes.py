"""containerd-sandbox's view of the processes it started: containerd and its shims found by PID
and command line (never by name), the state file, ``ctr``, and waiting for readiness.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from _sandbox.common import K8S_NS, Paths

# --------------------------------------------------------------------------- processes


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _alive(pid: int) -> bool:
    """True if *pid* exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state letter follows the parenthesised command name.
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _is_our_containerd(pid: int, p: Paths) -> bool:
    argv = _cmdline(pid)
    return _alive(pid) and bool(argv) and os.path.basename(argv[0]) == "containerd" and str(p.config) in argv


def _our_shims(p: Paths) -> list[int]:
    """PIDs of containerd shims serving *our* containerd socket."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        argv = _cmdline(int(entry))
        if not argv or not os.path.basename(argv[0]).startswith("containerd-shim"):
            continue
        for i, a in enumerate(argv):
            if (a in ("-address", "--address") and i + 1 < len(argv) and argv[i + 1] == str(p.sock)) or a in (
                f"-address={p.sock}",
                f"--address={p.sock}",
            ):
                pids.append(int(entry))
    return pids


def _read_state(p: Paths) -> dict[str, Any]:
    try:
        data = json.loads(p.state_file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _running_pid(p: Paths) -> int | None:
    pid = _read_state(p).get("pid")
    if isinstance(pid, int) and _is_our_containerd(pid, p):
        return pid
    return None


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    left = [pid for pid in pids if _alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if _alive(pid)]
    return left


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _ctr(
    p: Paths, *args: str, ns: str | None = K8S_NS, timeout: float = 60, check: bool = True
) -> subprocess.CompletedProcess[str]:
    bin_dir = _read_state(p).get("bin_dir")  # the ctr of the containerd that runs
    ctr = os.path.join(bin_dir, "ctr") if isinstance(bin_dir, str) and bin_dir else "ctr"
    cmd = [ctr, "-a", str(p.sock)]
    if ns:
        cmd += ["-n", ns]
    r = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd + list(args))} failed: {r.stderr.strip()}")
    return r


# --------------------------------------------------------------------------- start


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_ready(p: Paths, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Poll until the socket exists and `ctr version` answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"containerd exited with {proc.returncode}:\n{_tail(p.log)}")
        if p.sock.is_socket():
            r = _ctr(p, "version", ns=None, timeout=10, check=False)
            if r.returncode == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"containerd not ready after {timeout}s:\n{_tail(p.log)}")
