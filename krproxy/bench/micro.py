"""Single-process measurements: Version calls under a header flood, CPU per call of
:mod:`krproxy.rpc`'s server."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Any

import grpc

from krproxy.bench._support import (
    Processes,
    _check,
    _client,
    _serve_args,
    _summary,
)


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
        procs.start("containerd", ["-m", "krproxy.fakes.containerd", "--socket", backend], backend)
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
