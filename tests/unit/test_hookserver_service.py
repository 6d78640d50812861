"""krproxy.hookserver._service: a hook server says when krproxy will refuse its registration file."""

from __future__ import annotations

import logging
import os
import pathlib

import pytest

from krproxy.hookserver._service import warn_if_refused
from krproxy.hookserver.testing import logged_events


def _registration(tmp_path: pathlib.Path, mode: int) -> str:
    path = tmp_path / "sdk.json"
    path.write_text("{}")
    os.chmod(path, mode)
    return str(path)


def test_a_world_writable_registration_is_reported(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A registration file krproxy refuses for its mode is logged by the hook server too, with why and
    the fix (only krproxy said so: the plugin looked registered and was never called)."""
    path = _registration(tmp_path, 0o666)
    with caplog.at_level(logging.WARNING):
        warn_if_refused(path)
    [refused] = logged_events(caplog.records, "registration_refused")
    assert path == refused["registration"]
    assert "world-writable (mode 0666)" in refused["reason"]
    assert "run this hook server as root" in refused["fix"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_file_owned_by_another_user_is_reported(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file owned by a non-root user (a hook server run as that user) is reported; root's 0644 is not."""
    trusted = _registration(tmp_path, 0o644)
    with caplog.at_level(logging.WARNING):
        warn_if_refused(trusted)
    assert [] == logged_events(caplog.records, "registration_refused")
    os.chown(trusted, 65534, 65534)
    with caplog.at_level(logging.WARNING):
        warn_if_refused(trusted)
    [refused] = logged_events(caplog.records, "registration_refused")
    assert "owned by uid 65534, not root" in refused["reason"]
