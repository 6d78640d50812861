"""scripts/build_node_image.py: the DaemonSets' image (the build itself runs in tests/e2e, as root)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import build_node_image  # noqa: E402 - needs the line above

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the cache lock is taken as root only")


@needs_root
def test_base_only_keeps_a_cached_base_and_builds_no_image(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--base-only`` with a complete base in the cache says so, exit 0, and writes no image."""
    base = tmp_path / f"base-{build_node_image.SUITE}"
    base.mkdir()
    (base / build_node_image.MARKER).write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert 0 == build_node_image.main(["--base-only", "--cache", str(tmp_path)])
    assert f"the image base {base} (cached)" in capsys.readouterr().out
    assert not (tmp_path / "krproxy-image.tar").exists()
    assert (base / build_node_image.MARKER).read_text() == "{}"  # not built again


@needs_root
def test_base_only_says_why_it_cannot_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a cached base and without debootstrap, ``--base-only`` exits 2 with the fix."""
    monkeypatch.setattr(build_node_image.shutil, "which", lambda name: None)
    monkeypatch.setattr(build_node_image.os.path, "exists", lambda path: False)
    assert 2 == build_node_image.main(["--base-only", "--cache", str(tmp_path)])
    assert "apt-get install debootstrap" in capsys.readouterr().err
