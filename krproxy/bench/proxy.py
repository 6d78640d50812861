"""The proxy cases of ``nox -s bench``: passthrough, hooked calls, a stuck client, real
containerd, store recovery, leaks (the package docstring lists them)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
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
from krproxy.bench.anchor import go_anchor
from krproxy.bench.hookanchor import hook_anchor
from krproxy.bench.micro import header_flood
from krproxy.bench.nri import nri
from krproxy.bench.wrapper import runc_wrapper, runc_wrapper_containerd


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
            ["-m", "krproxy.fakes.containerd", "--socket", sock("containerd"), "--seed-pods", "1000"],
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
                    "krproxy.fakes.plugin",
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
                outs = _throughput_clients(target, "--seconds", str(args.throughput_seconds))
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
            "--calls",
            str(args.create_calls),
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
        with _scratch() as hook_dir:
            results["hook_anchor"] = hook_anchor(hook_dir, args)
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


def _recovery(procs: Processes, workdir: str) -> dict[str, float]:
    backend = os.path.join(workdir, "containerd-big.sock")
    procs.start(
        "containerd-big",
        [
            "-m",
            "krproxy.fakes.containerd",
            "--socket",
            backend,
            "--seed-pods",
            "1000",
            "--containers-per-pod",
            "3",
        ],
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


def _throughput_clients(target: str, *limit: str) -> list[dict[str, Any]]:
    """Four throughput client processes of 8 threads each against ``target``, until ``limit``
    (``--seconds N`` or ``--calls N``); their JSON reports."""
    command = [PY, "-m", "krproxy.bench.client", "throughput", "--target", target, "--threads", "8", *limit]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE) for _ in range(4)]
    return [json.loads(p.communicate()[0]) for p in runs]


def _leak_check(pid: int, target: str, calls: int) -> dict[str, Any]:
    """RSS and fds of the daemon at ``pid`` around ``calls`` calls, after a warm-up round of as many.

    The warm-up fills what is bounded by design, so that only real growth shows: h2 keeps
    the ids of the last 65,536 closed streams of each connection (~11 MB for the daemon's
    connection to the runtime), and memory freed by Python is kept for reuse.
    """

    def one_round() -> list[dict[str, Any]]:
        return _throughput_clients(target, "--calls", str(calls // 4))

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
