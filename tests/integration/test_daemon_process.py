"""`krproxy serve` as a real process: start-up, signals and graceful drain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

import grpc
import pytest
import trio

from tests.integration.processes import start_daemon
from tests.integration.support import in_thread, raw_unary

VERSION = "/runtime.v1.RuntimeService/Version"


class TestSignals:
    @pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
    async def test_sigterm_drains_in_flight_calls(
        self,
        signum: signal.Signals,
        sockdir: str,
        echo_backend: str,
        processes: list[subprocess.Popen[bytes]],
        channel_to: Callable[[str], grpc.Channel],
    ) -> None:
        """On SIGTERM a call in flight completes, the daemon exits 0 and removes its socket.

        SIGHUP (the terminal closed, or a ``kill -HUP`` meant as "reload") too: it used to kill the
        daemon at once, unlogged, the call cut and the socket file left behind."""
        process, listen = start_daemon(sockdir, echo_backend, "--grace-period=10")
        processes.append(process)
        call = raw_unary(channel_to(listen), VERSION)
        # Connected first: a call still connecting at SIGTERM would be refused, not drained (under load
        # 0.5 s was not always enough to connect and send it).
        assert b"ping" == await in_thread(call, b"ping", timeout=30)
        in_flight = call.future(b"sleep:1.5", timeout=30)
        await trio.sleep(0.5)
        process.send_signal(signum)
        assert b"sleep:1.5" == await in_thread(in_flight.result)
        _, stderr = await in_thread(process.communicate, timeout=20)
        assert 0 == process.returncode, stderr
        assert not await trio.Path(listen).exists()
        assert f"event=signal signal={signum.name}".encode() in stderr
        assert b"event=draining" in stderr
        assert b"event=stopped" in stderr

    async def test_grace_period_bounds_shutdown(
        self,
        sockdir: str,
        echo_backend: str,
        processes: list[subprocess.Popen[bytes]],
        channel_to: Callable[[str], grpc.Channel],
    ) -> None:
        """A call that outlives the grace period is cancelled and the daemon still exits 0."""
        process, listen = start_daemon(sockdir, echo_backend, "--grace-period=0.5")
        processes.append(process)
        call = raw_unary(channel_to(listen), VERSION)
        assert b"ping" == await in_thread(call, b"ping", timeout=30)  # connected first, as above
        in_flight = call.future(b"hang", timeout=30)
        await trio.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        _, stderr = await in_thread(process.communicate, timeout=20)
        assert 0 == process.returncode, stderr
        assert b"event=grace_period_over" in stderr
        with pytest.raises(grpc.RpcError):
            await in_thread(in_flight.result)


class TestStartup:
    def test_live_socket_is_an_error(self, sockdir: str, echo_backend: str) -> None:
        """A second daemon on the same socket exits 1 with a clear message, leaving the first alone."""
        first, listen = start_daemon(sockdir, echo_backend)
        try:
            second = subprocess.run(
                [sys.executable, "-m", "krproxy", "--koord-runtimeproxy-endpoint", listen],
                capture_output=True,
                timeout=30,
            )
            assert 1 == second.returncode
            assert b"event=socket_in_use" in second.stderr
            assert os.path.exists(listen)
        finally:
            first.send_signal(signal.SIGTERM)
            first.communicate(timeout=20)
        assert 0 == first.returncode

    def test_help_documents_every_flag(self) -> None:
        """`krproxy serve --help` names every koord-runtime-proxy flag and ours."""
        result = subprocess.run(
            [sys.executable, "-m", "krproxy", "serve", "--help"], capture_output=True, text=True, timeout=30
        )
        assert 0 == result.returncode
        for flag in (
            "--koord-runtimeproxy-endpoint",
            "--remote-runtime-service-endpoint",
            "--remote-image-service-endpoint",
            "--backend-runtime-mode",
            "--runtime-hook-server-key",
            "--runtime-hook-server-val",
            "--hook-dir",
            "--socket-mode",
            "--grace-period",
            "--log-level",
            "--log-format",
        ):
            assert flag in result.stdout

    def test_bad_endpoint_rejected(self, sockdir: str) -> None:
        """A non-unix endpoint is refused with exit code 2 and a message saying why."""
        result = subprocess.run(
            [sys.executable, "-m", "krproxy", "serve", "--remote-runtime-service-endpoint=tcp://1.2.3.4:5"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert 2 == result.returncode
        assert "only unix sockets are supported" in result.stderr
