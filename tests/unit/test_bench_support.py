"""The bench's helpers: the process CPU clock of another process; the idle time its clients take."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable

import pytest

from krproxy import bench
from krproxy.bench import client, sdk
from krproxy.bench._support import cpu_seconds, non_negative_ms

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


def test_idle_ms_read() -> None:
    """An idle time is milliseconds, 0 or more."""
    assert 0.0 == non_negative_ms("0")
    assert 2.5 == non_negative_ms("2.5")


@pytest.mark.parametrize(("text", "said"), [("-1", "0 or more"), ("nan", "0 or more"), ("2ms", "no number")])
def test_idle_ms_refused(text: str, said: str) -> None:
    """A negative, NaN or non-numeric idle time is refused, saying why."""
    with pytest.raises(argparse.ArgumentTypeError, match=said):
        non_negative_ms(text)


@pytest.mark.parametrize("text", ["inf", "1e400"])
def test_idle_ms_infinite_refused(text: str) -> None:
    """An idle time that is no finite number of milliseconds is refused: a client would sleep forever."""
    with pytest.raises(argparse.ArgumentTypeError, match="a finite number"):
        non_negative_ms(text)


@pytest.mark.parametrize(
    ("main", "argv"),
    [
        (bench.main, ["--only-hook-anchor", "--hook-anchor-idle-ms", "-1"]),
        (sdk.main, ["--idle-ms", "-1"]),
        (client.main, ["create", "--targets", "unix:///nowhere", "--idle-ms", "-1"]),
    ],
)
def test_negative_idle_refused_at_the_command_line(
    main: Callable[[list[str]], int], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each command with an idle time refuses a negative one before it starts anything (exit 2)."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert 2 == exited.value.code
    assert "milliseconds to idle are 0 or more" in capsys.readouterr().err
