"""``python -m krproxy.bench.instructions``: instructions per hooked CreateContainer, krproxy against its floor.

The hook anchor's ratios (:mod:`krproxy.bench.hookanchor`) are seconds, and they move with the host under
the machine: on a host shared with other tenants krproxy's ratio against Go rose from 1.12x to 1.38x of
the proxy's CPU between runs of the same code (docs/performance.md). Instructions do not: ``valgrind
--tool=callgrind`` counts what one process executes, whatever else the machine does, so a change of the hot
path can be judged by its count alone. Go's runtime does not run under valgrind 3.19 (it aborts in the
scheduler), so the count compares krproxy with the floor of its own stack (:mod:`krproxy.bench.floor`:
trio, the HTTP/2 core and the sockets, no hook logic), whose CPU ratio the anchor prints in the same runs.

Each target is a fresh set of processes in front of the fake containerd, one of them under callgrind with
its instrumentation off until the bench client's warm-up run is over (``callgrind_control -i on``), then
counted over one client run of ``--calls`` creates (each followed by its remove, the client's 20 warm-up
creates included, as in the anchor) and switched off again before it stops:

- the proxy counted: krproxy and the floor proxy, each with the SDK hook server (the bench's plain plugin
  function, :data:`krproxy.bench.sdk.PLAIN`, making its change) and with no hook server: per create + remove;
- the hook server counted, behind the floor proxy: the SDK hook server and the floor hook server: per call.

The counts are repeatable to about 2 % (hash seeds, the garbage collector's timing); a run takes a few
minutes (every process under callgrind runs some 50 times slower). Where valgrind is not installed the
run says so and measures nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from krproxy.bench._support import PY, Processes, _client, _serve_args
from krproxy.bench.hookanchor import WARM_UP, _wait_registered
from krproxy.bench.sdk import PLAIN, hook_server_argv

#: The measured runs: name -> (proxy, hook server or None, which process is counted).
CASES: dict[str, tuple[str, str | None, str]] = {
    "krproxy_sdk": ("krproxy", "sdk", "proxy"),
    "floor_sdk": ("floor", "sdk", "proxy"),
    "krproxy_none": ("krproxy", None, "proxy"),
    "floor_none": ("floor", None, "proxy"),
    "sdk_server": ("floor", "sdk", "hook"),
    "floor_server": ("floor", "floor", "hook"),
}

TITLES = {
    "krproxy_sdk": "krproxy + SDK hook server",
    "floor_sdk": "floor proxy + SDK hook server",
    "krproxy_none": "krproxy, no hook server",
    "floor_none": "floor proxy, no hook server",
    "sdk_server": "SDK hook server (floor proxy calling)",
    "floor_server": "floor hook server (floor proxy calling)",
}

#: The ratios printed: name -> (what it compares, the case divided, the case it is divided by).
RATIOS = {
    "hooked": ("krproxy + SDK hook server vs the floor proxy", "krproxy_sdk", "floor_sdk"),
    "no_hook": ("no hook server, krproxy vs the floor proxy", "krproxy_none", "floor_none"),
    "hook_server": ("the SDK hook server vs the floor hook server", "sdk_server", "floor_server"),
}

_COLLECTED = re.compile(rb"Collected : (\d+)")


def collected(log: bytes) -> int:
    """The instructions callgrind says it collected, from its summary in a process's log (the last one).

    Raises:
        RuntimeError: the log has no such summary (the process did not end under callgrind).
    """
    found = _COLLECTED.findall(log)
    if not found:
        raise RuntimeError("callgrind wrote no summary (did the process stop under valgrind?)")
    return int(found[-1])


def _callgrind(out: str) -> list[str]:
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]


def _toggle(pid: int, state: str) -> None:
    subprocess.run(["callgrind_control", "-i", state, str(pid)], check=True, capture_output=True)


def measure(workdir: str, case: str, calls: int) -> float:
    """Instructions of the counted process of *case* per create + remove (per hook call for a hook server)."""
    proxy, server, counted = CASES[case]
    procs = Processes(workdir)
    runtime, hook, listen = (os.path.join(workdir, f"{name}.sock") for name in ("runtime", "hook", "proxy"))
    hook_dir = os.path.join(workdir, "hooks")
    os.makedirs(hook_dir)
    wrap = {counted: [*_callgrind(os.path.join(workdir, "callgrind.out")), PY]}
    try:
        procs.start("runtime", ["-m", "krproxy.fakes.containerd", "--socket", runtime], runtime)
        process = {}
        if server is not None:
            argv = (
                hook_server_argv(hook, hook_dir, workdir, PLAIN)
                if server == "sdk"
                else ["-m", "krproxy.bench.floor", "hook", "--socket", hook, "--hook-dir", hook_dir]
            )
            process["hook"] = procs.start("hook", [*wrap.get("hook", [PY]), *argv], hook, python=False)
            _wait_registered(hook_dir, "the hook server wrote no registration file; see its log")
        if proxy == "krproxy":
            argv = _serve_args(listen, runtime, hook_dir)
        else:
            argv = ["-m", "krproxy.bench.floor", "proxy", "--listen", listen, "--backend", runtime]
            argv += ["--hook", hook] if server is not None else []
        process["proxy"] = procs.start("proxy", [*wrap.get("proxy", [PY]), *argv], listen, python=False)
        run = ("--targets", listen, "--idle-ms", "0")
        _client("create", *run, "--calls", "30")  # (also: krproxy has seen its hook server by now)
        _toggle(process[counted].pid, "on")
        _client("create", *run, "--calls", str(calls))
        _toggle(process[counted].pid, "off")
    finally:
        procs.stop()
    with open(os.path.join(workdir, f"{counted}.log"), "rb") as f:
        return collected(f.read()) / (calls + WARM_UP)


def instructions(calls: int) -> dict[str, Any]:
    """Every case of :data:`CASES` measured (:func:`measure`), and the ratios of :data:`RATIOS`."""
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        return {"skipped": f"{' and '.join(missing)} not installed (Debian's valgrind)"}
    per_call = {}
    for case in CASES:
        with tempfile.TemporaryDirectory(prefix="krproxy-instructions-") as workdir:
            per_call[case] = measure(workdir, case, calls)
    ratios = {name: per_call[a] / per_call[b] for name, (_, a, b) in RATIOS.items()}
    return {"calls": calls, "per_call": per_call, "ratios": ratios}


def report(r: dict[str, Any]) -> list[str]:
    """The run's lines: each case's thousands of instructions per create + remove (or hook call), the ratios."""
    lines = ["Instructions per hooked CreateContainer + RemoveContainer (callgrind: counts, not seconds)"]
    if "skipped" in r:
        return [*lines, f"  skipped: {r['skipped']}"]
    lines.append(f"  {r['calls']} creates + removes per case (and the client's {WARM_UP} warm-up)")
    for case, count in r["per_call"].items():
        unit = "per hook call" if CASES[case][2] == "hook" else "per create + remove"
        lines.append(f"  {TITLES[case]:<40} {count / 1e3:9.1f} k {unit}")
    for name, (title, *_) in RATIOS.items():
        lines.append(f"  {title}: {r['ratios'][name]:.2f}x")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m krproxy.bench.instructions", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--calls", type=int, default=200, help="creates per case (default %(default)s)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls must be at least 1")
    result = instructions(args.calls)
    print("\n".join(report(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
