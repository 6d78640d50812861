"""`krproxy demo`, the README's main-job command, behaves and says what happened."""

from __future__ import annotations

import io
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
import trio

from krproxy.demo import run_demo


class TestDemo:
    async def test_demo_in_process(self) -> None:
        """Every step of the demo succeeds and the plugin's limits reach the runtime."""
        out = io.StringIO()
        assert 0 == await run_demo(out)
        text = out.getvalue()
        assert "FAIL" not in text
        assert "demo finished: all steps behaved\nnext: " in text

    async def test_demo_shows_what_the_plugin_changed(self) -> None:
        """The demo shows kubelet's CreateContainer against what the runtime received, field by field:
        ``unset -> value`` for what the plugin set, ``(kept)`` for what it left; then the next commands to
        try. It printed only what the runtime received, and no next step."""
        out = io.StringIO()
        assert 0 == await run_demo(out)
        lines = [line.split() for line in out.getvalue().splitlines()]
        changes = {words[0]: " ".join(words[1:]) for words in lines if words and "." in words[0]}
        assert "unset -> 50000" == changes["linux.resources.cpu_quota"]
        assert "unset -> 100000" == changes["linux.resources.cpu_period"]
        assert "unset -> 268435456" == changes["linux.resources.memory_limit_in_bytes"]
        assert "unset -> '0-1'" == changes["linux.resources.cpuset_cpus"]
        assert "2 (kept)" == changes["linux.resources.cpu_shares"]
        assert "unset -> 'demo-limits'" == changes["annotations[demo.krproxy.io/limited-by]"]
        assert "krproxy hooks serve --help" in out.getvalue().split("demo finished")[1]

    async def test_demo_names_each_call(self) -> None:
        """Each CRI call the demo makes is one line naming its method, in the lifecycle's order."""
        out = io.StringIO()
        assert 0 == await run_demo(out)
        named = [line[7:31].rstrip() for line in out.getvalue().splitlines() if line[7:31].endswith("  ")]
        assert [
            "Version",
            "RunPodSandbox",
            "CreateContainer",
            "StartContainer",
            "ContainerStatus",
            "ExecSync",
            "StopContainer",
            "RemoveContainer",
            "StopPodSandbox",
            "RemovePodSandbox",
            "ListPodSandbox",
        ] == named

    def test_demo_command(self) -> None:
        """`krproxy demo` as a command exits 0 and leaves no socket directory behind."""
        result = subprocess.run(
            [sys.executable, "-m", "krproxy", "demo"], capture_output=True, text=True, timeout=60
        )
        assert 0 == result.returncode, result.stdout + result.stderr
        workdir = next(
            line for line in result.stdout.splitlines() if "sockets and hook dir in" in line
        ).split()[-1]
        assert not os.path.exists(workdir)

    def test_a_deep_tmpdir_moves_the_sockets_to_tmp(self, short_tmp: pathlib.Path) -> None:
        """With a TMPDIR so deep that socket paths in it would be too long for unix sockets, the demo puts
        its sockets in /tmp and behaves (it ended in an exception-group traceback)."""
        deep = short_tmp / ("d" * 100)
        deep.mkdir()
        result = subprocess.run(
            [sys.executable, "-m", "krproxy", "demo"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "TMPDIR": str(deep)},
        )
        assert 0 == result.returncode, result.stdout + result.stderr
        assert "sockets and hook dir in /tmp/krproxy-demo-" in result.stdout
        assert "Traceback" not in result.stderr

    def test_no_usable_tmpdir_is_one_line(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """When no work directory can be made, the demo says so in one line, with the fix, exit 1."""

        def refuse(*args: object, **kwargs: object) -> str:
            raise PermissionError(13, "Permission denied", "/nowhere")

        monkeypatch.setattr(tempfile, "mkdtemp", refuse)
        assert 1 == trio.run(run_demo, io.StringIO())
        err = capsys.readouterr().err
        assert "krproxy demo: error: cannot make a work directory" in err and "set TMPDIR" in err
