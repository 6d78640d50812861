"""The benchmark's CRI client: a separate process using grpcio (an independent gRPC stack).

Usage (run by :mod:`krproxy.bench`, which reads the JSON it prints on stdout)::

    python -m krproxy.bench.client latency --targets A,B --method Version --calls 2000 --blocks 10
    python -m krproxy.bench.client throughput --target A --threads 8 --seconds 5
    python -m krproxy.bench.client create --targets A,B,C --calls 300
    python -m krproxy.bench.client populate --target A --pods 10 --containers 20 --image IMG --cgroup-parent P
    python -m krproxy.bench.client mix --target A --threads 4 --calls 4000

``latency`` alternates between the targets block by block after a warm-up, so that drift on a
noisy machine hits every target alike; it prints per-target latencies in microseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as pb

from krproxy.bench._support import non_negative_ms

WARMUP_CALLS = 200
METHODS: dict[str, tuple[str, Callable[[str], Any]]] = {
    # method -> (path, request factory, needs a container id)
    "Version": ("/runtime.v1.RuntimeService/Version", lambda cid: pb.VersionRequest(version="v1")),
    "ContainerStatus": (
        "/runtime.v1.RuntimeService/ContainerStatus",
        lambda cid: pb.ContainerStatusRequest(container_id=cid),
    ),
    "ListContainers": ("/runtime.v1.RuntimeService/ListContainers", lambda cid: pb.ListContainersRequest()),
}


def _channel(socket: str) -> grpc.Channel:
    return grpc.insecure_channel(f"unix://{socket}", options=[("grpc.max_receive_message_length", 64 << 20)])


def _raw(channel: grpc.Channel, path: str) -> Callable[..., bytes]:
    return channel.unary_unary(path, request_serializer=None, response_deserializer=None)  # type: ignore[no-any-return]


def _first_container(channel: grpc.Channel) -> str:
    answer = pb.ListContainersResponse.FromString(
        _raw(channel, METHODS["ListContainers"][0])(
            pb.ListContainersRequest().SerializeToString(), timeout=30
        )
    )
    return answer.containers[0].id if answer.containers else ""


def latency(args: argparse.Namespace) -> dict[str, Any]:
    path, make = METHODS[args.method]
    channels = {t: _channel(t) for t in args.targets}
    cid = _first_container(channels[args.targets[0]])
    request = make(cid).SerializeToString()
    calls = {t: _raw(ch, path) for t, ch in channels.items()}
    for call in calls.values():
        for _ in range(min(WARMUP_CALLS, args.calls)):
            call(request, timeout=30)
    samples: dict[str, list[float]] = {t: [] for t in args.targets}
    per_block = max(1, args.calls // args.blocks)
    for _ in range(args.blocks):
        for target, call in calls.items():
            for _ in range(per_block):
                started = time.perf_counter()
                call(request, timeout=30)
                samples[target].append((time.perf_counter() - started) * 1e6)
    return {"latencies_us": samples}


def _run_threads(count: int, start: threading.Barrier, worker: Callable[[int], None]) -> float:
    """Run ``worker(0..count-1)`` in threads released together by ``start`` (of ``count + 1``
    parties); the seconds from their release until the last one is done."""
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    started = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    path, make = METHODS[args.method]
    channel = _channel(args.target)
    request = make("").SerializeToString()
    call = _raw(channel, path)
    counts = [0] * args.threads
    errors: dict[str, int] = {}
    deadline = time.perf_counter() + (args.seconds if not args.calls else 24 * 3600)
    quota = args.calls // args.threads if args.calls else None
    start = threading.Barrier(args.threads + 1)

    def worker(index: int) -> None:
        start.wait()
        while time.perf_counter() < deadline and (quota is None or counts[index] < quota):
            try:
                call(request, timeout=30)
                counts[index] += 1
            except grpc.RpcError as err:
                errors[err.code().name] = errors.get(err.code().name, 0) + 1

    seconds = _run_threads(args.threads, start, worker)
    return {"calls": sum(counts), "seconds": seconds, "errors": errors}


def _steady_mix(channel: grpc.Channel) -> list[tuple[Callable[..., bytes], bytes]]:
    """kubelet's steady calls on a node at rest, one of each: the PLEG relist (ListPodSandbox,
    ListContainers), the status of a pod and of a container, the runtime's Status and Version."""
    runtime = "/runtime.v1.RuntimeService/"
    pods = pb.ListPodSandboxResponse.FromString(
        _raw(channel, runtime + "ListPodSandbox")(pb.ListPodSandboxRequest().SerializeToString(), timeout=30)
    ).items
    return [
        (_raw(channel, runtime + "ListPodSandbox"), pb.ListPodSandboxRequest().SerializeToString()),
        (_raw(channel, runtime + "ListContainers"), pb.ListContainersRequest().SerializeToString()),
        (
            _raw(channel, runtime + "PodSandboxStatus"),
            pb.PodSandboxStatusRequest(pod_sandbox_id=pods[0].id if pods else "").SerializeToString(),
        ),
        (
            _raw(channel, runtime + "ContainerStatus"),
            pb.ContainerStatusRequest(container_id=_first_container(channel)).SerializeToString(),
        ),
        (_raw(channel, runtime + "Status"), pb.StatusRequest().SerializeToString()),
        (_raw(channel, runtime + "Version"), pb.VersionRequest(version="v1").SerializeToString()),
    ]


def mix(args: argparse.Namespace) -> dict[str, Any]:
    """``--calls`` calls of kubelet's steady mix (:func:`_steady_mix`, in turn) from ``--threads``
    callers on one connection; errors are counted by code (the caller judges them)."""
    channel = _channel(args.target)
    calls = _steady_mix(channel)
    errors: dict[str, int] = {}
    quota = args.calls // args.threads
    start = threading.Barrier(args.threads + 1)

    def worker(index: int) -> None:
        start.wait()
        for n in range(quota):
            call, request = calls[(index + n) % len(calls)]
            try:
                call(request, timeout=30)
            except grpc.RpcError as err:
                errors[err.code().name] = errors.get(err.code().name, 0) + 1

    seconds = _run_threads(args.threads, start, worker)
    return {"calls": quota * args.threads, "seconds": seconds, "errors": errors}


def create(args: argparse.Namespace) -> dict[str, Any]:
    """CreateContainer latency per target, each in a pod of its own created through that target (as kubelet
    creates its pods through the proxy, so the proxy knows the pod when the container comes); each container
    is removed again."""
    channels = {t: _channel(t) for t in args.targets}
    configs = {
        t: pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(
                name=f"bench-{n}", uid=f"bench-{n}-{time.time_ns()}", namespace="bench"
            ),
            linux=pb.LinuxPodSandboxConfig(cgroup_parent="/kubepods/bench"),
        )
        for n, t in enumerate(args.targets)
    }
    pods = {
        t: pb.RunPodSandboxResponse.FromString(
            _raw(ch, "/runtime.v1.RuntimeService/RunPodSandbox")(
                pb.RunPodSandboxRequest(config=configs[t]).SerializeToString(), timeout=30
            )
        ).pod_sandbox_id
        for t, ch in channels.items()
    }
    counter = iter(range(10**9))

    def request(target: str) -> bytes:
        message = pb.CreateContainerRequest(
            pod_sandbox_id=pods[target],
            config=pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name=f"c{next(counter)}"),
                image=pb.ImageSpec(image="docker.io/library/busybox:latest"),
                envs=[pb.KeyValue(key="A", value="1")],
                linux=pb.LinuxContainerConfig(resources=pb.LinuxContainerResources(cpu_shares=512)),
            ),
            sandbox_config=configs[target],
        )
        return bytes(message.SerializeToString())

    calls = {t: _raw(ch, "/runtime.v1.RuntimeService/CreateContainer") for t, ch in channels.items()}
    removes = {t: _raw(ch, "/runtime.v1.RuntimeService/RemoveContainer") for t, ch in channels.items()}

    def remove(target: str, answer: bytes) -> None:
        """Untimed: keeps the pod at one container, so every create costs the backend the same.

        (The fake runtime's cost per create grows with the containers in the pod: each
        lifecycle event it queues carries all their statuses.)
        """
        container_id = pb.CreateContainerResponse.FromString(answer).container_id
        removes[target](pb.RemoveContainerRequest(container_id=container_id).SerializeToString(), timeout=30)

    for target, call in calls.items():
        for _ in range(20):
            remove(target, call(request(target), timeout=30))
    # The targets take turns call by call (the order turning each round), not block by block: on a
    # shared machine whose load moves within seconds, each target's calls then meet the same load.
    samples: dict[str, list[float]] = {t: [] for t in args.targets}
    order = list(args.targets)
    for _ in range(args.calls):
        for target in order:
            body = request(target)
            if args.idle_ms:
                time.sleep(args.idle_ms / 1e3)
            started = time.perf_counter()
            answer = calls[target](body, timeout=30)
            samples[target].append((time.perf_counter() - started) * 1e6)
            remove(target, answer)
        order.append(order.pop(0))
    return {"latencies_us": samples}


def _pod_config(uid: str, cgroup_parent: str) -> Any:
    """A host-network pod named ``uid`` whose cgroups go under ``/<cgroup_parent>/``."""
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=uid, uid=uid, namespace="krproxy-bench"),
        hostname="",  # runc cannot set a hostname without a private UTS namespace
        linux=pb.LinuxPodSandboxConfig(
            cgroup_parent=f"/{cgroup_parent}/pod-{uid}",
            security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=pb.NamespaceOption(network=pb.NODE)
            ),
        ),
    )


def populate(args: argparse.Namespace) -> dict[str, Any]:
    """Create ``--pods`` host-network pods with ``--containers`` created (not started) containers each,
    for the real-containerd cases; pods' cgroups go under ``/<cgroup_parent>/``."""
    channel = _channel(args.target)
    run = _raw(channel, "/runtime.v1.RuntimeService/RunPodSandbox")
    create_ = _raw(channel, "/runtime.v1.RuntimeService/CreateContainer")
    started = time.perf_counter()
    for p in range(args.pods):
        uid = f"bench-{p}-{time.time_ns()}"
        config = _pod_config(uid, args.cgroup_parent)
        pod_id = pb.RunPodSandboxResponse.FromString(
            run(pb.RunPodSandboxRequest(config=config).SerializeToString(), timeout=120)
        ).pod_sandbox_id
        for c in range(args.containers):
            request = pb.CreateContainerRequest(
                pod_sandbox_id=pod_id,
                config=pb.ContainerConfig(
                    metadata=pb.ContainerMetadata(name=f"c{c}"),
                    image=pb.ImageSpec(image=args.image),
                    command=["sleep", "3600"],
                    labels={"app": "bench", "index": str(c)},
                    annotations={"krproxy.bench/pod": uid},
                ),
                sandbox_config=config,
            )
            create_(request.SerializeToString(), timeout=120)
    return {
        "pods": args.pods,
        "containers": args.pods * args.containers,
        "seconds": time.perf_counter() - started,
    }


def pod_create(args: argparse.Namespace) -> dict[str, Any]:
    """Time RunPodSandbox + CreateContainer + StartContainer of one-container pods (kubelet's pod start),
    straight to ``--target``; each pod is stopped and removed again, untimed."""
    channel = _channel(args.target)
    call = {
        name: _raw(channel, f"/runtime.v1.RuntimeService/{name}")
        for name in (
            "RunPodSandbox",
            "CreateContainer",
            "StartContainer",
            "StopPodSandbox",
            "RemovePodSandbox",
        )
    }
    samples: list[float] = []
    for p in range(args.pods):
        uid = f"bench-nri-{p}-{time.time_ns()}"
        config = _pod_config(uid, args.cgroup_parent)
        container = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="c"),
            image=pb.ImageSpec(image=args.image),
            command=["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1; done"],
            linux=pb.LinuxContainerConfig(resources=pb.LinuxContainerResources(cpu_shares=512)),
        )
        started = time.perf_counter()
        pod_id = pb.RunPodSandboxResponse.FromString(
            call["RunPodSandbox"](
                pb.RunPodSandboxRequest(
                    config=config, runtime_handler=args.runtime_handler
                ).SerializeToString(),
                timeout=240,
            )
        ).pod_sandbox_id
        request = pb.CreateContainerRequest(pod_sandbox_id=pod_id, config=container, sandbox_config=config)
        container_id = pb.CreateContainerResponse.FromString(
            call["CreateContainer"](request.SerializeToString(), timeout=240)
        ).container_id
        call["StartContainer"](
            pb.StartContainerRequest(container_id=container_id).SerializeToString(), timeout=240
        )
        samples.append((time.perf_counter() - started) * 1e6)
        call["StopPodSandbox"](
            pb.StopPodSandboxRequest(pod_sandbox_id=pod_id).SerializeToString(), timeout=240
        )
        call["RemovePodSandbox"](
            pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id).SerializeToString(), timeout=240
        )
    return {"latencies_us": samples}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m krproxy.bench.client")
    sub = parser.add_subparsers(dest="case", required=True)
    lat = sub.add_parser("latency")
    lat.add_argument("--targets", type=lambda v: v.split(","), required=True)
    lat.add_argument("--method", choices=sorted(METHODS), default="Version")
    lat.add_argument("--calls", type=int, default=2000)
    lat.add_argument("--blocks", type=int, default=10)
    thr = sub.add_parser("throughput")
    thr.add_argument("--target", required=True)
    thr.add_argument("--method", choices=sorted(METHODS), default="Version")
    thr.add_argument("--threads", type=int, default=8)
    thr.add_argument("--seconds", type=float, default=5.0)
    thr.add_argument(
        "--calls", type=int, default=0, help="stop after this many calls in all (0: run --seconds)"
    )
    cre = sub.add_parser("create")
    cre.add_argument("--targets", type=lambda v: v.split(","), required=True)
    cre.add_argument("--calls", type=int, default=300)
    cre.add_argument(
        "--idle-ms",
        type=non_negative_ms,
        default=0.0,
        help="milliseconds the client sleeps before each timed create: every process waits idle (default 0)",
    )
    pop = sub.add_parser("populate")
    pop.add_argument("--target", required=True)
    pop.add_argument("--pods", type=int, default=10)
    pop.add_argument("--containers", type=int, default=20)
    pop.add_argument("--image", required=True)
    pop.add_argument("--cgroup-parent", required=True)
    pod = sub.add_parser("pod-create")
    pod.add_argument("--target", required=True)
    pod.add_argument("--pods", type=int, default=5)
    pod.add_argument("--image", required=True)
    pod.add_argument("--cgroup-parent", required=True)
    pod.add_argument("--runtime-handler", default="", help="RunPodSandbox's runtime_handler (default: none)")
    mixed = sub.add_parser("mix")
    mixed.add_argument("--target", required=True)
    mixed.add_argument("--threads", type=int, default=4)
    mixed.add_argument("--calls", type=int, default=4000)
    args = parser.parse_args(argv)
    cases = {"latency": latency, "throughput": throughput, "create": create, "populate": populate, "mix": mix}
    result = {**cases, "pod-create": pod_create}[args.case](args)
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
