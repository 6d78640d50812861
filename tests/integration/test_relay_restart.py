"""A restart of krproxy under a steady stream of calls fails none (issue 16).

As under systemd socket activation (``deploy/krproxy.socket``), the test holds the listening
socket and passes it to each ``krproxy serve`` process as fd 3 (``LISTEN_FDS``/``LISTEN_PID``).
On SIGTERM the daemon sends the two-step GOAWAY (RFC 9113 §6.8) and lets its calls finish; the
caller's next calls go on a new connection, which waits in the socket's backlog until the
successor accepts it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pb_grpc

from krproxy.bench._support import Processes, _serve_args
from tests.integration.support import LIVENESS_LIMIT

#: Run in the child in place of a ``preexec_fn``: fd 3 and ``LISTEN_PID`` (this process's pid, which
#: ``exec`` keeps) set, then ``exec`` of the daemon. A ``preexec_fn`` runs Python between fork and
#: exec in a child of this process, whose other threads (grpcio's) it inherits in whatever state
#: they were: a successor daemon died there of SIGABRT (exit code -6, grpc's "epoll_wait error:
#: Bad file descriptor" in its log) and every call then timed out on the socket no one accepted;
#: another run hung in that fork. Without a ``preexec_fn`` the child runs no Python before exec.
_AS_SYSTEMD_DOES = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ["LISTEN_FDS"] = "1"
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def _activated(argv: list[str], listener: socket.socket, log: str) -> subprocess.Popen[bytes]:
    """Start ``python argv`` with ``listener`` as its fd 3, the way systemd passes a socket."""
    fd = listener.fileno()
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", _AS_SYSTEMD_DOES, str(fd), *argv], stdout=out, stderr=out, pass_fds=(fd,)
        )


def _serve_activated(
    workdir: str,
    procs: Processes,
    listener: socket.socket,
    daemons: list[subprocess.Popen[bytes]],
    *fake_args: str,
) -> tuple[str, list[str], str]:
    """The fake containerd (``fake_args`` added) and ``krproxy serve`` on ``listener``, bound at
    ``workdir/krproxy.sock``, as systemd starts it (appended to ``daemons``); returns the socket
    path, the daemon's argv (to start its successor) and its log file."""
    backend = os.path.join(workdir, "containerd.sock")
    procs.start("containerd", ["-m", "krproxy.fakes.containerd", "--socket", backend, *fake_args], backend)
    listen = os.path.join(workdir, "krproxy.sock")
    listener.bind(listen)
    listener.listen(128)
    hooks = os.path.join(workdir, "hooks")
    os.makedirs(hooks)
    argv = _serve_args(listen, backend, hooks, "--log-level=info")
    log = os.path.join(workdir, "krproxy.log")
    daemons.append(_activated(argv, listener, log))
    return listen, argv, log


def _stop_all(daemons: list[subprocess.Popen[bytes]], procs: Processes, listener: socket.socket) -> None:
    """Stop the daemons still running (SIGTERM, as systemd does), the fakes, and close the socket."""
    for daemon in daemons:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=20)
    procs.stop()
    listener.close()


@pytest.fixture
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="krrestart-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_restart_with_an_inherited_socket_fails_no_call(workdir: str) -> None:
    procs = Processes(workdir)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        listen, argv, log = _serve_activated(workdir, procs, listener, daemons)

        stop = threading.Event()
        latencies: list[float] = []
        failures: list[str] = []

        # A connection made during the restart waits in the socket's backlog until the successor has
        # started, which a loaded machine may take more than grpcio's 20 s connection timeout to do
        # (seen: every call failed UNAVAILABLE "timed out before receiving SETTINGS frame" from then
        # on, as the channel backed off). min_reconnect_backoff_ms is also grpcio's minimum connect
        # timeout; the calls' deadlines and the phases' bounds are as long.
        patience = 2 * LIVENESS_LIMIT

        def steady_calls() -> None:
            options = [("grpc.min_reconnect_backoff_ms", int(patience * 1000))]
            with grpc.insecure_channel(f"unix://{listen}", options=options) as channel:
                stub = pb_grpc.RuntimeServiceStub(channel)
                while not stop.is_set():
                    started = time.monotonic()
                    try:
                        stub.Version(pb.VersionRequest(), timeout=patience)
                    except grpc.RpcError as err:
                        failures.append(f"{err.code()}: {err.details()}")
                    latencies.append(time.monotonic() - started)

        caller = threading.Thread(target=steady_calls)
        caller.start()
        try:
            # Each phase has its own liveness bound: a loaded machine may take most of one to start a
            # daemon, and the successor must not be left only what the first phase did not use.
            deadline = time.monotonic() + patience
            while len(latencies) < 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            before = len(latencies)
            daemons[0].send_signal(signal.SIGTERM)
            assert 0 == daemons[0].wait(timeout=20)
            stopped = len(latencies)
            daemons.append(_activated(argv, listener, log))  # as systemd's Restart= would
            deadline = time.monotonic() + patience
            while len(latencies) < stopped + 200 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop.set()
            caller.join(timeout=2 * patience)
        slowest = max(latencies[before:])
        print(f"calls: {len(latencies)}, during the restart the slowest took {slowest:.3f} s")
        with open(log, "rb") as out:
            text = out.read()
        states = [daemon.poll() for daemon in daemons]
        context = f"daemons' exit codes {states}; their log:\n{text.decode(errors='replace')}"
        assert [] == failures, context
        assert len(latencies) >= stopped + 200, f"the successor served no calls; {context}"
        assert 2 == text.count(b"event=socket_activated")
        assert 1 == text.count(b"event=stopped")
        assert os.path.exists(listen)  # the socket file is systemd's: left in place
    finally:
        _stop_all(daemons, procs, listener)


def test_docker_mode_leaves_an_inherited_socket_file_in_place(workdir: str) -> None:
    """Docker mode takes the socket from systemd too; at stop the file stays (it is systemd's:
    removing it would leave the still-listening socket without a path for the successor)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listen = os.path.join(workdir, "krproxy.sock")
    listener.bind(listen)
    listener.listen(16)
    hooks = os.path.join(workdir, "hooks")
    os.makedirs(hooks)
    argv = [
        *_serve_args(listen, os.path.join(workdir, "docker.sock"), hooks, "--log-level=info"),
        "--backend-runtime-mode=Docker",
    ]
    log = os.path.join(workdir, "krproxy.log")
    daemon = _activated(argv, listener, log)
    try:
        deadline = time.monotonic() + 30
        while b"event=ready" not in open(log, "rb").read() and time.monotonic() < deadline:  # noqa: SIM115
            time.sleep(0.05)
        daemon.send_signal(signal.SIGTERM)
        assert 0 == daemon.wait(timeout=20)
        text = open(log, "rb").read()  # noqa: SIM115
        assert b"event=socket_activated" in text and b"event=stopped" in text
        assert os.path.exists(listen)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        listener.close()
