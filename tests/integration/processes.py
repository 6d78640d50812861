"""krproxy and the echo backend as processes of their own, for the tests of the daemon as a process."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc

from tests.integration.support import LIVENESS_LIMIT

ECHO_BACKEND = os.path.join(os.path.dirname(__file__), "echo_backend.py")


def wait_for_socket(path: str, process: subprocess.Popen[bytes], limit: float = LIVENESS_LIMIT) -> None:
    channel = grpc.insecure_channel(f"unix://{path}")
    try:
        grpc.channel_ready_future(channel).result(timeout=limit)
    except grpc.FutureTimeoutError:
        process.kill()
        raise AssertionError(f"{path} never became ready; stderr: {process.communicate()[1]!r}") from None
    finally:
        channel.close()


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
