"""A fake Docker Engine API over a unix socket, for Docker-mode tests and demos.

:class:`FakeDockerd` keeps containers, execs and logs in memory (:mod:`krproxy.fakes.dockerd.state`), logs
every request, can be told to fail a request, and serves streaming (logs, events) and hijacked
(exec start) endpoints like dockerd does; :func:`run_fake_dockerd` serves it as a trio task.
``python -m krproxy.fakes.dockerd --socket PATH`` runs one from the command line.
"""

from __future__ import annotations

from krproxy.fakes.dockerd.server import FakeDockerd as FakeDockerd
from krproxy.fakes.dockerd.server import run_fake_dockerd as run_fake_dockerd
from krproxy.fakes.dockerd.state import DockerState as DockerState
from krproxy.fakes.dockerd.state import Failure as Failure
from krproxy.fakes.dockerd.state import FakeContainer as FakeContainer
from krproxy.fakes.dockerd.state import RequestRecord as RequestRecord
from krproxy.fakes.dockerd.state import multiplex as multiplex
from krproxy.fakes.dockerd.state import sequential_ids as sequential_ids

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
