"""``python -m krproxy.bench --only-nri``: the Python stub / Go stub ratios are taken block by block and
their median reported (not the ratio of the medians), and the report says whether the 1.5x target is met."""

from __future__ import annotations

from typing import Any

from krproxy.bench.nri import digest, report_nri


def _run(pod_ms: float, wait_ms: float | None = None) -> dict[str, Any]:
    run: dict[str, Any] = {"pods_us": [pod_ms * 1000] * 3, "version_us": [300.0]}
    if wait_ms is not None:
        run.update(
            nri_wait_ms_per_pod=wait_ms, cpu_ms_per_pod=1.0, nri_calls_ms={"CreateContainer": [wait_ms]}
        )
    return run


def _block(scale: float, python_wait: float) -> dict[str, Any]:
    """A block where the Go stub's wait is ``scale`` ms and the Python stub's ``python_wait``."""
    return {
        "none": _run(100 * scale),
        "python_stub": _run(100 * scale + python_wait, python_wait),
        "go_stub": _run(100 * scale + scale, scale),
        "bridge": _run(100 * scale + 3, 3.0),
    }


def test_ratios_are_medians_of_per_block_ratios() -> None:
    # The Go stub's wait drifts 1 -> 2 -> 4 ms between blocks, the Python stub at 1.2x of it in each: the
    # per-block ratios are 1.2 but for one outlier (9.6), which their median leaves out.
    blocks = [_block(1.0, 1.2), _block(2.0, 2.4), _block(4.0, 4.8), _block(1.0, 9.6)]
    got = digest(blocks)
    assert [1.2, 1.2, 1.2, 9.6] == got["python_over_go"]["nri_wait"]["blocks"]
    assert 1.2 == got["python_over_go"]["nri_wait"]["median"]
    assert 4 * 3 == got["states"]["go_stub"]["pod_start"]["n"]
    assert 1.5 == got["states"]["go_stub"]["nri_wait_ms_per_pod"]  # median over blocks
    assert "nri_wait_ms_per_pod" not in got["states"]["none"]


def test_report_marks_the_target_met_or_missed() -> None:
    def lines(python_wait: float) -> list[str]:
        result = {
            "containerd": "2.1.9",
            "blocks": 2,
            "pods_per_block": 3,
            "load_average": {"start": [1.0, 1.0, 1.0], "end": [2.0, 1.0, 1.0]},
            **digest([_block(1.0, python_wait), _block(1.0, python_wait)]),
        }
        return report_nri(result)

    [met] = [line for line in lines(1.4) if line.startswith("Python stub / Go stub, containerd's wait")]
    assert "1.40x" in met and "target 1.5x met" in met and "goal 1.0x not met" in met
    [missed] = [line for line in lines(2.0) if line.startswith("Python stub / Go stub, containerd's wait")]
    assert "2.00x" in missed and "target 1.5x MISSED" in missed


def test_without_the_go_stub_no_ratio() -> None:
    """When tests/gonristub could not be built its state is missing: no ratio, the rest reported."""
    blocks = [{k: v for k, v in _block(1.0, 1.0).items() if k != "go_stub"}]
    got = digest(blocks)
    assert "python_over_go" not in got
    assert {"none", "python_stub", "bridge"} == set(got["states"])
