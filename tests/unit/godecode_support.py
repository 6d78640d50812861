"""tests/godecode, Go's protobuf reading (google.golang.org/protobuf, as containerd and
koord-runtime-proxy read bytes), for the tests that compare krproxy's reading with Go's: the
``godecode`` fixture builds it, :func:`go_decode` runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def godecode() -> str:
    """tests/godecode, built by scripts/install-go-client from the packages it unpacked (never
    downloads); without them the Go cases are skipped with its reason."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "install-go-client"), "--offline", "--program", "godecode"],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    path = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or not os.access(path, os.X_OK):
        pytest.skip(f"no Go decoder: {done.stdout.strip() or done.stderr.strip()}")
    return path


def go_decode(
    godecode: str, descriptor: Path, message: str, data: bytes
) -> subprocess.CompletedProcess[bytes]:
    """tests/godecode run on *data* as the message *message* (full name) of the descriptor set in the file
    *descriptor*: exit 0 with its protojson reading (proto names) on stdout, 1 when Go refuses the bytes."""
    return subprocess.run(
        [godecode, "-descriptor", str(descriptor), "-message", message],
        input=data,
        capture_output=True,
        check=False,
        timeout=60,
    )
