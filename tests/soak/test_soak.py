"""The bounded soak as a test (marker ``soak``: only ``nox -s soak`` runs it).

Budget from the environment: KRPROXY_SOAK_CALLS (default 200000), KRPROXY_SOAK_SECONDS (default 600),
KRPROXY_SOAK_CLIENTS (64), KRPROXY_SOAK_PROCESSES (4). The figures are printed (run with ``-s``).
"""

from __future__ import annotations

import os

import pytest

from tests.soak.run import soak

pytestmark = pytest.mark.soak


def test_soak() -> None:
    """Mixed calls from many clients with two plugins: no unexpected error; RSS, fds, asyncio tasks and the
    store back where they were."""
    figures = soak(
        calls=int(os.environ.get("KRPROXY_SOAK_CALLS", "200000")),
        seconds=float(os.environ.get("KRPROXY_SOAK_SECONDS", "600")),
        clients=int(os.environ.get("KRPROXY_SOAK_CLIENTS", "64")),
        processes=int(os.environ.get("KRPROXY_SOAK_PROCESSES", "4")),
    )
    print(figures.report())
    assert [] == figures.problems(max_rss_growth_mb=20.0)
