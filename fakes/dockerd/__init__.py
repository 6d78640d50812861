"""A fake Docker Engine API over a unix socket, for Docker-mode tests and demos.

:class:`FakeDockerd` keeps containers, execs and logs in memory (:mod:`fakes.dockerd.state`), logs
every request, can be told to fail a request, and serves streaming (logs, events) and hijacked
(exec start) endpoints like dockerd does; :func:`run_fake_dockerd` serves it as a trio task.
``python -m fakes.dockerd --socket PATH`` runs one from the command line.
"""

from __future__ import annotations

from fakes.dockerd.server import FakeDockerd as FakeDockerd
from fakes.dockerd.server import run_fake_dockerd as run_fake_dockerd
from fakes.dockerd.state import DockerState as DockerState
from fakes.dockerd.state import Failure as Failure
from fakes.dockerd.state import FakeContainer as FakeContainer
from fakes.dockerd.state import RequestRecord as RequestRecord
from fakes.dockerd.state import multiplex as multiplex
from fakes.dockerd.state import sequential_ids as sequential_ids

__all__ = [
    "DockerState",
    "Failure",
    "FakeContainer",
    "FakeDockerd",
    "RequestRecord",
    "multiplex",
    "run_fake_dockerd",
    "sequential_ids",
]
