"""``krproxy serve`` run by an unprivileged user: on the default paths it fails as docs/operations.md says
(``startup_failed``, the flag and the default named, nothing created), and on paths the user owns it serves.

Run as root, the tests switch to ``nobody`` with ``setpriv``; run as another user, they run as that user.
``nobody`` must be able to run the tests' interpreter: where it cannot (a venv whose Python lives under
root's 0700 home, as pyenv's does), a venv is made in a temp dir from the system's interpreter of the
same version, seeing the tests' own site-packages, and the tests are skipped, with the reason, where
that fails too.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import signal
import site
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from tests.integration.processes import wait_for_socket
from tests.integration.support import LIVENESS_LIMIT

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
USER = "nobody"
DEFAULT_LISTEN_DIR = "/var/run/koord-runtimeproxy"


def documented_failure() -> dict[str, str]:
    """The fields of the ``startup_failed`` line operations.md gives for a non-root ``krproxy serve``."""
    found = re.search(
        r"a non-root `krproxy serve` gets\s+`(event=startup_failed[^`]*)`", OPERATIONS.read_text()
    )
    assert found, f"{OPERATIONS}: no `event=startup_failed ...` line for a non-root `krproxy serve`"
    fields = dict(field.split("=", 1) for field in shlex.split(" ".join(found.group(1).split())))
    return fields


def logged_fields(stderr: str, event: str) -> dict[str, str]:
    """The fields of the first ``event=EVENT`` line of a logfmt log."""
    line = next((line for line in stderr.splitlines() if f"event={event}" in line.split()), None)
    assert line is not None, f"no event={event} logged:\n{stderr}"
    return dict(field.split("=", 1) for field in shlex.split(line) if "=" in field)


class Unprivileged:
    """Runs commands as the unprivileged user, with an interpreter that user can run."""

    def __init__(self, python: str, base: Path, switch: list[str], uid: int, gid: int) -> None:
        self.python, self.base, self.switch, self.uid, self.gid = python, base, switch, uid, gid

    def argv(self, *argv: str) -> list[str]:
        return [*self.switch, self.python, *argv]

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*argv), capture_output=True, text=True, timeout=LIVENESS_LIMIT, cwd=self.base
        )

    def start(self, *argv: str, log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            return subprocess.Popen(
                self.argv(*argv), stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd=self.base
            )

    def directory(self, name: str) -> Path:
        """A directory of the user's own under the base."""
        path = self.base / name
        path.mkdir()
        os.chown(path, self.uid, self.gid)
        return path


def _probe(switch: list[str], python: str, cwd: Path) -> str:
    """Why ``python -c 'import krproxy'`` fails as the user ("" when it does not)."""
    try:
        done = subprocess.run(
            [*switch, python, "-c", "import krproxy.cli"],
            capture_output=True,
            text=True,
            timeout=LIVENESS_LIMIT,
            cwd=cwd,
        )
    except OSError as exc:
        return str(exc)
    lines = done.stderr.strip().splitlines()
    return "" if done.returncode == 0 else (lines[-1] if lines else f"exit {done.returncode}")


def _venv_for(base: Path, switch: list[str]) -> tuple[str, str]:
    """A venv in ``base`` of the system's Python of this version that sees the tests' site-packages; its
    python, or "" and why not."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(f"python{version}", path="/usr/local/bin:/usr/bin:/bin")
    if system is None:
        return "", f"no system python{version} to make a venv {USER} can run"
    venv = base / "venv"
    made = subprocess.run([system, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        return "", f"{system} -m venv failed: {made.stderr.strip()}"
    (purelib,) = venv.glob(f"lib/python{version}/site-packages")
    # addsitedir: the tests' site-packages with their .pth files (an editable krproxy's finder).
    lines = [f"import site; site.addsitedir({path!r})" for path in site.getsitepackages()]
    (purelib / "krproxy-tests.pth").write_text("\n".join(lines) + "\n")
    python = str(venv / "bin" / "python")
    why = _probe(switch, python, base)
    return (python, "") if not why else ("", f"{USER} cannot import krproxy from {python}: {why}")


@pytest.fixture(scope="module")
def unprivileged() -> Iterator[Unprivileged]:
    base = Path(tempfile.mkdtemp(prefix="kpnr-", dir="/tmp"))
    try:
        base.chmod(0o755)
        if os.geteuid() != 0:
            yield Unprivileged(sys.executable, base, [], os.geteuid(), os.getegid())
            return
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("no setpriv (util-linux) to run krproxy as an unprivileged user")
        user = pwd.getpwnam(USER)
        switch = [setpriv, f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
        python = sys.executable
        why = _probe(switch, python, base)
        if why:
            python, why = _venv_for(base, switch)
        if why:
            pytest.skip(why)
        yield Unprivileged(python, base, switch, user.pw_uid, user.pw_gid)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("argv", [["serve"], []], ids=["serve", "bare"])
def test_default_paths_fail_as_documented(unprivileged: Unprivileged, argv: list[str]) -> None:
    """``krproxy serve`` (and a bare ``krproxy``) as an unprivileged user on the default paths exits 1
    with the ``startup_failed`` line operations.md gives, no traceback, creating nothing."""
    existed = os.path.lexists(DEFAULT_LISTEN_DIR)
    done = unprivileged.run("-m", "krproxy", *argv)
    assert 1 == done.returncode, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    logged = logged_fields(done.stderr, "startup_failed")
    documented = documented_failure()
    if existed:  # the directory is there (made by root): the socket is what cannot be made
        documented.pop("path")
    assert documented == {key: logged.get(key) for key in documented}, done.stderr
    assert existed == os.path.lexists(DEFAULT_LISTEN_DIR)


def test_it_serves_on_paths_the_user_owns(unprivileged: Unprivileged) -> None:
    """As an unprivileged user, with its sockets and hook directory in the user's own directories, it
    serves: a Version goes through to the runtime, the socket is the user's, SIGTERM exits 0."""
    run = unprivileged.directory("run")
    hooks = unprivileged.directory("hooks")
    runtime_socket, proxy_socket = run / "containerd.sock", run / "proxy.sock"
    runtime = unprivileged.start(
        "-m", "krproxy.fakes.containerd", "--socket", str(runtime_socket), log=unprivileged.base / "fake.log"
    )
    try:
        wait_for_socket(str(runtime_socket), runtime)  # type: ignore[arg-type]
        proxy = unprivileged.start(
            "-m",
            "krproxy",
            "serve",
            f"--koord-runtimeproxy-endpoint=unix://{proxy_socket}",
            f"--remote-runtime-service-endpoint=unix://{runtime_socket}",
            f"--hook-dir={hooks}",
            log=unprivileged.base / "proxy.log",
        )
        try:
            wait_for_socket(str(proxy_socket), proxy)  # type: ignore[arg-type]
            with grpc.insecure_channel(f"unix://{proxy_socket}") as channel:
                version = channel.unary_unary(
                    "/runtime.v1.RuntimeService/Version",
                    request_serializer=pb.VersionRequest.SerializeToString,
                    response_deserializer=pb.VersionResponse.FromString,
                )(pb.VersionRequest(), timeout=LIVENESS_LIMIT)
            assert version.runtime_name, version
            assert unprivileged.uid == proxy_socket.stat().st_uid
        finally:
            proxy.send_signal(signal.SIGTERM)
            code = proxy.wait(timeout=LIVENESS_LIMIT)
        log = (unprivileged.base / "proxy.log").read_text()
        assert 0 == code, log
        assert "Traceback" not in log, log
        assert not proxy_socket.exists(), log
    finally:
        runtime.send_signal(signal.SIGTERM)
        runtime.wait(timeout=LIVENESS_LIMIT)
