"""``python -m krproxy.bench.sdk``'s report: each SDK server's CPU against the grpc-go hook server's, and
issue 24's verdict only for calls back to back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from krproxy.bench import sdk


def _server(cpu_ms: float, kubelet_sized: bool = False, against_go: bool | None = None) -> dict[str, Any]:
    return {
        "kubelet_sized": kubelet_sized,
        "against_go": not kubelet_sized if against_go is None else against_go,
        "cpu_ms_rounds": [cpu_ms, cpu_ms],
        "cpu_ms": cpu_ms,
        "latency_median_ms": 0.3,
        "latency_p99_ms": 0.9,
        "calls": 20,
    }


def _result(idle_ms: float, go: bool = True) -> dict[str, Any]:
    servers = {
        "one plain function": _server(0.6),
        "one non-blocking function": _server(0.2),
        "one plain function, 4 KB": _server(0.8, kubelet_sized=True),
    }
    result: dict[str, Any] = {"idle_ms": idle_ms, "servers": servers}
    if go:
        servers[sdk.GO_SERVER] = _server(0.4)
    else:
        result["go_skipped"] = "tests/gohookserver cannot be built: no Go"
    return result


def test_sdk_cpu_against_go() -> None:
    """Each SDK server's line gives its CPU as a multiple of the Go hook server's for the same request;
    Go's line none."""
    lines = sdk.report_cpu_per_call(_result(0.0))
    assert "calls back to back" == lines[0]
    plain = next(line for line in lines if line.startswith("one plain function"))
    assert "1.50x Go's CPU" in plain and "<= 0.2 ms: MISSED" in plain
    quick = next(line for line in lines if line.startswith("one non-blocking function"))
    assert "0.50x Go's CPU" in quick and "<= 0.2 ms: met" in quick
    sized = next(line for line in lines if line.startswith("one plain function, 4 KB"))
    assert "Go's CPU" not in sized, "the Go server gets the minimal request only"
    go = next(line for line in lines if line.startswith(sdk.GO_SERVER))
    assert "Go's CPU" not in go and "<=" not in go


def test_idle_calls_get_no_verdict() -> None:
    """With the client idle before each call the report says so, and gives issue 24's target (for calls
    back to back) no verdict."""
    lines = sdk.report_cpu_per_call(_result(20.0))
    assert "the client idle 20 ms before each call" == lines[0]
    assert not any("<=" in line for line in lines)
    assert any("1.50x Go's CPU" in line for line in lines)


def test_no_go_server_says_why() -> None:
    """Where the Go hook server cannot be built, the report says why and gives no ratio."""
    lines = sdk.report_cpu_per_call(_result(0.0, go=False))
    assert f"(no {sdk.GO_SERVER}: tests/gohookserver cannot be built: no Go)" == lines[1]
    assert not any("Go's CPU" in line for line in lines)


def test_against_go_only_for_gos_change() -> None:
    """Only the servers that make the Go hook server's change on its request are set against its CPU:
    the bench's plugin alone on the minimal request; not the built-in policies (other work), not 4 KB."""
    assert ["one plain function", "one non-blocking function", "one async function"] == [
        case for case in sdk.CASES if sdk.against_go(case)
    ]
    result = _result(0.0)
    result["servers"]["built-in policies"] = _server(0.5, against_go=False)
    builtin = next(line for line in sdk.report_cpu_per_call(result) if line.startswith("built-in"))
    assert "Go's CPU" not in builtin and "<= 0.2 ms: MISSED" in builtin


def test_a_server_that_exits_fails_the_wait(tmp_path: Path) -> None:
    """A server that exits before it answers fails the wait at once, with its exit status and its log's
    end (the log goes with the run's directory), not after the minutes a slow start may take."""
    log_path = tmp_path / "s0.log"
    log_path.write_text("starting\ncannot listen: address in use\n")
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()

    async def wait() -> None:
        with trio.fail_after(10):
            await sdk._wait_ready(str(tmp_path / "s0.sock"), sdk.minimal_request(), process, str(log_path))

    with pytest.raises(RuntimeError, match=r"(?s)status 3.*cannot listen: address in use"):
        trio.run(wait)
