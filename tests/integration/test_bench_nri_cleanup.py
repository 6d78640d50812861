"""``python -m krproxy.bench --only-nri`` killed with SIGTERM or SIGINT stops what it started: the first
signal unwinds the bench through its ``finally`` blocks (which stop its processes by PID and the sandbox's
containerd through ``containerd-sandbox stop``), and it exits with 128 + the signal's number.

Without real containerd: a child process runs :func:`krproxy.bench.nri.stop_on_signals` around a
``finally`` that stops a process started in its own session, as the sandbox's containerd is (so a signal
to the bench never reaches it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.integration.support import LIVENESS_LIMIT

_BENCH = textwrap.dedent(
    """
    import subprocess, sys, time
    from krproxy.bench.nri import stop_on_signals

    with stop_on_signals():
        started = subprocess.Popen(["sleep", "600"], start_new_session=True)
        try:
            print(started.pid, flush=True)
            time.sleep(600)
        finally:
            subprocess.run(["sleep", "0.2"])  # a slow cleanup step: a second signal must not cut it short
            started.terminate()
            started.wait()
            print("stopped", flush=True)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_what_the_bench_started(signum: int) -> None:
    bench = subprocess.Popen([sys.executable, "-c", _BENCH], stdout=subprocess.PIPE, text=True)
    assert bench.stdout is not None
    child = int(bench.stdout.readline())
    try:
        bench.send_signal(signum)
        time.sleep(0.05)
        bench.send_signal(signum)  # during the cleanup: ignored
        assert 128 + signum == bench.wait(LIVENESS_LIMIT)
        assert "stopped" == bench.stdout.read().strip()
        assert not _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
        bench.kill()
        bench.wait()
