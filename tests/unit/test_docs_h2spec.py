"""docs/testing.md's h2spec exceptions and skips are the ones tests/integration/test_h2spec.py
allows (issue 24)."""

from __future__ import annotations

import pathlib
import re

import pytest

from tests.integration.test_h2spec import EXCEPTIONS, SKIPPED

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
