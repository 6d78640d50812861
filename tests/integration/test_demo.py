"""`krproxy demo`, the README's main-job command, behaves and says what happened."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from krproxy.demo import run_demo


class TestDemo:
    async def test_demo_in_process(self) -> None:
        """Every step of the demo succeeds and the plugin's limits reach the runtime."""
        out = io.StringIO()
        assert 0 == await run_demo(out)
        text = out.getvalue()
        assert "FAIL" not in text
        assert "cpu_quota=50000 cpu_period=100000 memory_limit=268435456 cpuset_cpus='0-1'" in text
        assert text.rstrip().endswith("demo finished: all steps behaved")

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
