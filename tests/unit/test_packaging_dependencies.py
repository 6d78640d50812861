"""``pip install krproxy`` pulls neither grpclib, trio-asyncio, h2 nor grpcio (issue 24): the
dependencies of pyproject.toml and, through the installed metadata, theirs."""

from __future__ import annotations

import pathlib
import re
import tomllib
from importlib.metadata import PackageNotFoundError, requires

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: What a plain install must not bring: the old engine (grpclib on trio-asyncio, with h2) and grpcio.
NOT_INSTALLED = frozenset(("grpclib", "trio-asyncio", "h2", "grpcio"))


def _name(requirement: Requirement) -> str:
    return re.sub(r"[-_.]+", "-", requirement.name).lower()


def _needed(requirements: list[str]) -> list[Requirement]:
    """The requirements a plain install takes (no extra, this interpreter's markers)."""
    parsed = [Requirement(r) for r in requirements]
    return [r for r in parsed if r.marker is None or r.marker.evaluate({"extra": ""})]


def runtime_closure() -> set[str]:
    """krproxy's dependencies from pyproject.toml, then theirs from what is installed here."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = _needed(project["dependencies"])
    seen: set[str] = set()
    while todo:
        name = _name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += _needed(requires(name) or [])
        except PackageNotFoundError:  # not installed here: its own dependencies unknown
            continue
    return seen


def test_a_plain_install_pulls_no_grpclib_h2_or_grpcio() -> None:
    """A plain install pulls no grpclib trio asyncio h2 or grpcio."""
    closure = runtime_closure()
    assert {"trio", "betterproto2", "protobuf"} <= closure  # it did read the dependencies
    assert set() == closure & NOT_INSTALLED
