"""The tests the docs name exist (issue 27: docs that tests keep true): a renamed or removed test
file, test or test class leaves no doc (README.md, docs/*.md) pointing at it."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


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
