#!/usr/bin/env python3
"""Smoke test: drive a full CRI pod lifecycle against the containerd sandbox.

Run after ``scripts/containerd-sandbox start`` with the project venv (needs
``grpcio`` and the PyPI package ``container-runtime-interface-api``, whose
generated stubs are ``cri_api.v1.api_pb2`` / ``cri_api.v1.api_pb2_grpc``)::

    .venv/bin/python scripts/sandbox_smoke.py [--dir /tmp/krproxy-containerd]

Steps (each printed with its duration): Version, RunPodSandbox (host network,
empty hostname, ``cgroup_parent=/<cgroup_parent>/pod-<uid>`` from
``sandbox.json``), CreateContainer (busybox, TERM-trapping loop, with CPU and
memory limits and a cpuset), StartContainer, ExecSync ``echo hi``, a check
that the limits are in the container's real cgroup v1 files, an
UpdateContainerResources round trip, StopContainer (must not wait out its
timeout), RemoveContainer, StopPodSandbox, RemovePodSandbox.

Every call has the deadline kubelet gives it with its default flags (``krproxy.kubelet``: 2 min,
4 min for RunPodSandbox, the command's or grace period's timeout added for ExecSync and
StopContainer), so krproxy is driven as kubelet drives it.

Exits non-zero on the first failure, after removing the pod it created.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pb_grpc

from krproxy import kubelet

CGROUP_ROOT = Path("/sys/fs/cgroup")


class SmokeFailure(Exception):
    pass


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """`with step("X"):` prints the step name, then its outcome and duration."""
    t0 = time.perf_counter()
    print(f"-> {name}", flush=True)
    try:
        yield
    except BaseException as exc:
        ms = (time.perf_counter() - t0) * 1000
        print(f"   {name}: FAILED: {type(exc).__name__}: {exc} ({ms:.1f} ms)", flush=True)
        raise
    ms = (time.perf_counter() - t0) * 1000
    print(f"   {name}: ok ({ms:.1f} ms)", flush=True)


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise SmokeFailure(msg)


def v1_mounts() -> dict[str, Path]:
    """Map each cgroup v1 controller (and name=...) to its mount point."""
    result: dict[str, Path] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, post = line.split(" - ", 1)
            fstype, _src, superopts = post.split()[:3]
            if fstype != "cgroup":
                continue
            mountpoint = Path(pre.split()[4])
            for opt in superopts.split(","):
                if opt in ("rw", "ro") or opt.startswith("release_agent"):
                    continue
                result.setdefault(opt, mountpoint)
    return result


def container_cgroups(rt: Any, cid: str) -> dict[str, str]:
    """controller -> cgroup path of the container, read from inside it.

    On cgroup v1 containerd does not give containers a cgroup namespace, so
    /proc/self/cgroup inside shows host paths.
    """
    r = rt.ExecSync(
        pb.ExecSyncRequest(container_id=cid, cmd=["cat", "/proc/self/cgroup"], timeout=10),
        timeout=kubelet.exec_sync_timeout(10),
    )
    check(r.exit_code == 0, f"cat /proc/self/cgroup failed: {r.stderr!r}")
    out: dict[str, str] = {}
    for line in r.stdout.decode().splitlines():
        _hid, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else ["unified"]:
            out[c] = path
    return out


def read_cg(mounts: dict[str, Path], cg: dict[str, str], controller: str, name: str) -> str:
    path = mounts[controller] / cg[controller].lstrip("/") / name
    return path.read_text().strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.environ.get("KRPROXY_CONTAINERD_DIR", "/tmp/krproxy-containerd"))
    args = ap.parse_args()
    state = json.loads((Path(args.dir) / "sandbox.json").read_text())
    channel = grpc.insecure_channel(state["endpoint"])
    rt: Any = pb_grpc.RuntimeServiceStub(channel)  # type: ignore[no-untyped-call]
    img: Any = pb_grpc.ImageServiceStub(channel)  # type: ignore[no-untyped-call]

    uid = uuid.uuid4().hex[:12]
    parent = f"/{state['cgroup_parent']}/pod-{uid}"
    pod_id = cid = None
    try:
        with step("Version"):
            v = rt.Version(pb.VersionRequest(), timeout=kubelet.RUNTIME_REQUEST_TIMEOUT)
            print(f"   runtime {v.runtime_name} {v.runtime_version}, api {v.runtime_api_version}")

        with step("ImageStatus busybox"):
            st = img.ImageStatus(
                pb.ImageStatusRequest(image=pb.ImageSpec(image=state["busybox_image"])),
                timeout=kubelet.RUNTIME_REQUEST_TIMEOUT,
            )
            check(st.image.id != "", "busybox image not known to the CRI")

        pod_config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name="smoke", uid=uid, namespace="krproxy-smoke", attempt=0),
            hostname="",  # host network: runc cannot set a hostname without its own UTS ns
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=parent,
                security_context=pb.LinuxSandboxSecurityContext(
                    namespace_options=pb.NamespaceOption(network=pb.NODE)
                ),
            ),
        )
        with step(f"RunPodSandbox (cgroup_parent={parent})"):
            pod_id = rt.RunPodSandbox(
                pb.RunPodSandboxRequest(config=pod_config), timeout=kubelet.RUN_POD_SANDBOX_TIMEOUT
            ).pod_sandbox_id
            print(f"   pod {pod_id}")

        resources = pb.LinuxContainerResources(
            cpu_period=100000,
            cpu_quota=50000,
            cpu_shares=512,
            memory_limit_in_bytes=64 * 1024 * 1024,
            cpuset_cpus="0",
        )
        ctr_config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="loop", attempt=0),
            image=pb.ImageSpec(image=state["busybox_image"]),
            command=["sh", "-c", 'trap "exit 0" TERM; while :; do sleep 1; done'],
            linux=pb.LinuxContainerConfig(resources=resources),
        )
        with step("CreateContainer"):
            cid = rt.CreateContainer(
                pb.CreateContainerRequest(
                    pod_sandbox_id=pod_id, config=ctr_config, sandbox_config=pod_config
                ),
                timeout=kubelet.RUNTIME_REQUEST_TIMEOUT,
            ).container_id
            print(f"   container {cid}")

        with step("StartContainer"):
            rt.StartContainer(
                pb.StartContainerRequest(container_id=cid), timeout=kubelet.RUNTIME_REQUEST_TIMEOUT
            )

        with step("ExecSync echo hi"):
            r = rt.ExecSync(
                pb.ExecSyncRequest(container_id=cid, cmd=["echo", "hi"], timeout=10),
                timeout=kubelet.exec_sync_timeout(10),
            )
            check(r.exit_code == 0 and r.stdout == b"hi\n", f"unexpected exec result {r}")

        with step("cgroup files match the requested resources"):
            mounts = v1_mounts()
            cg = container_cgroups(rt, cid)
            print(f"   cpu cgroup: {mounts['cpu']}{cg['cpu']}")
            check(cg["cpu"] == f"{parent}/{cid}", f"cpu cgroup {cg['cpu']} != {parent}/{cid}")
            got = {
                "cpu.cfs_quota_us": read_cg(mounts, cg, "cpu", "cpu.cfs_quota_us"),
                "cpu.cfs_period_us": read_cg(mounts, cg, "cpu", "cpu.cfs_period_us"),
                "cpu.shares": read_cg(mounts, cg, "cpu", "cpu.shares"),
                "memory.limit_in_bytes": read_cg(mounts, cg, "memory", "memory.limit_in_bytes"),
                "cpuset.cpus": read_cg(mounts, cg, "cpuset", "cpuset.cpus"),
            }
            print(f"   {got}")
            want = {
                "cpu.cfs_quota_us": "50000",
                "cpu.cfs_period_us": "100000",
                "cpu.shares": "512",
                "memory.limit_in_bytes": str(64 * 1024 * 1024),
                "cpuset.cpus": "0",
            }
            check(got == want, f"cgroup values {got} != {want}")

        with step("UpdateContainerResources cpu_quota=20000"):
            new = pb.LinuxContainerResources()
            new.CopyFrom(resources)
            new.cpu_quota = 20000
            rt.UpdateContainerResources(
                pb.UpdateContainerResourcesRequest(container_id=cid, linux=new),
                timeout=kubelet.RUNTIME_REQUEST_TIMEOUT,
            )
            q = read_cg(mounts, cg, "cpu", "cpu.cfs_quota_us")
            check(q == "20000", f"cpu.cfs_quota_us is {q} after update")

        with step("StopContainer (timeout 10s, TERM is trapped)"):
            t0 = time.monotonic()
            rt.StopContainer(
                pb.StopContainerRequest(container_id=cid, timeout=10),
                timeout=kubelet.stop_container_timeout(10),
            )
            check(time.monotonic() - t0 < 5, "StopContainer waited out its timeout")
            st = rt.ContainerStatus(
                pb.ContainerStatusRequest(container_id=cid), timeout=kubelet.RUNTIME_REQUEST_TIMEOUT
            ).status
            check(
                st.state == pb.CONTAINER_EXITED and st.exit_code == 0, f"state {st.state} exit {st.exit_code}"
            )

        with step("RemoveContainer"):
            rt.RemoveContainer(
                pb.RemoveContainerRequest(container_id=cid), timeout=kubelet.RUNTIME_REQUEST_TIMEOUT
            )
            cid = None

        with step("StopPodSandbox"):
            rt.StopPodSandbox(
                pb.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=kubelet.RUNTIME_REQUEST_TIMEOUT
            )

        with step("RemovePodSandbox"):
            rt.RemovePodSandbox(
                pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=kubelet.RUNTIME_REQUEST_TIMEOUT
            )
            pod_id = None

        left = sorted(str(p) for p in CGROUP_ROOT.glob(f"*{parent}") if p.is_dir())
        print(f"cgroup dirs left after removal (stop cleans them): {left}")
        print("SMOKE OK")
        return 0
    except (SmokeFailure, grpc.RpcError, KeyError, OSError) as exc:
        print(f"SMOKE FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        # Best-effort cleanup of whatever this run created.
        if cid:
            with contextlib.suppress(grpc.RpcError):
                rt.RemoveContainer(
                    pb.RemoveContainerRequest(container_id=cid), timeout=kubelet.RUNTIME_REQUEST_TIMEOUT
                )
        if pod_id:
            for call, req in (
                (rt.StopPodSandbox, pb.StopPodSandboxRequest),
                (rt.RemovePodSandbox, pb.RemovePodSandboxRequest),
            ):
                with contextlib.suppress(grpc.RpcError):
                    call(req(pod_sandbox_id=pod_id), timeout=kubelet.RUNTIME_REQUEST_TIMEOUT)
        channel.close()


if __name__ == "__main__":
    sys.exit(main())
