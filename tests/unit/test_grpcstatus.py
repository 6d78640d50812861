"""krproxy's own gRPC status codes: same names and numbers as grpcio's (an independent gRPC stack)."""

from __future__ import annotations

import subprocess
import sys

import grpc

from krproxy.grpcstatus import Status


def test_every_status_has_grpcios_name_and_number() -> None:
    """Each code is grpcio's StatusCode of the same name and number, and there are no others."""
    expected = {code.name: code.value[0] for code in grpc.StatusCode}
    actual = {s.name: s.value for s in Status}
    assert expected == actual


def test_importing_the_status_codes_loads_no_grpc_library() -> None:
    """A fresh interpreter that imports the module has loaded no grpclib, h2, hpack or trio."""
    probe = (
        "import sys, krproxy.grpcstatus; "
        "print(sorted(m for m in ('grpclib', 'h2', 'hpack', 'grpc', 'trio', 'trio_asyncio') "
        "if m in sys.modules))"
    )
    actual = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert "[]" == actual
