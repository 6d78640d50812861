"""What the benchmark's cases share: the processes they start, the client process, the real-containerd
sandbox, and how latencies are summed up. Names start with ``_``: they serve ``krproxy.bench``'s
modules only."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

PY = sys.executable


def cpu_seconds(pid: int) -> float:
    """The CPU time of process ``pid`` so far, all its threads (ended ones too), in seconds.

    Read from the kernel's CPU clock of the process (the clock id clock_getcpuclockid(3) gives:
    ``~pid << 3 | CPUCLOCK_SCHED``), which counts nanoseconds; /proc/PID/stat's utime and stime
    move in clock ticks (10 ms), a step of 0.03 ms a call over a round of 300 calls.
    OSError when the process has gone.
    """
    return time.clock_gettime((~pid << 3) | 2)


def non_negative_ms(text: str) -> float:
    """An ``--idle-ms`` value (argparse ``type``): milliseconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no number of milliseconds") from None
    if not value >= 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"{text}: milliseconds to idle are 0 or more")
    if value == math.inf:  # (1e400 too): a client would sleep forever, or fail after starting it all
        raise argparse.ArgumentTypeError(f"{text}: milliseconds to idle are a finite number")
    return value


def wait_grpc(socket: str, failure: str) -> None:
    """Wait (up to a minute) until ``socket`` answers gRPC; else RuntimeError(``failure``)."""
    channel = grpc.insecure_channel(f"unix://{socket}")
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
    except grpc.FutureTimeoutError:
        raise RuntimeError(failure) from None
    finally:
        channel.close()


class Processes:
    """Subprocesses the benchmark started; all stopped by PID at the end."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.started: list[subprocess.Popen[bytes]] = []

    def start(
        self, name: str, argv: Sequence[str], socket: str, *, python: bool = True
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` (a Python command line unless ``python`` is False) and wait until ``socket``
        answers gRPC."""
        log = open(os.path.join(self.workdir, f"{name}.log"), "wb")  # noqa: SIM115 - lives as long as the process
        command = [PY, *argv] if python else list(argv)
        process = subprocess.Popen(command, stdout=log, stderr=log, cwd=self.workdir)
        self.started.append(process)
        wait_grpc(socket, f"{name} did not start; see {log.name}")
        return process

    def stop(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.started:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _client(*args: str) -> dict[str, Any]:
    out = subprocess.run([PY, "-m", "krproxy.bench.client", *args], capture_output=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def _populate(target: str, pods: int, containers: int, image: str, cgroup_parent: str) -> dict[str, Any]:
    """Create ``pods`` pods of ``containers`` created containers each in the runtime at ``target``."""
    return _client(
        "populate",
        "--target",
        target,
        "--pods",
        str(pods),
        "--containers",
        str(containers),
        "--image",
        image,
        "--cgroup-parent",
        cgroup_parent,
    )


@contextlib.contextmanager
def _scratch() -> Iterator[str]:
    """A temp dir for a case's sockets, sandboxes and logs, removed afterwards."""
    workdir = tempfile.mkdtemp(prefix="krproxy-bench-")
    try:
        yield workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _summary(samples_us: list[float]) -> dict[str, float]:
    ordered = sorted(samples_us)
    return {
        "median_ms": statistics.median(ordered) / 1000,
        "p10_ms": ordered[int(len(ordered) * 0.1)] / 1000,
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1000,
        "n": len(ordered),
    }


def _serve_args(listen: str, backend: str, hook_dir: str, *extra: str) -> list[str]:
    return [
        "-m",
        "krproxy",
        "serve",
        f"--koord-runtimeproxy-endpoint={listen}",
        f"--remote-runtime-service-endpoint={backend}",
        f"--hook-dir={hook_dir}",
        "--log-level=warning",
        *extra,
    ]


#: scripts/containerd-sandbox, found next to the package in a source checkout (pip install -e .).
SANDBOX_SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "scripts",
    "containerd-sandbox",
)


class _NoSandbox(Exception):
    """containerd-sandbox could not start; the message says why."""


@contextlib.contextmanager
def _sandbox(workdir: str, name: str, *options: str) -> Iterator[tuple[str, dict[str, Any], str]]:
    """A real containerd from ``scripts/containerd-sandbox`` in ``workdir/name``, its pods' cgroups
    under ``krproxy-bench-<name>-<pid>``: yields (its directory, its ``sandbox.json``, that cgroup
    parent) and stops it afterwards. ``options`` go to ``containerd-sandbox start``.

    Raises:
        _NoSandbox: it did not start (the message ends with the script's error).
    """
    sandbox = os.path.join(workdir, name)
    cgroup_parent = f"krproxy-bench-{name}-{os.getpid()}"
    started = subprocess.run(
        [PY, SANDBOX_SCRIPT, "start", "--dir", sandbox, "--cgroup-parent", cgroup_parent, *options],
        capture_output=True,
        text=True,
    )
    if started.returncode != 0:
        raise _NoSandbox(f"containerd-sandbox start failed: {started.stderr.strip()[-300:]}")
    try:
        with open(os.path.join(sandbox, "sandbox.json")) as f:
            state = json.load(f)
        yield sandbox, state, cgroup_parent
    finally:
        subprocess.run([PY, SANDBOX_SCRIPT, "stop", "--dir", sandbox], capture_output=True)


def _check(ok: bool) -> str:
    return "met" if ok else "MISSED"
