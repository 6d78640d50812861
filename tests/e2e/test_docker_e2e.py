"""Docker mode end to end: the real ``krproxy serve --backend-runtime-mode=Docker`` in front of a real
dockerd, driven by the real docker CLI, with the fake plugin as a separate process.

dockerd runs privately: under ``unshare --mount --propagation private --net`` with a directory of
ours bind-mounted over ``/run``, data in a temp dir, the vfs storage driver, no iptables and no
bridge, and a busybox image imported from the host's busybox-static (no registry is reachable).
Skipped, with the reason, where that cannot run: not root, no ``dockerd`` (Debian's ``docker.io``;
``KRPROXY_DOCKERD`` may name the binary), no docker CLI, no ``unshare`` or busybox.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: Seconds dockerd, the proxy or the plugin may take to come up.
START_LIMIT = 30.0
CGROUP_PARENT = "/krproxy-e2e-docker/pod-web"


def _find(name: str, env: str = "") -> str | None:
    if env and os.environ.get(env):
        return os.environ[env]
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None
    )


def _wait_for(path: Path, process: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + START_LIMIT
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise AssertionError(f"{what} did not come up (exit {process.returncode}):\n{tail}")
        time.sleep(0.05)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Node:
    """dockerd, the proxy and a plugin, each a process of ours; ``docker`` runs the CLI via the proxy."""

    def __init__(self, root: Path, dockerd: str, cli: str) -> None:
        self.root, self.dockerd_bin, self.cli = root, dockerd, cli
        self.docker_sock = root / "docker.sock"
        self.proxy_sock = root / "proxy.sock"
        self.hook_dir = root / "hooks"
        self.processes: list[subprocess.Popen[bytes]] = []

    def spawn(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(self.root / log, "wb") as out:
            process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.processes.append(process)
        return process

    def start_dockerd(self) -> None:
        (self.root / "run").mkdir()
        script = self.root / "dockerd.sh"
        script.write_text(
            "set -e\n"
            f"mount -n --bind {self.root}/run /run\n"
            "ip link set lo up 2>/dev/null || true\n"
            f"exec {self.dockerd_bin} --data-root {self.root}/data --exec-root {self.root}/exec "
            f"--pidfile {self.root}/dockerd.pid -H unix://{self.docker_sock} --iptables=false "
            "--ip6tables=false --bridge=none --storage-driver=vfs --userland-proxy=false\n"
        )
        args = ["unshare", "--mount", "--propagation", "private", "--net", "sh", str(script)]
        self.dockerd = self.spawn(args, "dockerd.log")
        _wait_for(self.docker_sock, self.dockerd, "dockerd", self.root / "dockerd.log")

    def start_proxy(self) -> subprocess.Popen[bytes]:
        args = [
            sys.executable, "-m", "krproxy", "serve", "--backend-runtime-mode=Docker",
            f"--koord-runtimeproxy-endpoint={self.proxy_sock}",
            f"--remote-runtime-service-endpoint=unix://{self.docker_sock}",
            f"--hook-dir={self.hook_dir}", "--log-level=debug",
        ]  # fmt: skip
        proxy = self.spawn(args, "proxy.log")
        _wait_for(self.proxy_sock, proxy, "krproxy", self.root / "proxy.log")
        return proxy

    def start_plugin(self, *flags: str) -> None:
        socket = self.root / "plugin.sock"
        args = [
            sys.executable,
            "-m",
            "krproxy.fakes.plugin",
            f"--socket={socket}",
            f"--hook-dir={self.hook_dir}",
            *flags,
        ]
        _wait_for(socket, self.spawn(args, "plugin.log"), "fake plugin", self.root / "plugin.log")

    def docker(self, *args: str, via_proxy: bool = True, stdin: bytes = b"") -> str:
        host = self.proxy_sock if via_proxy else self.docker_sock
        done = subprocess.run(
            [self.cli, "-H", f"unix://{host}", *args],
            input=stdin,
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert 0 == done.returncode, done.stderr.decode(errors="replace")
        return done.stdout.decode()

    def inspect(self, ident: str) -> dict[str, object]:
        document: list[dict[str, object]] = json.loads(self.docker("inspect", ident, via_proxy=False))
        return document[0]

    def stop(self) -> None:
        for process in reversed(self.processes):
            _stop(process)


@pytest.fixture
def node() -> Iterator[Node]:
    if os.geteuid() != 0:
        pytest.skip(f"Docker e2e needs root to run dockerd (running as uid {os.geteuid()})")
    dockerd = _find("dockerd", "KRPROXY_DOCKERD")
    if dockerd is None:
        pytest.skip("no dockerd: install Debian's docker.io (or set KRPROXY_DOCKERD to a dockerd binary)")
    cli = _find("docker")
    if cli is None:
        pytest.skip("no docker CLI to drive the proxy with")
    for tool in ("unshare", "busybox"):
        if _find(tool) is None:
            pytest.skip(f"Docker e2e needs {tool} (util-linux, busybox-static)")
    root = Path(tempfile.mkdtemp(prefix="kpdk-", dir="/tmp"))
    node = Node(root, dockerd, cli)
    try:
        node.start_dockerd()
        rootfs = root / "rootfs" / "bin"
        rootfs.mkdir(parents=True)
        shutil.copy(_find("busybox") or "", rootfs / "busybox")
        for applet in ("sh", "cat", "sleep", "echo"):
            (rootfs / applet).symlink_to("busybox")
        with tarfile.open(root / "busybox.tar", "w") as tar:
            tar.add(root / "rootfs", arcname=".")
        node.docker("import", str(root / "busybox.tar"), "krproxy-e2e/busybox:1", via_proxy=False)
        yield node
    finally:
        node.stop()
        shutil.rmtree(root, ignore_errors=True)


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("docker", timeout=60)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(str(self.socket_path))


def post(path: Path, target: str, body: bytes) -> tuple[int, bytes]:
    """A raw POST to the Docker API on the socket *path*: the answer's status and body."""
    connection = _UnixHTTP(path)
    try:
        connection.request("POST", target, body=body, headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def create_pod(node: Node) -> tuple[str, str]:
    """The sandbox and an app container, created through the proxy the way dockershim names them."""
    common = ["--network", "none", "--cgroup-parent", CGROUP_PARENT]
    sandbox = node.docker(
        "create", "--name", "k8s_POD_web_prod_uid-web_0", *common,
        "--label", "io.kubernetes.docker.type=podsandbox", "--label", "app=web",
        "--label", "annotation.kubernetes.io/config.source=api",
        "krproxy-e2e/busybox:1", "sleep", "1000",
    ).strip()  # fmt: skip
    container = node.docker(
        "create", "--name", "k8s_app_web_prod_uid-web_0", *common, "-i", "--cpu-shares", "512",
        "-e", "MODE=a", "--label", "io.kubernetes.docker.type=container",
        "--label", f"io.kubernetes.sandbox.id={sandbox}",
        "krproxy-e2e/busybox:1", "sleep", "1000",
    ).strip()  # fmt: skip
    return sandbox, container


class TestDockerMode:
    def test_pod_lifecycle_with_hooks_and_exec(self, node: Node) -> None:
        """Through the proxy, the real docker CLI creates, starts, execs into, reads logs of, stops and
        removes containers; the plugin's answers are in what dockerd created."""
        node.start_plugin("--set-cpu-quota=50000", "--add-annotation=e2e=yes", "--log-level=DEBUG")
        node.start_proxy()
        sandbox, container = create_pod(node)
        host_config = node.inspect(container)["HostConfig"]
        assert isinstance(host_config, dict)
        assert (50000, 512, CGROUP_PARENT) == (
            host_config["CpuQuota"],
            host_config["CpuShares"],
            host_config["CgroupParent"],
        )
        config = node.inspect(container)["Config"]
        assert isinstance(config, dict) and "yes" == config["Labels"]["annotation.e2e"]
        node.docker("start", sandbox)
        node.docker("start", container)
        assert "hello from exec\n" == node.docker("exec", "-i", container, "cat", stdin=b"hello from exec\n")
        node.docker("exec", container, "sh", "-c", "echo logged > /proc/1/fd/1")
        assert "logged" in node.docker("logs", container)
        node.docker("stop", "-t", "1", container)
        node.docker("stop", "-t", "1", sandbox)
        node.docker("rm", container, sandbox)
        log = (node.root / "plugin.log").read_text(errors="replace")
        for hook in (
            "PreRunPodSandbox",
            "PreCreateContainer",
            "PreStartContainer",
            "PostStopContainer",
            "PostStopPodSandbox",
        ):
            assert hook in log

    def test_restart_recovers_the_store(self, node: Node) -> None:
        """A proxy restarted while the pod exists recovers it from dockerd."""
        proxy = node.start_proxy()
        create_pod(node)
        _stop(proxy)
        node.processes.remove(proxy)
        node.start_proxy()
        deadline = time.monotonic() + START_LIMIT
        while "store_recovered" not in (log := (node.root / "proxy.log").read_text(errors="replace")):
            assert time.monotonic() < deadline, log[-2000:]
            time.sleep(0.05)
        assert "pods=1 containers=1" in log


#: Create bodies that dockerd's Go decoder reads merged: a key sent twice (an object's fields, a map's
#: entries), a field under two spellings.
MERGED_BODIES = {
    "key twice": b'"HostConfig":{"Memory":67108864,"CpuShares":2},"HostConfig":{"CpuShares":3}',
    "map twice": b'"Labels":{"a":"1"},"Labels":{"b":"2"}',
    "two spellings": b'"HostConfig":{"CpuShares":5},"hostconfig":{"Memory":67108864}',
}


class TestJsonReading:
    def test_bodies_dockerd_merges_are_refused(self, node: Node) -> None:
        """Straight to dockerd 20.10, a key sent twice and a field under two spellings are read merged
        (Go decodes a later value into the earlier one), and ``HoſtConfig`` (U+017F) is HostConfig.
        Python's JSON keeps the last value alone, so through krproxy the merged ones get 400 and nothing
        is created; ``HoſtConfig`` is read as dockerd reads it, and a plugin's change joins its shares."""
        image = b'{"Image":"krproxy-e2e/busybox:1","Cmd":["sleep","1000"],'
        direct: dict[str, Any] = {}
        for n, (case, fields) in enumerate(MERGED_BODIES.items()):
            status, answer = post(
                node.docker_sock, f"/containers/create?name=direct-{n}", image + fields + b"}"
            )
            assert 201 == status, (case, answer)
            direct[case] = node.inspect(json.loads(answer)["Id"])
        assert (67108864, 3) == (
            direct["key twice"]["HostConfig"]["Memory"],
            direct["key twice"]["HostConfig"]["CpuShares"],
        )
        assert {"a": "1", "b": "2"} == direct["map twice"]["Config"]["Labels"]
        assert (67108864, 5) == (
            direct["two spellings"]["HostConfig"]["Memory"],
            direct["two spellings"]["HostConfig"]["CpuShares"],
        )

        node.start_plugin("--set-cpu-quota=50000")
        node.start_proxy()
        labels = b'"Labels":{"io.kubernetes.docker.type":"container"}'
        for n, (case, fields) in enumerate(MERGED_BODIES.items()):
            name = f"k8s_app{n}_web_prod_uid-web_0"
            body = image + (fields if case == "map twice" else labels + b"," + fields) + b"}"
            status, answer = post(node.proxy_sock, f"/containers/create?name={name}", body)
            assert 400 == status, (case, answer)
            assert b"send" in answer, answer
            assert name not in node.docker("ps", "-a", "--format", "{{.Names}}", via_proxy=False)
        folded = image + labels + ',"Ho\u017ftConfig":{"CpuShares":7}}'.encode()
        status, answer = post(node.proxy_sock, "/containers/create?name=k8s_appf_web_prod_uid-web_0", folded)
        assert 201 == status, answer
        host_config = node.inspect(json.loads(answer)["Id"])["HostConfig"]
        assert isinstance(host_config, dict)
        assert (7, 50000) == (host_config["CpuShares"], host_config["CpuQuota"])


#: Request-targets that dockerd 20.10 routes to create although krproxy's regex did not: gorilla/mux reads
#: the version as ``[0-9.]+`` (``1.41.0`` compares equal to 1.41) and matches the percent-decoded path.
CREATE_TARGETS = ("/v1.41.0/containers/create", "/v1.41./containers/create", "/containers/%63reate")
APP_BODY = b'{"Image":"krproxy-e2e/busybox:1","Cmd":["sleep","1000"],"Labels":{"io.kubernetes.docker.type":"container"}'


def _created(answer: bytes) -> str:
    ident: str = json.loads(answer)["Id"]
    return ident


class TestPathReading:
    def test_create_paths_dockerd_routes_are_hooked(self, node: Node) -> None:
        """``/v1.41.0/``, ``/v1.41./`` and ``/containers/%63reate`` create a container straight on dockerd
        20.10; through krproxy they run PreCreateContainer (the plugin's cpu quota is in it)."""
        for n, target in enumerate(CREATE_TARGETS):
            status, answer = post(node.docker_sock, f"{target}?name=direct-{n}", APP_BODY + b"}")
            assert 201 == status, (target, answer)
        node.start_plugin("--set-cpu-quota=50000")
        node.start_proxy()
        for n, target in enumerate(CREATE_TARGETS):
            status, answer = post(
                node.proxy_sock, f"{target}?name=k8s_p{n}_web_prod_uid-web_0", APP_BODY + b"}"
            )
            assert 201 == status, (target, answer)
            host_config = node.inspect(_created(answer))["HostConfig"]
            assert isinstance(host_config, dict) and 50000 == host_config["CpuQuota"], target

    def test_start_with_a_host_config_is_refused(self, node: Node) -> None:
        """Straight, ``/v1.23/containers/{id}/start`` with a HostConfig body sets the container's memory
        (API < 1.24); no hook sees it, so through krproxy it gets 400 and the container keeps its own."""
        start_body = b'{"Memory":67108864}'
        status, answer = post(node.docker_sock, "/containers/create?name=direct", APP_BODY + b"}")
        assert 201 == status, answer
        ident = _created(answer)
        assert (204, b"") == post(node.docker_sock, f"/v1.23/containers/{ident}/start", start_body)
        host_config = node.inspect(ident)["HostConfig"]
        assert isinstance(host_config, dict) and 67108864 == host_config["Memory"]
        node.start_plugin()
        node.start_proxy()
        status, answer = post(
            node.proxy_sock, "/containers/create?name=k8s_s_web_prod_uid-web_0", APP_BODY + b"}"
        )
        assert 201 == status, answer
        ident = _created(answer)
        status, answer = post(node.proxy_sock, f"/v1.23/containers/{ident}/start", start_body)
        assert 400 == status, answer
        host_config = node.inspect(ident)["HostConfig"]
        assert isinstance(host_config, dict) and 0 == host_config["Memory"]

    def test_top_level_host_config_fields_are_refused(self, node: Node) -> None:
        """Straight, a create body's top-level ``CgroupParent`` and ``Memory`` are HostConfig's to dockerd
        (its ContainerConfigWrapper embeds HostConfig); hooks read HostConfig alone, so krproxy refuses."""
        fields = b',"CgroupParent":"/krp-top","Memory":67108864}'
        status, answer = post(node.docker_sock, "/containers/create?name=direct", APP_BODY + fields)
        assert 201 == status, answer
        host_config = node.inspect(_created(answer))["HostConfig"]
        assert isinstance(host_config, dict)
        assert ("/krp-top", 67108864) == (host_config["CgroupParent"], host_config["Memory"])
        node.start_plugin("--set-cpu-quota=50000")
        node.start_proxy()
        name = "k8s_t_web_prod_uid-web_0"
        status, answer = post(node.proxy_sock, f"/containers/create?name={name}", APP_BODY + fields)
        assert 400 == status, answer
        assert b"HostConfig" in answer, answer
        assert name not in node.docker("ps", "-a", "--format", "{{.Names}}", via_proxy=False)

    def test_start_by_name_is_hooked(self, node: Node) -> None:
        """dockerd starts a container by its name as well as by id; through krproxy a start by name runs
        PreStartContainer for the stored container, as a start by id does."""
        node.start_plugin("--log-level=DEBUG")
        node.start_proxy()
        names = ("k8s_n0_web_prod_uid-web_0", "k8s_n1_web_prod_uid-web_0")
        for name in names:
            status, answer = post(node.proxy_sock, f"/containers/create?name={name}", APP_BODY + b"}")
            assert 201 == status, answer
        ident = node.inspect(names[1])["Id"]
        for reference in (names[0], ident):
            status, answer = post(node.proxy_sock, f"/containers/{reference}/start", b"")
            assert 204 == status, (reference, answer)
        log = (node.root / "plugin.log").read_text(errors="replace")
        assert 2 == log.count("hook=PreStartContainer "), log[-2000:]

    def test_restart_is_hooked_as_a_start(self, node: Node) -> None:
        """dockerd's restart starts a container again (a running one stopped first): through krproxy it runs
        PreStartContainer and PostStartContainer for the stored container, as a start does, and the container
        keeps its entry (a second restart is hooked too)."""
        node.start_plugin("--log-level=DEBUG")
        node.start_proxy()
        name = "k8s_r_web_prod_uid-web_0"
        status, answer = post(node.proxy_sock, f"/containers/create?name={name}", APP_BODY + b"}")
        assert 201 == status, answer
        for target in (
            f"/containers/{name}/start",
            f"/containers/{name}/restart?t=0",
            f"/v1.41/containers/{name}/restart",
        ):
            status, answer = post(node.proxy_sock, target, b"")
            assert 204 == status, (target, answer)
        log = (node.root / "plugin.log").read_text(errors="replace")
        assert (3, 3) == (log.count("hook=PreStartContainer "), log.count("hook=PostStartContainer ")), log[
            -2000:
        ]
        assert (
            "true" == node.docker("inspect", "--format", "{{.State.Running}}", name, via_proxy=False).strip()
        )

    def test_a_stopped_container_is_hooked_when_started_again(self, node: Node) -> None:
        """A container stopped through krproxy and then restarted (or started) runs again in dockerd: each
        start runs PreStartContainer and PostStartContainer for it, as its first start did."""
        node.start_plugin("--log-level=DEBUG")
        node.start_proxy()
        name = "k8s_s_web_prod_uid-web_0"
        status, answer = post(node.proxy_sock, f"/containers/create?name={name}", APP_BODY + b"}")
        assert 201 == status, answer
        for target in ("start", "stop?t=0", "restart?t=0", "stop?t=0", "start"):
            status, answer = post(node.proxy_sock, f"/containers/{name}/{target}", b"")
            assert 204 == status, (target, answer)
        log = (node.root / "plugin.log").read_text(errors="replace")
        counts = [
            log.count(f"hook={hook} ")
            for hook in ("PreStartContainer", "PostStartContainer", "PostStopContainer")
        ]
        assert [3, 3, 2] == counts, log[-2000:]
        assert (
            "true" == node.docker("inspect", "--format", "{{.State.Running}}", name, via_proxy=False).strip()
        )

    def test_a_reference_with_a_slash_is_routed(self, node: Node) -> None:
        """dockerd's start route takes any reference, ``/`` included (``{name:.*}``: a legacy link's alias
        ``web/db`` is a name): straight and through krproxy, a start of ``nosuch/name`` (sent as
        ``nosuch%2Fname`` or as two segments) is dockerd's 404 for that very reference."""
        node.start_proxy()
        for target in ("/containers/nosuch%2Fname/start", "/containers/nosuch/name/start"):
            for sock in (node.docker_sock, node.proxy_sock):
                status, answer = post(sock, target, b"")
                assert (404, True) == (status, b"nosuch/name" in answer), (sock, target, answer)
