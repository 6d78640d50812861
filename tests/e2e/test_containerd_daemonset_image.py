"""krproxy from the DaemonSet's image, run as a pod on real containerd with deploy/daemonset.yaml's spec.

The pod and the tutorial's plugin beside it are run as tests/e2e/daemonset.py says (the manifest's
command, args, security context and mounts; the plugin's pod registered with krproxy). A
CreateContainer sent to krproxy's socket in the pod must come out of containerd with the plugin's
change, and krproxy must exit 0 when kubelet stops its container.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as pb

from tests.e2e.daemonset import Manifest, daemonset_pod, log_of, pod, sandbox_config
from tests.e2e.support import REPO, TIMEOUT, Containerd, Cri, container_config, verbose_info

MANIFEST = Manifest(REPO / "deploy" / "daemonset.yaml")


def answers(socket: Path) -> bool:
    if not socket.exists():
        return False
    with Cri.connect(str(socket)) as cri:
        try:
            cri.runtime.Version(pb.VersionRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return True


def test_daemonset_image_hooks_create(
    node_image: str, containerd: Containerd, direct: Cri, short_tmp: Path
) -> None:
    """krproxy from the built image, run with daemonset.yaml's spec, hooks a CreateContainer sent to it."""
    with daemonset_pod(MANIFEST, node_image, containerd, direct, short_tmp) as running:
        # Where krproxy listens for kubelet, inside the pod and so on the host.
        endpoint = MANIFEST.arg("--koord-runtimeproxy-endpoint").removeprefix("unix://")
        proxy_socket = running.node.host_path(MANIFEST.container["volumeMounts"], endpoint)
        assert answers(proxy_socket), f"krproxy's socket {proxy_socket} does not answer Version"
        with Cri.connect(str(proxy_socket)) as via_pod:
            workload = sandbox_config(containerd, "workload", {}, running.logs / "workload", False)
            with pod(via_pod, workload, container_config(containerd.busybox)) as (_, workload_id):
                reply = direct.runtime.ContainerStatus(
                    pb.ContainerStatusRequest(container_id=workload_id, verbose=True), timeout=TIMEOUT
                )
                env = verbose_info(reply)["runtimeSpec"]["process"]["env"]
        assert f"POD_NAME={workload.metadata.name}" in env, json.dumps(env)
        code = running.stop(direct)
        assert 0 == code, f"krproxy exited {code}; log:\n{log_of(running.log)}"
