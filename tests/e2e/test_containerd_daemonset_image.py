"""krproxy from the DaemonSet's image, run as a pod on real containerd with deploy/daemonset.yaml's spec.

The image is built by scripts/build_node_image.py and imported with ``ctr images import``. The
pod gets the manifest's command, args, security context and mounts as kubelet would give them
(each hostPath moved under a directory of the test, except /run/containerd, which is the sandbox's
own socket directory). The tutorial's plugin (examples/first_plugin.py, the SDK's hook server) runs
from the same image as a second pod with the plugin socket and hook directories, and a
CreateContainer sent to krproxy's socket in the pod must come out of containerd with its change.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from cri_api.v1 import api_pb2 as pb

from krproxy import kubelet
from tests.e2e.support import REPO, TIMEOUT, Containerd, Cri, container_config, verbose_info, wait_until
from tests.integration.support import LIVENESS_LIMIT

sys.path.insert(0, str(REPO / "scripts"))
import build_node_image

MANIFEST = REPO / "deploy" / "daemonset.yaml"
TUTORIAL = REPO / "docs" / "plugin-authoring.md"
#: What the sandbox's own images are imported with (scripts/_sandbox/start.py).
IMPORT = ["images", "import", "--snapshotter", "overlayfs"]


def pod_spec() -> dict[str, Any]:
    manifest = yaml.safe_load(MANIFEST.read_text())
    spec: dict[str, Any] = manifest["spec"]["template"]["spec"]
    return spec


def tutorial_socket() -> str:
    """The plugin socket the tutorial runs its plugin on (its ``--socket``)."""
    found = re.search(r"first_plugin\.py --socket (\S+)", TUTORIAL.read_text())
    assert found, f"no `first_plugin.py --socket PATH` command in {TUTORIAL}"
    return found.group(1)


@pytest.fixture(scope="module")
def image(containerd: Containerd, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The DaemonSet's image, built from this checkout and imported into the sandbox's containerd."""
    name = str(pod_spec()["containers"][0]["image"])
    out = tmp_path_factory.mktemp("image") / "krproxy-image.tar"
    try:
        build_node_image.build(out, name)
    except build_node_image.Unavailable as exc:
        pytest.skip(f"the DaemonSet's image cannot be built here: {exc}")
    imported = subprocess.run(
        [containerd.ctr, "-a", containerd.socket, "-n", "k8s.io", *IMPORT, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert 0 == imported.returncode, f"ctr images import failed: {imported.stderr}"
    return name


class Node:
    """Host paths of the manifest's volumes, under ``root`` (the sandbox's directory for containerd's)."""

    def __init__(self, root: Path, containerd: Containerd, volumes: list[dict[str, Any]]) -> None:
        self.paths: dict[str, Path] = {}
        for volume in volumes:
            if "hostPath" in volume:
                path, kind = volume["hostPath"]["path"], volume["hostPath"].get("type", "")
                if path in ("/run/containerd", "/var/run/containerd"):
                    self.paths[volume["name"]] = Path(containerd.dir)
                    continue
                host = root / path.lstrip("/")
                assert kind == "DirectoryOrCreate", (
                    f"volume {volume['name']}: hostPath type {kind!r} not handled"
                )
                host.mkdir(parents=True, exist_ok=True)
            else:
                assert "emptyDir" in volume, (
                    f"volume {volume['name']}: only hostPath and emptyDir are handled"
                )
                host = root / "emptydir" / volume["name"]
                host.mkdir(parents=True)
            self.paths[volume["name"]] = host

    def host_path(self, mounts: list[dict[str, Any]], container_path: str) -> Path:
        """Where ``container_path`` (inside a directory the container mounts) is on the host."""
        for mount in mounts:
            prefix = mount["mountPath"].rstrip("/") + "/"
            if container_path.startswith(prefix):
                return self.paths[mount["name"]] / container_path[len(prefix) :]
        raise AssertionError(f"{container_path} is in no directory the DaemonSet mounts: {mounts}")

    def mounts(self, mounts: list[dict[str, Any]]) -> list[Any]:
        return [
            pb.Mount(
                container_path=m["mountPath"],
                host_path=str(self.paths[m["name"]]),
                readonly=bool(m.get("readOnly", False)),
            )
            for m in mounts
        ]


def security_context(spec: dict[str, Any]) -> Any:
    """The CRI security context kubelet makes of a container's ``securityContext``."""
    caps = spec.get("capabilities", {})
    return pb.LinuxContainerSecurityContext(
        run_as_user=pb.Int64Value(value=spec["runAsUser"]),
        privileged=spec.get("privileged", False),
        no_new_privs=not spec.get("allowPrivilegeEscalation", True),
        readonly_rootfs=spec.get("readOnlyRootFilesystem", False),
        capabilities=pb.Capability(
            add_capabilities=caps.get("add", []), drop_capabilities=caps.get("drop", [])
        ),
    )


def sandbox_config(
    containerd: Containerd, name: str, labels: dict[str, str], logs: Path, host_network: bool
) -> Any:
    """A pod in kube-system; a pod network only where the sandbox has CNI (its own "node" network
    namespace otherwise, private to the sandbox's containerd like the pod's would be)."""
    uid = uuid.uuid4().hex[:12]
    network = pb.NODE if host_network or not containerd.state.get("cni") else pb.POD
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=f"{name}-{uid}", uid=uid, namespace="kube-system"),
        labels=labels,
        log_directory=str(logs),
        linux=pb.LinuxPodSandboxConfig(
            cgroup_parent=f"/{containerd.cgroup_parent}/pod-{uid}",
            security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=pb.NamespaceOption(network=network)
            ),
        ),
    )


@contextlib.contextmanager
def pod(cri: Cri, config: Any, container: Any) -> Iterator[tuple[str, str]]:
    """Run a pod with one container (from ``container``) on ``cri``; stop and remove it afterwards."""
    pod_id = cri.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=config), timeout=kubelet.RUN_POD_SANDBOX_TIMEOUT
    ).pod_sandbox_id
    try:
        request = pb.CreateContainerRequest(pod_sandbox_id=pod_id, config=container, sandbox_config=config)
        container_id = cri.runtime.CreateContainer(request, timeout=TIMEOUT).container_id
        cri.runtime.StartContainer(pb.StartContainerRequest(container_id=container_id), timeout=TIMEOUT)
        yield pod_id, container_id
    finally:
        with contextlib.suppress(grpc.RpcError):
            cri.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT)
        with contextlib.suppress(grpc.RpcError):
            cri.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT)


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
    image: str, containerd: Containerd, direct: Cri, short_tmp: Path
) -> None:
    """krproxy from the built image, run with daemonset.yaml's spec, hooks a CreateContainer sent to it."""
    spec = pod_spec()
    (proxy,) = spec["containers"]
    node = Node(short_tmp / "host", containerd, spec["volumes"])
    logs = short_tmp / "logs"
    labels = yaml.safe_load(MANIFEST.read_text())["spec"]["template"]["metadata"]["labels"]
    # Where krproxy listens for kubelet, inside the pod and so on the host.
    endpoint = next(
        a.split("=", 1)[1] for a in proxy["args"] if a.startswith("--koord-runtimeproxy-endpoint=")
    )
    proxy_socket = node.host_path(proxy["volumeMounts"], endpoint.removeprefix("unix://"))
    plugin_socket = tutorial_socket()
    # The tutorial's plugin needs the DaemonSet's plugin socket directory and its hook directory.
    node.host_path(proxy["volumeMounts"], plugin_socket)
    hook_dir = next(a.split("=", 1)[1] for a in proxy["args"] if a.startswith("--hook-dir="))
    plugin_mounts = [
        {**m, "readOnly": False}
        for m in proxy["volumeMounts"]
        if m["mountPath"] == hook_dir or plugin_socket.startswith(m["mountPath"].rstrip("/") + "/")
    ]

    krproxy_container = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=proxy["name"]),
        image=pb.ImageSpec(image=image),
        command=proxy["command"],
        args=proxy["args"],
        mounts=node.mounts(proxy["volumeMounts"]),
        log_path="krproxy.log",
        linux=pb.LinuxContainerConfig(security_context=security_context(proxy["securityContext"])),
    )
    plugin_container = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="first-plugin"),
        image=pb.ImageSpec(image=image),
        command=["python3", "/examples/first_plugin.py", "--socket", plugin_socket, "--hook-dir", hook_dir],
        envs=[pb.KeyValue(key="PYTHONPATH", value=f"/{build_node_image.LIB}")],
        mounts=[
            *node.mounts(plugin_mounts),
            pb.Mount(container_path="/examples", host_path=str(REPO / "examples"), readonly=True),
        ],
        log_path="first-plugin.log",
    )
    proxy_log = logs / "krproxy" / "krproxy.log"
    proxy_config = sandbox_config(
        containerd, "krproxy", labels, logs / "krproxy", spec.get("hostNetwork", False)
    )
    plugin_config = sandbox_config(containerd, "first-plugin", {}, logs / "plugin", False)

    def log_of(path: Path) -> str:
        return path.read_text(errors="replace") if path.exists() else ""

    with pod(direct, proxy_config, krproxy_container) as (_, proxy_id):
        wait_until(
            lambda: answers(proxy_socket), LIVENESS_LIMIT, f"krproxy in the pod answering on {proxy_socket}"
        )
        probe = proxy["readinessProbe"]["exec"]["command"]
        ready = direct.runtime.ExecSync(
            pb.ExecSyncRequest(container_id=proxy_id, cmd=probe, timeout=10), timeout=30
        )
        assert 0 == ready.exit_code, f"readiness probe {probe}: {ready.stdout!r} {ready.stderr!r}"
        with pod(direct, plugin_config, plugin_container):
            registered = f"event=plugin_registered file={hook_dir}/first-plugin.json"
            try:
                wait_until(lambda: registered in log_of(proxy_log), LIVENESS_LIMIT, f"{registered!r} logged")
            except AssertionError as exc:
                plugin_log = log_of(logs / "plugin" / "first-plugin.log")
                raise AssertionError(f"{exc}; krproxy:\n{log_of(proxy_log)}\nplugin:\n{plugin_log}") from None
            with Cri.connect(str(proxy_socket)) as via_pod:
                workload = sandbox_config(containerd, "workload", {}, logs / "workload", False)
                with pod(via_pod, workload, container_config(containerd.busybox)) as (_, workload_id):
                    reply = direct.runtime.ContainerStatus(
                        pb.ContainerStatusRequest(container_id=workload_id, verbose=True), timeout=TIMEOUT
                    )
                    env = verbose_info(reply)["runtimeSpec"]["process"]["env"]
        assert f"POD_NAME={workload.metadata.name}" in env, json.dumps(env)
        direct.runtime.StopContainer(
            pb.StopContainerRequest(container_id=proxy_id, timeout=spec["terminationGracePeriodSeconds"]),
            timeout=TIMEOUT + spec["terminationGracePeriodSeconds"],
        )
        status = direct.runtime.ContainerStatus(
            pb.ContainerStatusRequest(container_id=proxy_id), timeout=TIMEOUT
        )
        assert 0 == status.status.exit_code, (
            f"krproxy exited {status.status.exit_code}; log:\n{log_of(proxy_log)}"
        )
