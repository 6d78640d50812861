"""The processes the tests start begin with the default signal dispositions, however the suite was started.

Started from a background job (``cmd &`` in a script, as CI may be, or ``nohup``) the suite inherits
SIGINT (SIGHUP) ignored, and an ignored signal stays ignored across ``exec``: a test that sent its
child SIGINT then failed (``test_ctrl_c_stops_a_replay_waiting_on_its_target``). tests/conftest.py
(``children_start_with_default_signals``) undoes that for the children.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Prints, for each signal, whether a Python child sees it at its start-up default.
_CHILD = """
import signal
defaults = {signal.SIGINT: signal.default_int_handler}
for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
    signum = getattr(signal, name)
    print(name, signal.getsignal(signum) is defaults.get(signum, signal.SIG_DFL))
"""
#: A shell that ignores SIGINT and SIGHUP, as a background job of a script and nohup leave them, then execs.
_IGNORING = "trap '' INT HUP; exec \"$@\""


def _child_sees() -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    assert 0 == done.returncode, done.stderr
    return dict(line.split() for line in done.stdout.splitlines())


def test_a_child_starts_with_default_signals() -> None:
    """A process started by a test has every signal the tests send at its default (SIGINT raising
    KeyboardInterrupt in Python), whatever this pytest process inherited."""
    assert (
        dict.fromkeys(("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"), "True")
        == _child_sees()
    )


def test_a_suite_started_with_sigint_ignored_still_gives_the_default() -> None:
    """pytest started with SIGINT and SIGHUP ignored (as from ``cmd &`` or ``nohup``) runs the test
    above and it passes: its children start with the defaults. The shell really ignores them: a
    Python started the same way sees SIGINT ignored."""
    ignoring = ["sh", "-c", _IGNORING, "sh"]
    probe = subprocess.run(
        [
            *ignoring,
            sys.executable,
            "-c",
            "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "True" == probe.stdout.strip(), probe.stderr
    inner = f"{Path(__file__).relative_to(ROOT)}::test_a_child_starts_with_default_signals"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    done = subprocess.run(
        [*ignoring, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", inner],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert 0 == done.returncode, done.stdout + done.stderr
    assert "1 passed" in done.stdout
