"""Sessions that build, check and test krproxy.

``nox`` with no arguments runs the default sessions: the unit and integration tests on every
supported Python (``tests(3.11)``, ``tests(3.12)``, ``tests(3.13)``; ``nox -s tests`` runs all
three), the end-to-end tests against a real containerd (skipped with a reason where the machine
cannot run one), lint and typecheck.

An interpreter the machine lacks is reported as a skipped session with the reason; on CI (where
``CI`` is set) nox counts that as a failure instead.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "e2e", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True


#: The Python versions krproxy supports (pyproject's requires-python); each gets a test session.
PYTHONS = ["3.11", "3.12", "3.13"]


def _is_version(path: str, version: str) -> bool:
    """Whether ``path`` runs and is Python ``version`` (a pyenv shim of an unselected one fails)."""
    try:
        done = subprocess.run(
            [path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError:
        return False
    return done.returncode == 0 and done.stdout.strip() == version


def _pyenv_root() -> str:
    if os.environ.get("PYENV_ROOT"):
        return os.environ["PYENV_ROOT"]
    try:
        return subprocess.run(["pyenv", "root"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.path.expanduser("~/.pyenv")


def _release(name: str) -> tuple[int, ...]:
    """``3.12.1`` -> ``(3, 12, 1)``; a pre-release counts as its release (``3.13.0rc1`` -> 3.13.0)."""
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in name.split(".")[:3])


def _find_python(version: str) -> str:
    """A path to an interpreter of ``version``, or ``version`` itself when none is found.

    Found by path: pyenv's ``python3.12`` shim fails unless pyenv selects 3.12, so the
    interpreters under ``$(pyenv root)/versions`` are tried first (the newest patch release),
    then ``pythonX.Y`` on PATH. With ``version`` itself nox looks once more and, finding
    nothing, skips the session with the reason (fails it on CI).
    """
    found = glob.glob(os.path.join(_pyenv_root(), "versions", f"{version}.*", "bin", f"python{version}"))
    newest_first = sorted(found, key=lambda path: _release(path.split(os.sep)[-3]), reverse=True)
    candidates = [*newest_first, shutil.which(f"python{version}"), sys.executable]
    for path in candidates:
        if path and _is_version(path, version):
            return path
    return version


def _install(session: nox.Session) -> None:
    session.install("-e", ".[test]")


@nox.session
@nox.parametrize("python", [nox.param(_find_python(v), id=v) for v in PYTHONS])
def tests(session: nox.Session) -> None:
    """Unit and integration tests (no real runtime needed), on each supported Python."""
    _install(session)
    # nghttp2's h2load, the relay's third-party HTTP/2 client (tests/integration/test_relay_h2load.py);
    # where it cannot be installed the script says why and that test is skipped.
    session.run("sh", "scripts/install-h2load", external=True, success_codes=[0, 1])
    # A grpc-go client set up as kubelet's (tests/integration/test_grpc_go_client.py), built from
    # Debian trixie's Go and grpc-go unpacked under /var/cache/krproxy-debs; where that cannot be
    # done the script says why and those tests are skipped with it.
    session.run("python", "scripts/install-go-client", success_codes=[0, 1])
    session.run("pytest", "tests/unit", "tests/integration", *session.posargs)


@nox.session
def e2e(session: nox.Session) -> None:
    """End-to-end tests: the krproxy daemon in front of real containerd 1.6, 1.7, 2.x (sid's 2.1) and 2.3
    in private sandboxes.

    scripts/e2e-matrix runs tests/e2e once per containerd version (in parallel) and Docker mode's
    file once, and prints passed/failed/skipped per version. Arguments go to every pytest run;
    ``--versions 1.6,2.x`` or ``--jobs N`` narrow the matrix or change how many run at a time.
    containerd 2.3 is the prebuilt archive in ../shared/peers (or $KRPROXY_PEERS_DIR); without it
    the 2.3 row is skipped with that reason.
    """
    _install(session)
    # Docker mode's e2e test needs a dockerd; fetch one if we can (unpacked, not installed).
    # Where that fails the test is skipped with its reason, like the containerd ones.
    env = {}
    fetched = session.run("python", "scripts/fetch-dockerd", silent=True, success_codes=[0, 1])
    path = fetched.strip().splitlines()[-1] if isinstance(fetched, str) and fetched.strip() else ""
    if os.access(path, os.X_OK):  # on failure the output is the reason, not a path
        env["KRPROXY_DOCKERD"] = path
    session.run("python", "scripts/e2e-matrix", *session.posargs, env=env)


@nox.session
def soak(session: nox.Session) -> None:
    """The bounded soak (not a default session): 200k mixed calls or 10 minutes, 64 clients, 2 plugins.

    Budget via KRPROXY_SOAK_CALLS / _SECONDS / _CLIENTS / _PROCESSES; figures are printed.
    """
    _install(session)
    session.run("pytest", "tests/soak", "-m", "soak", "-s", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    session.install("ruff==0.17.6")  # the version pinned in pyproject's test extra
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on krproxy/ and fakes/ (generated code excluded)."""
    _install(session)
    session.install("mypy")
    session.run("mypy")


@nox.session
def protos(session: nox.Session) -> None:
    """Regenerate krproxy/proto from protos/ (commit the result)."""
    _install(session)
    session.run("python", "scripts/genproto.py")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: direct vs through krproxy (prints a table, writes bench-results.json).

    The real-containerd cases need containerd and runc: installed here if we can (as the e2e
    session does); where that fails the table says why they were skipped.
    """
    _install(session)
    session.run("python", "scripts/containerd-sandbox", "install", success_codes=[0, 1, 2], silent=True)
    session.run("python", "-m", "krproxy.bench", *session.posargs)
