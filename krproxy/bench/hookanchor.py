"""The Go hook-path anchor: a hooked CreateContainer through krproxy beside the same work done in grpc-go.

``tests/gohookproxy`` does koord-runtime-proxy's work on a hooked call (decode RunPodSandbox and
CreateContainer with the CRI Go types, build the hook request, call one hook server over one kept
connection, merge, re-encode, forward, store); ``tests/gohookserver`` is a grpc-go hook server making
the SDK bench plugin's change (:func:`krproxy.bench.sdk.register`: BENCH=<pod name>). Both are built
offline by ``scripts/install-go-client``, as the raw Go anchor is (:mod:`krproxy.bench.anchor`).

In front of one fake containerd, each with a hook directory of its own holding one hook server:
Go proxy + Go hook server (the anchor, "Go+Go"), krproxy + Go hook server, Go proxy + SDK hook server
(``krproxy hooks serve`` with the bench plugin), krproxy + SDK hook server, and with no hook server
the Go proxy and krproxy; and direct. One client process (:func:`krproxy.bench.client.create`) takes
the targets in turn call by call, each in a pod created through it, each container removed again
(untimed); that run is repeated ``--hook-anchor-rounds`` times. Per round and target: the latency added
over direct (median minus direct's median), the proxy's CPU (its CPU clock, :func:`krproxy.bench._support.cpu_seconds`) per
create + remove and the hook server's per call, the client's 20 warm-up calls counted. The ratios
against Go+Go are taken round by round and their medians reported, so that drift of the machine's
load between rounds reaches both sides of a ratio alike; the load average is printed beside them.

``--hook-anchor-idle-ms`` makes the client idle that long before each timed create, so every process
meets each call after the machine idled, as kubelet's creates on a quiet node do, rather than only
with caches the other targets used. The ratios are then printed without a verdict: the targets are
for calls back to back (docs/performance.md says how the spacing moves them).

Issue 38's targets (:data:`TARGETS`): krproxy + SDK hook server at most 1.3x Go+Go's added latency and
1.2x its proxy CPU; the SDK hook server at most 1.2x the Go hook server's CPU per call; with no hook
server, krproxy's added latency at most the Go proxy's. The goal beyond is 0.8x on each.

Measured in the same rounds, the floor of that work on krproxy's stack (:mod:`krproxy.bench.floor`: trio,
the HTTP/2 core and the sockets, none of krproxy's hook logic): the floor proxy + Go hook server, the Go
proxy + floor hook server, the floor proxy + floor hook server (the floor of krproxy + SDK hook server),
and the floor proxy with no hook server. Their ratios (:data:`FLOOR_RATIOS`:
against Go+Go, and krproxy's against the floor's) are printed beside the targets, with no verdict: they
say whether a target is reachable on this stack at all, and how far krproxy is above its floor.

``python -m krproxy.bench --only-hook-anchor`` runs just this case; ``nox -s bench`` runs it with the
others. Where the Go programs cannot be built, the case says why and is skipped.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import time
from typing import Any

from krproxy.bench._support import Processes, _client, _serve_args, _summary, cpu_seconds
from krproxy.bench.anchor import STRETCH, go_program
from krproxy.bench.sdk import PLAIN, hook_server_argv

#: The proxied targets: label -> (proxy, hook server or None). "go_go" is the anchor of every ratio.
CASES: dict[str, tuple[str, str | None]] = {
    "go_go": ("go", "go"),
    "krproxy_go": ("krproxy", "go"),
    "go_sdk": ("go", "sdk"),
    "krproxy_sdk": ("krproxy", "sdk"),
    "go_none": ("go", None),
    "krproxy_none": ("krproxy", None),
    "floor_go": ("floor", "go"),
    "go_floor": ("go", "floor"),
    "floor_none": ("floor", None),
    "floor_floor": ("floor", "floor"),
}

TITLES = {
    "go_go": "Go proxy + Go hook server",
    "krproxy_go": "krproxy + Go hook server",
    "go_sdk": "Go proxy + SDK hook server",
    "krproxy_sdk": "krproxy + SDK hook server",
    "go_none": "Go proxy, no hook server",
    "krproxy_none": "krproxy, no hook server",
    "floor_go": "floor proxy + Go hook server",
    "go_floor": "Go proxy + floor hook server",
    "floor_none": "floor proxy, no hook server",
    "floor_floor": "floor proxy + floor hook server",
}

#: Issue 38's targets: ratio name -> (what it compares, the most it may be).
TARGETS = {
    "latency": ("krproxy + SDK hook server, latency added vs Go+Go", 1.3),
    "proxy_cpu": ("krproxy + SDK hook server, proxy CPU vs Go+Go", 1.2),
    "hook_cpu": ("SDK hook server CPU per call vs the Go hook server's", 1.2),
    "no_hook_latency": ("no hook server, krproxy's latency added vs the Go proxy's", 1.0),
    "no_hook_cpu": ("no hook server, krproxy's CPU vs the Go proxy's (no target)", None),
}

#: The floor's ratios, printed as "floor: ..." (no target): name -> (what it compares, the target and
#: its figure divided, the target it is divided by). Per round, as the targets' ratios are.
FLOOR_RATIOS = {
    "floor_latency": (
        "floor proxy + Go hook server, latency added vs Go+Go",
        "floor_go",
        "added_ms",
        "go_go",
    ),
    "floor_proxy_cpu": (
        "floor proxy + Go hook server, proxy CPU vs Go+Go",
        "floor_go",
        "proxy_cpu_ms",
        "go_go",
    ),
    "floor_hook_latency": (
        "Go proxy + floor hook server, latency added vs Go+Go",
        "go_floor",
        "added_ms",
        "go_go",
    ),
    "floor_hook_cpu": (
        "floor hook server CPU per call vs the Go hook server's",
        "go_floor",
        "hook_cpu_ms",
        "go_go",
    ),
    "floor_pair_latency": (
        "floor proxy + floor hook server, latency added vs Go+Go",
        "floor_floor",
        "added_ms",
        "go_go",
    ),
    "floor_pair_proxy_cpu": (
        "floor proxy + floor hook server, proxy CPU vs Go+Go",
        "floor_floor",
        "proxy_cpu_ms",
        "go_go",
    ),
    "floor_no_hook_latency": (
        "no hook server, the floor proxy's latency added vs the Go proxy's",
        "floor_none",
        "added_ms",
        "go_none",
    ),
    "floor_no_hook_cpu": (
        "no hook server, the floor proxy's CPU vs the Go proxy's",
        "floor_none",
        "proxy_cpu_ms",
        "go_none",
    ),
    "above_floor_pair_latency": (
        "krproxy + SDK hook server, latency added vs the floor pair's",
        "krproxy_sdk",
        "added_ms",
        "floor_floor",
    ),
    "above_floor_pair_proxy_cpu": (
        "krproxy + SDK hook server, proxy CPU vs the floor pair's",
        "krproxy_sdk",
        "proxy_cpu_ms",
        "floor_floor",
    ),
    "above_floor_latency": (
        "krproxy + Go hook server, latency added vs the floor proxy's",
        "krproxy_go",
        "added_ms",
        "floor_go",
    ),
    "above_floor_proxy_cpu": (
        "krproxy + Go hook server, proxy CPU vs the floor proxy's",
        "krproxy_go",
        "proxy_cpu_ms",
        "floor_go",
    ),
    "above_floor_hook_cpu": (
        "SDK hook server CPU per call vs the floor hook server's",
        "krproxy_sdk",
        "hook_cpu_ms",
        "go_floor",
    ),
    "above_floor_no_hook_latency": (
        "no hook server, krproxy's latency added vs the floor proxy's",
        "krproxy_none",
        "added_ms",
        "floor_none",
    ),
    "above_floor_no_hook_cpu": (
        "no hook server, krproxy's CPU vs the floor proxy's",
        "krproxy_none",
        "proxy_cpu_ms",
        "floor_none",
    ),
}

#: The client's warm-up creates per target and run (krproxy.bench.client.create): their CPU is counted.
WARM_UP = 20


def _wait_registered(hook_dir: str, failure: str) -> None:
    """Wait (up to a minute) until a registration file is in ``hook_dir``: the Go proxy reads it once."""
    deadline = time.monotonic() + 60
    while not glob.glob(os.path.join(hook_dir, "*.json")):
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(0.05)


def hook_anchor(workdir: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every target of :data:`CASES` started in front of one fake containerd, then measured in
    ``args.hook_anchor_rounds`` runs of ``args.hook_anchor_calls`` creates per target (module docstring)."""
    try:
        gohookproxy, gohookserver = go_program("gohookproxy"), go_program("gohookserver")
    except RuntimeError as err:
        return {"skipped": str(err)}
    procs = Processes(workdir)

    def sock(name: str) -> str:
        return os.path.join(workdir, f"{name}.sock")

    runtime = sock("containerd-hooks")
    targets = {"direct": runtime}
    pids: dict[str, dict[str, int]] = {}
    rounds: list[dict[str, Any]] = []
    try:
        procs.start("containerd-hooks", ["-m", "krproxy.fakes.containerd", "--socket", runtime], runtime)
        for label, (proxy, server) in CASES.items():
            hook_dir = os.path.join(workdir, f"hooks-{label}")
            os.makedirs(hook_dir)
            pids[label] = {}
            socket = None
            if server is not None:
                socket = sock(f"hook-{label}")
                if server == "go":
                    argv = [gohookserver, "-socket", socket, "-hook-dir", hook_dir]
                    process = procs.start(f"hook-{label}", argv, socket, python=False)
                elif server == "floor":
                    argv = ["-m", "krproxy.bench.floor", "hook", "--socket", socket, "--hook-dir", hook_dir]
                    process = procs.start(f"hook-{label}", argv, socket)
                else:
                    process = procs.start(
                        f"hook-{label}", hook_server_argv(socket, hook_dir, workdir, PLAIN), socket
                    )
                _wait_registered(hook_dir, f"hook-{label} wrote no registration file; see its log")
                pids[label]["hook"] = process.pid
            listen = sock(f"proxy-{label}")
            if proxy == "go":
                argv = [gohookproxy, "-listen", listen, "-backend", runtime, "-hook-dir", hook_dir]
                process = procs.start(f"proxy-{label}", argv, listen, python=False)
            elif proxy == "floor":  # given the hook server's socket: it reads no hook directory
                argv = ["-m", "krproxy.bench.floor", "proxy", "--listen", listen, "--backend", runtime]
                process = procs.start(
                    f"proxy-{label}", [*argv, *(["--hook", socket] if socket else [])], listen
                )
            else:
                process = procs.start(f"proxy-{label}", _serve_args(listen, runtime, hook_dir), listen)
            pids[label]["proxy"] = process.pid
            targets[label] = listen
        time.sleep(1.0)  # let each krproxy's watcher see its hook server
        load_start = os.getloadavg()
        for _ in range(args.hook_anchor_rounds):
            rounds.append(_round(targets, pids, args.hook_anchor_calls, args.hook_anchor_idle_ms))
        load_end = os.getloadavg()
    finally:
        procs.stop()
    _check_logs(workdir, args.hook_anchor_rounds * (args.hook_anchor_calls + WARM_UP))
    return {
        "runtime": "fake containerd",
        "calls_per_round": args.hook_anchor_calls,
        "idle_ms": args.hook_anchor_idle_ms,
        "load_average": {"start": list(load_start), "end": list(load_end)},
        "rounds": rounds,
        **_digest(rounds),
    }


def _round(
    targets: dict[str, str], pids: dict[str, dict[str, int]], calls: int, idle_ms: float = 0.0
) -> dict[str, Any]:
    """One client run over every target: latencies, and each process's CPU per create (ms); the
    client idles ``idle_ms`` before each timed create."""
    before = {label: {kind: cpu_seconds(pid) for kind, pid in p.items()} for label, p in pids.items()}
    run = ("--targets", ",".join(targets.values()), "--calls", str(calls), "--idle-ms", str(idle_ms))
    got = _client("create", *run)["latencies_us"]
    after = {label: {kind: cpu_seconds(pid) for kind, pid in p.items()} for label, p in pids.items()}
    latency = {label: _summary(got[target]) for label, target in targets.items()}
    direct = latency["direct"]["median_ms"]
    out: dict[str, Any] = {"direct_ms": direct}
    for label, p in pids.items():
        out[label] = {"added_ms": latency[label]["median_ms"] - direct, "p99_ms": latency[label]["p99_ms"]}
        for kind in p:
            out[label][f"{kind}_cpu_ms"] = (
                (after[label][kind] - before[label][kind]) / (calls + WARM_UP) * 1e3
            )
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def _digest(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds per target, and per ratio its value in each round and their median."""
    figures = {
        label: {
            key: statistics.median(r[label][key] for r in rounds)
            for key in rounds[0][label]
            if key != "p99_ms"
        }
        for label in CASES
    }
    per_round: dict[str, list[float]] = {
        "latency": [_ratio(r["krproxy_sdk"]["added_ms"], r["go_go"]["added_ms"]) for r in rounds],
        "proxy_cpu": [_ratio(r["krproxy_sdk"]["proxy_cpu_ms"], r["go_go"]["proxy_cpu_ms"]) for r in rounds],
        "hook_cpu": [_ratio(r["krproxy_sdk"]["hook_cpu_ms"], r["go_go"]["hook_cpu_ms"]) for r in rounds],
        "no_hook_latency": [_ratio(r["krproxy_none"]["added_ms"], r["go_none"]["added_ms"]) for r in rounds],
        "no_hook_cpu": [
            _ratio(r["krproxy_none"]["proxy_cpu_ms"], r["go_none"]["proxy_cpu_ms"]) for r in rounds
        ],
    }
    for label in ("krproxy_go", "go_sdk"):
        per_round[f"{label}_latency"] = [_ratio(r[label]["added_ms"], r["go_go"]["added_ms"]) for r in rounds]
        per_round[f"{label}_proxy_cpu"] = [
            _ratio(r[label]["proxy_cpu_ms"], r["go_go"]["proxy_cpu_ms"]) for r in rounds
        ]
    for name, (_, label, key, base) in FLOOR_RATIOS.items():
        per_round[name] = [_ratio(r[label][key], r[base][key]) for r in rounds]
    ratios = {
        name: {"rounds": values, "median": statistics.median(values)} for name, values in per_round.items()
    }
    return {"median": figures, "ratios": ratios}


def _check_logs(workdir: str, creates: int) -> None:
    """RuntimeError if a proxy logged a hook it skipped or a hook server that failed, or if a floor
    program's counts, printed as it stopped (:mod:`krproxy.bench.floor`), are not ``creates`` hook
    calls each (none for the floor proxy with no hook server): the figures would not be those of a
    hooked CreateContainer."""
    for label, (proxy, server) in CASES.items():
        marks = ("event=hook_",) if proxy == "krproxy" else ("hook failed", "not in the store")
        with open(os.path.join(workdir, f"proxy-{label}.log"), errors="replace") as f:
            problems = [line for line in f if any(mark in line for mark in marks)]
        if problems:
            raise RuntimeError(
                f"proxy-{label} did not run its hook on every call ({len(problems)} log lines like"
                f" {problems[0].strip()!r}): the figures would not be those of a hooked CreateContainer"
            )
        if proxy == "floor":
            want = {"hook_calls": creates if server else 0, "hook_failures": 0}
            _check_counts(workdir, f"proxy-{label}", "floor proxy stopped:", want)
        if server == "floor":
            _check_counts(workdir, f"hook-{label}", "floor hook server stopped:", {"answered": creates})


def _check_counts(workdir: str, name: str, prefix: str, want: dict[str, int]) -> None:
    """RuntimeError unless ``name``'s log has a line ``prefix key=value ...`` with the values of ``want``."""
    with open(os.path.join(workdir, f"{name}.log"), errors="replace") as f:
        log = f.read().splitlines()
    lines = [line.split()[len(prefix.split()) :] for line in log if line.startswith(prefix)]
    got = dict(field.partition("=")[::2] for field in lines[-1]) if lines else {}
    if any(got.get(key) != str(value) for key, value in want.items()):
        said = " ".join(lines[-1]) if lines else f"no counts (killed? its log ends {log[-3:]!r})"
        raise RuntimeError(
            f"{name} logged {said}, not {want}: the floor's figures would not be a hooked call's"
        )


def _verdict(value: float, most: float | None) -> str:
    if most is None:
        return ""
    verdict = "met" if value <= most else "MISSED"
    stretch = ", and the 0.8x goal" if value <= STRETCH else ""
    return f"  [target <= {most:.1f}x: {verdict}{stretch}]"


def report_hook_anchor(r: dict[str, Any]) -> list[str]:
    """The case's lines: per target the medians of the rounds, then the medians of per-round ratios."""
    lines = ["", "Go hook-path anchor (hooked CreateContainer: krproxy and the SDK vs grpc-go, same run)"]
    if "skipped" in r:
        return [*lines, f"  skipped: {r['skipped']}"]
    load = r["load_average"]
    idle_ms = r.get("idle_ms", 0.0)
    spacing = f", the client idle {idle_ms:g} ms before each" if idle_ms else ""
    lines.append(
        f"  {r['runtime']}, {len(r['rounds'])} rounds of {r['calls_per_round']} creates per target, calls"
        f" alternating{spacing}; load average {load['start'][0]:.2f} at the start, {load['end'][0]:.2f} at the end;"
        f" direct median {statistics.median(x['direct_ms'] for x in r['rounds']):.3f} ms"
    )
    lines.append(
        f"  {'target':<31} {'added ms':>9} {'(by round)':<34} {'proxy CPU ms':>12} {'hook CPU ms':>12}"
    )
    for label, figures in r["median"].items():
        by_round = "/".join(f"{x[label]['added_ms']:.2f}" for x in r["rounds"])
        hook = f"{figures['hook_cpu_ms']:12.3f}" if "hook_cpu_ms" in figures else f"{'-':>12}"
        lines.append(
            f"  {TITLES[label]:<31} {figures['added_ms']:+9.3f} {by_round:<34} {figures['proxy_cpu_ms']:12.3f} {hook}"
        )
    lines.append("  (proxy CPU per create + remove, hook server CPU per call)")
    lines.append("  medians of per-round ratios against Go+Go:")
    for name, (title, most) in TARGETS.items():
        ratio = r["ratios"][name]
        rounds = "/".join(f"{v:.2f}" for v in ratio["rounds"])
        verdict = "  [spaced calls: no verdict]" if idle_ms and most else _verdict(ratio["median"], most)
        lines.append(f"    {title}: {ratio['median']:.2f}x ({rounds}){verdict}")
    for label in ("krproxy_go", "go_sdk"):
        latency, cpu = r["ratios"][f"{label}_latency"]["median"], r["ratios"][f"{label}_proxy_cpu"]["median"]
        lines.append(f"    {TITLES[label]}: latency added {latency:.2f}x, proxy CPU {cpu:.2f}x")
    for name, (title, *_) in FLOOR_RATIOS.items():
        ratio = r["ratios"][name]
        rounds = "/".join(f"{v:.2f}" for v in ratio["rounds"])
        lines.append(f"    floor: {title}: {ratio['median']:.2f}x ({rounds})")
    return lines
