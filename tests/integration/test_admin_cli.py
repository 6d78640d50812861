"""`krproxy status` as a process, against `krproxy serve --metrics-address 127.0.0.1:0` as a process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from tests.integration.support import STARTUP_LIMIT

#: How long a daemon may take to start (imports included) before a test gives up.
START_LIMIT = STARTUP_LIMIT


def _wait_for(predicate: object, what: str, process: subprocess.Popen[bytes], log: str) -> None:
    deadline = time.monotonic() + START_LIMIT
    while not predicate():  # type: ignore[operator]
        if process.poll() is not None or time.monotonic() > deadline:
            with open(log, "rb") as f:
                raise AssertionError(f"{what} never happened; log: {f.read()!r}")
        time.sleep(0.05)


def start_containerd(sockdir: str, processes: list[subprocess.Popen[bytes]]) -> str:
    path = os.path.join(sockdir, "containerd.sock")
    log = os.path.join(sockdir, "containerd.log")
    with open(log, "wb") as f:
        process = subprocess.Popen(
            [sys.executable, "-m", "krproxy.fakes.containerd", "--socket", path], stderr=f
        )
    processes.append(process)
    _wait_for(lambda: os.path.exists(path), "fake containerd listening", process, log)
    return path


def start_daemon(sockdir: str, runtime: str, processes: list[subprocess.Popen[bytes]]) -> str:
    """Start `krproxy serve` with the admin endpoint on a free loopback port; return its HOST:PORT."""
    log = os.path.join(sockdir, "daemon.log")
    with open(log, "wb") as f:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "krproxy",
                "serve",
                f"--koord-runtimeproxy-endpoint={sockdir}/proxy.sock",
                f"--remote-runtime-service-endpoint={runtime}",
                f"--hook-dir={sockdir}/hooks",
                "--metrics-address=127.0.0.1:0",
            ],
            stderr=f,
        )
    processes.append(process)
    found: list[str] = []

    def listening() -> bool:
        with open(log) as f:
            found[:] = re.findall(r"event=admin_listening address=(\S+)", f.read())
        return bool(found)

    _wait_for(listening, "admin_listening", process, log)
    return found[0]


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "krproxy", "status", *args],
        capture_output=True,
        text=True,
        timeout=STARTUP_LIMIT,
    )


def wait_ready(address: str) -> subprocess.CompletedProcess[str]:
    deadline = time.monotonic() + START_LIMIT
    while True:
        result = status(f"--metrics-address={address}")
        if result.returncode != 1 or time.monotonic() > deadline:
            return result
        time.sleep(0.1)


class TestStatusCommand:
    def test_ready_daemon(self, sockdir: str, processes: list[subprocess.Popen[bytes]]) -> None:
        """Against a ready daemon: exit 0 and a readable report; --json gives the document."""
        address = start_daemon(sockdir, start_containerd(sockdir, processes), processes)

        text = wait_ready(address)
        as_json = status(f"--metrics-address={address}", "--json")

        assert 0 == text.returncode, text.stderr
        assert "ready: yes" in text.stdout
        assert f"listen: {sockdir}/proxy.sock (accepting calls)" in text.stdout
        assert f"backend runtime: {sockdir}/containerd.sock" in text.stdout
        assert "plugins (" in text.stdout
        assert 0 == as_json.returncode
        document = json.loads(as_json.stdout)
        assert (True, processes[-1].pid) == (document["ready"], document["pid"])

    def test_not_ready_daemon(self, sockdir: str, processes: list[subprocess.Popen[bytes]]) -> None:
        """A daemon whose runtime is down is running but not ready: exit 1, with the reason."""
        address = start_daemon(sockdir, f"{sockdir}/nothing.sock", processes)

        result = status(f"--metrics-address={address}")

        assert 1 == result.returncode, result.stderr
        assert "ready: NO — the store is not recovered from the runtime yet" in result.stdout

    def test_unreachable(self, sockdir: str) -> None:
        """Nobody at the address: exit 2 and a message on stderr that says what to check."""
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]  # bound, never listening: connections are refused

            result = status(f"--metrics-address=127.0.0.1:{port}", "--timeout=2")

        assert (2, "") == (result.returncode, result.stdout)
        assert "no krproxy status at 127.0.0.1:" in result.stderr
        # It says what to check: the admin endpoint is off unless the daemon was given the flag.
        assert f"is krproxy serve (or nri) running with --metrics-address=127.0.0.1:{port}?" in result.stderr
