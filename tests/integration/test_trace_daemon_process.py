"""`krproxy serve --record` as a real process: SIGUSR1 toggles recording, SIGTERM leaves a readable trace."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable

import grpc

from krproxy.trace import load
from tests.integration.processes import start_daemon
from tests.integration.support import in_thread, raw_unary

VERSION = "/runtime.v1.RuntimeService/Version"


def _wait_for_line(process: subprocess.Popen[bytes], text: str, limit: float = 10.0) -> str:
    assert process.stderr is not None
    deadline = time.monotonic() + limit
    seen = []
    while time.monotonic() < deadline:
        line = process.stderr.readline().decode()
        seen.append(line)
        if text in line:
            return line
    raise AssertionError(f"{text!r} not logged; stderr so far: {''.join(seen)}")


class TestRecordingSignals:
    async def test_sigusr1_toggles_and_sigterm_flushes(
        self, sockdir: str, echo_backend: str, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """SIGUSR1 logs state=off then state=on; only calls made while on are in the trace after SIGTERM."""
        trace = os.path.join(sockdir, "trace.krt")
        process, listen = start_daemon(sockdir, echo_backend, f"--record={trace}")
        try:
            version = raw_unary(channel_to(listen), VERSION)
            _wait_for_line(process, "event=recording state=on")
            await in_thread(version, b"\x0a\x01a", timeout=10)
            process.send_signal(signal.SIGUSR1)
            assert f"file={trace}" in _wait_for_line(process, "event=recording state=off")
            await in_thread(version, b"\x0a\x01b", timeout=10)
            process.send_signal(signal.SIGUSR1)
            _wait_for_line(process, "event=recording state=on")
            await in_thread(version, b"\x0a\x01c", timeout=10)
            process.send_signal(signal.SIGTERM)
            assert 0 == process.wait(20)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert [b"\x0a\x01a", b"\x0a\x01c"] == [r.request for r in load([trace]).records]
