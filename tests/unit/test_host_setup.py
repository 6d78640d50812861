"""scripts/host-setup: the one-time host set-up nox does before the test sessions."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tests.unit import test_descriptors

ROOT = Path(__file__).resolve().parents[2]


def _host_setup() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("host_setup", str(ROOT / "scripts" / "host-setup"))
    spec = importlib.util.spec_from_loader("host_setup", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_it_fetches_the_nri_releases_the_descriptor_test_reads() -> None:
    """The NRI packages host-setup unpacks are those test_descriptors compares against: the sid
    chroot sees the package cache read-only, so a release host-setup missed is skipped there."""
    wanted = {(suite, test_descriptors.NRI_PACKAGE, v) for v, suite in test_descriptors.NRI_VERSIONS.items()}
    assert wanted == set(_host_setup().DEBIAN_FILES)


def test_it_builds_every_go_program_of_the_tests() -> None:
    """Every Go program under tests/ (a directory with a main package) is built by host-setup."""
    programs = {path.parent.name for path in ROOT.glob("tests/*/main.go")}
    assert programs == set(_host_setup().GO_PROGRAMS)


def test_it_makes_the_image_base_before_the_e2e_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """host-setup makes the node image's base (debootstrap first) in the cache the e2e image build reads,
    so that the first e2e run does not debootstrap it."""
    host_setup = _host_setup()
    ran: list[list[str]] = []
    monkeypatch.setattr(host_setup, "step", lambda what, command, note="": ran.append(command) or True)
    host_setup.host()
    base = [host_setup.sys.executable, str(ROOT / "scripts" / "build_node_image.py"), "--base-only"]
    assert base in ran, ran
    assert "--cache" not in base  # build_node_image's default cache, which build() uses too
    tool = ["sh", str(ROOT / "scripts" / "install-debian-command"), "debootstrap", "debootstrap"]
    assert ran.index(tool) < ran.index(base)


def test_it_makes_the_docs_root_after_debootstrap(monkeypatch: pytest.MonkeyPatch) -> None:
    """host-setup makes the fresh sid root of the docs-install test (sid-python's docs root, in the default
    cache the test uses), after debootstrap is installed, so that the e2e row only reuses it."""
    host_setup = _host_setup()
    ran: list[list[str]] = []
    monkeypatch.setattr(host_setup, "step", lambda what, command, note="": ran.append(command) or True)
    host_setup.host()
    docs = [host_setup.sys.executable, str(ROOT / "scripts" / "sid-python"), "--root", "docs", "ensure"]
    assert docs in ran, ran
    tool = ["sh", str(ROOT / "scripts" / "install-debian-command"), "debootstrap", "debootstrap"]
    assert ran.index(tool) < ran.index(docs)
