"""Sessions that build, check and test krproxy.

``nox`` with no arguments runs the default sessions: the unit and integration tests,
the end-to-end tests against a real containerd (skipped with a reason where the machine
cannot run one), lint and typecheck.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "e2e", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True


def _install(session: nox.Session) -> None:
    session.install("-e", ".[test]")


@nox.session
def tests(session: nox.Session) -> None:
    """Unit and integration tests (no real runtime needed)."""
    _install(session)
    session.run("pytest", "tests/unit", "tests/integration", *session.posargs)


@nox.session
def e2e(session: nox.Session) -> None:
    """End-to-end tests: the krproxy daemon in front of real containerd 1.6, 1.7 and 2.x in private sandboxes.

    scripts/e2e-matrix runs tests/e2e once per containerd version (in parallel) and Docker mode's
    file once, and prints passed/failed/skipped per version. Arguments go to every pytest run;
    ``--versions 1.6,2.x`` or ``--jobs N`` narrow the matrix or change how many run at a time.
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
