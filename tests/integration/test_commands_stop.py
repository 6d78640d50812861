"""Every long-running command, as a process of its own, stops on exactly one SIGINT (Ctrl-C) or one SIGTERM
(systemd, kubelet): its stop line, its documented exit status (0 for a server; 128 plus the signal for a
one-shot command cut short, as a shell reports it) and no traceback (docs/operations.md, Stopping).

Each command is started, waited on until it says it is up (its signals are caught from then on), sent one
signal and waited on. The tests' children start with the default signal dispositions whatever the suite
inherited (tests/conftest.py), as from a terminal.
"""

from __future__ import annotations

import contextlib
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
from pathlib import Path

import attrs
import pytest

from krproxy.trace import format as fmt
from tests.integration.processes import wait_for_file
from tests.integration.support import LIVENESS_LIMIT, STARTUP_LIMIT

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_PLUGIN = ROOT / "examples" / "first_plugin.py"
#: plugin-authoring.md's NRI samples, each a program run by the runtime (or by hand) until stopped.
NRI_SAMPLES = sorted(path.stem for path in (ROOT / "examples" / "nri").glob("*.py"))
SIGNALS = [signal.SIGINT, signal.SIGTERM]
VERSION = "/runtime.v1.RuntimeService/Version"


@attrs.frozen
class Command:
    """A command line (``{tmp}`` and ``{runtime}`` filled in), the text it prints once its signals are
    caught, the text of its stop line, and whether a signal cuts short a one-shot command (exit 128+N)."""

    argv: tuple[str, ...]
    up: str
    stopped: str
    one_shot: bool = False


def _krproxy(*argv: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "krproxy", *argv)


COMMANDS = {
    "serve": Command(
        _krproxy(
            "serve",
            "--koord-runtimeproxy-endpoint=unix://{tmp}/proxy.sock",
            "--remote-runtime-service-endpoint=unix://{runtime}",
            "--hook-dir={tmp}/hooks",
        ),
        "event=ready",
        "event=stopped",
    ),
    # No NRI runtime: it keeps retrying, as on a node whose containerd has NRI off.
    "nri": Command(
        _krproxy("nri", "--nri-socket", "unix://{tmp}/nri.sock", "--hook-dir", "{tmp}/hooks"),
        "event=nri_started",
        "event=stopped mode=nri",
    ),
    "hooks-serve": Command(
        _krproxy("hooks", "serve", "--no-builtin", "--socket", "{tmp}/hs.sock", "--hook-dir", "{tmp}/hooks"),
        "event=hookserver_started",
        "event=hookserver_stopped",
    ),
    "hooks-standalone": Command(
        _krproxy("hooks", "standalone", "--no-builtin", "--cri-endpoint", "unix://{tmp}/absent.sock"),
        "event=standalone_started",
        "event=standalone_stopped",
    ),
    "trace-serve": Command(
        _krproxy("trace", "serve", "{tmp}/node.krt", "--socket", "{tmp}/ts.sock"),
        "event=serving",
        "event=stopped",
    ),
    # The recorded calls are a minute apart: the signal comes while replay waits for the second.
    "trace-replay-timing": Command(
        _krproxy(
            "trace", "replay", "--timing", "{tmp}/node.krt", "--target", "{runtime}", "--progress=always"
        ),
        "1/3",
        "krproxy trace replay: interrupted by",
        one_shot=True,
    ),
    "fake-containerd": Command(
        (sys.executable, "-m", "krproxy.fakes.containerd", "--socket", "{tmp}/fc.sock"),
        "event=listening",
        "event=stopped",
    ),
    "fake-plugin": Command(
        (
            sys.executable,
            "-m",
            "krproxy.fakes.plugin",
            "--socket",
            "{tmp}/fp.sock",
            "--hook-dir",
            "{tmp}/hooks",
        ),
        "event=registered",
        "event=stopped",
    ),
    "fake-dockerd": Command(
        (sys.executable, "-m", "krproxy.fakes.dockerd", "--socket", "{tmp}/fd.sock"),
        "fd.sock",
        "krproxy.fakes.dockerd: stopped by",
    ),
    "plugin-tutorial-example": Command(
        (sys.executable, str(EXAMPLE_PLUGIN), "--socket", "{tmp}/ex.sock", "--hook-dir", "{tmp}/hooks"),
        "event=hookserver_started",
        "event=hookserver_stopped",
    ),
}


def _trace(path: Path) -> None:
    """Three recorded Version calls a minute apart."""

    def record(n: int) -> bytes:
        from krproxy.calls import CallRecord
        from krproxy.grpcstatus import Status

        call = CallRecord(
            path=VERSION,
            started=1_700_000_000.0 + 60 * n,
            seconds=0.002,
            backend_seconds=0.001,
            request=b"\x0a\x02v1",
            forwarded=None,
            reply=b"\x0a\x030.1",
            replies=1,
            status=Status.OK,
            message=None,
            hooks=(),
        )
        return fmt.encode_call(call)

    path.write_bytes(fmt.encode_header({"writer": "test"}) + b"".join(record(n) for n in range(3)))


class Output:
    """A child's merged stdout and stderr, read in a thread as it comes."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        self._stream = process.stdout
        self._chunks: list[bytes] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while chunk := self._stream.read1(65536):
            with self._changed:
                self._chunks.append(chunk)
                self._changed.notify_all()

    @property
    def text(self) -> str:
        with self._changed:
            return b"".join(self._chunks).decode(errors="replace")

    def wait_for(self, needle: str, process: subprocess.Popen[bytes]) -> None:
        """Wait until the child says *needle*: its start-up line, so the bound is start-up's."""
        deadline = time.monotonic() + STARTUP_LIMIT
        with self._changed:
            while needle not in b"".join(self._chunks).decode(errors="replace"):
                left = deadline - time.monotonic()
                assert left > 0 and process.poll() is None, f"never said {needle!r}:\n{self.text}"
                self._changed.wait(min(left, 0.2))

    def close(self) -> str:
        self._thread.join(LIVENESS_LIMIT)
        return self.text


@contextlib.contextmanager
def _serving(argv: list[str], path: str) -> Iterator[str]:
    """``argv`` as a process until the end of the block, from when its socket ``path`` appears."""
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_file(path, process)
        yield path
    finally:
        process.terminate()
        process.wait(LIVENESS_LIMIT)


@pytest.fixture
def runtime(short_tmp: Path) -> Iterator[str]:
    """The fake containerd as a process: the runtime behind ``serve`` and replay's target."""
    path = str(short_tmp / "runtime.sock")
    with _serving([sys.executable, "-m", "krproxy.fakes.containerd", "--socket", path], path):
        yield path


#: The fake NRI runtime as a process, on the socket path it is given. Its timeouts are the tests' bound, not
#: NRI's 5 s for registering: a sample starting on a loaded machine took longer to import, and was dropped.
_FAKE_NRI_RUNTIME = """
import sys, trio
from krproxy.fakes.nri import FakeNriRuntime

async def main():
    limit = float(sys.argv[2])
    runtime = FakeNriRuntime(sys.argv[1], registration_timeout=limit, request_timeout=limit)
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.serve)

trio.run(main)
"""


@pytest.fixture(scope="module")
def nri_runtime() -> Iterator[str]:
    """The fake NRI runtime as a process, one for the module: what the NRI samples connect to."""
    directory = tempfile.mkdtemp(prefix="kp-", dir="/tmp")  # short: a unix socket's path
    path = os.path.join(directory, "nri.sock")
    try:
        with _serving([sys.executable, "-c", _FAKE_NRI_RUNTIME, path, str(STARTUP_LIMIT)], path):
            yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _stop(
    argv: list[str], up: str, signum: signal.Signals, env: dict[str, str] | None = None, fd: int | None = None
) -> tuple[int, str]:
    """Start ``argv`` (with ``env``, inheriting ``fd``), wait until it says ``up``, send one ``signum``; its
    exit status and output."""
    fds = () if fd is None else (fd,)
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, pass_fds=fds)
    output = Output(process)
    try:
        output.wait_for(up, process)
        process.send_signal(signum)
        try:
            process.wait(LIVENESS_LIMIT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after one {signum.name}:\n{output.text}") from None
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, output.close()


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_one_signal_stops_the_command(
    request: pytest.FixtureRequest, short_tmp: Path, name: str, signum: signal.Signals
) -> None:
    """One SIGINT or SIGTERM stops each long-running command: its stop line, exit 0 (a one-shot command
    cut short: 128 plus the signal, 130 for Ctrl-C), no traceback. ``nri`` used to die of a SIGTERM
    in start-up and print trio's KeyboardInterrupt group for a SIGINT; ``trace replay --timing`` slept
    through both; ``demo`` ended in a traceback or died."""
    command = COMMANDS[name]
    (short_tmp / "hooks").mkdir()
    _trace(short_tmp / "node.krt")
    # The fake containerd only where the command line names it (serve, replay): a process each, 0.8 s of CPU.
    runtime = request.getfixturevalue("runtime") if any("{runtime}" in part for part in command.argv) else ""
    argv = [part.format(tmp=short_tmp, runtime=runtime) for part in command.argv]
    code, text = _stop(argv, command.up, signum)
    assert (128 + signum if command.one_shot else 0) == code, text
    assert command.stopped in text, text
    assert "Traceback" not in text, text


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
@pytest.mark.parametrize("name", NRI_SAMPLES)
def test_one_signal_stops_an_nri_sample(nri_runtime: str, name: str, signum: signal.Signals) -> None:
    """One SIGINT or SIGTERM stops each NRI sample of examples/nri, started as the runtime starts a
    plugin (its connection in NRI_PLUGIN_SOCKET): "nri_stub_stopped", exit 0, no traceback. They ran
    ``trio.run(stub.run)``: SIGINT printed trio's KeyboardInterrupt group and exit 1, SIGTERM killed them."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(nri_runtime)
        env = {**os.environ, "NRI_PLUGIN_SOCKET": str(connection.fileno())}
        argv = [sys.executable, str(ROOT / "examples" / "nri" / f"{name}.py")]
        code, text = _stop(argv, "nri_stub_registered", signum, env, connection.fileno())
    assert 0 == code, text
    assert "event=nri_stub_stopped" in text, text
    assert "Traceback" not in text, text


#: ``krproxy demo`` run with its output going through a writer that signals the process itself once the
#: first CRI call is printed: the signal comes mid-lifecycle however busy the machine is (a test sending it
#: from outside could come after a fast demo finished).
_DEMO_SIGNALLED = """
import os, signal, sys
from krproxy import cli

class Signalling:
    def __init__(self, out):
        self.out, self.sent = out, False
    def write(self, text):
        self.out.write(text)
        if "Version" in text and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.{signal})
        return len(text)
    def flush(self):
        self.out.flush()

sys.stdout = Signalling(sys.stdout)
raise SystemExit(cli.main(["demo"]))
"""


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_one_signal_stops_the_demo_midway(signum: signal.Signals) -> None:
    """One SIGINT or SIGTERM during ``krproxy demo``'s lifecycle: "demo stopped by SIG..." and 128 plus
    the signal (130 for Ctrl-C), no traceback, no work directory left (SIGINT printed trio's
    KeyboardInterrupt group and exit 1; SIGTERM killed it, its sockets left behind)."""
    done = subprocess.run(
        [sys.executable, "-c", _DEMO_SIGNALLED.format(signal=signum.name)],
        capture_output=True,
        text=True,
        timeout=LIVENESS_LIMIT,
        cwd=ROOT,
    )
    text = done.stdout + done.stderr
    assert 128 + signum == done.returncode, text
    assert f"demo stopped by {signum.name} before it finished" in done.stdout, text
    assert "ok   RemovePodSandbox" not in done.stdout  # stopped midway, not after the lifecycle
    assert "Traceback" not in text
    [workdir] = [line.split()[-1] for line in done.stdout.splitlines() if "sockets and hook dir in" in line]
    assert not os.path.exists(workdir)
