"""NRI mode against containerd 2.x: pod start and a plain call, with and without
``krproxy nri`` registered."""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import signal
import socket
import statistics
import subprocess
import time
import urllib.request
from typing import Any

from krproxy.bench._support import (
    PY,
    SANDBOX_SCRIPT,
    Processes,
    _client,
    _NoSandbox,
    _sandbox,
    _summary,
)


def nri(workdir: str, args: argparse.Namespace) -> dict[str, Any]:
    """NRI mode against a real containerd (``--nri-containerd``: 2.x, sid's 2.1, the default, or 1.7,
    trixie's, whose NRI the sandbox turns on): pod start with and without ``krproxy nri``
    registered (one hook server that answers at once, on PreCreateContainer), and Version straight to
    containerd in both states (plain CRI calls never touch krproxy in NRI mode).

    The two states alternate block by block (``krproxy nri`` started, synchronized, then stopped again), so
    machine noise hits both alike. Needs root and ``containerd-sandbox fetch --version VERSION``; otherwise
    says why not.
    """
    if os.geteuid() != 0 or not os.path.exists(SANDBOX_SCRIPT):
        return {"skipped": "not root" if os.geteuid() else "no sandbox script"}
    fetched = subprocess.run(
        [PY, SANDBOX_SCRIPT, "fetch", "--version", args.nri_containerd], capture_output=True, text=True
    )
    if fetched.returncode != 0:
        return {"skipped": f"containerd {args.nri_containerd} cannot be had: {fetched.stderr.strip()[-300:]}"}
    bin_dir = fetched.stdout.strip().splitlines()[-1]
    procs = Processes(workdir)
    try:
        with _sandbox(workdir, "nri-containerd", "--bin-dir", bin_dir) as (sandbox, state, cgroup_parent):
            try:
                direct, image = state["socket"], state["busybox_image"]
                socket = os.path.join(sandbox, "run", "nri", "nri.sock")
                if not os.path.exists(socket):
                    return {
                        "skipped": f"containerd {state.get('containerd_version', '?')} serves no NRI socket"
                    }
                hook_dir = os.path.join(workdir, "hooks-nri")
                os.makedirs(hook_dir)
                plugin = os.path.join(workdir, "nri-plugin.sock")
                procs.start(
                    "plugin-nri",
                    [
                        "-m",
                        "krproxy.fakes.plugin",
                        "--socket",
                        plugin,
                        "--hook-dir",
                        hook_dir,
                        "--name",
                        "p",
                        "--hooks",
                        "PreCreateContainer",
                    ],
                    plugin,
                )
                pods: dict[str, list[float]] = {"without": [], "with": []}
                version: dict[str, list[float]] = {"without": [], "with": []}
                cpu_per_pod: list[float] = []  # krproxy nri CPU ms per pod, one figure per "with" block
                waited: list[float] = []  # ms containerd waited on krproxy nri's answers per pod, likewise
                hook_calls: list[float] = []  # ms of those in calls to the hook server
                blocks = max(args.nri_blocks, 1)
                for block in range(blocks):
                    for state_name in ("without", "with"):
                        port = _free_port()
                        daemon = (
                            _start_nri(workdir, socket, hook_dir, block, port)
                            if state_name == "with"
                            else None
                        )
                        answered = _nri_answer_seconds(port) if daemon is not None else (0.0, 0.0)
                        cpu_before = _cpu_seconds(daemon.pid) if daemon is not None else 0.0
                        try:
                            got = _client(
                                "pod-create", "--target", direct, "--pods", str(args.nri_pods), "--image", image,
                                "--cgroup-parent", cgroup_parent,
                            )  # fmt: skip
                            pods[state_name] += got["latencies_us"]
                            calls = _client(
                                "latency", "--targets", direct, "--calls", str(args.nri_version_calls)
                            )
                            version[state_name] += calls["latencies_us"][direct]
                            if daemon is not None:
                                used = _cpu_seconds(daemon.pid) - cpu_before
                                cpu_per_pod.append(used * 1000 / max(args.nri_pods, 1))
                                answering, hooks = _nri_answer_seconds(port)
                                pods_done = max(args.nri_pods, 1)
                                waited.append((answering - answered[0]) * 1000 / pods_done)
                                hook_calls.append((hooks - answered[1]) * 1000 / pods_done)
                        finally:
                            if daemon is not None:
                                daemon.send_signal(signal.SIGTERM)
                                daemon.wait(30)
                return {
                    "pod_start": {k: _summary(v) for k, v in pods.items()},
                    # every pod's start, so that runs can be pooled (one run's medians move by tens of ms)
                    "pod_start_samples_ms": {k: [round(us / 1000, 3) for us in v] for k, v in pods.items()},
                    "version": {k: _summary(v) for k, v in version.items()},
                    "krproxy_cpu_ms_per_pod": round(statistics.median(cpu_per_pod), 2),
                    "krproxy_answer_ms_per_pod": round(statistics.median(waited), 3),
                    "hook_call_ms_per_pod": round(statistics.median(hook_calls), 3),
                    "containerd": state.get("containerd_version", "?"),
                }
            finally:
                procs.stop()
    except _NoSandbox as err:
        return {"skipped": str(err)}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time ``pid`` has used so far (``/proc/PID/stat``, clock-tick resolution)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (14th, 15th)


def _free_port() -> int:
    """A loopback TCP port nobody listens on now (for an admin endpoint)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


#: NRI calls that are not events: registration and state, off a pod's path.
_NRI_SETUP_CALLS = frozenset({"Configure", "Synchronize", "Shutdown"})


def _nri_answer_seconds(port: int) -> tuple[float, float]:
    """Seconds ``krproxy nri`` (admin endpoint on ``port``) spent so far answering the runtime's event calls
    (``krproxy_nri_call_seconds`` of every method but :data:`_NRI_SETUP_CALLS`), and of them in calls to
    hook servers (``krproxy_hook_call_seconds``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    answering = hooks = 0.0
    for match in re.finditer(r'^krproxy_nri_call_seconds_sum\{method="([A-Za-z]+)"\} (\S+)$', text, re.M):
        if match[1] not in _NRI_SETUP_CALLS:
            answering += float(match[2])
    for match in re.finditer(r"^krproxy_hook_call_seconds_sum\{[^}]*\} (\S+)$", text, re.M):
        hooks += float(match[1])
    return answering, hooks


def _start_nri(workdir: str, socket: str, hook_dir: str, block: int, port: int) -> subprocess.Popen[bytes]:
    """``krproxy nri`` on ``socket``; returns once containerd synchronized it with its hook server loaded."""
    log_path = os.path.join(workdir, f"krproxy-nri-{block}.log")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                PY,
                "-m",
                "krproxy",
                "nri",
                "--nri-socket",
                socket,
                "--hook-dir",
                hook_dir,
                "--insecure-registration-files",
                "--metrics-address",
                f"127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=log,
            cwd=workdir,
        )
    deadline = time.monotonic() + 60
    while "event=nri_synchronized" not in pathlib.Path(log_path).read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"krproxy nri did not register; see {log_path}")
        time.sleep(0.05)
    return process


def report_nri(r: dict[str, Any]) -> list[str]:
    """Rows for :func:`nri`: without vs with ``krproxy nri`` registered (medians/p99 in ms)."""
    if "skipped" in r:
        return [f"NRI mode                          not measured: {r['skipped']}"]
    lines = [
        f"NRI mode, containerd {r['containerd']}: without / with krproxy nri registered (ms, median/p99)"
    ]
    for name, label in (
        ("pod_start", "pod start (run+create+start)"),
        ("version", "Version (plain CRI call)"),
    ):
        a, b = r[name]["without"], r[name]["with"]
        lines.append(
            f"{label:<33} {a['median_ms']:8.3f}/{a['p99_ms']:8.3f}"
            f"   {b['median_ms']:8.3f}/{b['p99_ms']:8.3f}   added {b['median_ms'] - a['median_ms']:+8.3f}"
        )
    if "krproxy_cpu_ms_per_pod" in r:
        lines.append(
            f"{'krproxy nri CPU per pod':<33} {r['krproxy_cpu_ms_per_pod']:8.2f} ms (run to removal; median of the "
            "'with' blocks; user+system, its idle work included)"
        )
    if "krproxy_answer_ms_per_pod" in r:
        lines.append(
            f"{'krproxy nri answering, per pod':<33} {r['krproxy_answer_ms_per_pod']:8.3f} ms (handler start to answer "
            "ready, every event call; median of the 'with' blocks: what containerd waited on it)"
        )
    if "hook_call_ms_per_pod" in r:
        lines.append(
            f"{'  of which calling the hook server':<33} {r['hook_call_ms_per_pod']:8.3f} ms (krproxy_hook_call_seconds)"
        )
    return lines
