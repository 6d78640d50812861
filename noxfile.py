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

# uv makes a session's venv and installs into it in seconds (from its cache after the first run);
# .ci/run and README's test command install it beside nox.
nox.options.default_venv_backend = "uv"
nox.options.sessions = ["setup", "tests", "e2e", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True
# Bytecode caches are written (and reused by every later process of the session: the pytest
# workers, each `python -m krproxy` a test starts, the e2e rows' daemons) even where the caller's
# environment says not to: with PYTHONDONTWRITEBYTECODE=1 every one of those processes compiled
# krproxy, its dependencies and (pytest's assertion rewriting) every test module from source, and a
# test session took 505 s of CPU rather than 425 s (docs/testing.md, "How CI runs").
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


#: The Python versions krproxy supports (pyproject's requires-python); each gets a test session.
PYTHONS = ["3.11", "3.12", "3.13", "3.14", "3.15"]
#: Run in scripts/sid-python's Debian sid chroot where the machine has no interpreter of theirs.
SID_PYTHONS = ["3.14", "3.15"]
#: What every test session runs: pytest's arguments before the session's own. ``-n`` is
#: pytest-xdist's worker count: 5 on this 2-core machine, since many tests wait on sockets and
#: processes rather than the CPU (docs/testing.md, "How CI runs"); KRPROXY_TEST_WORKERS changes it
#: (0: no workers, every test in the one pytest process). No test needs to run alone: what tests
#: share between processes is written under a per-process name or a lock (docs/testing.md).
TEST_PATHS = ["tests/unit", "tests/integration"]
TEST_WORKERS = os.environ.get("KRPROXY_TEST_WORKERS", "5")


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


#: Whether this nox run did the host set-up already (scripts/host-setup: once per run).
_SET_UP: dict[str, bool] = {}


def _host_setup(session: nox.Session, *, sid: bool = False) -> None:
    """scripts/host-setup once per nox run (``--sid``: with the sid chroot), in the first session that
    needs it; later sessions of the run skip it. On CI a sid chroot that cannot be had fails the run."""
    key = "sid" if sid else "host"
    if key in _SET_UP:
        if not _SET_UP[key]:
            _sid_unavailable(session)
        return
    command = [sys.executable, "scripts/host-setup", *(["--sid"] if sid else [])]
    session.log(" ".join(command))
    done = subprocess.run(command).returncode == 0  # its output as it goes; 1: no sid chroot
    _SET_UP["host"] = True
    if sid:
        _SET_UP["sid"] = done
        if not done:
            _sid_unavailable(session)


def _sid_unavailable(session: nox.Session) -> None:
    reason = "no Debian sid chroot for the 3.14 and 3.15 sessions (scripts/host-setup said why, above)"
    if "CI" in os.environ:  # as nox's --error-on-missing-interpreters for the other versions
        session.error(reason)
    session.skip(reason)


def _pytest_args(session: nox.Session) -> list[str]:
    workers = ["-n", TEST_WORKERS] if TEST_WORKERS != "0" else ["-p", "no:xdist"]
    return [*TEST_PATHS, *workers, *session.posargs]


@nox.session(python=False)
def setup(session: nox.Session) -> None:
    """The host set-up every test session needs, once per run and cached for the next (scripts/host-setup):
    h2load, the Go test programs, NRI's protos, the sid chroot where 3.14 or 3.15 runs in it."""
    _host_setup(session, sid=bool(_IN_SID))


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


_TEST_PARAMS = _test_params()
#: The versions whose session runs in the sid chroot on this machine.
_IN_SID = [param.args[1] for param in _TEST_PARAMS if param.args[1]]


@nox.session
@nox.parametrize(["python", "sid"], _TEST_PARAMS)
def tests(session: nox.Session, sid: str | None) -> None:
    """Unit and integration tests (no real runtime needed), on each supported Python."""
    if sid:
        _tests_in_sid(session, sid)
        return
    _host_setup(session)
    _install(session)
    session.run("pytest", *_pytest_args(session))


def _uv_binary() -> str:
    """The uv that nox uses (installed beside it), for the sid chroot, which has none of its own."""
    try:
        from uv import find_uv_bin  # the PyPI package ``uv``, installed with nox
    except ImportError:
        return shutil.which("uv") or "uv"
    return str(find_uv_bin())


def _tests_in_sid(session: nox.Session, version: str) -> None:
    """The tests on Debian sid's Python ``version``, in scripts/sid-python's chroot.

    The chroot is built by scripts/host-setup on first use (about 2 minutes) and cached; the venv
    lives in .nox/tests-sid-X-Y of the repository, made by the host's uv (bound read-only into the
    chroot) with the chroot's pythonX.Y, uv's cache kept in the chroot. Where the chroot cannot be
    had (no root, no debootstrap) the session is skipped with the reason, or fails on CI.
    """
    _host_setup(session, sid=True)
    uv = os.path.realpath(_uv_binary())
    sid = [sys.executable, "scripts/sid-python", "run", "--ro-bind", uv, "--", "env", "UV_LINK_MODE=copy"]
    venv = os.path.join(".nox", f"tests-sid-{version.replace('.', '-')}")
    python = os.path.join(venv, "bin", "python")
    if not os.path.lexists(python):  # a link to the chroot's python
        session.run(*sid, uv, "venv", "-q", "-p", f"/usr/bin/python{version}", venv, external=True)
    session.run(*sid, uv, "pip", "install", "-q", "-p", python, "-e", ".[test]", external=True)
    session.run(*sid, python, "-m", "pytest", *_pytest_args(session), external=True)


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
def image(session: nox.Session) -> None:
    """The DaemonSets' image (not a default session): scripts/build_node_image.py, as root.

    Writes krproxy-image.tar (arguments go to the script: ``nox -s image -- --out PATH``); import it
    with ``ctr -n k8s.io images import krproxy-image.tar`` (docs/operations.md).
    """
    session.install("pip")  # the script installs krproxy's wheels with pip; uv's venvs have none
    session.run("python", "scripts/build_node_image.py", *session.posargs)


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
