"""The committed generated code (krproxy/proto) must equal what protos/ compiles to."""

from __future__ import annotations

import importlib.util
import pathlib
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tree(path: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.mark.skipif(
    importlib.util.find_spec("betterproto2_compiler") is None, reason="betterproto2-compiler not installed"
)
@pytest.mark.skipif(
    importlib.util.find_spec("grpc_tools") is None,
    reason="grpcio-tools is not installed (the test extra has none on Python 3.15: see pyproject.toml)",
)
def test_generated_code_is_fresh(tmp_path: pathlib.Path) -> None:
    """Regenerating into a temp dir gives byte-identical files; if not, run `nox -s protos`."""
    genproto = runpy.run_path(str(ROOT / "scripts" / "genproto.py"))
    fresh = tmp_path / "proto"
    genproto["generate"](fresh)
    committed, regenerated = _tree(ROOT / "krproxy" / "proto"), _tree(fresh)
    assert sorted(committed) == sorted(regenerated), "file lists differ: run `nox -s protos`"
    stale = [name for name in committed if committed[name] != regenerated[name]]
    assert [] == stale, f"stale generated files (run `nox -s protos`): {stale}"
