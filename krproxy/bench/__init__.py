"""``nox -s bench`` / ``python -m krproxy.bench``: what the proxy costs, direct vs through krproxy.

Everything runs as separate processes on unix sockets in a temp dir: the fake containerd (the
backend, seeded with 1000 pods), fake hook plugins, several ``krproxy serve`` daemons, and
grpcio client processes (:mod:`krproxy.bench.client`) that alternate between direct and
proxied targets block by block after a warm-up, so machine noise hits both alike.

Cases (issue 8): small passthrough latency (Version, ContainerStatus); large passthrough
(ListContainers of 1000 containers, ~860 KB); throughput with 32 concurrent callers; hooked
CreateContainer with one and with three chained plugins, and with one SDK plugin (:mod:`krproxy.bench.sdk`); small calls while another client is
stuck with ~20 MB of answers unread (issue 16); the same with recording on (when
``--record`` exists); store recovery of 1000 pods / 3000 containers and the RSS after it; RSS
and open fds after 100k calls; NRI mode against containerd 2.x (pod start and a plain call, with
and without ``krproxy nri`` registered; ``--only-nri`` runs just these). CPU per unary call of
:mod:`krproxy.rpc`'s server beside a relay interceptor (``--only-rpc-server``). Prints a table
(medians, p99s, proxy/direct) with each target marked met or missed, and writes the figures
as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from krproxy.bench._support import (
    PY,
    SANDBOX_SCRIPT,
    Processes,
    _client,
    _NoSandbox,
    _populate,
    _sandbox,
    _scratch,
    _serve_args,
    _summary,
)
from krproxy.bench.anchor import go_anchor, report_go_anchor

__all__ = ["main", "report", "run"]


def _proc_status(pid: int) -> dict[str, float]:
    with open(f"/proc/{pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"rss_mb": rss_kb / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _record_supported() -> bool:
    help_text = subprocess.run(
        [PY, "-m", "krproxy", "serve", "--help"], capture_output=True, text=True
    ).stdout
    return "--record" in help_text


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix="krbench-", dir="/tmp")
    procs = Processes(workdir)

    def sock(name: str) -> str:
        return os.path.join(workdir, f"{name}.sock")

    results: dict[str, Any] = {}
    try:
        procs.start(
            "containerd",
            ["-m", "fakes.containerd", "--socket", sock("containerd"), "--seed-pods", "1000"],
            sock("containerd"),
        )
        hook_dirs = {n: os.path.join(workdir, f"hooks-{n}") for n in ("none", "one", "three", "rec")}
        for d in hook_dirs.values():
            os.makedirs(d)
        plugin_dirs = [("p1", "one"), ("p2", "three"), ("p3", "three"), ("p4", "three"), ("p5", "rec")]
        for name, where in plugin_dirs:
            procs.start(
                f"plugin-{name}",
                [
                    "-m",
                    "fakes.plugin",
                    "--socket",
                    sock(name),
                    "--hook-dir",
                    hook_dirs[where],
                    "--name",
                    name,
                    "--hooks",
                    "PreCreateContainer",
                ],
                sock(name),
            )
        direct = sock("containerd")
        proxies = {"plain": "none", "one": "one", "three": "three"}
        record = _record_supported()
        if record:
            proxies["record"] = "rec"
        proxy_procs = {}
        for name, hooks in proxies.items():
            extra = ["--record", os.path.join(workdir, "trace.krt")] if name == "record" else []
            proxy_procs[name] = procs.start(
                f"krproxy-{name}",
                _serve_args(sock(f"krproxy-{name}"), direct, hook_dirs[hooks], *extra),
                sock(f"krproxy-{name}"),
            )
        time.sleep(1.0)  # let each daemon's watcher see its plugin and recovery finish
        plain = sock("krproxy-plain")

        for method in ("Version", "ContainerStatus"):
            got = _client(
                "latency",
                "--targets",
                f"{direct},{plain}",
                "--method",
                method,
                "--calls",
                str(args.small_calls),
                "--blocks",
                "10",
            )["latencies_us"]
            results[f"small_{method}"] = {"direct": _summary(got[direct]), "proxy": _summary(got[plain])}
        got = _client(
            "latency",
            "--targets",
            f"{direct},{plain}",
            "--method",
            "ListContainers",
            "--calls",
            str(args.large_calls),
            "--blocks",
            "5",
        )["latencies_us"]
        results["large_ListContainers"] = {"direct": _summary(got[direct]), "proxy": _summary(got[plain])}

        throughput: dict[str, list[float]] = {"direct": [], "proxy": []}
        for _ in range(2):
            for label, target in (("direct", direct), ("proxy", plain)):
                runs = [
                    subprocess.Popen(
                        [
                            PY,
                            "-m",
                            "krproxy.bench.client",
                            "throughput",
                            "--target",
                            target,
                            "--threads",
                            "8",
                            "--seconds",
                            str(args.throughput_seconds),
                        ],
                        stdout=subprocess.PIPE,
                    )
                    for _ in range(4)
                ]
                outs = [json.loads(p.communicate()[0]) for p in runs]
                throughput[label].append(sum(o["calls"] for o in outs) / max(o["seconds"] for o in outs))
                errors = {k: v for o in outs for k, v in o["errors"].items()}
                if errors:
                    results.setdefault("throughput_errors", {})[label] = errors
        results["throughput_32_callers"] = {k: statistics.median(v) for k, v in throughput.items()}

        targets = [direct, sock("krproxy-plain"), sock("krproxy-one"), sock("krproxy-three")]
        if record:
            targets.append(sock("krproxy-record"))
        got = _client(
            "create",
            "--targets",
            ",".join(targets),
            "--pod-via",
            sock("krproxy-plain"),
            "--calls",
            str(args.create_calls),
            "--blocks",
            "10",
        )["latencies_us"]
        labels = [
            "direct",
            "proxy_no_plugin",
            "proxy_1_plugin",
            "proxy_3_plugins",
            "proxy_1_plugin_recording",
        ]
        results["hooked_CreateContainer"] = {
            label: _summary(got[t]) for label, t in zip(labels, targets, strict=False)
        }

        from krproxy.bench.sdk import sdk_create  # here: `python -m krproxy.bench.sdk` runs it as __main__

        with _scratch() as sdk_dir:
            results["sdk_CreateContainer"] = sdk_create(sdk_dir, args.create_calls)
        results["stuck_client"] = _stuck_client(plain, args)
        results["header_flood"] = header_flood(args.flood_calls, [1 << 20, 4095])
        results["real_containerd"] = _real_containerd(procs, workdir, args)
        results["runc_wrapper"] = runc_wrapper(workdir, args.wrapper_calls)
        results["runc_wrapper_containerd"] = runc_wrapper_containerd(workdir, args)
        results["nri"] = nri(workdir, args)
        results["go_anchor"] = go_anchor(workdir, args)
        results["recovery"] = _recovery(procs, workdir)
        results["leak_check"] = _leak_check(proxy_procs["plain"].pid, plain, args.leak_calls)
    finally:
        procs.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def _stuck_client(proxy: str, args: argparse.Namespace) -> dict[str, Any]:
    """kubelet's small calls while another client of the same proxy is stuck (issue 16): it has
    1000 calls in flight (verbose ContainerStatus, and as many ListContainers as make ~20 MB of
    answers with them: 24 against the fake's 1000 containers) and reads none of the answers."""
    from cri_api.v1 import api_pb2 as pb

    from krproxy.bench.stuck import hold_unread

    channel = grpc.insecure_channel(
        f"unix://{proxy}", options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    status_path, list_path = (
        "/runtime.v1.RuntimeService/ContainerStatus",
        "/runtime.v1.RuntimeService/ListContainers",
    )
    list_request = pb.ListContainersRequest().SerializeToString()
    try:
        listed = len(channel.unary_unary(list_path)(list_request, timeout=30))
        first = pb.ListContainersResponse.FromString(channel.unary_unary(list_path)(list_request, timeout=30))
        status = pb.ContainerStatusRequest(
            container_id=first.containers[0].id, verbose=True
        ).SerializeToString()
        stated = len(channel.unary_unary(status_path)(status, timeout=30))
    finally:
        channel.close()
    lists = min(1000, max(0, math.ceil((20e6 - 1000 * stated) / max(1, listed - stated))))
    calls = [(status_path, status)] * (1000 - lists) + [(list_path, list_request)] * lists

    def version_latency() -> dict[str, float]:
        got = _client(
            "latency",
            "--targets",
            proxy,
            "--method",
            "Version",
            "--calls",
            str(args.small_calls // 2),
            "--blocks",
            "5",
        )["latencies_us"]
        return _summary(got[proxy])

    before = version_latency()
    stuck = hold_unread(proxy, calls)
    try:
        time.sleep(5.0)  # the fake takes seconds to answer its ListContainers of 1000 containers
        while_stuck = version_latency()
    finally:
        stuck.close()
    return {
        "streams": len(calls),
        "unread_mb": ((1000 - lists) * stated + lists * listed) / 1e6,
        "before": before,
        "stuck": while_stuck,
    }


def header_flood(calls: int, sizes: list[int]) -> dict[str, Any]:
    """Version latency through ``krproxy serve`` (in front of the fake containerd), idle and while
    another connection floods it with header blocks of each of ``sizes`` bytes
    (:func:`krproxy.bench.flood.send_header_blocks`)."""
    from krproxy.bench.flood import send_header_blocks

    workdir = tempfile.mkdtemp(prefix="krflood-", dir="/tmp")
    procs = Processes(workdir)
    backend, proxy = os.path.join(workdir, "containerd.sock"), os.path.join(workdir, "krproxy.sock")

    def latency() -> dict[str, float]:
        got = _client(
            "latency", "--targets", proxy, "--method", "Version", "--calls", str(calls), "--blocks", "5"
        )
        return _summary(got["latencies_us"][proxy])

    results: dict[str, Any] = {}
    try:
        procs.start("containerd", ["-m", "fakes.containerd", "--socket", backend], backend)
        procs.start("krproxy", _serve_args(proxy, backend, os.path.join(workdir, "hooks")), proxy)
        results["idle"] = latency()
        for size in sizes:
            stop = threading.Event()
            sent: list[int] = []
            sender = threading.Thread(target=send_header_blocks, args=(proxy, size, stop, sent), daemon=True)
            sender.start()
            try:
                results[f"blocks_of_{size}"] = {**latency(), "blocks_sent": len(sent)}
            finally:
                stop.set()
                sender.join(60)
    finally:
        procs.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def report_header_flood(flood: dict[str, Any]) -> list[str]:
    """Rows for :func:`header_flood`: each flood against the idle figure (the stuck-client target)."""
    lines = []
    idle = flood.get("idle")
    for size, r in flood.items():
        if size == "idle" or idle is None:
            continue
        ok = r["median_ms"] <= 2 * idle["median_ms"] + 0.5
        lines.append(
            f"Version, another caller floods    ({size.removeprefix('blocks_of_')}-byte header blocks)"
            f" {idle['median_ms']:.3f}/{idle['p99_ms']:.3f} ms idle, {r['median_ms']:.3f}/{r['p99_ms']:.3f} ms"
            f" flooded   usual latency: {_check(ok)}"
        )
    return lines


def rpc_server_cpu(calls: int, rounds: int = 3) -> dict[str, Any]:
    """CPU of a unary hook-sized call in the server's own process: :mod:`krproxy.rpc`'s Server
    against a relay answering through an interceptor (:mod:`krproxy.bench.rpcserver`), ``calls``
    echo calls of 600 bytes from grpcio per round, the engines taking turns (and turns going first).
    The server reports its own getrusage before and after each round."""
    workdir = tempfile.mkdtemp(prefix="krrpc-", dir="/tmp")
    procs = Processes(workdir)
    request = os.urandom(600)
    samples: dict[str, list[float]] = {"rpc": [], "relay": []}
    channels: list[grpc.Channel] = []
    try:
        calls_of = {}
        for engine in samples:
            path = os.path.join(workdir, f"{engine}.sock")
            procs.start(f"rpcserver-{engine}", ["-m", "krproxy.bench.rpcserver", engine, path], path)
            channel = grpc.insecure_channel(f"unix://{path}")
            channels.append(channel)
            echo = channel.unary_unary("/krproxy.bench.Echo/Echo")
            cpu = channel.unary_unary("/krproxy.bench.Echo/Cpu")
            calls_of[engine] = (echo, cpu)
            for _ in range(200):  # warm-up: connection, code paths, allocator
                echo(request, timeout=10)
        for turn in range(rounds):
            order = list(calls_of.items())
            for engine, (echo, cpu) in order[::-1] if turn % 2 else order:  # who goes first alternates
                before = float(cpu(b"", timeout=10))
                for _ in range(calls):
                    echo(request, timeout=10)
                after = float(cpu(b"", timeout=10))
                samples[engine].append((after - before) / calls * 1e6)
    finally:
        for channel in channels:
            channel.close()
        procs.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        engine: {"cpu_us_per_call": min(us), "rounds_us": us, "calls": calls}
        for engine, us in samples.items()
    }


#: CPU per unary call the hook server engine may cost in its own process (issue 24).
RPC_SERVER_CPU_TARGET_US = 200.0


def report_rpc_server_cpu(r: dict[str, Any]) -> list[str]:
    rpc, relay = r["rpc"], r["relay"]
    ok = rpc["cpu_us_per_call"] <= RPC_SERVER_CPU_TARGET_US
    rounds = ", ".join(f"{us:.0f}" for us in rpc["rounds_us"])
    return [
        f"hook server CPU per unary call    krproxy.rpc {rpc['cpu_us_per_call']:.0f} us (rounds {rounds}),"
        f" relay interceptor {relay['cpu_us_per_call']:.0f} us"
        f"   <= {RPC_SERVER_CPU_TARGET_US:.0f} us: {_check(ok)}"
    ]


def _real_containerd(procs: Processes, workdir: str, args: argparse.Namespace) -> dict[str, Any]:
    """Small and listing calls against a real containerd (the e2e sandbox), direct vs proxied.

    Runs when containerd and runc are installed, we are root and the sandbox script is there
    (``nox -s e2e`` installs them); otherwise says why not. Populates the sandbox with pods
    of created containers first, so ListContainers and ContainerStatus have something to say.
    """
    missing = [tool for tool in ("containerd", "runc") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0 or not os.path.exists(SANDBOX_SCRIPT):
        why = (
            f"{', '.join(missing)} not installed"
            if missing
            else "not root"
            if os.geteuid()
            else "no sandbox script"
        )
        return {"skipped": why}
    try:
        with _sandbox(workdir, "real-containerd") as (_, state, cgroup_parent):
            direct = state["socket"]
            populated = _populate(
                direct, args.real_pods, args.real_containers_per_pod, state["busybox_image"], cgroup_parent
            )
            hook_dir = os.path.join(workdir, "hooks-real")
            os.makedirs(hook_dir)
            listen = os.path.join(workdir, "krproxy-real.sock")
            procs.start("krproxy-real", _serve_args(listen, direct, hook_dir), listen)
            results: dict[str, Any] = {"containers": populated["containers"]}
            for method, calls in (
                ("Version", args.small_calls),
                ("ContainerStatus", args.small_calls),
                ("ListContainers", max(args.small_calls // 4, 50)),
            ):
                got = _client(
                    "latency",
                    "--targets",
                    f"{direct},{listen}",
                    "--method",
                    method,
                    "--calls",
                    str(calls),
                    "--blocks",
                    "10",
                )["latencies_us"]
                results[method] = {"direct": _summary(got[direct]), "proxy": _summary(got[listen])}
            results["stuck_client"] = _stuck_client(listen, args)
            return results
    except _NoSandbox as err:
        return {"skipped": str(err)}


def nri(workdir: str, args: argparse.Namespace) -> dict[str, Any]:
    """NRI mode against a real containerd (``--nri-containerd``: 2.3, the default, or 2.x; NRI on by default in
    both): pod start with and without ``krproxy nri``
    registered (one hook server that answers at once, on PreCreateContainer), and Version straight to
    containerd in both states (plain CRI calls never touch krproxy in NRI mode).

    The two states alternate block by block (``krproxy nri`` started, synchronized, then stopped again), so
    machine noise hits both alike. Needs root and ``containerd-sandbox fetch --version VERSION``; otherwise
    says why not.
    """
    if os.geteuid() != 0 or not os.path.exists(SANDBOX_SCRIPT):
        return {"skipped": "not root" if os.geteuid() else "no sandbox script"}
    fetched = subprocess.run(
        [PY, SANDBOX_SCRIPT, "fetch", "--version", args.nri_containerd], capture_output=True, text=True
    )
    if fetched.returncode != 0:
        return {"skipped": f"containerd {args.nri_containerd} cannot be had: {fetched.stderr.strip()[-300:]}"}
    bin_dir = fetched.stdout.strip().splitlines()[-1]
    procs = Processes(workdir)
    try:
        with _sandbox(workdir, "nri-containerd", "--bin-dir", bin_dir) as (sandbox, state, cgroup_parent):
            try:
                direct, image = state["socket"], state["busybox_image"]
                socket = os.path.join(sandbox, "run", "nri", "nri.sock")
                if not os.path.exists(socket):
                    return {
                        "skipped": f"containerd {state.get('containerd_version', '?')} serves no NRI socket"
                    }
                hook_dir = os.path.join(workdir, "hooks-nri")
                os.makedirs(hook_dir)
                plugin = os.path.join(workdir, "nri-plugin.sock")
                procs.start(
                    "plugin-nri",
                    [
                        "-m",
                        "fakes.plugin",
                        "--socket",
                        plugin,
                        "--hook-dir",
                        hook_dir,
                        "--name",
                        "p",
                        "--hooks",
                        "PreCreateContainer",
                    ],
                    plugin,
                )
                pods: dict[str, list[float]] = {"without": [], "with": []}
                version: dict[str, list[float]] = {"without": [], "with": []}
                cpu_per_pod: list[float] = []  # krproxy nri CPU ms per pod, one figure per "with" block
                blocks = max(args.nri_blocks, 1)
                for block in range(blocks):
                    for state_name in ("without", "with"):
                        daemon = (
                            _start_nri(workdir, socket, hook_dir, block) if state_name == "with" else None
                        )
                        cpu_before = _cpu_seconds(daemon.pid) if daemon is not None else 0.0
                        try:
                            got = _client(
                                "pod-create", "--target", direct, "--pods", str(args.nri_pods), "--image", image,
                                "--cgroup-parent", cgroup_parent,
                            )  # fmt: skip
                            pods[state_name] += got["latencies_us"]
                            calls = _client(
                                "latency", "--targets", direct, "--calls", str(args.nri_version_calls)
                            )
                            version[state_name] += calls["latencies_us"][direct]
                            if daemon is not None:
                                used = _cpu_seconds(daemon.pid) - cpu_before
                                cpu_per_pod.append(used * 1000 / max(args.nri_pods, 1))
                        finally:
                            if daemon is not None:
                                daemon.send_signal(signal.SIGTERM)
                                daemon.wait(30)
                return {
                    "pod_start": {k: _summary(v) for k, v in pods.items()},
                    "version": {k: _summary(v) for k, v in version.items()},
                    "krproxy_cpu_ms_per_pod": round(statistics.median(cpu_per_pod), 2),
                    "containerd": state.get("containerd_version", "?"),
                }
            finally:
                procs.stop()
    except _NoSandbox as err:
        return {"skipped": str(err)}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time ``pid`` has used so far (``/proc/PID/stat``, clock-tick resolution)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (14th, 15th)


def _start_nri(workdir: str, socket: str, hook_dir: str, block: int) -> subprocess.Popen[bytes]:
    """``krproxy nri`` on ``socket``; returns once containerd synchronized it with its hook server loaded."""
    log_path = os.path.join(workdir, f"krproxy-nri-{block}.log")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                PY,
                "-m",
                "krproxy",
                "nri",
                "--nri-socket",
                socket,
                "--hook-dir",
                hook_dir,
                "--insecure-registration-files",
            ],
            stdout=log,
            stderr=log,
            cwd=workdir,
        )
    deadline = time.monotonic() + 60
    while "event=nri_synchronized" not in pathlib.Path(log_path).read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"krproxy nri did not register; see {log_path}")
        time.sleep(0.05)
    return process


def _timed_runs(
    variants: dict[str, list[str]], env: dict[str, str], calls: int
) -> dict[str, dict[str, float]]:
    """Wall time of each command line (start to exit), alternating variants block by block."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    blocks = 10
    for block in range(blocks + 1):  # block 0 warms the page cache and is not counted
        for name, argv in variants.items():
            for _ in range(max(calls // blocks, 1)):
                started = time.perf_counter_ns()
                subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                if block:
                    samples[name].append((time.perf_counter_ns() - started) / 1000)
    return {name: _summary(got) for name, got in samples.items()}


#: A hook file like oci-seccomp-bpf-hook's: it applies to containers with one annotation. Used as the
#: hook that matches nothing in the wrapper's cases.
_NO_MATCH_HOOK = {
    "version": "1.0.0",
    "hook": {"path": "/bin/true"},
    "when": {"annotations": {r"^io\.containers\.trace-syscall$": ".*"}},
    "stages": ["prestart"],
}


def _wrapper_install(directory: str, runc: str, hooks: dict[str, dict[str, Any]]) -> str:
    """The fast launcher at ``directory/krproxy-runc-wrapper`` with ``hooks`` in ``directory/hooks``
    and its index in ``directory/index``; returns the launcher's path.

    Waits out the second by which the index is dated back (see :mod:`krproxy.ocihooks.index`), so that
    the first create writes an index that is current for the later ones.
    """
    from krproxy.ocihooks.wrapper import CONFIG_NAME, write_launcher

    hook_dir = os.path.join(directory, "hooks")
    os.makedirs(hook_dir, exist_ok=True)
    for name, doc in hooks.items():
        with open(os.path.join(hook_dir, name), "w") as f:
            json.dump(doc, f)
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        f.write(f"runc = {runc}\nhooks-dir = {hook_dir}\n")
    launcher = os.path.join(directory, "krproxy-runc-wrapper")
    write_launcher(launcher, runc=runc, index=os.path.join(directory, "index"))
    time.sleep(1.1)
    return launcher


def runc_wrapper(workdir: str, calls: int) -> dict[str, Any]:
    """What the OCI hooks runc wrapper adds to a runc call that no hook concerns.

    Plain runc against the fast launcher (``krproxy oci-launcher``) and the Python entry point
    (``krproxy-runc-wrapper``), for ``runc --version`` and ``runc state`` (a container that does
    not exist: runc's own work is small, so the wrapper's share shows). Then ``create`` against a
    runc that does nothing (``true``), so that all of the difference is the wrapper's: with a hook
    file whose index strings are not in ``config.json`` (the launcher decides without Python), and
    with one the index cannot rule out (``hasBindMounts``: Python runs, reads the hooks and
    ``config.json``, adds nothing).
    """
    runc = shutil.which("runc")
    if runc is None:
        return {"skipped": "runc not installed"}
    base = os.path.join(workdir, "runc-wrapper")
    os.makedirs(base)
    true = shutil.which("true") or "/bin/true"
    entry_point = os.path.join(os.path.dirname(PY), "krproxy-runc-wrapper")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KRPROXY_")}
    root = os.path.join(base, "root")
    bundle = os.path.join(base, "bundle")
    os.makedirs(bundle)
    with open(os.path.join(bundle, "config.json"), "w") as f:
        spec = {"ociVersion": "1.0.2", "process": {"args": ["sh"]}, "annotations": {}, "mounts": []}
        json.dump(spec, f)
    results: dict[str, Any] = {}
    launcher = _wrapper_install(os.path.join(base, "plain"), runc, {"never.json": _NO_MATCH_HOOK})
    for name, args in (("version", ["--version"]), ("state", ["--root", root, "state", "nothing"])):
        variants = {"runc": [runc, *args], "launcher": [launcher, *args]}
        if os.path.exists(entry_point):
            variants["entry_point"] = [entry_point, *args]
        results[name] = _timed_runs(variants, env, calls)
    create = ["--root", root, "create", "--bundle", bundle, "c1"]
    bind_hook = {**_NO_MATCH_HOOK, "when": {"hasBindMounts": True}}
    for name, hooks in (
        ("create", {"never.json": _NO_MATCH_HOOK}),
        ("create_python", {"binds.json": bind_hook}),
    ):
        launcher = _wrapper_install(os.path.join(base, name), true, hooks)
        subprocess.run([launcher, *create], env=env, check=True)  # writes the index
        results[name] = _timed_runs({"runc": [true, *create], "launcher": [launcher, *create]}, env, calls)
    return results


def runc_wrapper_containerd(workdir: str, args: argparse.Namespace) -> dict[str, Any]:
    """Pod start (RunPodSandbox, CreateContainer, StartContainer) on real containerd with runc as the
    runtime's binary, and with the fast launcher in front of it and a hook file that matches nothing.

    The two runtime handlers alternate block by block. Needs root, containerd and runc (``nox -s e2e``
    installs them) and the sandbox script; otherwise says why not.
    """
    runc = shutil.which("runc")
    if os.geteuid() != 0 or not os.path.exists(SANDBOX_SCRIPT) or runc is None:
        return {"skipped": "not root" if os.geteuid() else "no sandbox script or no runc"}
    try:
        with _sandbox(workdir, "wrapper-containerd") as (sandbox, state, cgroup_parent):
            # The sandbox's config names this path as BinaryName of the runtime handler "krproxy-oci".
            _wrapper_install(os.path.join(sandbox, "krproxy-oci"), runc, {"never.json": _NO_MATCH_HOOK})
            pods: dict[str, list[float]] = {"runc": [], "launcher": []}
            for _ in range(max(args.wrapper_blocks, 1)):
                for name, handler in (("runc", ""), ("launcher", "krproxy-oci")):
                    got = _client(
                        "pod-create", "--target", state["socket"], "--pods", str(args.wrapper_pods),
                        "--image", state["busybox_image"], "--cgroup-parent", cgroup_parent,
                        "--runtime-handler", handler,
                    )  # fmt: skip
                    pods[name] += got["latencies_us"]
            return {
                "pod_start": {k: _summary(v) for k, v in pods.items()},
                "containerd": state.get("containerd_version", "?"),
            }
    except _NoSandbox as err:
        return {"skipped": str(err)}


def _recovery(procs: Processes, workdir: str) -> dict[str, float]:
    backend = os.path.join(workdir, "containerd-big.sock")
    procs.start(
        "containerd-big",
        ["-m", "fakes.containerd", "--socket", backend, "--seed-pods", "1000", "--containers-per-pod", "3"],
        backend,
    )
    listen = os.path.join(workdir, "krproxy-recovery.sock")
    hook_dir = os.path.join(workdir, "hooks-recovery")
    os.makedirs(hook_dir)
    argv = _serve_args(listen, backend, hook_dir)
    argv[argv.index("--log-level=warning")] = "--log-level=info"
    process = procs.start("krproxy-recovery", argv, listen)
    log_path = os.path.join(workdir, "krproxy-recovery.log")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(log_path) as f:
            match = re.search(
                r"event=store_recovered pods=(\d+) containers=(\d+).* seconds=([\d.]+)", f.read()
            )
        if match:
            return {
                "pods": int(match[1]),
                "containers": int(match[2]),
                "seconds": float(match[3]),
                **_proc_status(process.pid),
            }
        time.sleep(0.1)
    raise RuntimeError("recovery did not finish within 120 s")


def _leak_check(pid: int, target: str, calls: int) -> dict[str, Any]:
    """RSS and fds of the daemon at ``pid`` around ``calls`` calls, after a warm-up round of as many.

    The warm-up fills what is bounded by design, so that only real growth shows: h2 keeps
    the ids of the last 65,536 closed streams of each connection (~11 MB for the daemon's
    connection to the runtime), and memory freed by Python is kept for reuse.
    """

    def one_round() -> list[dict[str, Any]]:
        runs = [
            subprocess.Popen(
                [
                    PY,
                    "-m",
                    "krproxy.bench.client",
                    "throughput",
                    "--target",
                    target,
                    "--threads",
                    "8",
                    "--calls",
                    str(calls // 4),
                ],
                stdout=subprocess.PIPE,
            )
            for _ in range(4)
        ]
        return [json.loads(p.communicate()[0]) for p in runs]

    start = _proc_status(pid)
    one_round()
    before = _proc_status(pid)
    outs = one_round()
    after = _proc_status(pid)
    return {
        "calls": sum(o["calls"] for o in outs),
        "start": start,
        "before": before,
        "after": after,
        "errors": {k: v for o in outs for k, v in o["errors"].items()},
    }


def _check(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(results: dict[str, Any]) -> str:
    lines = [
        "case                              direct med/p99 ms   proxy med/p99 ms   ratio   added ms   target"
    ]

    def row(name: str, d: dict[str, float], p: dict[str, float], target: str) -> None:
        added = p["median_ms"] - d["median_ms"]
        lines.append(
            f"{name:<33} {d['median_ms']:7.3f}/{d['p99_ms']:7.3f}   {p['median_ms']:7.3f}/{p['p99_ms']:7.3f}"
            f"   {p['median_ms'] / d['median_ms']:5.2f}   {added:8.3f}   {target}"
        )

    for method in ("Version", "ContainerStatus"):
        r = results[f"small_{method}"]
        ok = (
            r["proxy"]["median_ms"] - r["direct"]["median_ms"] <= 0.5
            and r["proxy"]["p99_ms"] - r["direct"]["p99_ms"] <= 2
        )
        row(f"small {method}", r["direct"], r["proxy"], f"added <=0.5 ms, p99 added <=2 ms: {_check(ok)}")
    r = results["large_ListContainers"]
    row(
        "large ListContainers (1000)",
        r["direct"],
        r["proxy"],
        f"ratio <=2.0: {_check(r['proxy']['median_ms'] / r['direct']['median_ms'] <= 2.0)}",
    )
    h = results["hooked_CreateContainer"]
    row("CreateContainer, no plugin", h["direct"], h["proxy_no_plugin"], "")
    row(
        "CreateContainer, 1 plugin",
        h["direct"],
        h["proxy_1_plugin"],
        f"added <=2 ms: {_check(h['proxy_1_plugin']['median_ms'] - h['direct']['median_ms'] <= 2)}",
    )
    row(
        "CreateContainer, 3 plugins",
        h["direct"],
        h["proxy_3_plugins"],
        f"added <=4 ms: {_check(h['proxy_3_plugins']['median_ms'] - h['direct']['median_ms'] <= 4)}",
    )
    if "proxy_1_plugin_recording" in h:
        rec, one = h["proxy_1_plugin_recording"]["median_ms"], h["proxy_1_plugin"]["median_ms"]
        row(
            "CreateContainer, 1 plugin, rec",
            h["direct"],
            h["proxy_1_plugin_recording"],
            f"recording cost {100 * (rec / one - 1):+.1f}% (<=10%): {_check(rec <= one * 1.10)}",
        )
    else:
        lines.append("CreateContainer with --record      not measured: recording is not built yet")
    if "sdk_CreateContainer" in results:
        from krproxy.bench.sdk import report_sdk_create

        lines += report_sdk_create(results["sdk_CreateContainer"])
    real = results.get("real_containerd", {"skipped": "not run"})
    if "skipped" in real:
        lines.append(f"real containerd                   not measured: {real['skipped']}")
    else:
        for method in ("Version", "ContainerStatus"):
            r = real[method]
            ok = r["proxy"]["median_ms"] - r["direct"]["median_ms"] <= 0.5
            row(f"real containerd {method}", r["direct"], r["proxy"], f"added <=0.5 ms: {_check(ok)}")
        r = real["ListContainers"]
        ratio_ok = r["proxy"]["median_ms"] / r["direct"]["median_ms"] <= 2.0
        row(
            f"real ListContainers ({real['containers']})",
            r["direct"],
            r["proxy"],
            f"ratio <=2.0: {_check(ratio_ok)}",
        )
    lines += report_runc_wrapper(results.get("runc_wrapper", {"skipped": "not run"}))
    lines += report_runc_wrapper_containerd(results.get("runc_wrapper_containerd", {"skipped": "not run"}))
    lines += report_nri(results.get("nri", {"skipped": "not run"}))
    lines += report_go_anchor(results.get("go_anchor", {"skipped": "not run"}))
    for label, sc in (("", results.get("stuck_client")), ("real ", real.get("stuck_client"))):
        if sc is not None:
            ok = sc["stuck"]["median_ms"] <= 2 * sc["before"]["median_ms"] + 0.5
            lines.append(
                f"{label}Version, a client stuck    ({sc['streams']} unread streams, {sc['unread_mb']:.0f} MB unread)"
                f" {sc['before']['median_ms']:.3f}/{sc['before']['p99_ms']:.3f} ms before,"
                f" {sc['stuck']['median_ms']:.3f}/{sc['stuck']['p99_ms']:.3f} ms stuck   usual latency: {_check(ok)}"
            )
    lines += report_header_flood(results.get("header_flood", {}))
    t = results["throughput_32_callers"]
    lines.append(
        f"throughput, 32 callers            direct {t['direct']:8.0f}/s   proxy {t['proxy']:8.0f}/s"
        f"   target >=2000/s: {_check(t['proxy'] >= 2000)}"
    )
    rc = results["recovery"]
    lines.append(
        f"recovery {rc['pods']} pods/{rc['containers']} containers   {rc['seconds']:.2f} s, RSS {rc['rss_mb']:.0f} MB"
        f"   targets <=2 s, <=100 MB: {_check(rc['seconds'] <= 2)}, {_check(rc['rss_mb'] <= 100)}"
    )
    lk = results["leak_check"]
    lines.append(
        f"leak check, {lk['calls']} calls          RSS {lk['before']['rss_mb']:.1f} -> {lk['after']['rss_mb']:.1f} MB"
        f" (warm-up from {lk['start']['rss_mb']:.1f}), fds {lk['before']['fds']} -> {lk['after']['fds']},"
        f" errors {lk['errors'] or 'none'}"
    )
    return "\n".join(lines)


#: What the wrapper may add to a runc call that no hook concerns (issue 19).
WRAPPER_TARGET_MS = 10.0


def report_runc_wrapper(r: dict[str, Any]) -> list[str]:
    """Rows for :func:`runc_wrapper`'s figures: added ms per runc call, launcher and entry point."""
    if "skipped" in r:
        return [f"runc wrapper                      not measured: {r['skipped']}"]
    lines = []
    for name, label in (
        ("version", "runc --version"),
        ("state", "runc state"),
        ("create", "create, hook, no match"),
        ("create_python", "create, hasBindMounts hook"),
    ):
        runs = r.get(name)
        if runs is None:
            continue
        plain = runs["runc"]
        for variant in ("launcher", "entry_point"):
            if variant not in runs:
                continue
            v = runs[variant]
            added = v["median_ms"] - plain["median_ms"]
            if variant == "entry_point":
                target = "(Python entry point; no target)"
            elif name == "create_python":
                target = "(the index cannot rule it out: Python runs; info)"
            else:
                target = f"added <={WRAPPER_TARGET_MS:g} ms: {_check(added <= WRAPPER_TARGET_MS)}"
            lines.append(
                f"{'wrapper ' + variant[:8] + ' ' + label:<33} {plain['median_ms']:7.3f}/{plain['p99_ms']:7.3f}"
                f"   {v['median_ms']:7.3f}/{v['p99_ms']:7.3f}   {v['median_ms'] / plain['median_ms']:5.2f}"
                f"   {added:8.3f}   {target}"
            )
    if "create" in r:
        lines.append("  (create rows: runc replaced by `true`, so the difference is all the wrapper's)")
    return lines


def report_runc_wrapper_containerd(r: dict[str, Any]) -> list[str]:
    """Rows for :func:`runc_wrapper_containerd`: pod start with runc vs the launcher (medians/p99 in ms)."""
    if "skipped" in r:
        return [f"runc wrapper on containerd        not measured: {r['skipped']}"]
    plain, launcher = r["pod_start"]["runc"], r["pod_start"]["launcher"]
    return [
        f"pod start, containerd {r['containerd']}, runc vs fast launcher (hook file, no match), ms median/p99:",
        f"  runc {plain['median_ms']:.1f}/{plain['p99_ms']:.1f}   launcher {launcher['median_ms']:.1f}/"
        f"{launcher['p99_ms']:.1f}   added {launcher['median_ms'] - plain['median_ms']:+.1f} "
        f"(n={plain['n']}+{launcher['n']}; info)",
    ]


def report_nri(r: dict[str, Any]) -> list[str]:
    """Rows for :func:`nri`: without vs with ``krproxy nri`` registered (medians/p99 in ms)."""
    if "skipped" in r:
        return [f"NRI mode                          not measured: {r['skipped']}"]
    lines = [
        f"NRI mode, containerd {r['containerd']}: without / with krproxy nri registered (ms, median/p99)"
    ]
    for name, label in (
        ("pod_start", "pod start (run+create+start)"),
        ("version", "Version (plain CRI call)"),
    ):
        a, b = r[name]["without"], r[name]["with"]
        lines.append(
            f"{label:<33} {a['median_ms']:8.3f}/{a['p99_ms']:8.3f}"
            f"   {b['median_ms']:8.3f}/{b['p99_ms']:8.3f}   added {b['median_ms'] - a['median_ms']:+8.3f}"
        )
    if "krproxy_cpu_ms_per_pod" in r:
        lines.append(
            f"{'krproxy nri CPU per pod':<33} {r['krproxy_cpu_ms_per_pod']:8.2f} ms (run to removal; median of the "
            "'with' blocks; user+system, its idle work included)"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m krproxy.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--small-calls", type=int, default=2000)
    parser.add_argument("--large-calls", type=int, default=50)
    parser.add_argument("--create-calls", type=int, default=300)
    parser.add_argument("--throughput-seconds", type=float, default=5.0)
    parser.add_argument("--leak-calls", type=int, default=100_000)
    parser.add_argument("--real-pods", type=int, default=10, help="pods created in the real containerd")
    parser.add_argument("--real-containers-per-pod", type=int, default=20)
    parser.add_argument("--json", default="bench-results.json", metavar="FILE", help="default: %(default)s")
    parser.add_argument("--wrapper-calls", type=int, default=200, help="runs per runc wrapper variant")
    parser.add_argument(
        "--flood-calls", type=int, default=1000, help="Version calls per header-flood measurement"
    )
    parser.add_argument(
        "--wrapper-blocks", type=int, default=10, help="wrapper on containerd: blocks per runtime handler"
    )
    parser.add_argument("--wrapper-pods", type=int, default=4, help="wrapper on containerd: pods per block")
    parser.add_argument(
        "--only-runc-wrapper", action="store_true", help="measure only what the OCI hooks runc wrapper adds"
    )
    parser.add_argument(
        "--only-nri", action="store_true", help="measure only the NRI mode cases (--nri-containerd)"
    )
    parser.add_argument(
        "--nri-containerd",
        default="2.3",
        choices=["2.3", "2.x"],
        help="NRI cases: which containerd (containerd-sandbox fetch --version); default %(default)s",
    )
    parser.add_argument(
        "--only-header-flood",
        action="store_true",
        help="measure only Version calls while another caller floods krproxy with header blocks",
    )
    parser.add_argument(
        "--only-sdk-create",
        action="store_true",
        help="measure only CreateContainer through krproxy with one SDK plugin, beside direct and one fake plugin",
    )
    parser.add_argument(
        "--only-rpc-server",
        action="store_true",
        help="measure only the CPU per unary call of krproxy.rpc's server (hook servers' engine)",
    )
    parser.add_argument(
        "--nri-blocks", type=int, default=4, help="NRI cases: blocks per state (with/without)"
    )
    parser.add_argument("--nri-pods", type=int, default=5, help="NRI cases: pods started per block")
    parser.add_argument(
        "--nri-version-calls", type=int, default=500, help="NRI cases: Version calls per block"
    )
    parser.add_argument(
        "--only-go-anchor",
        action="store_true",
        help="measure only krproxy against a grpc-go raw-forwarding proxy on real containerd",
    )
    parser.add_argument("--anchor-pods", type=int, default=20, help="Go anchor: pods in the containerd")
    parser.add_argument(
        "--anchor-calls", type=int, default=6000, help="Go anchor: calls of the mix per round"
    )
    parser.add_argument("--anchor-rounds", type=int, default=3, help="Go anchor: rounds per proxy")
    parser.add_argument(
        "--anchor-runtime",
        choices=["containerd", "fake"],
        default="containerd",
        help="Go anchor: in front of real containerd (the sandbox) or the fake containerd",
    )
    args = parser.parse_args(argv)
    if args.only_go_anchor:
        with _scratch() as workdir:
            results = {"go_anchor": go_anchor(workdir, args)}
        print("\n".join(report_go_anchor(results["go_anchor"])))
    elif args.only_nri:
        workdir = tempfile.mkdtemp(prefix="krproxy-bench-")
        try:
            results = {"nri": nri(workdir, args)}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print("\n".join(report_nri(results["nri"])))
    elif args.only_header_flood:
        results = {"header_flood": header_flood(args.flood_calls, [1 << 20, 384 << 10, 4095])}
        print("\n".join(report_header_flood(results["header_flood"])))
    elif args.only_sdk_create:
        from krproxy.bench.sdk import report_sdk_create, sdk_create

        with _scratch() as workdir:
            results = {"sdk_CreateContainer": sdk_create(workdir, args.create_calls)}
        print("\n".join(report_sdk_create(results["sdk_CreateContainer"])))
    elif args.only_rpc_server:
        results = {"rpc_server": rpc_server_cpu(args.small_calls)}
        print("\n".join(report_rpc_server_cpu(results["rpc_server"])))
    elif args.only_runc_wrapper:
        workdir = tempfile.mkdtemp(prefix="krproxy-bench-")
        try:
            results = {
                "runc_wrapper": runc_wrapper(workdir, args.wrapper_calls),
                "runc_wrapper_containerd": runc_wrapper_containerd(workdir, args),
            }
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        lines = report_runc_wrapper(results["runc_wrapper"])
        print("\n".join(lines + report_runc_wrapper_containerd(results["runc_wrapper_containerd"])))
    else:
        results = run(args)
        results["rpc_server"] = rpc_server_cpu(args.small_calls)
        print(report(results))
        print("\n".join(report_rpc_server_cpu(results["rpc_server"])))
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nJSON written to {args.json}")
    return 0
