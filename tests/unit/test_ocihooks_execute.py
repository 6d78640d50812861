"""Running one hook: stdin state, exact environment, output capture, timeout killing the process group."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from krproxy.ocihooks.execute import run_hook
from krproxy.ocihooks.model import HookCommand


def script(tmp_path: Path, body: str, name: str = "hook.py") -> str:
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return str(path)


class TestRunHook:
    def test_stdin_env_args(self, tmp_path: Path) -> None:
        """The hook reads the state on stdin, sees only its own env and gets its args."""
        out = tmp_path / "out"
        path = script(
            tmp_path,
            "import json, os, sys\n"
            f"open({str(out)!r}, 'w').write(json.dumps([sys.stdin.read(), dict(os.environ), sys.argv[1:]]))\n",
        )
        run = run_hook(HookCommand(path, (path, "x", "y"), ("A=1",)), b'{"id": "c"}')
        assert run.ok
        stdin, env, args = __import__("json").loads(out.read_text())
        assert ('{"id": "c"}', ["x", "y"]) == (stdin, args)
        assert "1" == env["A"] and "PATH" not in env

    def test_failure_captures_output(self, tmp_path: Path) -> None:
        """A non-zero exit is a failure described with its status and stderr."""
        path = script(tmp_path, "import sys\nprint('out')\nsys.stderr.write('boom')\nsys.exit(3)\n")
        run = run_hook(HookCommand(path), b"{}")
        assert (False, 3, "out\n", "boom") == (run.ok, run.returncode, run.stdout, run.stderr)
        assert "exit status 3: boom" == run.describe()

    def test_timeout_kills_the_process_group(self, tmp_path: Path) -> None:
        """On timeout the hook and its children are killed, and the run says it timed out."""
        pidfile = tmp_path / "child.pid"
        path = script(
            tmp_path,
            "import subprocess, time\n"
            "child = subprocess.Popen(['sleep', '60'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
            "time.sleep(60)\n",
        )
        started = time.monotonic()
        run = run_hook(HookCommand(path, env=(f"PATH={os.environ['PATH']}",), timeout=1), b"{}")
        assert run.timed_out and not run.ok
        assert time.monotonic() - started < 30  # killed at its 1 s timeout, not after its 60 s sleep
        child = int(pidfile.read_text())
        stat = Path(f"/proc/{child}/stat")

        def dead() -> bool:
            try:
                return stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
            except FileNotFoundError:
                return True

        # SIGKILL takes effect when the child next runs, which a loaded machine may delay: poll for it
        # (the 60 s sleep is the alternative), rather than look once after 0.2 s.
        waited = time.monotonic()
        while not dead() and time.monotonic() - waited < 30:
            time.sleep(0.05)
        assert dead()

    def test_default_timeout_applies_when_hook_sets_none(self, tmp_path: Path) -> None:
        """The caller's timeout bounds a hook without its own."""
        path = script(tmp_path, "import time\ntime.sleep(60)\n")
        assert run_hook(HookCommand(path), b"{}", timeout=0.5).timed_out

    def test_missing_program(self, tmp_path: Path) -> None:
        """A hook that cannot be started is a failure saying so."""
        run = run_hook(HookCommand(str(tmp_path / "nope")), b"{}")
        assert (False, None) == (run.ok, run.returncode)
        assert run.describe().startswith("cannot run ")
