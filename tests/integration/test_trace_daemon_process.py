"""`krproxy serve --record` as a real process: SIGUSR1 toggles recording, SIGTERM leaves a readable trace,
also when it stops the process while calls pour in: the trace reads cleanly and holds every call that was answered."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable

import grpc

from krproxy.trace import load
from tests.integration.processes import start_daemon
from tests.integration.support import in_thread, raw_unary, wait_until

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


# -- SIGTERM under load ------------------------------------------------------------------------

CALLERS = 8


def call_until_refused(listen: str, caller: int, answered: list[bytes]) -> None:
    """Version calls one after another, each with its own request, until the proxy stops answering."""
    channel = grpc.insecure_channel(f"unix://{listen}", options=[("grpc.enable_retries", 0)])
    version = raw_unary(channel, VERSION)
    try:
        for n in range(100_000):
            request = b"\x0a\x06" + f"{caller:02d}{n:04d}".encode()
            try:
                reply = version(request, timeout=10)
            except grpc.RpcError:
                return  # draining, then gone
            assert request == reply
            answered.append(request)
    finally:
        channel.close()


async def stop_under_load(process: subprocess.Popen[bytes], listen: str, signum: int) -> list[bytes]:
    """Send ``signum`` to the daemon once CALLERS callers in a loop have had 300 answers; wait for it
    to end and the callers to stop. Returns the requests that were answered."""
    answered: list[bytes] = []
    threads = [
        threading.Thread(target=call_until_refused, args=(listen, k, answered), daemon=True)
        for k in range(CALLERS)
    ]
    for thread in threads:
        thread.start()
    try:
        await wait_until(lambda: len(answered) >= 300)
        process.send_signal(signum)
        await in_thread(process.wait, 30)
    finally:
        for thread in threads:
            await in_thread(thread.join, 30)
    assert not any(thread.is_alive() for thread in threads)
    return answered


class TestSigtermUnderLoad:
    async def test_every_answered_call_is_in_the_trace(
        self, sockdir: str, echo_backend: str, processes: list[subprocess.Popen[bytes]]
    ) -> None:
        """Eight callers in a loop; SIGTERM once a few hundred calls are answered: exit 0, the trace
        has no torn or damaged record, and every answered call is in it once."""
        trace = os.path.join(sockdir, "trace.krt")
        process, listen = start_daemon(sockdir, echo_backend, f"--record={trace}")
        processes.append(process)
        answered = await stop_under_load(process, listen, signal.SIGTERM)
        # The daemon's log, for the messages below: one run of the whole suite on a loaded machine
        # found none of 328 answered calls in the trace (a header only), and no run since has.
        log = process.stderr.read().decode(errors="replace") if process.stderr is not None else ""
        assert 0 == process.returncode, log
        loaded = load([trace])
        recorded = [r.request for r in loaded.records if r.path == VERSION]
        assert () == loaded.notes, log
        assert len(recorded) == len(set(recorded))
        assert set(answered) <= set(recorded), (
            f"{len(set(answered) - set(recorded))} answered calls not recorded, "
            f"{len(loaded.records)} records in {sorted(os.listdir(sockdir))}; the daemon's log:\n{log}"
        )

    async def test_after_sigkill_the_next_daemon_appends_to_a_clean_file(
        self, sockdir: str, echo_backend: str, processes: list[subprocess.Popen[bytes]]
    ) -> None:
        """SIGKILL under load (no flush, maybe a torn last record): the file reads up to its last whole
        record; a daemon started again on it cuts any torn tail and appends its own calls after."""
        trace = os.path.join(sockdir, "trace.krt")
        process, listen = start_daemon(sockdir, echo_backend, f"--record={trace}")
        processes.append(process)
        answered = await stop_under_load(process, listen, signal.SIGKILL)
        before = load([trace]).records
        assert set(r.request for r in before) <= set(answered)
        os.unlink(listen)  # left by the killed process; the next one would replace it as stale anyway
        again, listen = start_daemon(sockdir, echo_backend, f"--record={trace}")
        processes.append(again)
        channel = grpc.insecure_channel(f"unix://{listen}")
        try:
            assert b"\x0a\x04last" == await in_thread(
                raw_unary(channel, VERSION), b"\x0a\x04last", timeout=10
            )
        finally:
            channel.close()
        again.send_signal(signal.SIGTERM)
        assert 0 == await in_thread(again.wait, 30)
        after = load([trace])
        assert () == after.notes
        assert [*[r.request for r in before], b"\x0a\x04last"] == [r.request for r in after.records]
