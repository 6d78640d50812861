"""``python -m krproxy.bench --only-hook-anchor``: the ratios against Go+Go are taken round by round and
their median reported (not the ratio of the medians), and the report says which target each one meets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from krproxy.bench import hookanchor


def _round(scale: float, krproxy_sdk_added: float) -> dict[str, Any]:
    """A round where every Go+Go figure is ``scale`` and krproxy + SDK adds ``krproxy_sdk_added`` ms."""
    out: dict[str, Any] = {"direct_ms": 3.0}
    for label, (_, server) in hookanchor.CASES.items():
        out[label] = {"added_ms": scale, "p99_ms": 9.0, "proxy_cpu_ms": scale}
        if server is not None:
            out[label]["hook_cpu_ms"] = scale
    out["krproxy_sdk"]["added_ms"] = krproxy_sdk_added
    return out


def test_ratios_are_medians_of_per_round_ratios() -> None:
    # Go+Go drifts 1 -> 2 -> 4 ms between rounds, krproxy + SDK at 1.2x of it in each round: the
    # per-round ratios are all 1.2; the medians (2.0 and 4.8) would give 2.4x.
    rounds = [_round(1.0, 1.2), _round(2.0, 2.4), _round(4.0, 4.8), _round(1.0, 9.6)]
    got = hookanchor._digest(rounds)
    assert [1.2, 1.2, 1.2, 9.6] == [round(v, 6) for v in got["ratios"]["latency"]["rounds"]]
    assert 1.2 == round(got["ratios"]["latency"]["median"], 6)
    assert 1.0 == got["ratios"]["no_hook_latency"]["median"]
    assert 1.5 == got["median"]["go_go"]["added_ms"]


def test_report_marks_each_target_met_or_missed() -> None:
    rounds = [_round(1.0, 1.2), _round(1.0, 1.4), _round(1.0, 1.5)]
    result = {
        "runtime": "fake containerd",
        "calls_per_round": 10,
        "load_average": {"start": [1.0, 1.0, 1.0], "end": [2.0, 1.0, 1.0]},
        "rounds": rounds,
        **hookanchor._digest(rounds),
    }
    lines = hookanchor.report_hook_anchor(result)
    latency = next(line for line in lines if "latency added vs Go+Go" in line)
    assert "1.40x" in latency and "MISSED" in latency
    cpu = next(line for line in lines if "proxy CPU vs Go+Go" in line)
    assert "1.00x" in cpu and "met" in cpu
    assert any("load average 1.00 at the start, 2.00 at the end" in line for line in lines)


def test_spaced_calls_get_no_verdict() -> None:
    """A run whose client idled before each create says so, and gives its ratios no verdict: the
    targets are for calls back to back."""
    rounds = [_round(1.0, 1.1), _round(1.0, 1.1)]
    result = {
        "runtime": "fake containerd",
        "calls_per_round": 10,
        "idle_ms": 2.0,
        "load_average": {"start": [1.0, 1.0, 1.0], "end": [1.0, 1.0, 1.0]},
        "rounds": rounds,
        **hookanchor._digest(rounds),
    }
    lines = hookanchor.report_hook_anchor(result)
    assert any("calls alternating, the client idle 2 ms before each;" in line for line in lines)
    targeted = [line for line in lines if "vs Go+Go" in line and "floor:" not in line]
    assert targeted and all(line.endswith("[spaced calls: no verdict]") for line in targeted)
    assert not any("met" in line or "MISSED" in line for line in lines)


def test_the_client_idles_before_each_create(monkeypatch: pytest.MonkeyPatch) -> None:
    """The round hands the idle time to the client as --idle-ms."""
    seen: list[tuple[str, ...]] = []

    def client(*argv: str) -> dict[str, Any]:
        seen.append(argv)
        return {"latencies_us": {"a.sock": [1000.0], "b.sock": [1500.0]}}

    monkeypatch.setattr(hookanchor, "_client", client)
    monkeypatch.setattr(hookanchor, "cpu_seconds", lambda pid: 0.0)
    got = hookanchor._round({"direct": "a.sock", "go_go": "b.sock"}, {"go_go": {}}, 1, 2.5)
    assert ("--idle-ms", "2.5") == seen[0][-2:]
    assert 0.5 == got["go_go"]["added_ms"]


def test_a_skipped_run_says_why() -> None:
    lines = hookanchor.report_hook_anchor({"skipped": "tests/gohookproxy cannot be built: no Go"})
    assert "  skipped: tests/gohookproxy cannot be built: no Go" == lines[-1]


def test_floor_ratios_are_printed_without_a_verdict() -> None:
    """Each floor ratio is a "floor: ..." line, its per-round values beside it, no target verdict."""
    rounds = [_round(1.0, 1.2), _round(1.0, 1.2)]
    for r in rounds:
        r["floor_go"]["added_ms"] = 0.5
    result = {
        "runtime": "fake containerd",
        "calls_per_round": 10,
        "load_average": {"start": [1.0, 1.0, 1.0], "end": [1.0, 1.0, 1.0]},
        "rounds": rounds,
        **hookanchor._digest(rounds),
    }
    lines = hookanchor.report_hook_anchor(result)
    floor = [line for line in lines if line.strip().startswith("floor:")]
    assert len(hookanchor.FLOOR_RATIOS) == len(floor)
    latency = next(line for line in floor if "floor proxy + Go hook server, latency added vs Go+Go" in line)
    assert latency.endswith(": 0.50x (0.50/0.50)")
    assert not any("target" in line for line in floor)


def _logs(tmp_path: Path, floor_hook_calls: int, answered: int) -> None:
    for label, (proxy, server) in hookanchor.CASES.items():
        text = ""
        if proxy == "floor":
            calls = floor_hook_calls if server else 0
            text = f"floor proxy stopped: calls=9 hook_calls={calls} hook_failures=0\n"
        (tmp_path / f"proxy-{label}.log").write_text(text)
        if server == "floor":
            (tmp_path / f"hook-{label}.log").write_text(
                f"floor hook server stopped: answered={answered} x=1\n"
            )


def test_floor_counts_that_match_pass(tmp_path: Path) -> None:
    """A floor proxy and floor hook server that counted one hook call per create pass the check."""
    _logs(tmp_path, 120, 120)
    hookanchor._check_logs(str(tmp_path), 120)


def test_a_floor_proxy_that_skipped_hooks_fails(tmp_path: Path) -> None:
    """A floor proxy that made fewer hook calls than creates makes the run fail, naming it."""
    _logs(tmp_path, 119, 120)
    with pytest.raises(RuntimeError, match="proxy-floor_go logged calls=9 hook_calls=119"):
        hookanchor._check_logs(str(tmp_path), 120)


def test_a_floor_hook_server_without_counts_fails(tmp_path: Path) -> None:
    """A floor hook server that printed no counts (killed, not stopped) makes the run fail."""
    _logs(tmp_path, 120, 120)
    (tmp_path / "hook-go_floor.log").write_text("")
    with pytest.raises(RuntimeError, match="hook-go_floor logged no counts"):
        hookanchor._check_logs(str(tmp_path), 120)
