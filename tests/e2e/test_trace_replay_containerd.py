"""Record a session through krproxy against real containerd, replay it against the same containerd.

containerd lists its images, pods and containers from maps, in an order that changes from call to
call: a replay comparing lists position by position reported the same 16 images in another order as
67 differences. Here a session with several images, three pods and every list and status call is
recorded by ``krproxy serve --record`` and replayed with ``krproxy trace replay`` straight against
that containerd: an unchanged runtime must give 0 differences.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from krproxy import kubelet
from krproxy.trace.format import read_records
from tests.e2e.support import REPO, TIMEOUT, Containerd, Cri, container_config, pod_config, start_proxy

#: Images imported for this test on top of the sandbox's pause and busybox: enough that
#: containerd's map order differs between calls. One of them carries two names.
EXTRA_IMAGES = 12
PODS = 3
IMAGE_PREFIX = "krproxy.local/e2e-replay"


def _build_images_module() -> Any:
    spec = importlib.util.spec_from_file_location("build_images", REPO / "scripts" / "build_images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("build_images", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _one_file_layer(number: int) -> bytes:
    """A layer holding one small file, different per image, so every image has its own ID."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        data = f"image {number}\n".encode()
        info = tarfile.TarInfo("krproxy-e2e-image")
        info.size, info.mtime = len(data), 0
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _ctr(containerd: Containerd, *args: str) -> None:
    ctr = shutil.which(containerd.ctr)  # the ctr of the containerd version under test
    assert ctr is not None, "ctr not found (it comes with containerd: scripts/containerd-sandbox install)"
    r = subprocess.run(
        [ctr, "-a", containerd.socket, "-n", "k8s.io", *args], capture_output=True, text=True, timeout=120
    )
    assert 0 == r.returncode, f"ctr {' '.join(args)} failed: {r.stderr}"


@pytest.fixture
def extra_images(containerd: Containerd, short_tmp: Path) -> Iterator[list[str]]:
    """EXTRA_IMAGES small images (plus a second name for the first) imported into containerd."""
    build_images = _build_images_module()
    names = [f"{IMAGE_PREFIX}-{n}:v1" for n in range(EXTRA_IMAGES)] + [f"{IMAGE_PREFIX}-0:alias"]
    try:
        for n, name in enumerate(names):
            tar = short_tmp / f"image-{n}.tar"
            build_images.write_oci_tar(str(tar), name, _one_file_layer(n % EXTRA_IMAGES), cmd=["sh"])
            _ctr(containerd, "images", "import", "--snapshotter", "overlayfs", str(tar))
        yield names
    finally:
        with Cri.connect(containerd.socket) as cri:
            for name in names:
                with contextlib.suppress(grpc.RpcError):
                    cri.image.RemoveImage(
                        pb.RemoveImageRequest(image=pb.ImageSpec(image=name)), timeout=TIMEOUT
                    )


def _lists(cri: Cri) -> None:
    cri.image.ListImages(pb.ListImagesRequest(), timeout=TIMEOUT)
    cri.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=TIMEOUT)
    cri.runtime.ListContainers(pb.ListContainersRequest(), timeout=TIMEOUT)
    cri.runtime.ListContainerStats(pb.ListContainerStatsRequest(), timeout=TIMEOUT)
    with contextlib.suppress(grpc.RpcError):  # UNIMPLEMENTED by some versions: recorded as such
        cri.runtime.ListPodSandboxStats(pb.ListPodSandboxStatsRequest(), timeout=TIMEOUT)


def drive_session(cri: Cri, containerd: Containerd) -> None:
    """What kubelet does on a node, briefly: look around, run pods, poll them, take them down."""
    cri.runtime.Version(pb.VersionRequest(), timeout=TIMEOUT)
    cri.runtime.Status(pb.StatusRequest(), timeout=TIMEOUT)
    cri.image.ImageFsInfo(pb.ImageFsInfoRequest(), timeout=TIMEOUT)
    for _ in range(3):
        cri.image.ListImages(pb.ListImagesRequest(), timeout=TIMEOUT)
    cri.image.ImageStatus(
        pb.ImageStatusRequest(image=pb.ImageSpec(image=containerd.busybox)), timeout=TIMEOUT
    )
    pods: list[tuple[str, str]] = []
    for n in range(PODS):
        config = pod_config(containerd.cgroup_parent, name=f"replay{n}")
        pod = cri.runtime.RunPodSandbox(
            pb.RunPodSandboxRequest(config=config), timeout=kubelet.RUN_POD_SANDBOX_TIMEOUT
        ).pod_sandbox_id
        create = pb.CreateContainerRequest(
            pod_sandbox_id=pod, config=container_config(containerd.busybox), sandbox_config=config
        )
        container = cri.runtime.CreateContainer(create, timeout=TIMEOUT).container_id
        cri.runtime.StartContainer(pb.StartContainerRequest(container_id=container), timeout=TIMEOUT)
        pods.append((pod, container))
    _lists(cri)
    for pod, container in pods:
        cri.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod), timeout=TIMEOUT)
        cri.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=container), timeout=TIMEOUT)
    for _pod, container in pods:
        cri.runtime.StopContainer(
            pb.StopContainerRequest(container_id=container, timeout=10),
            timeout=kubelet.stop_container_timeout(10),
        )
        cri.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=container), timeout=TIMEOUT)
    _lists(cri)
    for pod, container in pods:
        cri.runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=container), timeout=TIMEOUT)
        cri.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod), timeout=TIMEOUT)
        cri.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod), timeout=TIMEOUT)
    _lists(cri)


def _image_orders(trace: Path) -> list[tuple[str, ...]]:
    result = read_records(trace.read_bytes())
    return [
        tuple(image.id for image in pb.ListImagesResponse.FromString(r.reply).images)
        for r in result.records
        if r.method == "ListImages" and r.reply is not None
    ]


def test_replay_against_the_same_containerd_finds_no_difference(
    containerd: Containerd, short_tmp: Path, extra_images: list[str]
) -> None:
    """A session recorded through krproxy replays against the containerd it was recorded on with 0 differences."""
    trace = short_tmp / "session.krt"
    proxy = start_proxy(short_tmp, containerd.socket, extra=("--record", str(trace)))
    try:
        with Cri.connect(proxy.socket) as cri:
            drive_session(cri, containerd)
    finally:
        code = proxy.terminate()
    assert 0 == code, f"krproxy exited with {code}; log:\n{proxy.log}"

    orders = _image_orders(trace)
    assert len(orders) >= 6, f"expected the session's ListImages calls in the trace, got {len(orders)}"
    assert len(orders[0]) >= EXTRA_IMAGES + 2, f"containerd listed only {len(orders[0])} images"

    replay = subprocess.run(
        [sys.executable, "-m", "krproxy", "trace", "replay", str(trace), "--target", containerd.socket],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=short_tmp,  # not the repo: `python -m` would import krproxy from the cwd first
    )
    summary = replay.stdout.strip().splitlines()[-1] if replay.stdout.strip() else ""
    print(
        f"\n{summary}\nListImages orders in the recording: {len(set(orders))} distinct of {len(orders)} calls"
    )
    assert 0 == replay.returncode, f"replay exit {replay.returncode}:\n{replay.stdout}\n{replay.stderr}"
    assert summary.startswith("OK ") and " 0 different, 0 skipped" in summary, replay.stdout
