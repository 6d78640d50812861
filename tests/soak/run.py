"""The bounded soak.

Set-up, all on unix sockets in a temp directory:

- a fake containerd process (``python -m tests.integration.faults_support``), seeded with pods;
- two fake hook plugin processes (``python -m krproxy.fakes.plugin``) registered for every hook, the first
  setting a cpu quota, the second an annotation;
- the proxy daemon, in this process on a thread of its own (``trio.run`` → ``open_loop`` →
  :func:`krproxy.daemon.serve`), so that its trio tasks can be counted;
- ``--processes`` client processes with ``--clients`` threads in all, each with its own grpcio channel,
  making calls until ``--calls`` calls were made in total or ``--seconds`` passed.

Each client repeats a mix: Version, ListContainers, ContainerStatus of a seeded container, and a hooked
lifecycle (CreateContainer → StartContainer → StopContainer → RemoveContainer in the client's own pod).
Every call must succeed: any error is unexpected. The daemon's RSS, fds and trio tasks are sampled at
the start (after a warm-up), the middle and the end; the run fails if RSS grew by more than
``--max-rss-growth-mb`` after the warm-up, or fds or tasks grew by more than a small constant.
"""

from __future__ import annotations

import argparse
import array
import collections
import contextlib
import functools
import json
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from krproxy.config import ProxyConfig
from krproxy.daemon import Daemon, serve

SEEDED_PODS = 20
WARM_UP_SECONDS = 3.0
#: fds and tasks allowed beyond the start sample at the end (channels reconnecting, a call in flight).
COUNT_SLACK = 8


@attrs.frozen
class Sample:
    at: float
    rss_mb: float
    fds: int
    tasks: int
    calls: int


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# -- the daemon, on its own thread --------------------------------------------------------------------


class DaemonThread:
    """The proxy daemon running in a thread of this process, until :meth:`stop`."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.daemon: Daemon | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), name="daemon", daemon=True)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self.daemon = await nursery.start(functools.partial(serve, self.config, handle_signals=False))
            self._ready.set()

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the daemon did not start")

    def tasks(self) -> int:
        """The daemon's live trio tasks (it runs no asyncio)."""

        def count() -> int:
            root = trio.lowlevel.current_root_task()
            todo, seen = [root] if root is not None else [], 0
            while todo:
                task = todo.pop()
                seen += 1
                for nursery in task.child_nurseries:
                    todo.extend(nursery.child_tasks)
            return seen

        assert self._token is not None
        return trio.from_thread.run_sync(count, trio_token=self._token)

    def stop(self) -> None:
        if self._token is not None and self.daemon is not None:
            trio.from_thread.run_sync(self.daemon.request_shutdown, trio_token=self._token)
        self._thread.join(30)


# -- clients, in processes of their own ------------------------------------------------------------------


def _client_process(
    socket: str, threads: int, first: int, budget: Any, deadline: float, results: Any, seeded: list[str]
) -> None:
    """Run ``threads`` client threads; put (latencies, error counts by code, calls) on ``results``."""
    import grpc
    from cri_api.v1 import api_pb2, api_pb2_grpc

    latencies: list[float] = []
    errors: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def take() -> bool:
        with budget.get_lock():
            if budget.value <= 0:
                return False
            budget.value -= 1
            return True

    def client(index: int) -> None:
        channel = grpc.insecure_channel(f"unix://{socket}", options=[("grpc.enable_retries", 0)])
        stub = api_pb2_grpc.RuntimeServiceStub(channel)
        mine: list[float] = []
        bad: collections.Counter[str] = collections.Counter()

        def call(method: Any, request: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(request, timeout=30)
            except grpc.RpcError as err:
                bad[f"{method._method.decode().rsplit('/', 1)[1]}:{err.code().name}"] += 1
                return None
            finally:
                mine.append(time.perf_counter() - started)

        name = f"soak-{index}"
        pod = stub.RunPodSandbox(
            api_pb2.RunPodSandboxRequest(
                config=api_pb2.PodSandboxConfig(
                    metadata=api_pb2.PodSandboxMetadata(name=name, uid=f"uid-{name}", namespace="soak"),
                    linux=api_pb2.LinuxPodSandboxConfig(cgroup_parent=f"/kubepods/pod{name}"),
                )
            ),
            timeout=30,
        ).pod_sandbox_id
        round_ = 0
        try:
            while time.time() < deadline:
                round_ += 1
                kind = round_ % 10
                if kind < 3:
                    if not take():
                        break
                    call(stub.Version, api_pb2.VersionRequest())
                elif kind < 5:
                    if not take():
                        break
                    call(stub.ListContainers, api_pb2.ListContainersRequest())
                elif kind < 7:
                    if not take():
                        break
                    cid = seeded[(index + round_) % len(seeded)]
                    call(stub.ContainerStatus, api_pb2.ContainerStatusRequest(container_id=cid))
                else:
                    if not all(take() for _ in range(4)):
                        break
                    config = api_pb2.ContainerConfig(
                        metadata=api_pb2.ContainerMetadata(name=f"c{round_}"),
                        image=api_pb2.ImageSpec(image="busybox:1"),
                        linux=api_pb2.LinuxContainerConfig(
                            resources=api_pb2.LinuxContainerResources(
                                cpu_shares=512, memory_limit_in_bytes=1 << 28
                            )
                        ),
                    )
                    created = call(
                        stub.CreateContainer,
                        api_pb2.CreateContainerRequest(pod_sandbox_id=pod, config=config),
                    )
                    if created is None:
                        continue
                    cid = created.container_id
                    call(stub.StartContainer, api_pb2.StartContainerRequest(container_id=cid))
                    call(stub.StopContainer, api_pb2.StopContainerRequest(container_id=cid, timeout=0))
                    call(stub.RemoveContainer, api_pb2.RemoveContainerRequest(container_id=cid))
        finally:
            stub.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod), timeout=30)
            stub.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod), timeout=30)
            channel.close()
            with lock:
                latencies.extend(mine)
                errors.update(bad)

    workers = [threading.Thread(target=client, args=(first + i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    # As an array (8 bytes a figure): the end sample of the daemon's RSS is taken with every client's
    # latencies received in this process, and 200k Python floats in lists would add 6 MB to it.
    results.put((array.array("d", latencies), dict(errors)))


# -- the run ---------------------------------------------------------------------------------------------


@attrs.frozen
class Figures:
    calls: int
    seconds: float
    errors: dict[str, int]
    p50_ms: float
    p99_ms: float
    samples: list[Sample]
    store: tuple[int, int]

    @property
    def rate(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0

    def problems(self, max_rss_growth_mb: float) -> list[str]:
        start, end = self.samples[0], self.samples[-1]
        found = []
        if self.errors:
            found.append(f"unexpected errors: {self.errors}")
        if end.rss_mb - start.rss_mb > max_rss_growth_mb:
            found.append(f"RSS grew {end.rss_mb - start.rss_mb:.1f} MB (limit {max_rss_growth_mb})")
        if end.fds > start.fds + COUNT_SLACK:
            found.append(f"fds grew from {start.fds} to {end.fds}")
        if end.tasks > start.tasks + COUNT_SLACK:
            found.append(f"tasks grew from {start.tasks} to {end.tasks}")
        if self.store != (SEEDED_PODS, SEEDED_PODS):
            found.append(f"store holds {self.store} (pods, containers); expected only the seeded ones")
        return found

    def report(self) -> str:
        lines = [
            f"calls {self.calls} in {self.seconds:.1f} s: {self.rate:.0f} calls/s",
            f"latency p50 {self.p50_ms:.2f} ms, p99 {self.p99_ms:.2f} ms",
            f"errors by method:code {json.dumps(self.errors) if self.errors else 'none'}",
            f"store at the end: {self.store[0]} pods, {self.store[1]} containers",
            "daemon samples (time s, RSS MB, fds, trio tasks, calls so far):",
        ]
        lines += [
            f"  {s.at:7.1f}  {s.rss_mb:7.1f}  {s.fds:4d}  {s.tasks:4d}  {s.calls:8d}" for s in self.samples
        ]
        return "\n".join(lines)


def _start(argv: list[str], log: str) -> Any:
    import subprocess

    with open(log, "wb") as stderr:
        return subprocess.Popen([sys.executable, *argv], stderr=stderr, stdout=subprocess.DEVNULL)


def _wait_socket(path: str, limit: float = 20.0) -> None:
    import grpc

    with grpc.insecure_channel(f"unix://{path}") as channel:
        grpc.channel_ready_future(channel).result(timeout=limit)


def soak(calls: int, seconds: float, clients: int, processes: int) -> Figures:
    """Run the soak and return its figures (see the module docstring)."""
    directory = tempfile.mkdtemp(prefix="kp-soak-", dir="/tmp")
    started: list[Any] = []
    daemon: DaemonThread | None = None
    try:
        runtime = os.path.join(directory, "containerd.sock")
        hook_dir = os.path.join(directory, "hooks")
        started.append(
            _start(
                [
                    "-m",
                    "tests.integration.faults_support",
                    "--socket",
                    runtime,
                    "--seed-pods",
                    str(SEEDED_PODS),
                ],
                os.path.join(directory, "containerd.log"),
            )
        )
        _wait_socket(runtime)
        for index, flags in enumerate((["--set-cpu-quota=50000"], ["--add-annotation=soak=yes"])):
            socket = os.path.join(directory, f"plugin{index}.sock")
            argv = [
                "-m",
                "krproxy.fakes.plugin",
                "--socket",
                socket,
                "--hook-dir",
                hook_dir,
                f"--name=plugin{index}",
            ]
            started.append(
                _start([*argv, "--log-level=WARNING", *flags], os.path.join(directory, f"p{index}.log"))
            )
            _wait_socket(socket)
        while len([f for f in os.listdir(hook_dir) if f.endswith(".json")]) < 2:
            time.sleep(0.05)
        listen = os.path.join(directory, "proxy.sock")
        daemon = DaemonThread(ProxyConfig(listen=listen, runtime_endpoint=runtime, hook_dir=hook_dir))
        daemon.start()
        assert daemon.daemon is not None
        hooks = daemon.daemon.hooks
        while not hooks.recovered or len(hooks.dispatcher.registry.plugins) < 2:
            time.sleep(0.05)
        seeded = sorted(hooks.store.containers())

        context = multiprocessing.get_context("spawn")
        budget = context.Value("q", calls)
        results = context.Queue()
        began = time.time()
        deadline = began + seconds
        per = [clients // processes + (1 if i < clients % processes else 0) for i in range(processes)]
        workers = [
            context.Process(
                target=_client_process,
                args=(listen, n, sum(per[:i]), budget, deadline, results, seeded),
            )
            for i, n in enumerate(per)
        ]
        for worker in workers:
            worker.start()

        def sample() -> Sample:
            return Sample(
                time.time() - began,
                _rss_mb(),
                len(os.listdir("/proc/self/fd")),
                daemon.tasks(),
                calls - budget.value,
            )

        samples: list[Sample] = []
        time.sleep(WARM_UP_SECONDS)
        samples.append(sample())
        collected: list[tuple[array.array[float], dict[str, int]]] = []
        middle_taken = False
        while len(collected) < len(workers):
            with contextlib.suppress(queue.Empty):
                collected.append(results.get(timeout=0.5))
            done = calls - budget.value
            if not middle_taken and (done >= calls / 2 or time.time() - began >= seconds / 2):
                samples.append(sample())
                middle_taken = True
        for worker in workers:
            worker.join()
        elapsed = time.time() - began
        time.sleep(1.0)  # let the last streams close
        samples.append(sample())
        latencies = sorted(x for lat, _ in collected for x in lat)
        errors: collections.Counter[str] = collections.Counter()
        for _, errs in collected:
            errors.update(errs)
        stats = hooks.store.statistics()
        return Figures(
            calls=len(latencies),
            seconds=elapsed,
            errors=dict(errors),
            p50_ms=latencies[len(latencies) // 2] * 1e3 if latencies else 0.0,
            p99_ms=latencies[int(len(latencies) * 0.99)] * 1e3 if latencies else 0.0,
            samples=samples,
            store=(stats.pods, stats.containers),
        )
    finally:
        if daemon is not None:
            daemon.stop()
        for process in started:
            process.terminate()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200_000, help="total calls (default 200000)")
    parser.add_argument("--seconds", type=float, default=600.0, help="time limit (default 600)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent client threads (default 64)")
    parser.add_argument("--processes", type=int, default=4, help="client processes (default 4)")
    parser.add_argument("--max-rss-growth-mb", type=float, default=20.0)
    args = parser.parse_args(argv)
    figures = soak(args.calls, args.seconds, args.clients, args.processes)
    print(figures.report())
    problems = figures.problems(args.max_rss_growth_mb)
    for problem in problems:
        print("FAILED:", problem)
    return 1 if problems else 0
