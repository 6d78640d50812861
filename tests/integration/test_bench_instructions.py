"""``krproxy.bench.instructions`` against real processes: callgrind counts the floor proxy's creates only."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from krproxy.bench import instructions

pytestmark = pytest.mark.skipif(
    shutil.which("valgrind") is None or shutil.which("callgrind_control") is None, reason="no valgrind here"
)


def test_a_case_counts_its_creates(tmp_path: Path) -> None:
    """The floor proxy with no hook server, counted over 5 creates + removes (and the client's warm-up):
    hundreds of thousands of instructions each, not the millions its start-up and imports take (the
    instrumentation is off until the warm-up run is over)."""
    per_call = instructions.measure(str(tmp_path), "floor_none", 5)
    assert 100e3 < per_call < 3e6, per_call
