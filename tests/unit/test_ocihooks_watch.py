"""The proxy's hooks.d directories: a directory that is missing is said, once, and so is its return."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from krproxy.hookserver.testing import logged_events
from krproxy.ocihooks.watch import HookDirectories


def test_missing_directory_is_logged_once_and_its_return(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A mistyped --oci-hooks-dir runs no hooks: a warning says so at the first scan, not at every
    scan; the directory appearing is logged, and so is it disappearing again. A directory that is
    there from the start logs nothing."""
    missing, present = tmp_path / "hooks.d-typo", tmp_path / "present"
    present.mkdir()
    dirs = HookDirectories([str(present), str(missing)])
    with caplog.at_level(logging.INFO):
        dirs.rescan()
        dirs.rescan()
        assert [str(missing)] == [e["dir"] for e in logged_events(caplog.records, "oci_hooks_dir_missing")]
        assert "--oci-hooks-dir" in logged_events(caplog.records, "oci_hooks_dir_missing")[0]["hint"]
        [record] = [r for r in caplog.records if r.getMessage() == "oci_hooks_dir_missing"]
        assert logging.WARNING == record.levelno
        caplog.clear()
        missing.mkdir()
        dirs.rescan()
        dirs.rescan()
        assert [str(missing)] == [e["dir"] for e in logged_events(caplog.records, "oci_hooks_dir_found")]
        missing.rmdir()
        dirs.rescan()
        assert [str(missing)] == [e["dir"] for e in logged_events(caplog.records, "oci_hooks_dir_missing")]
