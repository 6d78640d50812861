"""krproxy called by a grpc-go client set up as kubelet's (tests/goclient, built by
``scripts/install-go-client``, which ``nox -s tests`` runs; without it these tests are skipped
with its reason).

kubelet is a grpc-go client, and the other tests call krproxy from grpcio, krproxy.rpc and h2load:
grpc-go sends BDP-estimation PINGs and grows its windows as it measures, judges an answer's size
against its own 16 MiB limit, and after a GOAWAY reconnects with backoff and replays only the
calls the server said it never processed. The client prints one JSON summary per run (status
codes by name, a few messages per code, latencies, answer sizes); these tests assert on the
codes and on what the runtime and the plugin received, never on timings.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from cri_api.v1 import api_pb2 as pb

from krproxy import rpc
from krproxy.bench._support import Processes
from krproxy.fakes.containerd import FakeContainerd
from krproxy.fakes.plugin import Changes, FakePlugin
from krproxy.h2 import hpackmemo
from krproxy.hooks.points import HookPoint
from tests.conftest import CriClient
from tests.integration.hooks_support import Node, container_config, make_node, pod_config
from tests.integration.support import LIVENESS_LIMIT, start_proxy, start_scripted_backend, wait_until
from tests.integration.test_relay_restart import _activated, _serve_activated, _stop_all

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = "/runtime.v1.RuntimeService/"
LIMIT = 16 * 1024 * 1024  # kubelet's receive limit (maxMsgSize), the client's default


@pytest.fixture(scope="module")
def goclient() -> str:
    """The client binary, built from the packages scripts/install-go-client unpacked (never downloads)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "install-go-client"), "--offline"],
        capture_output=True,
        text=True,
        check=False,
    )
    path = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or not os.access(path, os.X_OK):
        pytest.skip(f"no grpc-go client: {done.stdout.strip() or done.stderr.strip()}")
    return path


async def run_client(binary: str, socket_path: str, *args: str) -> dict[str, Any]:
    """Run the client to the end; its JSON summary."""
    done = await trio.run_process(
        [binary, "-socket", socket_path, *args], capture_stdout=True, capture_stderr=True, check=False
    )
    assert 0 == done.returncode, done.stderr.decode()
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


async def test_concurrent_calls_with_kubelet_s_options_all_succeed(
    goclient: str, fake_containerd: tuple[FakeContainerd, str], nursery: trio.Nursery, sockdir: str
) -> None:
    """400 Version calls, 50 at a time, on one grpc-go connection: every one OK, and every request
    reached the runtime with a grpc-timeout grpc-go accepts, for about kubelet's 2 minutes."""
    fake, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    summary = await run_client(goclient, proxy.config.listen, "-calls", "400", "-concurrency", "50")
    assert {"OK": 400} == summary["codes"], summary
    assert [] == fake.rejected
    timeouts = [dict(h)["grpc-timeout"] for h in fake.headers("Version")]
    assert timeouts and all(len(t) <= 9 and t[-1] in "HMSmun" for t in timeouts)  # 8 digits and a unit
    assert all(100 < _seconds(t) <= 120 for t in timeouts), timeouts


async def test_a_short_deadline_s_headers_read_as_grpc_go_sent_them(
    goclient: str, fake_containerd: tuple[FakeContainerd, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpc-go straight to a krproxy.rpc.Server (the fake runtime), 3 s deadlines: each call's
    grpc-timeout is often a new dynamic-table entry that shifts every index, so its blocks are
    read by hpackmemo's table rule; every call OK with the grpc-timeout it was sent."""
    fake, backend = fake_containerd
    read: list[int] = []
    by_table = hpackmemo._by_table

    def counted(decoder: Any, block: bytes, limit: int) -> Any:
        got = by_table(decoder, block, limit)
        read.append(got is not None)
        return got

    monkeypatch.setattr(hpackmemo, "_by_table", counted)
    summary = await run_client(goclient, backend, "-calls", "300", "-concurrency", "4", "-timeout", "3s")
    assert {"OK": 300} == summary["codes"], summary
    timeouts = [dict(h)["grpc-timeout"] for h in fake.headers("Version")]  # the last ones kept
    assert timeouts and all(0 < _seconds(t) <= 3 for t in timeouts), timeouts
    # Fresh values among them: new entries. How many depends on the machine's speed alone (grpc-go sends
    # the deadline less the microseconds between the call's context and its header block: 10 distinct
    # values among the last 100 on a fast run, more on a slow one), so only their being there is checked;
    # that they churn the table is what the blocks read by the rule show, below.
    assert len(set(timeouts)) > 1, timeouts
    # Every block not answered from memory by the rule, but those with literal names: the first,
    # and one each time new timeouts have evicted "te" and "grpc-timeout" (every ~90 entries).
    # (Each fresh value is a block never seen before, so at least that many were read by the rule: 63-114
    # blocks in runs with 11-17 distinct values.)
    assert len(read) >= len(set(timeouts)), f"{len(read)} blocks, {len(set(timeouts))} values"
    assert read.count(False) <= 1 + len(read) // 20, f"{sum(read)} of {len(read)}"


def _seconds(timeout: str) -> float:
    unit = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}[timeout[-1]]
    return int(timeout[:-1]) * unit


async def test_an_answer_of_12_mib_arrives_whole_as_from_the_runtime(
    goclient: str,
    fake_containerd: tuple[FakeContainerd, str],
    cri_client: Callable[[str], CriClient],
    nursery: trio.Nursery,
    sockdir: str,
) -> None:
    """ListContainers of 400 seeded containers and 12 with 1 MiB of labels each (about 12 MiB), 3
    at a time, 6 times: grpc-go's flow control (BDP PINGs, window updates) against the relay's;
    each answer as long as the same call straight to the fake containerd answers. (Seeding 14,000
    kubelet-like containers for the same size takes the fake 20 s.)"""
    fake, backend = fake_containerd
    fake.seed(pods=400)
    client = cri_client(backend)
    pod = await client.call(client.runtime.RunPodSandbox, pb.RunPodSandboxRequest(config=pod_config("big")))
    for i in range(12):
        config = container_config(f"c{i}")
        config.labels["big"] = "x" * (1 << 20)
        request = pb.CreateContainerRequest(pod_sandbox_id=pod.pod_sandbox_id, config=config)
        await client.call(client.runtime.CreateContainer, request)
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    args = ("-method", RUNTIME + "ListContainers", "-calls", "6", "-concurrency", "3")
    direct = await run_client(goclient, backend, *args)
    relayed = await run_client(goclient, proxy.config.listen, *args)
    assert {"OK": 6} == direct["codes"] == relayed["codes"], (direct, relayed)
    size = direct["answer_bytes"]["max"]
    assert 12 << 20 < size < LIMIT
    assert {"min": size, "max": size} == direct["answer_bytes"] == relayed["answer_bytes"]


async def _huge(stream: rpc.Stream, messages: list[bytes]) -> None:
    """An answer one byte over kubelet's limit (a runtime with a larger send limit than containerd's)."""
    await stream.send_message(b"x" * (LIMIT + 1))


async def test_an_answer_over_16_mib_kubelet_refuses_krproxy_goes_on(
    goclient: str, nursery: trio.Nursery, sockdir: str
) -> None:
    """grpc-go refuses an answer over its receive limit itself (RESOURCE_EXHAUSTED, from the
    length prefix) and resets the stream; krproxy must drop that stream's answer and serve the
    connection's and the next callers' calls."""
    backend, _ = await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))
    backend.behaviours[RUNTIME + "ListContainers"] = _huge
    proxy = await start_proxy(nursery, sockdir)
    summary = await run_client(
        goclient,
        proxy.config.listen,
        "-method",
        RUNTIME + "ListContainers",
        "-calls",
        "3",
        "-concurrency",
        "3",
    )
    assert {"RESOURCE_EXHAUSTED": 3} == summary["codes"], summary
    assert [f"grpc: received message larger than max ({LIMIT + 1} vs. {LIMIT})"] == summary["messages"][
        "RESOURCE_EXHAUSTED"
    ]
    # Below the answer's size the client's own limit refuses it as well, at any size.
    smaller = await run_client(
        goclient, proxy.config.listen, "-method", RUNTIME + "ListContainers", "-max-recv", str(4 << 20)
    )
    assert {"RESOURCE_EXHAUSTED": 1} == smaller["codes"], smaller
    after = await run_client(goclient, proxy.config.listen, "-calls", "20", "-concurrency", "5")
    assert {"OK": 20} == after["codes"], after
    await wait_until(lambda: proxy.relay.transport.in_flight == 0)  # the refused answers' streams are gone


async def test_a_hooked_pod_and_container_with_kubelet_s_deadlines(
    goclient: str, node: Node, short_tmp: Path
) -> None:
    """RunPodSandbox (4 min deadline) and CreateContainer (2 min) from grpc-go through a plugin
    registered for every hook: the runtime gets the plugin's changes, the client the runtime's answer."""
    await node.start_proxy()
    plugin = await node.add_plugin("p", FakePlugin(Changes(labels={"hooked": "yes"}, envs={"HOOKED": "yes"})))
    run = pb.RunPodSandboxRequest(config=pod_config("go"), runtime_handler="runc")
    answer = short_tmp / "answer.bin"
    summary = await run_client(
        goclient,
        node.proxy_socket,
        "-method",
        RUNTIME + "RunPodSandbox",
        "-request-hex",
        run.SerializeToString().hex(),
        "-save-answer",
        str(answer),
    )
    assert {"OK": 1} == summary["codes"] and "4m0s" == summary["timeout"], summary
    pod_id = pb.RunPodSandboxResponse.FromString(answer.read_bytes()).pod_sandbox_id
    assert "yes" == node.received("RunPodSandbox")[-1].config.labels["hooked"]

    create = node.create_request(pod_id)
    summary = await run_client(
        goclient,
        node.proxy_socket,
        "-method",
        RUNTIME + "CreateContainer",
        "-request-file",
        str(_write(short_tmp / "create.bin", create.SerializeToString())),
        "-save-answer",
        str(answer),
    )
    assert {"OK": 1} == summary["codes"] and "2m0s" == summary["timeout"], summary
    container_id = pb.CreateContainerResponse.FromString(answer.read_bytes()).container_id
    received = node.received("CreateContainer")[-1]
    assert ("HOOKED", "yes") in [(e.key, e.value) for e in received.config.envs]
    listed = await node.call(
        "ListContainers", pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod_id))
    )
    assert [container_id] == [c.id for c in listed.containers]
    assert {HookPoint.PRE_RUN_POD_SANDBOX, HookPoint.PRE_CREATE_CONTAINER} <= set(plugin.hooks_called())


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.fixture
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="krgo-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(
    ("method", "seed_pods"),
    [("Version", 0), ("ListContainers", 1500)],
    ids=["small-answers", "1-mb-answers"],
)
def test_a_restart_loses_no_call_of_a_grpc_go_client(
    goclient: str, workdir: str, method: str, seed_pods: int
) -> None:
    """Steady calls from 16 goroutines while krproxy restarts with a socket systemd holds: the
    two-step GOAWAY lets grpc-go finish the calls krproxy took and replay the ones it refused, on
    a new connection that waits in the backlog for the successor. No call may fail."""
    procs = Processes(workdir)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    daemons: list[subprocess.Popen[bytes]] = []
    client: subprocess.Popen[bytes] | None = None
    try:
        listen, argv, log = _serve_activated(workdir, procs, listener, daemons, "--seed-pods", str(seed_pods))
        answered = os.path.join(workdir, "answered")
        # kubelet's connect timeout is 5 s: a successor that takes longer to start (a loaded
        # machine) would fail calls UNAVAILABLE for that reason alone, not for krproxy's GOAWAY.
        steady = ("-mode", "steady", "-duration", "120s", "-concurrency", "16", "-answered-file", answered)
        patience = ("-connect-timeout", f"{2 * LIVENESS_LIMIT:.0f}s")
        client = subprocess.Popen(
            [goclient, "-socket", listen, "-method", RUNTIME + method, *steady, *patience],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        _wait_for(lambda: os.path.exists(answered))
        time.sleep(1)  # calls in flight when the GOAWAY comes
        daemons[0].send_signal(signal.SIGTERM)
        assert 0 == daemons[0].wait(timeout=LIVENESS_LIMIT)
        os.remove(answered)  # from now on only the successor can answer
        daemons.append(_activated(argv, listener, log))  # as systemd's Restart= would
        _wait_for(lambda: os.path.exists(answered))
        time.sleep(0.5)  # and a while of calls to the successor
        client.send_signal(signal.SIGTERM)
        out, err = client.communicate(timeout=2 * LIVENESS_LIMIT)
        assert 0 == client.returncode, err.decode()
        summary = json.loads(out)
        assert summary["calls"] > 0 and {"OK": summary["calls"]} == summary["codes"], summary["messages"]
        with open(log, "rb") as f:
            text = f.read()
        assert (2, 1) == (text.count(b"event=socket_activated"), text.count(b"event=stopped"))
    finally:
        if client is not None and client.poll() is None:
            client.kill()
            client.wait()
        _stop_all(daemons, procs, listener)


def _wait_for(predicate: Any) -> None:
    deadline = time.monotonic() + 2 * LIVENESS_LIMIT
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
