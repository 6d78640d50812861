"""NRI against containerd 2.x: what a pod's start waits on an NRI plugin, for four attachments in one run.

States, alternating block by block (the order rotated each block, so no state always follows the same
one): ``none`` (no plugin), ``python_stub`` (:mod:`krproxy.bench.nristub`, the SDK's NRI stub),
``go_stub`` (``tests/gonristub``, containerd's own Go stub, built offline by ``scripts/install-go-client``)
and ``bridge`` (``krproxy nri`` with one hook server on PreCreateContainer that answers at once). The two
stub plugins are the same plugin: told of each RunPodSandbox, one env var added at each CreateContainer.
Each plugin is started and synchronized for its block and stopped after it.

Figures per state: kubelet's pod start (RunPodSandbox + CreateContainer + StartContainer of one
container, straight to containerd, :mod:`krproxy.bench.client`); **containerd's wait on the plugin per
pod**, every NRI event call's own time read on containerd's side of the socket by a timing relay
(:mod:`krproxy.bench.nritiming`; containerd 2.1.9's NRI 0.8.0 neither logs nor counts it), summed over a
pod's calls; the plugin's CPU per pod; a plain Version call (which never reaches an NRI plugin). The
ratios Python stub / Go stub are taken block by block and their median reported (load drifts between
blocks; both sides of a block's ratio see the same). The issue's target is 1.5x (goal 1.0x).

SIGTERM or SIGINT of the bench stops what it started (:func:`stop_on_signals`): plugins and relays by
PID, then the sandbox's containerd through ``containerd-sandbox stop`` (by the PID in its state file).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import signal
import socket
import statistics
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from krproxy.bench._support import (
    PY,
    SANDBOX_SCRIPT,
    Processes,
    _client,
    _NoSandbox,
    _sandbox,
    _summary,
    cpu_seconds,
)
from krproxy.bench.anchor import go_program

__all__ = ["STATES", "TARGET", "nri", "report_nri", "stop_on_signals"]

#: The attachments measured, in the first block's order.
STATES = ("none", "python_stub", "go_stub", "bridge")
#: The issue's bound for the Python stub's wait against the Go stub's (goal 1.0x).
TARGET, GOAL = 1.5, 1.0
#: NRI calls that are not events: registration and state, off a pod's path.
_NRI_SETUP_CALLS = frozenset({"Configure", "Synchronize", "Shutdown"})
#: What each plugin logs once the runtime has synchronized it.
_SYNCHRONIZED = {
    "python_stub": "synchronized",
    "go_stub": "synchronized:",
    "bridge": "event=nri_synchronized",
}
#: After that line, time for containerd to add the plugin to those it calls (it does so once
#: Synchronize is answered, a moment after the plugin logs it).
_SETTLE = 0.3


class _Interrupted(BaseException):
    """SIGTERM or SIGINT arrived: unwinds the bench through every ``finally`` that stops something."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals(signums: Sequence[int] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[None]:
    """Within: the first SIGTERM or SIGINT raises an exception where the bench is, so each ``finally``
    stops what it started (by PID; the sandbox's containerd by ``containerd-sandbox stop``); then exits
    with 128 + the signal's number. Signals that come while that cleanup runs are ignored, so that it
    completes (SIGKILL still stops the bench). Outside the main thread it does nothing (Python delivers
    signals there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def interrupt(signum: int, frame: object) -> None:
        if not received:
            received.append(signum)
            raise _Interrupted(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in signums}
    try:
        yield
    except _Interrupted as stopped:
        raise SystemExit(128 + stopped.signum) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def nri(workdir: str, args: argparse.Namespace) -> dict[str, Any]:
    """The four states against a real containerd (``--nri-containerd``: 2.x, sid's 2.1, the default, or
    1.7, trixie's, whose NRI the sandbox turns on); see the module. Needs root and ``containerd-sandbox
    fetch --version VERSION``; otherwise says why not. The Go stub's state is left out, saying why, when
    tests/gonristub cannot be built."""
    with stop_on_signals():
        return _nri(workdir, args)


def _nri(workdir: str, args: argparse.Namespace) -> dict[str, Any]:
    if os.geteuid() != 0 or not os.path.exists(SANDBOX_SCRIPT):
        return {"skipped": "not root" if os.geteuid() else "no sandbox script"}
    fetched = subprocess.run(
        [PY, SANDBOX_SCRIPT, "fetch", "--version", args.nri_containerd], capture_output=True, text=True
    )
    if fetched.returncode != 0:
        return {"skipped": f"containerd {args.nri_containerd} cannot be had: {fetched.stderr.strip()[-300:]}"}
    bin_dir = fetched.stdout.strip().splitlines()[-1]
    states, left_out = list(STATES), {}
    try:
        go_binary = go_program("gonristub")
    except RuntimeError as err:
        states.remove("go_stub")
        left_out["go_stub"] = str(err)
        go_binary = ""
    procs = Processes(workdir)
    try:
        with _sandbox(workdir, "nri-containerd", "--bin-dir", bin_dir) as (sandbox, state, cgroup_parent):
            nri_socket = os.path.join(sandbox, "run", "nri", "nri.sock")
            if not os.path.exists(nri_socket):
                return {"skipped": f"containerd {state.get('containerd_version', '?')} serves no NRI socket"}
            bench = _Bench(workdir, args, procs, state, cgroup_parent, nri_socket, go_binary)
            bench.hook_dir()
            bench.pods("none")  # warm-up, not counted: containerd's first pod after start is slower
            load_start = os.getloadavg()
            blocks = [bench.block(block, states) for block in range(max(args.nri_blocks, 1))]
            load_end = os.getloadavg()
            return {
                "containerd": state.get("containerd_version", "?"),
                "blocks": len(blocks),
                "pods_per_block": args.nri_pods,
                "load_average": {"start": list(load_start), "end": list(load_end)},
                **({"left_out": left_out} if left_out else {}),
                **digest(blocks),
            }
    except _NoSandbox as err:
        return {"skipped": str(err)}
    finally:
        procs.stop()


@attrs.define
class _Bench:
    """One run's sandbox, hook server and the attachments' processes."""

    workdir: str
    args: argparse.Namespace
    procs: Processes
    state: dict[str, Any]
    cgroup_parent: str
    nri_socket: str
    go_binary: str
    hooks: str = ""

    def hook_dir(self) -> None:
        """The bridge's hook directory with its hook server (one, on PreCreateContainer, answering at once)."""
        self.hooks = os.path.join(self.workdir, "hooks-nri")
        os.makedirs(self.hooks)
        plugin = os.path.join(self.workdir, "nri-plugin.sock")
        argv = ["-m", "krproxy.fakes.plugin", "--socket", plugin, "--hook-dir", self.hooks, "--name", "p"]
        self.procs.start("plugin-nri", [*argv, "--hooks", "PreCreateContainer"], plugin)

    def pods(self, state: str) -> list[float]:
        """Pod starts (µs) of ``--nri-pods`` pods, each stopped and removed again."""
        got = _client(
            "pod-create", "--target", self.state["socket"], "--pods", str(self.args.nri_pods),
            "--image", self.state["busybox_image"], "--cgroup-parent", self.cgroup_parent,
        )  # fmt: skip
        samples: list[float] = got["latencies_us"]
        return samples

    def block(self, block: int, states: list[str]) -> dict[str, Any]:
        """One block: each state in turn (rotated by ``block``), its figures."""
        turn = block % len(states)
        out: dict[str, Any] = {}
        for name in states[turn:] + states[:turn]:
            out[name] = self._measure(name, block)
        return out

    def _measure(self, name: str, block: int) -> dict[str, Any]:
        pods = max(self.args.nri_pods, 1)
        if name == "none":
            return {"pods_us": self.pods(name), "version_us": self._version()}
        calls = os.path.join(self.workdir, f"calls-{name}-{block}.jsonl")
        relay = self._start(
            f"relay-{name}-{block}",
            [PY, "-m", "krproxy.bench.nritiming", "--listen", self._relay_socket(name, block),
             "--runtime", self.nri_socket, "--out", calls],
        )  # fmt: skip
        port = _free_port() if name == "bridge" else 0
        try:
            _wait_for(lambda: os.path.exists(self._relay_socket(name, block)), relay, "the timing relay")
            plugin, log_path = self._start_plugin(name, block, port)
            try:
                _wait_for(lambda: _SYNCHRONIZED[name] in _read(log_path), plugin, f"{name} ({log_path})")
                time.sleep(_SETTLE)
                answered = _bridge_seconds(port) if port else (0.0, 0.0)
                cpu_before = cpu_seconds(plugin.pid)
                out: dict[str, Any] = {"pods_us": self.pods(name), "version_us": self._version()}
                out["cpu_ms_per_pod"] = (cpu_seconds(plugin.pid) - cpu_before) * 1000 / pods
                if port:
                    answering, hooks = _bridge_seconds(port)
                    out["bridge_answer_ms_per_pod"] = (answering - answered[0]) * 1000 / pods
                    out["hook_call_ms_per_pod"] = (hooks - answered[1]) * 1000 / pods
            finally:
                _stop(plugin)
        finally:
            _stop(relay)
        timed = [json.loads(line) for line in _read(calls).splitlines() if line.strip()]
        events = [c for c in timed if c["method"] not in _NRI_SETUP_CALLS]
        out["nri_wait_ms_per_pod"] = sum(c["ms"] for c in events) / pods
        out["nri_calls_ms"] = {
            method: [c["ms"] for c in events if c["method"] == method]
            for method in {c["method"] for c in events}
        }
        return out

    def _relay_socket(self, name: str, block: int) -> str:
        return os.path.join(self.workdir, f"relay-{name}-{block}.sock")

    def _start_plugin(self, name: str, block: int, port: int) -> tuple[subprocess.Popen[bytes], str]:
        socket_path = self._relay_socket(name, block)
        if name == "python_stub":
            argv = [PY, "-m", "krproxy.bench.nristub", "--socket", socket_path]
        elif name == "go_stub":
            argv = [self.go_binary, "-socket", socket_path]
        else:
            argv = [
                PY, "-m", "krproxy", "nri", "--nri-socket", socket_path, "--hook-dir", self.hooks,
                "--insecure-registration-files", "--metrics-address", f"127.0.0.1:{port}",
            ]  # fmt: skip
        log_name = f"{name}-{block}"
        return self._start(log_name, argv), os.path.join(self.workdir, f"{log_name}.log")

    def _start(self, log_name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        """``argv`` with its output in ``WORKDIR/LOG_NAME.log``, kept for the end's stop (by PID)."""
        with open(os.path.join(self.workdir, f"{log_name}.log"), "wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=log, cwd=self.workdir)
        self.procs.started.append(process)
        return process

    def _version(self) -> list[float]:
        calls = _client(
            "latency", "--targets", self.state["socket"], "--calls", str(self.args.nri_version_calls)
        )
        samples: list[float] = calls["latencies_us"][self.state["socket"]]
        return samples


def digest(blocks: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per state: pod start and Version summaries over every block, the medians over blocks of the
    per-pod figures; and the per-block ratios Python stub / Go stub (pod start medians; containerd's wait
    on the plugin per pod) with their medians."""
    states: dict[str, Any] = {}
    names = [name for name in STATES if all(name in b for b in blocks)]
    for name in names:
        runs = [b[name] for b in blocks]
        pods = [us for run in runs for us in run["pods_us"]]
        figures: dict[str, Any] = {
            "pod_start": _summary(pods),
            # every pod's start, so that runs can be pooled (one run's medians move by tens of ms)
            "pod_start_samples_ms": [round(us / 1000, 3) for us in pods],
            "version": _summary([us for run in runs for us in run["version_us"]]),
        }
        for key in (
            "nri_wait_ms_per_pod",
            "cpu_ms_per_pod",
            "bridge_answer_ms_per_pod",
            "hook_call_ms_per_pod",
        ):
            if key in runs[0]:
                figures[key] = round(statistics.median(run[key] for run in runs), 3)
        if "nri_calls_ms" in runs[0]:
            methods = sorted({m for run in runs for m in run["nri_calls_ms"]})
            figures["nri_calls"] = {
                m: _summary([ms * 1000 for run in runs for ms in run["nri_calls_ms"].get(m, [])])
                for m in methods
            }
        states[name] = figures
    out: dict[str, Any] = {"states": states}
    if "python_stub" in names and "go_stub" in names:
        ratios: dict[str, Any] = {}
        for key, of in (("pod_start", _pod_median), ("nri_wait", _nri_wait)):
            per_block = [of(b["python_stub"]) / of(b["go_stub"]) for b in blocks if of(b["go_stub"]) > 0]
            if per_block:
                ratios[key] = {
                    "blocks": [round(r, 3) for r in per_block],
                    "median": round(statistics.median(per_block), 3),
                }
        out["python_over_go"] = ratios
    return out


def _pod_median(run: dict[str, Any]) -> float:
    return float(statistics.median(run["pods_us"])) / 1000


def _nri_wait(run: dict[str, Any]) -> float:
    return float(run["nri_wait_ms_per_pod"])


def _read(path: str) -> str:
    try:
        return pathlib.Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _wait_for(ready: Any, process: subprocess.Popen[bytes], what: str, timeout: float = 60) -> None:
    """Until ``ready()``; RuntimeError if ``process`` ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not get ready (exit {process.poll()})")
        time.sleep(0.02)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _free_port() -> int:
    """A loopback TCP port nobody listens on now (for an admin endpoint)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _bridge_seconds(port: int) -> tuple[float, float]:
    """Seconds ``krproxy nri`` (admin endpoint on ``port``) spent so far answering the runtime's event calls
    (``krproxy_nri_call_seconds`` of every method but :data:`_NRI_SETUP_CALLS`), and of them in calls to
    hook servers (``krproxy_hook_call_seconds``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    answering = hooks = 0.0
    for match in re.finditer(r'^krproxy_nri_call_seconds_sum\{method="([A-Za-z]+)"\} (\S+)$', text, re.M):
        if match[1] not in _NRI_SETUP_CALLS:
            answering += float(match[2])
    for match in re.finditer(r"^krproxy_hook_call_seconds_sum\{[^}]*\} (\S+)$", text, re.M):
        hooks += float(match[1])
    return answering, hooks


_LABELS = {
    "none": "no plugin",
    "python_stub": "Python stub (SDK NriStub)",
    "go_stub": "Go stub (containerd/nri)",
    "bridge": "krproxy nri (bridge)",
}


def report_nri(r: dict[str, Any]) -> list[str]:
    """Rows for :func:`nri`: each state's pod start, containerd's wait on the plugin, CPU; the ratios."""
    if "skipped" in r:
        return [f"NRI mode                          not measured: {r['skipped']}"]
    load = r["load_average"]
    lines = [
        f"NRI, containerd {r['containerd']}: {r['blocks']} blocks x {r['pods_per_block']} pods per state,"
        f" alternating; load average {load['start'][0]:.2f} at the start, {load['end'][0]:.2f} at the end",
        f"{'state':<27} {'pod start ms':>17} {'NRI wait/pod':>13} {'CPU/pod':>8} {'Version ms':>17}",
        f"{'':<27} {'median/p99':>17} {'ms (median)':>13} {'ms':>8} {'median/p99':>17}",
    ]
    for name, figures in r["states"].items():
        pod, version = figures["pod_start"], figures["version"]
        wait = f"{figures['nri_wait_ms_per_pod']:13.3f}" if "nri_wait_ms_per_pod" in figures else f"{'-':>13}"
        cpu = f"{figures['cpu_ms_per_pod']:8.2f}" if "cpu_ms_per_pod" in figures else f"{'-':>8}"
        lines.append(
            f"{_LABELS[name]:<27} {pod['median_ms']:8.2f}/{pod['p99_ms']:8.2f} {wait} {cpu}"
            f" {version['median_ms']:8.3f}/{version['p99_ms']:8.3f}"
        )
    for name, figures in r["states"].items():
        for method, calls in figures.get("nri_calls", {}).items():
            lines.append(
                f"  {_LABELS[name]:<25} {method:<20} {calls['median_ms']:7.3f}/{calls['p99_ms']:7.3f} ms"
                f" median/p99 per call (n={calls['n']})"
            )
    bridge = r["states"].get("bridge", {})
    if "bridge_answer_ms_per_pod" in bridge:
        lines.append(
            f"  krproxy nri's own count: answering {bridge['bridge_answer_ms_per_pod']:.3f} ms per pod, of which"
            f" {bridge['hook_call_ms_per_pod']:.3f} ms calling the hook server"
        )
    ratios = r.get("python_over_go", {})
    for key, label in (("nri_wait", "containerd's wait on the plugin"), ("pod_start", "pod start")):
        if key in ratios:
            got = ratios[key]["median"]
            verdict = "met" if got <= TARGET else "MISSED"
            goal = "goal met" if got <= GOAL else f"goal {GOAL:.1f}x not met"
            lines.append(
                f"Python stub / Go stub, {label}: {got:.2f}x (median of per-block"
                f" {', '.join(f'{v:.2f}' for v in ratios[key]['blocks'])}); target {TARGET}x {verdict}, {goal}"
            )
    for name, why in r.get("left_out", {}).items():
        lines.append(f"{_LABELS[name]} not measured: {why}")
    return lines
