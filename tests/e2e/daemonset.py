"""A DaemonSet of deploy/ run as kubelet would run it, on the sandbox's real containerd, from the built image.

The pod gets the manifest's command, args, security context and mounts as kubelet would give them:
each hostPath moves under a directory of the test, except the runtime's own directories, which are
the sandbox's (``/run/containerd``: its CRI socket; ``/var/run/nri``: its NRI socket). The tutorial's
plugin (examples/first_plugin.py, the SDK's hook server) runs from the same image as a second pod with
the DaemonSet's plugin socket and hook directories, and must be registered with krproxy before
:func:`daemonset_pod` yields.

The image is built by scripts/build_node_image.py and imported with ``ctr images import``
(the ``node_image`` fixture of tests/e2e/conftest.py, once per e2e run).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import grpc
import pytest
import yaml
from cri_api.v1 import api_pb2 as pb

from krproxy import kubelet
from tests.e2e.support import REPO, TIMEOUT, Containerd, Cri, wait_until
from tests.integration.support import LIVENESS_LIMIT

sys.path.insert(0, str(REPO / "scripts"))
import build_node_image

TUTORIAL = REPO / "docs" / "plugin-authoring.md"
#: What the sandbox's own images are imported with (scripts/_sandbox/start.py).
IMPORT = ["images", "import", "--snapshotter", "overlayfs"]


def sandbox_paths(containerd: Containerd) -> dict[str, Path]:
    """The node's runtime directories that a DaemonSet mounts, as the sandbox has them."""
    run = Path(containerd.dir)
    nri = run / "run" / "nri"  # containerd's NRI socket dir, in the sandbox's own /run
    return {"/run/containerd": run, "/var/run/containerd": run, "/var/run/nri": nri, "/run/nri": nri}


@attrs.frozen
class Manifest:
    """One DaemonSet of deploy/: its pod spec and its one container."""

    path: Path

    @property
    def document(self) -> dict[str, Any]:
        document: dict[str, Any] = yaml.safe_load(self.path.read_text())
        return document

    @property
    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.document["spec"]["template"]["spec"]
        return spec

    @property
    def labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.document["spec"]["template"]["metadata"]["labels"]
        return labels

    @property
    def container(self) -> dict[str, Any]:
        (container,) = self.spec["containers"]
        return dict(container)

    @property
    def image(self) -> str:
        return str(self.container["image"])

    def arg(self, flag: str) -> str:
        """The value of ``--flag=VALUE`` in the container's args."""
        found = [a.split("=", 1)[1] for a in self.container["args"] if a.startswith(f"{flag}=")]
        assert found, f"{self.path.name}: no {flag}= in the container's args"
        return str(found[0])


def tutorial_socket() -> str:
    """The plugin socket the tutorial runs its plugin on (its ``--socket``)."""
    found = re.search(r"first_plugin\.py --socket (\S+)", TUTORIAL.read_text())
    assert found, f"no `first_plugin.py --socket PATH` command in {TUTORIAL}"
    return found.group(1)


#: The image's tarball built once for every row by scripts/e2e-matrix (built here when unset).
PREBUILT = "KRPROXY_E2E_NODE_IMAGE"


def import_image(containerd: Containerd, out: Path, name: str) -> str:
    """Build the DaemonSets' image at ``out`` and import it into the sandbox's containerd (skips where it
    cannot be built here); its name. Where ``$KRPROXY_E2E_NODE_IMAGE`` names a tarball
    scripts/build_node_image.py built (with its default name), that one is imported instead."""
    prebuilt = os.environ.get(PREBUILT, "")
    if prebuilt:
        assert name == build_node_image.IMAGE_NAME, (
            f"${PREBUILT} is {build_node_image.IMAGE_NAME}, not {name}"
        )
        out = Path(prebuilt)
    else:
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
    """Host paths of the manifest's volumes, under ``root`` (the sandbox's for the runtime's directories)."""

    def __init__(self, root: Path, containerd: Containerd, volumes: list[dict[str, Any]]) -> None:
        self.paths: dict[str, Path] = {}
        runtime = sandbox_paths(containerd)
        for volume in volumes:
            if "hostPath" in volume:
                path, kind = volume["hostPath"]["path"], volume["hostPath"].get("type", "")
                if path in runtime:
                    assert runtime[path].is_dir(), f"volume {volume['name']}: the sandbox has no {path}"
                    self.paths[volume["name"]] = runtime[path]
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


def log_of(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@attrs.frozen
class Running:
    """krproxy's pod of a DaemonSet, running with the tutorial's plugin registered."""

    manifest: Manifest
    node: Node
    container_id: str
    log: Path
    logs: Path

    def stop(self, direct: Cri) -> int:
        """Stop krproxy's container as kubelet would (the manifest's grace period); its exit code."""
        grace = int(self.manifest.spec["terminationGracePeriodSeconds"])
        direct.runtime.StopContainer(
            pb.StopContainerRequest(container_id=self.container_id, timeout=grace), timeout=TIMEOUT + grace
        )
        status = direct.runtime.ContainerStatus(
            pb.ContainerStatusRequest(container_id=self.container_id), timeout=TIMEOUT
        )
        return int(status.status.exit_code)


def _ready(direct: Cri, container_id: str, probe: list[str]) -> bool:
    """Whether the readiness probe, run in the container as kubelet runs it, exits 0 (a probe that times
    out, as one may on a busy machine, is a failed probe: kubelet runs it again)."""
    try:
        reply = direct.runtime.ExecSync(
            pb.ExecSyncRequest(container_id=container_id, cmd=probe, timeout=10), timeout=30
        )
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return False
        raise
    return reply.exit_code == 0


@contextlib.contextmanager
def daemonset_pod(
    manifest: Manifest, image: str, containerd: Containerd, direct: Cri, tmp: Path
) -> Iterator[Running]:
    """krproxy's pod with ``manifest``'s spec, Ready by its own probe, and the tutorial's plugin as a second
    pod, registered; both are removed afterwards."""
    spec, proxy = manifest.spec, manifest.container
    node = Node(tmp / "host", containerd, spec["volumes"])
    logs = tmp / "logs"
    plugin_socket = tutorial_socket()
    node.host_path(proxy["volumeMounts"], plugin_socket)  # the DaemonSet mounts its directory
    hook_dir = manifest.arg("--hook-dir")
    # The tutorial's plugin needs the DaemonSet's plugin socket directory and its hook directory.
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
        containerd, "krproxy", manifest.labels, logs / "krproxy", spec.get("hostNetwork", False)
    )
    plugin_config = sandbox_config(containerd, "first-plugin", {}, logs / "plugin", False)
    probe = proxy["readinessProbe"]["exec"]["command"]

    with pod(direct, proxy_config, krproxy_container) as (_, proxy_id):
        try:
            wait_until(lambda: _ready(direct, proxy_id, probe), LIVENESS_LIMIT, f"readiness probe {probe}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; krproxy:\n{log_of(proxy_log)}") from None
        with pod(direct, plugin_config, plugin_container):
            registered = f"event=plugin_registered file={hook_dir}/first-plugin.json"
            try:
                wait_until(lambda: registered in log_of(proxy_log), LIVENESS_LIMIT, f"{registered!r} logged")
            except AssertionError as exc:
                plugin_log = log_of(logs / "plugin" / "first-plugin.log")
                raise AssertionError(f"{exc}; krproxy:\n{log_of(proxy_log)}\nplugin:\n{plugin_log}") from None
            yield Running(manifest, node, proxy_id, proxy_log, logs)
