"""krproxy and the echo backend as processes of their own, for the tests of the daemon as a process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc

from tests.integration.support import STARTUP_LIMIT

ECHO_BACKEND = os.path.join(os.path.dirname(__file__), "echo_backend.py")


def wait_for_socket(path: str, process: subprocess.Popen[bytes], limit: float = STARTUP_LIMIT) -> None:
    channel = grpc.insecure_channel(f"unix://{path}")
    try:
        grpc.channel_ready_future(channel).result(timeout=limit)
    except grpc.FutureTimeoutError:
        process.kill()
        raise AssertionError(f"{path} never became ready; stderr: {process.communicate()[1]!r}") from None
    finally:
        channel.close()


def wait_for_file(
    path: str | os.PathLike[str], process: subprocess.Popen[bytes], limit: float = STARTUP_LIMIT
) -> None:
    """Wait until *path* exists (a child's socket or registration file); fail with the child's stderr
    if the child exits first or *limit* passes. The child is killed before its stderr is read, so a
    child that is still running cannot leave the test waiting for its end."""
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if process.poll() is not None or time.monotonic() >= deadline:
            process.kill()
            stderr = process.communicate()[1]
            raise AssertionError(
                f"{os.fspath(path)} never appeared (exit {process.returncode}); stderr: {stderr!r}"
            )
        time.sleep(0.05)


def start_daemon(sockdir: str, backend: str, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    listen = os.path.join(sockdir, "proxy.sock")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "krproxy",
            "serve",
            f"--koord-runtimeproxy-endpoint=unix://{listen}",
            f"--remote-runtime-service-endpoint=unix://{backend}",
            f"--hook-dir={sockdir}/hooks",
            *extra,
        ],
        stderr=subprocess.PIPE,
    )
    wait_for_socket(listen, process)
    return process, listen
