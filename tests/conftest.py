"""Fixtures shared by every test suite.

- ``short_tmp``: a fresh directory under ``/tmp`` with a short path (unix socket paths are limited
  to 107 bytes, and pytest's ``tmp_path`` can be longer), removed afterwards.
- ``fake_containerd``: a :class:`~krproxy.fakes.containerd.FakeContainerd` served on a socket in
  ``short_tmp``, with a deterministic clock and IDs; yields ``(fake, socket_path)``.
- ``cri_client``: a factory ``cri_client(socket_path) -> CriClient`` of independent grpcio clients
  (upstream ``cri_api`` stubs), closed at teardown.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import grpc
import hypothesis
import pytest
import trio
from cri_api.v1 import api_pb2_grpc

from krproxy.fakes.containerd import (
    FakeContainerd,
    RuntimeState,
    run_fake_containerd,
    sequential_ids,
    stepping_clock,
)
from krproxy.fakes.containerd.records import LIST_SEED_ENV
from krproxy.relay import connection as relay_connection

#: Signals the tests send to the processes they start, or which those processes rely on.
CHILD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _still_ignored(signum: int, frame: object) -> None:
    """In place of SIG_IGN in the pytest process: the signal is still ignored here."""


def children_start_with_default_signals() -> None:
    """Replace each inherited SIG_IGN of :data:`CHILD_SIGNALS` with a handler that does nothing.

    A process started from a background job (``cmd &`` in a script, ``nohup``) inherits SIGINT
    (SIGHUP) ignored, and an ignored signal stays ignored across ``exec``: every process a test
    started then ignored it too, and a test sending it SIGINT failed (a ``krproxy trace replay``
    went on waiting, since Python installs its KeyboardInterrupt handler only where SIGINT is at
    its default). A caught signal is reset to its default by ``exec``, so with a handler here the
    children start as from a terminal, while this process keeps ignoring the signal as asked.
    """
    for signum in CHILD_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_IGN:
            signal.signal(signum, _still_ignored)


def pytest_configure(config: pytest.Config) -> None:
    """Fix the fake containerd's list order for the session (lists come shuffled, as containerd's);
    let the processes the tests start begin with the default signal dispositions."""
    os.environ.setdefault(LIST_SEED_ENV, str(random.randrange(2**32)))
    children_start_with_default_signals()


def _list_seed_line() -> str:
    seed = os.environ[LIST_SEED_ENV]
    return f"fake containerd list order: {LIST_SEED_ENV}={seed} (set it to repeat this run's orders)"


def pytest_report_header(config: pytest.Config) -> str:
    return _list_seed_line()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The seed again after a failure (``-q`` hides the header)."""
    if exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        terminalreporter.write_line(_list_seed_line())


class _RelayBugs(logging.Handler):
    """Keeps the records of the relay's last resort (:data:`krproxy.relay.connection.BUG_MESSAGE`)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == relay_connection.BUG_MESSAGE:
            self.seen.append(record)


@pytest.fixture(autouse=True)
def _no_relay_bug(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test in which the relay met a bug of its own. In the daemon such a bug closes the one
    connection it was met on and is logged, so that the daemon keeps serving the others; in a test
    it must not pass quietly. A test that injects one is marked ``relay_bug_expected``."""
    handler = _RelayBugs()
    logger = logging.getLogger("krproxy.relay")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if handler.seen and request.node.get_closest_marker("relay_bug_expected") is None:
        first = handler.seen[0]
        pytest.fail(f"the relay met a bug of its own: {first.getMessage()}\n{handler.format(first)}")


#: Generous client-side deadline for grpcio calls in tests: a hung call fails instead of hanging. A
#: liveness bound, long enough for a loaded machine (CI runs three suites at once on 2 cores).
CALL_TIMEOUT = 30.0

# Every run: no per-example deadline and no data-generation-speed health check. Both are wall-clock
# limits (200 ms an example; generation that is "too slow"), which a loaded 2-core machine exceeds now
# and then (a first example that decoded 300 ms failed as DeadlineExceeded); speed is measured by
# `nox -s bench`, not asserted here. `--hypothesis-profile=NAME` still replaces this profile.
hypothesis.settings.register_profile(
    "krproxy", deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
hypothesis.settings.load_profile("krproxy")
# `--hypothesis-profile=fuzz`: the long fuzzing run (see tests/fuzz/__init__.py for the budget).
hypothesis.settings.register_profile(
    "fuzz", parent=hypothesis.settings.get_profile("krproxy"), print_blob=True
)


@attrs.define
class CriClient:
    """Synchronous grpcio CRI stubs for one socket, plus a helper to call them from trio."""

    channel: grpc.Channel
    runtime: Any
    image: Any

    async def call(self, method: Callable[..., Any], request: Any, *, deadline: float = CALL_TIMEOUT) -> Any:
        """Run a unary grpcio call in a worker thread so the trio loop (and the server) keep going.

        ``deadline`` is the grpcio call timeout in seconds (real time; the server sees it too).
        """
        return await trio.to_thread.run_sync(functools.partial(method, request, timeout=deadline))


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kp-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def serve_fake_containerd(
    nursery: trio.Nursery, path: str, *, enforce_deadlines: bool = True, **state: Any
) -> FakeContainerd:
    """A fake containerd on ``path`` whose ids count up and whose clock steps (its answers are the
    same on every run); ``state`` goes to its :class:`RuntimeState` (e.g. ``pod_resize=False``,
    ``imitate="2.3"``). It imitates containerd 1.6 but answers UpdatePodSandboxResources (as 2.3 does)
    unless told ``pod_resize=False``: the hook tests of that point need a runtime that has it."""
    state.setdefault("pod_resize", True)
    fake = FakeContainerd(
        RuntimeState(clock=stepping_clock(), new_id=sequential_ids(), **state),
        enforce_deadlines=enforce_deadlines,
    )
    await nursery.start(run_fake_containerd, path, fake)
    return fake


@pytest.fixture
async def fake_containerd(short_tmp: Path) -> AsyncIterator[tuple[FakeContainerd, str]]:
    path = str(short_tmp / "containerd.sock")
    async with trio.open_nursery() as nursery:
        yield await serve_fake_containerd(nursery, path), path
        nursery.cancel_scope.cancel()


@pytest.fixture
def cri_client() -> Iterator[Callable[[str], CriClient]]:
    channels: list[grpc.Channel] = []

    def connect(path: str) -> CriClient:
        channel = grpc.insecure_channel("unix://" + path)
        channels.append(channel)
        return CriClient(
            channel=channel,
            runtime=api_pb2_grpc.RuntimeServiceStub(channel),
            image=api_pb2_grpc.ImageServiceStub(channel),
        )

    yield connect
    for channel in channels:
        channel.close()
