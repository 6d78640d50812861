"""``python -m krproxy.bench.instructions``: callgrind's count read from a log, the report, a machine without valgrind."""

from __future__ import annotations

import pytest

from krproxy.bench import instructions


def test_the_last_summary_counts() -> None:
    """The count is the last ``Collected :`` of callgrind's summary in the process's log."""
    log = b"x\n==1== Collected : 12\n==2== Events    : Ir\n==2== Collected : 482656797\n==2== I   refs: 482,656,797\n"
    assert 482656797 == instructions.collected(log)


def test_no_summary_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no summary"):
        instructions.collected(b"Traceback (most recent call last):\n")


def test_report_gives_each_case_and_ratio() -> None:
    """Thousands of instructions per create + remove (per hook call for the hook servers), then the ratios."""
    per_call = {case: 1000.0 * (n + 1) for n, case in enumerate(instructions.CASES)}
    ratios = {name: per_call[a] / per_call[b] for name, (_, a, b) in instructions.RATIOS.items()}
    lines = instructions.report({"calls": 10, "per_call": per_call, "ratios": ratios})
    assert "  krproxy + SDK hook server                      1.0 k per create + remove" in lines
    assert "  floor hook server (floor proxy calling)        6.0 k per hook call" in lines
    assert "  krproxy + SDK hook server vs the floor proxy: 0.50x" in lines


def test_without_valgrind_nothing_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where valgrind is not installed the run says so and starts nothing."""
    monkeypatch.setattr(instructions.shutil, "which", lambda tool: None)
    monkeypatch.setattr(instructions, "measure", lambda *a: pytest.fail("measured without valgrind"))
    result = instructions.instructions(5)
    assert ["valgrind and callgrind_control not installed (Debian's valgrind)"] == [result["skipped"]]
    assert instructions.report(result)[-1].startswith("  skipped: valgrind")
