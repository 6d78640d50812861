"""OCI hooks (hooks.d) against a real containerd, both ways: at the proxy, and inside runc via the wrapper.

``mechanism`` runs each test twice:

- ``proxy``: ``krproxy serve --oci-hooks-dir LOW --oci-hooks-dir HIGH`` in front of containerd; pods use
  the default runc handler.
- ``wrapper``: straight to containerd; pods use the ``krproxy-oci`` runtime handler, whose
  ``BinaryName`` (configured by scripts/containerd-sandbox) is ``krproxy-runc-wrapper``, installed here
  with a ``krproxy-runc-wrapper.conf`` naming the same two directories.

The hooks are a Python script that appends its label and the state it read on stdin to a JSON-lines file.
Hooks at runc's createContainer/startContainer stages would run inside the container's mount
namespace, where the script does not exist, so these tests use prestart, createRuntime, poststart
and poststop.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from krproxy import kubelet
from krproxy.ocihooks.wrapper import write_launcher
from tests.e2e.support import LOOP, TIMEOUT, Containerd, Cri, Proxy, pod_config, start_proxy, wait_until
from tests.ocihook_files import HookFiles

RECORDER = f"""#!{sys.executable}
import json, sys, time
out, label = sys.argv[1], sys.argv[2]
code = int(sys.argv[3]) if len(sys.argv) > 3 else 0
state = json.loads(sys.stdin.read())
# The environment the hook was started with (Python itself may add LC_CTYPE to os.environ).
with open("/proc/self/environ", "rb") as f:
    env = dict(v.decode().partition("=")[::2] for v in f.read().split(b"\\0") if v)
with open(out, "a") as f:
    f.write(json.dumps({{"label": label, "state": state, "env": env}}) + "\\n")
if len(sys.argv) > 4:
    time.sleep(float(sys.argv[4]))
if code:
    sys.stderr.write("hook " + label + " says no")
sys.exit(code)
"""

#: Annotations with this prefix reach the OCI spec under the krproxy-oci handler (the sandbox's allowlist).
ANNOTATION = "krproxy.e2e/team"
#: Hooks.d changes reach the proxy within two polls; the wrapper reads the directories on every create.
RELOAD_LIMIT = 2.0
WRAPPER = Path(sys.executable).parent / "krproxy-runc-wrapper"


def for_team(team: str) -> dict[str, Any]:
    """A hook file's ``when``: containers whose :data:`ANNOTATION` is ``team`` (a regular expression)."""
    return {"annotations": {f"^{ANNOTATION}$": team}}


@attrs.define
class Hooks(HookFiles):
    low: Path
    high: Path
    record: Path
    script: Path

    def calls(self, container_id: str | None = None) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        calls = [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]
        return [c for c in calls if container_id is None or c["state"]["id"] == container_id]

    def labels(self, container_id: str) -> list[str]:
        return [c["label"] for c in self.calls(container_id)]


@attrs.define
class Node:
    """How a test reaches containerd: the client, the runtime handler, and the proxy when there is one."""

    kind: str
    cri: Cri
    containerd: Containerd
    hooks: Hooks
    handler: str = ""
    proxy: Proxy | None = None
    pod_config: Any = None

    def settle(self) -> None:
        """Give a hooks.d change time to take effect (the proxy polls; the wrapper reads on each create)."""
        if self.proxy is not None:
            time.sleep(RELOAD_LIMIT)

    @contextlib.contextmanager
    def pod(self) -> Iterator[str]:
        config = pod_config(self.containerd.cgroup_parent, name="oci")
        request = pb.RunPodSandboxRequest(config=config, runtime_handler=self.handler)
        self.pod_config = config
        pod_id = self.cri.runtime.RunPodSandbox(
            request, timeout=kubelet.RUN_POD_SANDBOX_TIMEOUT
        ).pod_sandbox_id
        try:
            yield pod_id
        finally:
            with contextlib.suppress(grpc.RpcError):
                self.cri.runtime.StopPodSandbox(
                    pb.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT
                )
            with contextlib.suppress(grpc.RpcError):
                self.cri.runtime.RemovePodSandbox(
                    pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=TIMEOUT
                )

    @contextlib.contextmanager
    def container(self, team: str) -> Iterator[str]:
        """A container named ``team`` with :data:`ANNOTATION` ``team``, in a pod of its own (removed after)."""
        with self.pod() as pod_id:
            yield self.create(pod_id, team, annotations={ANNOTATION: team})

    def create(
        self,
        pod_id: str,
        name: str,
        *,
        annotations: dict[str, str] | None = None,
        command: list[str] | None = None,
        mounts: list[Any] | None = None,
    ) -> str:
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=name),
            image=pb.ImageSpec(image=self.containerd.busybox),
            command=command or LOOP,
            annotations=annotations or {},
            mounts=mounts or [],
        )
        request = pb.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=config, sandbox_config=self.pod_config
        )
        return str(self.cri.runtime.CreateContainer(request, timeout=TIMEOUT).container_id)

    def start(self, container_id: str) -> None:
        self.cri.runtime.StartContainer(pb.StartContainerRequest(container_id=container_id), timeout=TIMEOUT)

    def stop(self, container_id: str) -> None:
        self.cri.runtime.StopContainer(
            pb.StopContainerRequest(container_id=container_id, timeout=5),
            timeout=kubelet.stop_container_timeout(5),
        )

    def state_of(self, container_id: str) -> int:
        reply = self.cri.runtime.ContainerStatus(
            pb.ContainerStatusRequest(container_id=container_id), timeout=TIMEOUT
        )
        return int(reply.status.state)


def _start_oci_proxy(workdir: Path, backend: str, dirs: list[Path], limit: float = 30) -> Proxy:
    """``krproxy serve`` with ``--oci-hooks-dir`` for each of ``dirs``; returns once it answers Version."""
    extra = tuple(arg for directory in dirs for arg in ("--oci-hooks-dir", str(directory)))
    return start_proxy(workdir, backend, limit=limit, extra=extra)


@pytest.fixture
def hooks(short_tmp: Path) -> Hooks:
    low, high = short_tmp / "hooks-low", short_tmp / "hooks-high"
    low.mkdir()
    high.mkdir()
    script = short_tmp / "recorder.py"
    script.write_text(RECORDER)
    script.chmod(0o755)
    return Hooks(low, high, short_tmp / "record.jsonl", script)


@pytest.fixture(params=["proxy", "wrapper", "launcher"])
def node(
    request: pytest.FixtureRequest, containerd: Containerd, hooks: Hooks, short_tmp: Path
) -> Iterator[Node]:
    if request.param == "proxy":
        proxy = _start_oci_proxy(short_tmp, containerd.socket, [hooks.low, hooks.high])
        try:
            with Cri.connect(proxy.socket) as cri:
                yield Node("proxy", cri, containerd, hooks, proxy=proxy)
        finally:
            code = proxy.terminate()
        assert 0 == code, f"krproxy exited with {code}; log:\n{proxy.log}"
        return
    if not WRAPPER.exists():
        pytest.skip(f"{WRAPPER} is not installed (pip install -e . creates it)")
    runc = shutil.which("runc")
    assert runc is not None
    install = containerd.dir / "krproxy-oci"
    install.mkdir(exist_ok=True)
    link = install / "krproxy-runc-wrapper"
    link.unlink(missing_ok=True)
    (install / "krproxy-runc-wrapper.conf").write_text(
        f"runc = {runc}\nhooks-dir = {hooks.low}\nhooks-dir = {hooks.high}\nlog = {short_tmp / 'wrapper.log'}\n"
    )
    if request.param == "launcher":  # the /bin/sh fast launcher, resolved from the .conf above
        write_launcher(str(link), index=str(install / "oci-hooks.index"))
    else:  # the Python entry point
        link.symlink_to(WRAPPER)
    try:
        with Cri.connect(containerd.socket) as cri:
            yield Node("wrapper", cri, containerd, hooks, handler="krproxy-oci")
    finally:
        (install / "krproxy-runc-wrapper.conf").unlink(missing_ok=True)


def _failed_start(node: Node, container_id: str) -> tuple[grpc.StatusCode, str, float]:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        node.start(container_id)
    return caught.value.code(), str(caught.value.details()), time.monotonic() - started


class TestOciHooks:
    def test_each_when_kind(self, node: Node, short_tmp: Path) -> None:
        """always, annotations, commands and hasBindMounts each select a hook only for matching containers."""
        h = node.hooks
        h.write("10-always.json", {"always": True}, ["prestart"])
        h.write("20-annotations.json", for_team("^gpu$"), ["prestart"])
        h.write("30-commands.json", {"commands": ["^sh$"]}, ["prestart"])
        h.write("40-binds.json", {"hasBindMounts": True}, ["prestart"])
        node.settle()
        data = short_tmp / "data"
        data.mkdir()
        with node.pod() as pod_id:
            matching = node.create(
                pod_id,
                "matching",
                annotations={ANNOTATION: "gpu"},
                mounts=[pb.Mount(container_path="/data", host_path=str(data))],
            )
            node.start(matching)
            plain = node.create(
                pod_id, "plain", annotations={ANNOTATION: "web"}, command=["/bin/sh", "-c", LOOP[2]]
            )
            node.start(plain)
            assert ["10-always.json", "20-annotations.json", "30-commands.json", "40-binds.json"] == h.labels(
                matching
            )
            assert ["10-always.json"] == h.labels(plain)

    def test_hook_that_matches_nothing(self, node: Node, short_tmp: Path) -> None:
        """A hook keyed on an annotation runs for the container that has it and for no other. Through
        the fast launcher, once its index is current (a second after the hook files last changed),
        the other containers' creates are decided by the index against containerd's own
        config.json, without Python; the hook must still run for the one that has the annotation."""
        h = node.hooks
        h.write("traced.json", for_team("^traced-by-seccomp$"), ["prestart"])
        node.settle()
        time.sleep(1.1)
        with node.pod() as pod_id:
            ids = [
                node.create(pod_id, "traced-1", annotations={ANNOTATION: "traced-by-seccomp"}),
                node.create(pod_id, "plain-1"),
                node.create(pod_id, "other-1", annotations={ANNOTATION: "web"}),
                node.create(pod_id, "plain-2"),
                node.create(pod_id, "traced-2", annotations={ANNOTATION: "traced-by-seccomp"}),
            ]
            for container_id in ids:
                node.start(container_id)
            got = [h.labels(container_id) for container_id in ids]
        assert [["traced.json"], [], [], [], ["traced.json"]] == got
        install = node.containerd.dir / "krproxy-oci"
        if node.handler and not (install / "krproxy-runc-wrapper").is_symlink():  # the launcher
            lines = (install / "oci-hooks.index").read_text().splitlines()
            assert [f"# krproxy-oci-index 2 dirs=:{h.low}:{h.high}", "# watch=", "traced-by-seccomp"] == lines

    def test_state_on_stdin(self, node: Node) -> None:
        """Every stage's hook reads the OCI state: id, status, annotations; pid and bundle where known."""
        h = node.hooks
        for stage in ("prestart", "createRuntime", "poststart", "poststop"):
            h.write(f"{stage}.json", for_team("state"), [stage])
        node.settle()
        with node.container("state") as container_id:
            node.start(container_id)
            node.stop(container_id)
            wait_until(lambda: len(h.calls(container_id)) == 4, 10, "poststop hook ran")
        calls = {c["label"]: c["state"] for c in h.calls(container_id)}
        assert ["prestart.json", "createRuntime.json", "poststart.json", "poststop.json"] == h.labels(
            container_id
        )
        for state in calls.values():
            assert (container_id, "state") == (state["id"], state["annotations"][ANNOTATION])
            assert state["ociVersion"].startswith("1.")
        assert "stopped" == calls["poststop.json"]["status"]
        if node.kind == "wrapper":
            # runc passes its true state: the container's pid and bundle directory.
            assert calls["prestart.json"]["pid"] > 0
            # runc (1.1) omits the pid of a stopped container, so poststop has none.
            assert "pid" not in calls["poststop.json"]
            assert container_id in calls["prestart.json"]["bundle"]
            assert os.path.isabs(calls["poststart.json"]["bundle"])
            assert "container" == calls["prestart.json"]["annotations"]["io.kubernetes.cri.container-type"]
        else:
            # The proxy knows no bundle; the pid only once the container runs (containerd's verbose status).
            assert "bundle" not in calls["prestart.json"] and "pid" not in calls["prestart.json"]
            assert ("creating", "running") == (
                calls["prestart.json"]["status"],
                calls["poststart.json"]["status"],
            )
            assert calls["poststart.json"]["pid"] > 0

    def test_environment_is_exactly_the_files_env(self, node: Node) -> None:
        """A hook file without ``env`` runs with an empty environment (not runc's, containerd's or
        the shim's); one with ``env`` gets exactly that."""
        h = node.hooks
        h.write("bare.json", for_team("env"), ["prestart"])
        h.write("set.json", for_team("env"), ["prestart"], env=["A=1", "B=two words"])
        node.settle()
        with node.container("env") as container_id:
            node.start(container_id)
        envs = {c["label"]: c["env"] for c in h.calls(container_id)}
        assert {"bare.json": {}, "set.json": {"A": "1", "B": "two words"}} == envs

    def test_failing_prestart_blocks_the_start(self, node: Node) -> None:
        """A pre-start hook exiting non-zero fails StartContainer, and the container never runs."""
        node.hooks.write("gate.json", for_team("gate"), ["createRuntime"], exit_code=3)
        node.settle()
        with node.container("gate") as container_id:
            code, details, _ = _failed_start(node, container_id)
            assert grpc.StatusCode.UNKNOWN == code
            assert "hook gate.json says no" in details, details
            assert pb.CONTAINER_RUNNING != node.state_of(container_id)
            assert ["gate.json"] == node.hooks.labels(container_id)

    def test_timeout_is_enforced(self, node: Node) -> None:
        """A pre-start hook over its timeout is killed and the start fails soon after the timeout."""
        node.hooks.write("slow.json", for_team("slow"), ["prestart"], sleep=60, timeout=1)
        node.settle()
        with node.container("slow") as container_id:
            _, details, seconds = _failed_start(node, container_id)
            assert seconds < 15, f"start took {seconds:.1f}s"
            assert "time" in details.lower(), details
            assert pb.CONTAINER_RUNNING != node.state_of(container_id)

    def test_precedence_and_live_reload(self, node: Node) -> None:
        """The later directory wins on a shared name; removing it brings the earlier back; new files apply."""
        h = node.hooks
        when = for_team("reload")
        h.write("a.json", when, ["prestart"], label="low")
        h.write("a.json", when, ["prestart"], label="high", directory=h.high)
        node.settle()
        with node.pod() as pod_id:
            first = node.create(pod_id, "first", annotations={ANNOTATION: "reload"})
            node.start(first)
            assert ["high"] == h.labels(first)
            (h.high / "a.json").unlink()
            h.write("b.json", when, ["prestart"], label="new")
            node.settle()
            second = node.create(pod_id, "second", annotations={ANNOTATION: "reload"})
            node.start(second)
            assert ["low", "new"] == h.labels(second)


def test_wrapper_is_quick_when_no_hook_matches(short_tmp: Path) -> None:
    """The installed wrapper passes a non-create command straight to runc, silently, with runc's status."""
    if not WRAPPER.exists():
        pytest.skip(f"{WRAPPER} is not installed")
    fake = short_tmp / "runc"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    env = {
        **os.environ,
        "KRPROXY_RUNC": str(fake),
        "KRPROXY_OCI_HOOKS_DIRS": str(short_tmp / uuid.uuid4().hex),
    }
    done = subprocess.run([str(WRAPPER), "state", "x"], env=env, capture_output=True, text=True, timeout=30)
    assert (0, "") == (done.returncode, done.stderr)


class TestPostStageFailures:
    def test_failing_poststart(self, node: Node) -> None:
        """A failing poststart hook: only logged at the proxy; runc (1.1) instead fails the start and kills the container."""
        node.hooks.write("post.json", for_team("post"), ["poststart"], exit_code=1)
        node.settle()
        with node.container("post") as container_id:
            if node.kind == "proxy":
                node.start(container_id)
                assert pb.CONTAINER_RUNNING == node.state_of(container_id)
                assert node.proxy is not None and "event=oci_hook_failed" in node.proxy.log
            else:
                _, details, _ = _failed_start(node, container_id)
                assert "hook post.json says no" in details, details
                assert pb.CONTAINER_RUNNING != node.state_of(container_id)
            assert ["post.json"] == node.hooks.labels(container_id)
