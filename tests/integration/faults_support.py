"""Helpers of the fault-injection suite (``test_faults_*``); this module holds no tests.

- Leak accounting for in-process daemons: :func:`open_fds`, :func:`trio_tasks` and :class:`Usage`, a
  snapshot of both to compare before and after a burst of trouble.
- Processes: :class:`Processes` starts fake containerds (``python -m tests.integration.faults_support``,
  a fake that can be told to answer slowly) and ``krproxy serve`` daemons as real processes, with their
  stderr in a file, and kills whatever is left at teardown.
- :func:`version_ok`: the "daemon keeps serving" probe, a Version call on a fresh connection.

Run as a program it serves a fake containerd on ``--socket``, optionally seeded and with ``--delay
METHOD=SECONDS`` faults on every call of a method (so a test can kill it while a call is in flight)::

    python -m tests.integration.faults_support --socket /tmp/x/containerd.sock --delay Version=30
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import attrs
import grpc
import trio
from cri_api.v1 import api_pb2, api_pb2_grpc

from krproxy.fakes.containerd import FakeContainerd, Fault, run_fake_containerd
from tests.integration.support import STARTUP_LIMIT

#: fds that may legitimately come and go around a burst (the relay reconnecting a backend or plugin
#: connection, the watcher's scandir): a leak grows with the number of calls, not by this much.
#: Each connection has a trio task of its own, so trio tasks get the same allowance.
FD_SLACK = 4


def open_fds(pid: int | str = "self") -> int:
    """How many file descriptors the process has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def trio_task_names() -> list[str]:
    """Names of the live trio tasks below the root task."""

    def walk(task: trio.lowlevel.Task) -> Iterator[str]:
        yield task.name
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                yield from walk(child)

    return list(walk(trio.lowlevel.current_root_task()))


def trio_tasks() -> int:
    """Live trio tasks below the root task."""
    return len(trio_task_names())


@attrs.frozen
class Usage:
    """fds and trio tasks of this process at one moment."""

    fds: int
    trio_tasks: int

    @classmethod
    def now(cls) -> Usage:
        return cls(open_fds(), trio_tasks())

    def leaked_since(self, before: Usage) -> bool:
        return self.fds > before.fds + FD_SLACK or self.trio_tasks > before.trio_tasks + FD_SLACK


async def settled_usage(before: Usage, limit: float = 30.0) -> Usage:
    """The usage once it is back within the allowance of ``before`` (finished calls need a moment to
    close their streams), or the last one seen after ``limit`` seconds, for the assertion to show."""
    deadline = trio.current_time() + limit
    while True:
        usage = Usage.now()
        if not usage.leaked_since(before) or trio.current_time() > deadline:
            return usage
        await trio.sleep(0.05)


async def assert_no_leak(before: Usage) -> None:
    """Fail unless fds and tasks return to within the allowance of ``before``."""
    after = await settled_usage(before)
    assert not after.leaked_since(before), f"leak: before {before}, after {after}"


def channel(path: str) -> grpc.Channel:
    """A grpcio channel to a unix socket, without retries (a failure shows as it happened)."""
    return grpc.insecure_channel(f"unix://{path}", options=[("grpc.enable_retries", 0)])


def version_ok(path: str, timeout: float = 5.0) -> bool:
    """Whether a Version call on a fresh connection to ``path`` succeeds (blocking; use a thread)."""
    with channel(path) as ch:
        reply = api_pb2_grpc.RuntimeServiceStub(ch).Version(api_pb2.VersionRequest(), timeout=timeout)
    return bool(reply.runtime_name)


def wait_for_socket(
    path: str, process: subprocess.Popen[bytes], log: str, limit: float = STARTUP_LIMIT
) -> None:
    """Block until ``path`` accepts gRPC connections; kill ``process`` and fail if it never does."""
    with channel(path) as ch:
        try:
            grpc.channel_ready_future(ch).result(timeout=limit)
        except grpc.FutureTimeoutError:
            process.kill()
            process.wait()
            with open(log) as f:
                raise AssertionError(f"{path} never became ready; log:\n{f.read()}") from None


@attrs.define
class Process:
    """A started process, its socket and its stderr log file."""

    popen: subprocess.Popen[bytes]
    socket: str
    log: str

    @property
    def pid(self) -> int:
        return self.popen.pid

    def read_log(self) -> str:
        with open(self.log) as f:
            return f.read()

    def kill(self) -> None:
        """SIGKILL and reap: no clean-up of any kind happens in the process."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait()

    def events(self, name: str) -> list[dict[str, str]]:
        """The fields of every logfmt ``event=<name>`` line of the log (values unquoted)."""
        found = []
        for line in self.read_log().splitlines():
            fields = dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)', line))
            if fields.get("event") == name:
                found.append({k: v.strip('"') for k, v in fields.items()})
        return found


@attrs.define
class Processes:
    """Starts processes for one test and kills any still running at :meth:`close`."""

    directory: str
    started: list[Process] = attrs.field(factory=list)

    def _start(self, name: str, argv: Sequence[str], socket: str) -> Process:
        log = os.path.join(self.directory, f"{name}-{len(self.started)}.log")
        with open(log, "wb") as stderr:
            popen = subprocess.Popen([sys.executable, *argv], stderr=stderr, stdout=subprocess.DEVNULL)
        process = Process(popen, socket, log)
        self.started.append(process)
        wait_for_socket(socket, popen, log)
        return process

    def containerd(
        self,
        socket: str,
        *,
        seed_pods: int = 0,
        containers_per_pod: int = 1,
        delays: dict[str, float] | None = None,
    ) -> Process:
        """A fake containerd process on ``socket`` (see this module's docstring)."""
        argv = ["-m", "tests.integration.faults_support", "--socket", socket]
        argv += ["--seed-pods", str(seed_pods), "--containers-per-pod", str(containers_per_pod)]
        for method, seconds in (delays or {}).items():
            argv += ["--delay", f"{method}={seconds}"]
        return self._start("containerd", argv, socket)

    def plugin(self, argv: Sequence[str], socket: str) -> Process:
        """A process serving a hook plugin on ``socket`` (``argv``: after the interpreter)."""
        return self._start("plugin", argv, socket)

    def proxy(self, listen: str, runtime: str, hook_dir: str, *extra: str) -> Process:
        """``krproxy serve`` on ``listen`` in front of ``runtime``, logging at info level."""
        argv = [
            "-m",
            "krproxy",
            "serve",
            f"--koord-runtimeproxy-endpoint=unix://{listen}",
            f"--remote-runtime-service-endpoint=unix://{runtime}",
            f"--hook-dir={hook_dir}",
            *extra,
        ]
        return self._start("proxy", argv, listen)

    def close(self) -> None:
        for process in self.started:
            process.kill()


@contextlib.contextmanager
def processes(directory: str) -> Iterator[Processes]:
    started = Processes(directory)
    try:
        yield started
    finally:
        started.close()


async def wait_for_log(
    process: Process, event: str, count: int = 1, limit: float = 30.0
) -> list[dict[str, str]]:
    """Wait until ``process`` logged ``event`` at least ``count`` times; return those lines' fields."""
    with trio.fail_after(limit):
        while len(found := process.events(event)) < count:  # noqa: ASYNC110 - another process's log
            await trio.sleep(0.05)
    return found


def blocking_wait_for_log(process: Process, event: str, limit: float = 30.0) -> list[dict[str, str]]:
    """:func:`wait_for_log` for synchronous tests."""
    deadline = time.monotonic() + limit
    while not (found := process.events(event)):
        if time.monotonic() > deadline:
            raise AssertionError(f"no event={event} within {limit}s; log:\n{process.read_log()}")
        time.sleep(0.05)
    return found


# -- the fake containerd as a program ---------------------------------------------------------------


def _delay(value: str) -> tuple[str, float]:
    method, sep, seconds = value.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected METHOD=SECONDS, not {value!r}")
    return method, float(seconds)


async def _serve(path: str, fake: FakeContainerd) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(run_fake_containerd, path, fake)
            async for _ in signals:
                break
            nursery.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.integration.faults_support")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--seed-pods", type=int, default=0)
    parser.add_argument("--containers-per-pod", type=int, default=1)
    parser.add_argument("--delay", type=_delay, action="append", default=[], metavar="METHOD=SECONDS")
    args = parser.parse_args(argv)
    fake = FakeContainerd()
    if args.seed_pods:
        fake.seed(args.seed_pods, args.containers_per_pod)
    for method, seconds in args.delay:
        fake.inject(method, Fault(delay=seconds, times=None))
    trio.run(_serve, args.socket, fake)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
