"""tests/gojson, Go's encoding/json (as koord-runtime-proxy and koordlet read JSON), for the tests
that compare krproxy's readings with Go's: the ``gojson`` fixture builds it, :func:`go_reads` runs it
once over a test module's documents."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.unit.godecode_support import built_go_program


@pytest.fixture(scope="module")
def gojson() -> str:
    """tests/gojson's binary (the tests that use it are skipped without Go's packages)."""
    return built_go_program("gojson", "no Go JSON reader")


def go_reads(gojson: str, folder: Path, read_as: str, documents: list[bytes]) -> list[dict[str, Any]]:
    """What Go makes of each document read as the struct ``read_as`` (``registration``,
    ``resource-status``): ``{"value": ...}`` or ``{"error": ...}``, in order, from one process."""
    paths = []
    for index, content in enumerate(documents):
        path = folder / f"{index}.json"
        path.write_bytes(content)
        paths.append(str(path))
    done = subprocess.run([gojson, "-as", read_as, *paths], capture_output=True, check=True, timeout=60)
    lines = done.stdout.decode().splitlines()
    assert len(lines) == len(documents), done.stderr
    return [json.loads(line) for line in lines]
