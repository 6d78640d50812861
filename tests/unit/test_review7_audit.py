"""Review 7's audit of issues 24 and 27 ("Done when"): rules the tree met that no test held yet.

- ``pip install krproxy`` pulls neither grpclib, trio-asyncio, h2 nor grpcio (issue 24): the
  dependencies of pyproject.toml and, through the installed metadata, theirs.
- The tests the docs name exist (issue 27: docs that tests keep true): a renamed or removed test
  leaves no doc pointing at it.
- docs/testing.md's h2spec exceptions and skips are the ones tests/integration/test_h2spec.py
  allows (issue 24).
"""

from __future__ import annotations

import pathlib
import re
import tomllib
from importlib.metadata import PackageNotFoundError, requires

import pytest
from packaging.requirements import Requirement

from tests.integration.test_h2spec import EXCEPTIONS, SKIPPED

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

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


def test_a_plain_install_pulls_no_grpclib_trio_asyncio_h2_or_grpcio() -> None:
    closure = runtime_closure()
    assert {"trio", "betterproto2", "protobuf"} <= closure  # it did read the dependencies
    assert set() == closure & NOT_INSTALLED


def _code_spans() -> list[tuple[str, str]]:
    return [(doc.name, m.group(1)) for doc in DOCS for m in re.finditer(r"`([^`\n]+)`", doc.read_text())]


def _test_names() -> tuple[set[str], set[str]]:
    """The test files under tests/, and every function and class defined in them."""
    files = {p.name for p in (ROOT / "tests").rglob("test_*.py")}
    defined: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        defined.update(re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", path.read_text(), re.M))
    return files, defined


def test_every_test_the_docs_name_exists() -> None:
    """A test file (``test_relay_attacks.py``), test or test class a doc names is one of tests/ (a
    prefix such as ``test_docker_*`` aside)."""
    files, defined = _test_names()
    missing = []
    for doc, span in _code_spans():
        for name in re.findall(r"\b(test_\w+(?:\.py)?)(?![\w*])", span):
            if name.endswith("_"):
                continue  # a prefix (test_docker_*)
            if (
                name not in files
                if name.endswith(".py")
                else name not in defined and f"{name}.py" not in files
            ):
                missing.append(f"{doc}: {name}")
    assert [] == missing


def _testing_section(title: str) -> str:
    text = (ROOT / "docs" / "testing.md").read_text()
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_h2spec_exceptions_of_the_docs_are_the_tests() -> None:
    section = _testing_section("## HTTP/2 conformance: h2spec")
    table = section[section.index("The exceptions:") :]
    rows = re.findall(r"^\| ((?:generic|http2|hpack)/[\d.]+/\d+)", table, re.M)
    assert sorted(EXCEPTIONS) == sorted(rows)
    (skips,) = re.findall(r"h2spec skips four cases itself \(([^)]*)\)", section)
    named = [s.strip() for s in skips.split(",")]
    package = named[0].split("/")[0] + "/"  # "http2/6.5.3/1, 6.9.1/1": the rest in the first's package
    assert sorted(SKIPPED) == sorted(n if n.startswith(package) else package + n for n in named)


@pytest.mark.parametrize("mutation", ["exception", "skip"])
def test_the_h2spec_check_sees_a_difference(monkeypatch: pytest.MonkeyPatch, mutation: str) -> None:
    """The check itself: one more exception or skip in the test than in the doc fails it."""
    target = EXCEPTIONS if mutation == "exception" else SKIPPED
    monkeypatch.setitem(target, "http2/9.9/9", "not in the doc")
    with pytest.raises(AssertionError):
        test_the_h2spec_exceptions_of_the_docs_are_the_tests()
