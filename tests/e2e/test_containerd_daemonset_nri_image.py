"""``krproxy nri`` from the DaemonSet's image, run as a pod on real containerd with deploy/daemonset-nri.yaml's
spec.

The pod and the tutorial's plugin beside it are run as tests/e2e/daemonset.py says; the NRI socket
directory the manifest mounts is the sandbox's own (containerd 2.x serves NRI by default,
scripts/containerd-sandbox turns it on for 1.7; 1.6 has none, and the test is skipped there). A pod
created straight at containerd, as kubelet does in NRI mode, must come out with the plugin's change
in its container's spec, and krproxy must exit 0 when kubelet stops its container.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cri_api.v1 import api_pb2 as pb

from tests.e2e.daemonset import Manifest, daemonset_pod, log_of, pod, sandbox_config, sandbox_paths
from tests.e2e.support import REPO, TIMEOUT, Containerd, Cri, container_config, verbose_info

MANIFEST = Manifest(REPO / "deploy" / "daemonset-nri.yaml")


def test_nri_daemonset_image_hooks_create(
    node_image: str, containerd: Containerd, direct: Cri, short_tmp: Path
) -> None:
    """krproxy nri from the built image, run with daemonset-nri.yaml's spec, hooks a pod made at containerd."""
    socket = MANIFEST.arg("--nri-socket").removeprefix("unix://")
    if not (sandbox_paths(containerd)[str(Path(socket).parent)] / Path(socket).name).exists():
        pytest.skip(f"containerd {containerd.version} serves no NRI socket (NRI is 1.7 and later)")
    with daemonset_pod(MANIFEST, node_image, containerd, direct, short_tmp) as running:
        workload = sandbox_config(containerd, "workload", {}, running.logs / "workload", False)
        with pod(direct, workload, container_config(containerd.busybox)) as (_, workload_id):
            reply = direct.runtime.ContainerStatus(
                pb.ContainerStatusRequest(container_id=workload_id, verbose=True), timeout=TIMEOUT
            )
            env = verbose_info(reply)["runtimeSpec"]["process"]["env"]
        assert f"POD_NAME={workload.metadata.name}" in env, f"{json.dumps(env)}\n{log_of(running.log)}"
        code = running.stop(direct)
        assert 0 == code, f"krproxy exited {code}; log:\n{log_of(running.log)}"
