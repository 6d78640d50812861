"""Helpers for end-to-end tests: the containerd sandbox, the ``krproxy serve`` daemon, a CRI client.

The fixtures that use them live in conftest.py. Everything here is blocking (grpcio and
subprocesses); e2e tests are plain sync tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import grpc
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pb_grpc
from google.protobuf.message import Message

from krproxy import kubelet

REPO = Path(__file__).resolve().parents[2]
SANDBOX_SCRIPT = REPO / "scripts" / "containerd-sandbox"
#: A container loop that exits at once on SIGTERM (the shell runs the trap while ``wait`` waits).
LOOP = ["sh", "-c", "while :; do sleep 1 & wait $!; done"]

#: The deadline of a CRI call in the tests: kubelet's (krproxy/kubelet.py), not a shortened one.
TIMEOUT = kubelet.RUNTIME_REQUEST_TIMEOUT


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/containerd-sandbox ARGS``; never raises on a non-zero exit."""
    return subprocess.run(
        [sys.executable, str(SANDBOX_SCRIPT), *args], capture_output=True, text=True, timeout=600
    )


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (PID 1 here reaps orphans slowly)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_until(predicate: Callable[[], bool], limit: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until it holds; fail after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached after {limit}s")
        time.sleep(0.02)


@attrs.define
class Containerd:
    """A private containerd started by ``scripts/containerd-sandbox`` in ``dir``."""

    dir: Path
    cgroup_parent: str
    #: Where the containerd, shim and ctr to run are (``containerd-sandbox fetch``); "" for PATH.
    bin_dir: str = ""
    #: TOML files the next :meth:`start` puts into the config's ``imports`` (merged over it).
    config_imports: list[str] = attrs.field(factory=list)

    @property
    def state(self) -> dict[str, Any]:
        """sandbox.json as written by the last ``start`` (it changes when containerd restarts)."""
        state: dict[str, Any] = json.loads((self.dir / "sandbox.json").read_text())
        return state

    @property
    def socket(self) -> str:
        return str(self.dir / "containerd.sock")

    @property
    def busybox(self) -> str:
        return str(self.state["busybox_image"])

    @property
    def pull_image(self) -> str:
        """An image only the sandbox's registry has: CRI PullImage of it downloads (busybox, Env KRPROXY_PULLED=yes)."""
        return str(self.state["pull_image"])

    @property
    def version(self) -> str:
        """The version containerd reports (``1.6.20~ds1``, ``2.1.9+unknown``...)."""
        return str(self.state["containerd_version"])

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    @property
    def release(self) -> tuple[int, int]:
        """Major and minor version: ``(2, 1)`` for ``2.1.9+unknown``."""
        major, minor = self.version.split(".")[:2]
        return int(major), int(minor)

    @property
    def ctr(self) -> str:
        """The ``ctr`` of this containerd."""
        return os.path.join(self.bin_dir, "ctr") if self.bin_dir else "ctr"

    def start(self) -> None:
        r = run_script(
            *("start", "--dir", str(self.dir), "--cgroup-parent", self.cgroup_parent),
            *(("--bin-dir", self.bin_dir) if self.bin_dir else ()),
            *(arg for path in self.config_imports for arg in ("--config-import", path)),
        )
        assert 0 == r.returncode, f"containerd-sandbox start failed:\n{r.stderr}"

    def stop(self) -> None:
        r = run_script("stop", "--dir", str(self.dir))
        assert 0 == r.returncode, f"containerd-sandbox stop failed:\n{r.stderr}"

    def crash(self) -> None:
        """SIGKILL containerd (by the PID in sandbox.json) and wait until it is gone."""
        pid = self.state["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not alive(pid), what=f"containerd {pid} gone")


@attrs.define
class Proxy:
    """A ``krproxy serve`` subprocess listening on ``socket``; its stderr goes to ``log_path``."""

    process: subprocess.Popen[bytes]
    socket: str
    log_path: Path
    #: How it was started (for :meth:`restart`); the hook dir is ``workdir / "hooks"``.
    workdir: Path | None = None
    backend: str = ""
    grace_period: float = 10
    #: Logs of the daemons this one replaced (see :meth:`restart`), oldest first.
    previous_logs: list[Path] = attrs.field(factory=list)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def hook_dir(self) -> Path:
        assert self.workdir is not None, "proxy not started by start_proxy"
        return self.workdir / "hooks"

    def restart(self) -> int:
        """SIGTERM the daemon, then start a new one on the same socket, backend and hook dir.

        Returns the old daemon's exit code; from then on this object stands for the new daemon
        (its log goes to a new file, the old one is kept in :attr:`previous_logs`).
        """
        assert self.workdir is not None, "proxy not started by start_proxy"
        code = self.terminate()
        log_name = f"krproxy-{len(self.previous_logs) + 2}.log"
        new = start_proxy(self.workdir, self.backend, self.grace_period, log_name=log_name)
        self.previous_logs.append(self.log_path)
        self.process, self.log_path = new.process, new.log_path
        return code

    def terminate(self, limit: float = 30) -> int:
        """SIGTERM the daemon and return its exit code (SIGKILL and fail if it hangs)."""
        return sigterm(self.process, limit, lambda: f"krproxy ignored SIGTERM for {limit}s; log:\n{self.log}")


def sigterm(process: subprocess.Popen[bytes], limit: float, hung: Callable[[], str]) -> int:
    """SIGTERM ``process`` (by PID) unless it has exited, and return its exit code; if it is still
    running after ``limit`` seconds, SIGKILL it and fail with ``hung()``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(limit)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError(hung()) from None


def start_proxy(
    workdir: Path,
    backend: str,
    grace_period: float = 10,
    limit: float = 30,
    log_name: str = "krproxy.log",
    extra: tuple[str, ...] = (),
) -> Proxy:
    """Start ``krproxy serve ... EXTRA`` in front of ``backend``; return once the socket answers Version."""
    socket = str(workdir / "proxy.sock")
    (workdir / "hooks").mkdir(exist_ok=True)
    log_path = workdir / log_name
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "krproxy", "serve"),
                *("--koord-runtimeproxy-endpoint", socket, "--remote-runtime-service-endpoint", backend),
                *("--hook-dir", str(workdir / "hooks"), "--grace-period", str(grace_period)),
                *extra,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=workdir,  # not the repo: `python -m` would import krproxy from the cwd first
        )
    proxy = Proxy(process, socket, log_path, workdir, backend, grace_period)
    deadline = time.monotonic() + limit
    # Connect only once the socket exists: grpcio backs off ~1 s after a failed connection.
    wait_until(lambda: os.path.exists(socket) or process.poll() is not None, limit, "proxy socket")
    with Cri.connect(socket) as cri:
        while True:
            if process.poll() is not None:
                raise AssertionError(f"krproxy exited with {process.returncode}; log:\n{proxy.log}")
            with contextlib.suppress(grpc.RpcError):
                cri.runtime.Version(pb.VersionRequest(), timeout=1)
                return proxy
            if time.monotonic() > deadline:
                proxy.terminate()
                raise AssertionError(f"krproxy not answering after {limit}s; log:\n{proxy.log}")
            time.sleep(0.05)


@contextlib.contextmanager
def serving_proxy(workdir: Path, backend: str, extra: tuple[str, ...] = ()) -> Iterator[Proxy]:
    """:func:`start_proxy` for a fixture: terminated at the end, which must exit 0."""
    daemon = start_proxy(workdir, backend, extra=extra)
    try:
        yield daemon
    finally:
        code = daemon.terminate()
    assert 0 == code, f"krproxy exited with {code}; log:\n{daemon.log}"


@attrs.define
class Cri:
    """grpcio stubs for one CRI socket, plus raw-bytes access to any method path."""

    channel: grpc.Channel
    runtime: Any
    image: Any

    @classmethod
    @contextlib.contextmanager
    def connect(cls, socket: str) -> Iterator[Cri]:
        channel = grpc.insecure_channel(f"unix://{socket}", options=[("grpc.enable_retries", 0)])
        try:
            yield cls(channel, pb_grpc.RuntimeServiceStub(channel), pb_grpc.ImageServiceStub(channel))
        finally:
            channel.close()

    def raw(self, path: str, request: bytes) -> bytes:
        """Call ``path`` with serialized ``request``; return the serialized reply."""
        call = self.channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        reply: bytes = call(request, timeout=TIMEOUT)
        return reply


def outcome(fn: Callable[[], Any]) -> Any:
    """What a call gave: its result, or ``(code, details)`` if it failed."""
    try:
        return fn()
    except grpc.RpcError as err:
        return (err.code(), err.details())


# --------------------------------------------------------------------------- pods


def pod_config(cgroup_parent: str, name: str = "e2e") -> Any:
    """A host-network pod whose cgroups go under ``/<cgroup_parent>/pod-<uid>`` (removed by ``stop``)."""
    uid = uuid.uuid4().hex[:12]
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=f"{name}-{uid}", uid=uid, namespace="krproxy-e2e"),
        hostname="",  # runc cannot set a hostname without a private UTS namespace
        linux=pb.LinuxPodSandboxConfig(
            cgroup_parent=f"/{cgroup_parent}/pod-{uid}",
            security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=pb.NamespaceOption(network=pb.NODE)
            ),
        ),
    )


def container_config(image: str, name: str = "loop") -> Any:
    return pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name), image=pb.ImageSpec(image=image), command=LOOP
    )


@attrs.frozen
class Pod:
    """A running pod with one running container."""

    id: str
    config: Any
    container_id: str


@contextlib.contextmanager
def running_pod(cri: Cri, containerd: Containerd) -> Iterator[Pod]:
    """Run a pod with one looping container through ``cri``; remove both afterwards."""
    config = pod_config(containerd.cgroup_parent)
    request = pb.RunPodSandboxRequest(config=config)
    pod_id = cri.runtime.RunPodSandbox(request, timeout=kubelet.RUN_POD_SANDBOX_TIMEOUT).pod_sandbox_id
    try:
        request = pb.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=container_config(containerd.busybox), sandbox_config=config
        )
        container_id = cri.runtime.CreateContainer(request, timeout=TIMEOUT).container_id
        cri.runtime.StartContainer(pb.StartContainerRequest(container_id=container_id), timeout=TIMEOUT)
        yield Pod(pod_id, config, container_id)
    finally:
        with contextlib.suppress(grpc.RpcError):
            cri.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT)
        with contextlib.suppress(grpc.RpcError):
            cri.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT)


# --------------------------------------------------------------------------- comparing replies

#: Fields that legitimately differ between two calls a few ms apart: sample times and the
#: usage figures of a live container (its loop forks ``sleep`` every second).
VOLATILE = frozenset({"timestamp", "cpu", "memory", "swap", "network", "process"})


def normalised(message: Message, volatile: frozenset[str] = frozenset()) -> Message:
    """A copy of ``message`` with ``volatile`` fields cleared and repeated messages sorted.

    containerd lists pods, containers and images in map order, which differs between calls.
    """
    copy = type(message)()
    copy.CopyFrom(message)
    _normalise(copy, volatile)
    return copy


def _normalise(message: Message, volatile: frozenset[str]) -> None:
    for field, value in message.ListFields():
        if field.name in volatile:
            message.ClearField(field.name)
        elif field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        elif field.is_repeated:
            for item in value:
                _normalise(item, volatile)
            ordered = sorted(item.SerializeToString(deterministic=True) for item in value)
            del value[:]
            for data in ordered:
                value.add().ParseFromString(data)
        else:
            _normalise(value, volatile)


# --------------------------------------------------------------------------- hook plugins


def wait_registered(proxy: Proxy, name: str, limit: float = 10.0) -> None:
    """Wait until the proxy logged that it loaded ``<hook dir>/<name>.json``."""
    line = f"event=plugin_registered file={proxy.hook_dir / name}.json "
    wait_until(lambda: line in proxy.log, limit, f"proxy registered plugin {name}")


@attrs.define
class Plugin:
    """A ``tests/e2e/plugin_process.py`` subprocess; each hook call it got is a line in ``calls_path``."""

    name: str
    process: subprocess.Popen[bytes]
    socket: str
    calls_path: Path
    log_path: Path
    #: One JSON line per request the plugin's (grpc-go-strict) server accepted: path, grpc-timeout.
    headers_path: Path | None = None

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def grpc_timeouts(self) -> list[str]:
        """The ``grpc-timeout`` header of every request accepted so far, as sent."""
        if self.headers_path is None or not self.headers_path.exists():
            return []
        lines = self.headers_path.read_text().splitlines()
        return [str(json.loads(line)["grpc-timeout"]) for line in lines if line.strip()]

    def calls(self, hook: str | None = None) -> list[dict[str, Any]]:
        """The calls received so far (``{"hook": ..., "request": {...}}``), only ``hook``'s if given."""
        if not self.calls_path.exists():
            return []
        lines = self.calls_path.read_text().splitlines()
        calls = [json.loads(line) for line in lines if line.strip()]
        return [c for c in calls if hook is None or c["hook"] == hook]

    def requests(self, hook: str) -> list[dict[str, Any]]:
        return [c["request"] for c in self.calls(hook)]

    def hooks_called(self) -> list[str]:
        return [c["hook"] for c in self.calls()]

    def forget(self) -> None:
        """Drop the calls recorded so far."""
        self.calls_path.write_text("")

    def stop(self, limit: float = 10) -> int:
        """SIGTERM the plugin (by PID) and return its exit code; SIGKILL and fail if it hangs."""
        return sigterm(self.process, limit, lambda: f"plugin {self.name} ignored SIGTERM; log:\n{self.log}")


def start_plugin(proxy: Proxy, name: str, limit: float = 20, **config: Any) -> Plugin:
    """Start a scripted plugin (see plugin_process.py for ``config``) registered in ``proxy``'s hook dir.

    Returns once the proxy has loaded its registration file.
    """
    assert proxy.workdir is not None
    socket = str(proxy.workdir / f"{name}.sock")
    calls_path = proxy.workdir / f"{name}.calls.jsonl"
    log_path = proxy.workdir / f"{name}.log"
    headers_path = proxy.workdir / f"{name}.headers.jsonl"
    config = {
        **config,
        "name": name,
        "socket": socket,
        "calls": str(calls_path),
        "headers": str(headers_path),
        "hook_dir": str(proxy.hook_dir),
    }
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.plugin_process", json.dumps(config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=REPO,
        )
    plugin = Plugin(name, process, socket, calls_path, log_path, headers_path)
    registration = proxy.hook_dir / f"{name}.json"
    try:
        wait_until(
            lambda: registration.exists() or process.poll() is not None, limit, f"plugin {name} serving"
        )
        if process.poll() is not None:
            raise AssertionError(f"plugin {name} exited with {process.returncode}; log:\n{plugin.log}")
        wait_registered(proxy, name)
    except BaseException:
        plugin.stop()
        raise
    return plugin


# --------------------------------------------------------------------------- cgroups (v1)

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroups_of(pid: int) -> dict[str, str]:
    """Controller → cgroup path of process ``pid`` (cgroup v1; ``cpu,cpuacct`` split into both)."""
    paths = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            if controller:
                paths[controller] = path
    return paths


def cgroup_file(controller: str, path: str, name: str) -> str:
    """The content of ``/sys/fs/cgroup/<controller>/<path>/<name>``, stripped."""
    return (CGROUP_ROOT / controller / path.lstrip("/") / name).read_text().strip()


def verbose_info(reply: Any) -> dict[str, Any]:
    """The JSON document containerd puts under ``info["info"]`` of a verbose status reply."""
    info: dict[str, Any] = json.loads(reply.info["info"])
    return info


def container_pid(cri: Cri, container_id: str) -> int:
    reply = cri.runtime.ContainerStatus(
        pb.ContainerStatusRequest(container_id=container_id, verbose=True), timeout=TIMEOUT
    )
    return int(verbose_info(reply)["pid"])


def sandbox_pid(cri: Cri, pod_id: str) -> int:
    reply = cri.runtime.PodSandboxStatus(
        pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True), timeout=TIMEOUT
    )
    return int(verbose_info(reply)["pid"])
