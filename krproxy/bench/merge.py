"""``python -m krproxy.bench.merge``: in-process µs per CreateContainer merge + encode, the proxy's own work
when a plugin changes the request (no sockets, so far less sensitive to the machine's load than the
end-to-end ``--only-sdk-create``).

For the bench's CreateContainer (:mod:`krproxy.bench.client`'s, ~200 bytes) and for one of kubelet's size
(``krproxy.hookserver.testing``'s ~4 KB one), and two answers (one annotation added; one env added), times:

* ``whole``: the request path, all in upb (:mod:`krproxy.hooks.rewrite`): decode, the record
  (:func:`krproxy.hooks.convert.container_from_wire_create`), merge, write the record into the decoded
  message and encode it — everything the proxy does for a hooked CreateContainer but the calls;
* ``parse+encode, upb``: the last step alone, a upb parse + :func:`krproxy.hooks.rewrite.create_request`
  (which changes the message it is given).

The betterproto2 path these replaced (docs/performance.md has its figures) is kept only as the tests'
reference, in tests/oracles.py.

Each figure is the best of ``--rounds`` rounds of ``--calls`` calls.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from krproxy.hooks import convert, merge, rewrite
from krproxy.hooks.model import PodInfo
from krproxy.proto.runtime import v1, v1alpha1

ANSWERS = {
    "annotation": v1alpha1.ContainerResourceHookResponse(container_annotations={"bench": "1"}),
    "env": v1alpha1.ContainerResourceHookResponse(container_envs={"A": "1", "BENCH": "1"}),
}


def bench_request() -> bytes:
    """The CreateContainer request of the end-to-end bench (krproxy.bench.client's ``create``)."""
    config = v1.PodSandboxConfig(
        metadata=v1.PodSandboxMetadata(name="bench", uid="bench-0", namespace="bench"),
        linux=v1.LinuxPodSandboxConfig(cgroup_parent="/kubepods/bench"),
    )
    request = v1.CreateContainerRequest(
        pod_sandbox_id="0" * 64,
        config=v1.ContainerConfig(
            metadata=v1.ContainerMetadata(name="c0"),
            image=v1.ImageSpec(image="docker.io/library/busybox:latest"),
            envs=[v1.KeyValue(key="A", value=b"1")],
            linux=v1.LinuxContainerConfig(resources=v1.LinuxContainerResources(cpu_shares=512)),
        ),
        sandbox_config=config,
    )
    return bytes(request.SerializeToString())


def kubelet_sized_request() -> bytes:
    """A CreateContainer of about kubelet's size (~4 KB): labels, annotations, envs and mounts as a pod with
    a service account and a few variables gets."""
    labels = {"app": "web", "pod-template-hash": "5d8f7c9b6d", "io.kubernetes.pod.namespace": "default"}
    annotations = {f"example.com/annotation-{i}": "x" * 40 for i in range(12)}
    envs = [v1.KeyValue(key=f"SERVICE_{i}_PORT", value=f"tcp://10.96.0.{i}:443".encode()) for i in range(30)]
    mounts = [
        v1.Mount(
            container_path=f"/var/run/secrets/{i}", host_path=f"/var/lib/kubelet/pods/{'0' * 36}/volumes/{i}"
        )
        for i in range(6)
    ]
    config = v1.PodSandboxConfig(
        metadata=v1.PodSandboxMetadata(name="web-5d8f7c9b6d-abcde", uid="0" * 36, namespace="default"),
        labels=labels,
        annotations=annotations,
        linux=v1.LinuxPodSandboxConfig(cgroup_parent="kubepods-burstable-pod" + "0" * 36 + ".slice"),
    )
    request = v1.CreateContainerRequest(
        pod_sandbox_id="0" * 64,
        config=v1.ContainerConfig(
            metadata=v1.ContainerMetadata(name="web"),
            image=v1.ImageSpec(image="registry.example/web@sha256:" + "0" * 64),
            command=["/bin/web"],
            args=["--port=8080", "--verbose"],
            envs=envs,
            mounts=mounts,
            labels={**labels, "io.kubernetes.container.name": "web"},
            annotations={**annotations, "io.kubernetes.container.hash": "1a2b3c4d"},
            log_path="web/0.log",
            linux=v1.LinuxContainerConfig(
                resources=v1.LinuxContainerResources(cpu_period=100000, cpu_quota=50000, cpu_shares=512)
            ),
        ),
        sandbox_config=config,
    )
    return bytes(request.SerializeToString())


def best_us(work: Callable[[], object], calls: int, rounds: int) -> float:
    """The best round's µs per call of *work* (after a warm-up)."""
    for _ in range(min(calls, 100)):
        work()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            work()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def measure(
    data: bytes, answer: v1alpha1.ContainerResourceHookResponse, calls: int, rounds: int
) -> dict[str, float]:
    pod = PodInfo(name="bench", namespace="bench")
    info = merge.merge_container_info(
        convert.container_from_wire_create(rewrite.CreateContainerRequest.FromString(data), pod),
        convert.container_answer(answer),
    ).value

    def whole() -> bytes:
        decoded = rewrite.CreateContainerRequest.FromString(data)
        record = convert.container_from_wire_create(decoded, pod)
        merged = merge.merge_container_info(record, convert.container_answer(answer)).value
        return rewrite.create_request(decoded, merged)

    return {
        "whole": best_us(whole, calls, rounds),
        "parse+encode, upb": best_us(
            lambda: rewrite.create_request(rewrite.CreateContainerRequest.FromString(data), info),
            calls,
            rounds,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m krproxy.bench.merge", description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for size, data in (("bench", bench_request()), ("kubelet-sized", kubelet_sized_request())):
        for name, answer in ANSWERS.items():
            figures = measure(data, answer, args.calls, args.rounds)
            shown = "  ".join(f"{k} {v:7.1f} us" for k, v in figures.items())
            print(f"{size} request ({len(data)} B), {name} added: {shown}")


if __name__ == "__main__":
    main()
