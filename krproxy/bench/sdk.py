"""``python -m krproxy.bench.sdk``: the CPU a hook server written with the SDK spends per hook call.

Starts ``krproxy hooks serve`` as a process of its own — with one trivial plugin function (this
module's :func:`register`), and again with the built-in policies and no policy file — and sends
it PreCreateContainerHook calls one after another from this process (a :class:`krproxy.rpc.Channel`,
as the proxy calls it). Prints, per server, the server process's CPU (utime + stime from
``/proc/PID/stat``) per call and the median and p99 call latency seen by the client. Issue 24's
target: at most 0.2 ms of the server's CPU per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import trio

from krproxy import log, rpc
from krproxy.grpcstatus import GRPCError
from krproxy.hookserver import ContainerContext, HookServer, Stage
from krproxy.hookserver.testing import container_request, pod_request

TICKS = os.sysconf("SC_CLK_TCK")


def register(app: HookServer) -> None:
    """The bench's plugin (``--plugin krproxy.bench.sdk``): one function setting one variable."""

    @app.hook(Stage.PRE_CREATE_CONTAINER, name="bench-env")
    def bench_env(ctx: ContainerContext) -> None:
        ctx.response.add_envs["BENCH"] = ctx.request.pod.meta.name


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # fields 14 and 15 of proc(5)


async def _wait_ready(socket: str, request: bytes) -> None:
    with trio.fail_after(60):
        while True:
            try:
                async with rpc.Channel(socket) as channel:
                    await channel.unary(Stage.PRE_CREATE_CONTAINER.rpc_path, request, timeout=5)
                return
            except GRPCError:
                await trio.sleep(0.1)


async def _measure(socket: str, pid: int, calls: int) -> tuple[float, list[float]]:
    request = bytes(container_request(pod_request("bench"), "app").SerializeToString())
    await _wait_ready(socket, request)
    async with rpc.Channel(socket) as channel:
        for _ in range(200):  # warm-up
            await channel.unary(Stage.PRE_CREATE_CONTAINER.rpc_path, request, timeout=5)
        latencies = []
        before = cpu_seconds(pid)
        for _ in range(calls):
            start = time.perf_counter()
            await channel.unary(Stage.PRE_CREATE_CONTAINER.rpc_path, request, timeout=5)
            latencies.append(time.perf_counter() - start)
        spent = cpu_seconds(pid) - before
    return spent / calls, latencies


def run_case(name: str, extra: Sequence[str], calls: int, workdir: str) -> None:
    socket = os.path.join(workdir, f"{name}.sock")
    argv = [sys.executable, "-m", "krproxy", "hooks", "serve", "--socket", socket]
    argv += ["--hook-dir", os.path.join(workdir, f"{name}.d"), "--cgroup-root", workdir, *extra]
    with open(os.path.join(workdir, f"{name}.log"), "wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=log)
    try:
        per_call, latencies = trio.run(_measure, socket, server.pid, calls)
    finally:
        server.terminate()
        server.wait(timeout=30)
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    print(
        f"{name:<28} server CPU {per_call * 1e3:6.3f} ms/call   latency median "
        f"{statistics.median(latencies) * 1e3:6.3f} ms  p99 {p99 * 1e3:6.3f} ms  ({calls} calls)",
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m krproxy.bench.sdk", description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="calls per server (default: %(default)s)")
    args = parser.parse_args(argv)
    log.configure("error")  # the client channel warns while the server is still starting
    with tempfile.TemporaryDirectory(prefix="krproxy-bench-sdk-") as workdir:
        run_case("one plain function", ["--no-builtin", "--plugin", "krproxy.bench.sdk"], args.calls, workdir)
        run_case("built-in policies", [], args.calls, workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
