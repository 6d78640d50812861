"""The bench's CPU figures: the process CPU clock of another process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from krproxy.bench._support import cpu_seconds

#: A child that spends 0.15 s of CPU in a thread that then ends, says so, and waits for stdin.
_CHILD = """
import sys, threading, time
def burn():
    start = time.thread_time()
    while time.thread_time() - start < 0.15:
        pass
t = threading.Thread(target=burn); t.start(); t.join()
print("burnt", flush=True)
sys.stdin.read()
"""


def _stat_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / 100


def test_counts_ended_threads() -> None:
    """A process's CPU clock counts the threads that have ended, as /proc/PID/stat does, to
    within its clock ticks."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "burnt\n"
        clock, stat = cpu_seconds(child.pid), _stat_seconds(child.pid)
        assert clock >= 0.15
        assert abs(clock - stat) < 0.05
    finally:
        child.communicate("")


def test_gone_process() -> None:
    """A process that has ended and been reaped has no clock: OSError, not a figure."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(OSError):
        cpu_seconds(child.pid)
