"""The Go anchor: krproxy next to a grpc-go raw-forwarding proxy in front of the same containerd.

``tests/goproxy`` (built offline by ``scripts/install-go-client --program goproxy``, as the
grpc-go test client is) forwards every call the way a Go CRI proxy passes calls through: an
unknown-service handler, a raw-bytes codec, one connection to the runtime. Both proxies serve the
same real containerd (``scripts/containerd-sandbox``, populated with pods), one after the other
in alternating rounds, so that drift on a noisy machine reaches both alike. Two figures each:

- **added latency** of a small call (Version): median through the proxy minus median direct,
  from one client process alternating between direct and both proxies block by block;
- **CPU per forwarded call** of kubelet's steady mix (List*, *Status, Version; a few concurrent
  callers; :func:`krproxy.bench.client.mix`): the proxy process's CPU clock over the run
  divided by the calls. The client is a separate process, so only the proxy's own work counts.

``python -m krproxy.bench --only-go-anchor`` runs just this case; ``nox -s bench`` runs it with
the others. ``--anchor-runtime fake`` puts both proxies in front of the fake containerd (seeded with
``--anchor-pods`` pods) instead: no root, no sandbox. Where the sandbox or the Go build cannot run, the case says why and is skipped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
from typing import Any

from krproxy.bench._support import (
    PY,
    SANDBOX_SCRIPT,
    Processes,
    _client,
    _NoSandbox,
    _populate,
    _sandbox,
    _serve_args,
    _summary,
    cpu_seconds,
)

#: scripts/install-go-client, next to the package in a source checkout.
INSTALL_GO = os.path.join(os.path.dirname(SANDBOX_SCRIPT), "install-go-client")

#: The issue's goals: at most the anchor's cost (1.0x); beyond it, 0.8x.
GOAL = 1.0
STRETCH = 0.8


def go_program(program: str = "goproxy") -> str:
    """The binary of Go program ``tests/<program>`` (built now if needed); RuntimeError "the grpc-go
    proxy cannot be built: ..." (or "tests/<program> cannot be built") with the build's reason (the Go
    anchors' and the create bench's skip)."""
    try:
        done = subprocess.run([PY, INSTALL_GO, "--program", program], capture_output=True, text=True)
    except OSError as err:
        reason = str(err)
    else:
        if done.returncode == 0:
            return done.stdout.strip()
        reason = done.stdout.strip() or done.stderr.strip()
    what = "the grpc-go proxy" if program == "goproxy" else f"tests/{program}"
    raise RuntimeError(f"{what} cannot be built: {reason}")


def go_proxy() -> str:
    """The grpc-go raw-forwarding proxy's binary: :func:`go_program` of tests/goproxy."""
    return go_program("goproxy")


def go_anchor(workdir: str, args: argparse.Namespace) -> dict[str, Any]:
    """krproxy and the Go proxy in front of one real containerd (see the module docstring); in
    front of the fake containerd instead with ``args.anchor_runtime == "fake"``."""
    fake = getattr(args, "anchor_runtime", "containerd") == "fake"
    missing = [tool for tool in ("containerd", "runc") if shutil.which(tool) is None]
    if not fake and (missing or os.geteuid() != 0):
        return {"skipped": f"{', '.join(missing)} not installed" if missing else "not root"}
    try:
        binary = go_proxy()
    except RuntimeError as err:
        return {"skipped": str(err)}
    procs = Processes(workdir)
    try:
        if fake:
            direct = os.path.join(workdir, "containerd-anchor.sock")
            seed = ["--seed-pods", str(args.anchor_pods)]
            procs.start(
                "containerd-anchor", ["-m", "krproxy.fakes.containerd", "--socket", direct, *seed], direct
            )
            return {
                "runtime": "fake containerd",
                **_measure(procs, workdir, binary, direct, args.anchor_pods, args),
            }
        with _sandbox(workdir, "go-anchor") as (_, state, cgroup_parent):
            direct = state["socket"]
            populated = _populate(direct, args.anchor_pods, 1, state["busybox_image"], cgroup_parent)
            pods = populated.get("pods", args.anchor_pods)
            return {"runtime": "containerd", **_measure(procs, workdir, binary, direct, pods, args)}
    except _NoSandbox as err:
        return {"skipped": str(err)}
    finally:
        procs.stop()


def _measure(
    procs: Processes, workdir: str, binary: str, direct: str, pods: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Both proxies started in front of ``direct``; the latency and the CPU figures."""
    hook_dir = os.path.join(workdir, "hooks-anchor")
    os.makedirs(hook_dir, exist_ok=True)
    krproxy_sock = os.path.join(workdir, "krproxy-anchor.sock")
    go_sock = os.path.join(workdir, "goproxy-anchor.sock")
    proxies = {
        "krproxy": procs.start("krproxy-anchor", _serve_args(krproxy_sock, direct, hook_dir), krproxy_sock),
        "go": procs.start(
            "goproxy-anchor", [binary, "-listen", go_sock, "-backend", direct], go_sock, python=False
        ),
    }
    sockets = {"krproxy": krproxy_sock, "go": go_sock}
    got = _client(
        "latency",
        "--targets",
        f"{direct},{krproxy_sock},{go_sock}",
        "--method",
        "Version",
        "--calls",
        str(args.small_calls),
        "--blocks",
        "10",
    )["latencies_us"]
    latency = {"direct": _summary(got[direct])}
    for name, sock in sockets.items():
        latency[name] = _summary(got[sock])
    cpu: dict[str, list[float]] = {name: [] for name in proxies}
    errors: dict[str, dict[str, int]] = {name: {} for name in proxies}
    for _ in range(args.anchor_rounds):
        for name, process in proxies.items():
            before = cpu_seconds(process.pid)
            ran = _client(
                "mix", "--target", sockets[name], "--threads", "4", "--calls", str(args.anchor_calls)
            )
            cpu[name].append((cpu_seconds(process.pid) - before) / ran["calls"] * 1e6)
            for code, count in ran["errors"].items():
                errors[name][code] = errors[name].get(code, 0) + count
    return {"pods": pods, "version_latency": latency, "cpu_per_call_us": cpu, "mix_errors": errors}


def report_go_anchor(r: dict[str, Any]) -> list[str]:
    """The case's lines of the report: both figures per proxy, and krproxy's ratio to the anchor."""
    lines = ["", "Go anchor (krproxy vs a grpc-go raw-forwarding proxy, same containerd, same run)"]
    if "skipped" in r:
        return [*lines, f"  skipped: {r['skipped']}"]
    lat = r["version_latency"]
    added = {name: (lat[name]["median_ms"] - lat["direct"]["median_ms"]) * 1000 for name in ("krproxy", "go")}
    cpu = {name: statistics.median(values) for name, values in r["cpu_per_call_us"].items()}
    lines.append(
        f"  {r.get('runtime', 'containerd')} with {r['pods']} pods;"
        f" Version direct median {lat['direct']['median_ms'] * 1000:.0f} µs"
    )
    for title, figures in (("added latency of Version", added), ("CPU per call of the steady mix", cpu)):
        ratio = figures["krproxy"] / figures["go"] if figures["go"] > 0 else float("inf")
        verdict = "met" if ratio <= GOAL else "MISSED"
        stretch = " (and the 0.8x stretch)" if ratio <= STRETCH else ""
        lines.append(
            f"  {title}: krproxy {figures['krproxy']:.0f} µs, grpc-go {figures['go']:.0f} µs, "
            f"{ratio:.2f}x  [goal <= {GOAL:.1f}x: {verdict}{stretch}]"
        )
    rounds = ", ".join(
        f"{name} " + "/".join(f"{v:.0f}" for v in values) for name, values in r["cpu_per_call_us"].items()
    )
    lines.append(f"  CPU per call by round (µs): {rounds}")
    if any(r["mix_errors"].values()):
        lines.append(f"  errors in the mix: {r['mix_errors']}")
    return lines
