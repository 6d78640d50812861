"""Sessions that build, check and test krproxy.

``nox`` with no arguments runs the default sessions: the unit and integration tests on every
supported Python (``tests(3.11)`` to ``tests(3.15)``; ``nox -s tests`` runs all five), the
end-to-end tests against a real containerd (skipped with a reason where the machine cannot run
one), lint and typecheck.

A test session runs on the machine's interpreter of its version (pyenv's, then ``pythonX.Y`` on
PATH). Where there is none for 3.14 or 3.15, it runs in a Debian sid chroot that ships both
(scripts/sid-python builds it once, as root, and caches it). An interpreter that cannot be had
is reported as a skipped session with the reason; on CI (where ``CI`` is set) that fails the run.
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
PYTHONS = ["3.11", "3.12", "3.13", "3.14", "3.15"]
#: Run in scripts/sid-python's Debian sid chroot where the machine has no interpreter of theirs.
SID_PYTHONS = ["3.14", "3.15"]
#: What every test session runs: pytest's arguments before the session's own.
TEST_PATHS = ["tests/unit", "tests/integration"]


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


def _test_params() -> list[nox.param]:
    """One (python, sid) per version: the interpreter found, or ``False`` (no host venv) and the sid version."""
    params = []
    for version in PYTHONS:
        found = _find_python(version)
        if found == version and version in SID_PYTHONS:
            params.append(nox.param(False, version, id=version))
        else:
            params.append(nox.param(found, None, id=version))
    return params


@nox.session
@nox.parametrize(["python", "sid"], _test_params())
def tests(session: nox.Session, sid: str | None) -> None:
    """Unit and integration tests (no real runtime needed), on each supported Python."""
    if sid:
        _tests_in_sid(session, sid)
        return
    _install(session)
    # nghttp2's h2load, the relay's third-party HTTP/2 client (tests/integration/test_relay_h2load.py);
    # where it cannot be installed the script says why and its test is skipped.
    session.run(
        "sh",
        "scripts/install-debian-command",
        "h2load",
        "nghttp2-client",
        external=True,
        success_codes=[0, 1],
    )
    # A grpc-go client set up as kubelet's (tests/integration/test_grpc_go_client.py), built from
    # Debian trixie's Go and grpc-go unpacked under /var/cache/krproxy-debs; where that cannot be
    # done the script says why and those tests are skipped with it. The same for the benchmark's
    # grpc-go proxy (tests/integration/test_go_anchor_proxy.py).
    session.run("python", "scripts/install-go-client", success_codes=[0, 1])
    session.run("python", "scripts/install-go-client", "--program", "goproxy", success_codes=[0, 1])
    session.run("pytest", *TEST_PATHS, *session.posargs)


def _tests_in_sid(session: nox.Session, version: str) -> None:
    """The tests on Debian sid's Python ``version``, in scripts/sid-python's chroot.

    The chroot is built on first use (about 2 minutes) and cached; the venv lives in
    .nox/tests-sid-X-Y of the repository, made by the chroot's pythonX.Y. Where the chroot
    cannot be had (no root, no debootstrap) the session is skipped with the reason, or fails on CI.
    """
    ensured = subprocess.run(
        [sys.executable, "scripts/sid-python", "ensure"], stdout=subprocess.PIPE, text=True
    )
    if ensured.returncode != 0:
        why = ensured.stdout.strip().removeprefix("sid-python: ")
        reason = f"no Python {version} on this machine (pyenv, PATH) and no Debian sid chroot for it: {why}"
        if "CI" in os.environ:  # as nox's --error-on-missing-interpreters for the other versions
            session.error(reason)
        session.skip(reason)
    # The grpc-go client is built on the host (its Go comes unpacked from Debian packages) into
    # /var/cache/krproxy-debs, which the chroot sees read-only; h2load is installed in the chroot.
    session.run(sys.executable, "scripts/install-go-client", external=True, success_codes=[0, 1])
    session.run(
        sys.executable,
        "scripts/install-go-client",
        "--program",
        "goproxy",
        external=True,
        success_codes=[0, 1],
    )
    sid = [sys.executable, "scripts/sid-python", "run", "--"]
    venv = os.path.join(".nox", f"tests-sid-{version.replace('.', '-')}")
    if not os.path.lexists(os.path.join(venv, "bin", "python")):  # a link to the chroot's python
        session.run(*sid, f"python{version}", "-m", "venv", venv, external=True)
    python = os.path.join(venv, "bin", "python")
    session.run(*sid, python, "-m", "pip", "install", "-e", ".[test]", external=True)
    session.run(
        *sid,
        "sh",
        "scripts/install-debian-command",
        "h2load",
        "nghttp2-client",
        external=True,
        success_codes=[0, 1],
    )
    session.run(*sid, python, "-m", "pytest", *TEST_PATHS, *session.posargs, external=True)


@nox.session
def e2e(session: nox.Session) -> None:
    """End-to-end tests: the krproxy daemon in front of real containerd 1.6, 1.7 and 2.x (sid's 2.1),
    Debian's packages, in private sandboxes, and Docker mode in front of a real dockerd.

    scripts/e2e-matrix runs tests/e2e once per containerd version (in parallel) and Docker mode's
    file once, and prints passed/failed/skipped per version. Arguments go to every pytest run;
    ``--versions 1.6,2.x`` or ``--jobs N`` narrow the matrix or change how many run at a time.
    What only containerd 2.3 does (NRI 0.12) is covered by the fakes (docs/testing.md).
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
