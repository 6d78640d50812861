"""The layout of tests/ (docs/testing.md, "Where tests live"): a file is named after the module or
behaviour it tests, never after the review or round that wrote it, and a test's name is short enough
to scan, its sentence in the docstring.

The naming rule, on a file's name without its suffix cut into words at ``_``, ``-`` and ``.``: no
word is ``review``, ``reviews``, ``reviewN``, ``roundN`` (``round7``, or ``round`` followed by the
word ``7``), ``auditN`` or ``round`` on its own (``round_trip`` stays allowed: a round trip is a
behaviour). A test function or method (``test_*``) has at most :data:`MAX_TEST_NAME` characters.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: The longest name a test may have; aim for about 60, the sentence in the docstring.
MAX_TEST_NAME = 70

_NUMBER = re.compile(r"\d+")
_REVIEW_WORD = re.compile(r"(?:reviews?|audit|round)\d*")


def named_after_a_review(name: str) -> bool:
    """Whether the file name *name* (a path's last part) names a review or a round, by the rule above."""
    words = [w for w in re.split(r"[_.\-]", name.lower().removesuffix(".py")) if w]
    for i, word in enumerate(words):
        following = words[i + 1] if i + 1 < len(words) else ""
        if not _REVIEW_WORD.fullmatch(word):
            continue
        if word.startswith("review") or word[-1].isdigit():
            return True
        if word == "round" and (_NUMBER.fullmatch(following) or following not in ("trip", "trips")):
            return True
    return False


def _files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in (root / "tests").rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def misnamed_files(root: pathlib.Path = ROOT) -> list[str]:
    """The files under *root*/tests named after a review or a round."""
    return [str(p.relative_to(root)) for p in _files(root) if named_after_a_review(p.name)]


def long_test_names(root: pathlib.Path = ROOT) -> list[str]:
    """``path::name (length)`` of every test function or method longer than :data:`MAX_TEST_NAME`."""
    found = []
    for path in _files(root):
        if not (path.name.startswith("test_") and path.suffix == ".py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            is_def = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_def and node.name.startswith("test_") and len(node.name) > MAX_TEST_NAME:
                found.append(f"{path.relative_to(root)}::{node.name} ({len(node.name)})")
    return found


def test_no_test_file_is_named_after_a_review_or_a_round() -> None:
    assert [] == misnamed_files()


def test_no_test_name_is_over_70_characters() -> None:
    assert [] == long_test_names()


@pytest.mark.parametrize(
    "name",
    [
        "test_review7_audit.py",
        "test_relay_review.py",
        "test_review_h2fast_core.py",
        "test_trio_hooks_reviews.py",
        "test_relay_round3.py",
        "test_relay_round_3.py",
        "test_round.py",
        "test_hooks_audit2.py",
        "Test_Review-Perf.py",
        "review_support.py",
    ],
)
def test_a_review_or_round_in_a_file_name_is_seen(name: str) -> None:
    assert named_after_a_review(name)


@pytest.mark.parametrize(
    "name",
    [
        "test_relay_hand_over.py",
        "test_trace_round_trip.py",
        "test_h2_frames_round_trips.py",
        "test_admin_audit_log.py",
        "test_reviewer_tools.py",
        "test_groundwork.py",
        "test_h2state.py",
    ],
)
def test_a_name_that_only_contains_the_letters_passes(name: str) -> None:
    assert not named_after_a_review(name)


def test_the_layout_checks_see_a_violation(tmp_path: pathlib.Path) -> None:
    """A review-named file and a 71-character test name in a tree are both found; 70 passes."""
    unit = tmp_path / "tests" / "unit"
    unit.mkdir(parents=True)
    long_name, fitting = "test_" + "x" * 66, "test_" + "y" * 65
    (unit / "test_review9_relay.py").write_text(f"def {fitting}():\n    pass\n")
    (unit / "test_relay.py").write_text(
        f"class TestA:\n    async def {long_name}(self):\n        pass\n\ndef {fitting}():\n    pass\n"
    )
    assert ["tests/unit/test_review9_relay.py"] == misnamed_files(tmp_path)
    assert [f"tests/unit/test_relay.py::{long_name} (71)"] == long_test_names(tmp_path)
