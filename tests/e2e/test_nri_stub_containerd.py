"""Python NRI plugins written with the SDK's stub (:class:`krproxy.hookserver.nri.NriStub`) on a real
containerd: what they change is in containerd's OCI spec for the container and in the running container.

Each plugin runs as its own process (``tests/e2e/nri_stub_process.py``) on the sandbox's NRI socket, as
an operator would run it; pods are created by a CRI client straight to containerd. The spec is read from
the runtime (ContainerStatus's verbose ``info``, its ``runtimeSpec``), never from the plugin, and each
change is looked for again in the container: its environ, its limits, its /dev, its mounts, the hook's
trace. containerd 2.1 (Debian sid's 2.1.9) and 1.7 (trixie's 1.7.24, NRI 0.6.1) run every adjustment
here; 1.6 has no NRI (skipped, with the reason). The validation samples (NRI's validator plugins,
``ValidateContainerAdjustment``) need a runtime whose NRI has them; the test asks the runtime, through
the plugin's subscription, and skips with the reason where it has not.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from tests.e2e import nri_stub_process as plugin_process
from tests.e2e.support import (
    REPO,
    TIMEOUT,
    Containerd,
    Cri,
    container_config,
    container_pid,
    pod_config,
    sigterm,
    verbose_info,
    wait_until,
)
from tests.e2e.test_containerd_hooks import cleanup, create_container, run_pod, start, update
from tests.e2e.test_nri_containerd import environ, nri_socket


@attrs.define
class StubPlugin:
    """A ``nri_stub_process`` subprocess; its log (krproxy's JSON lines) in ``log_path``."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    seen_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def seen(self) -> list[dict[str, Any]]:
        """The containers the adjuster was asked about (one JSON line each)."""
        if not self.seen_path.exists():
            return []
        return [json.loads(line) for line in self.seen_path.read_text().splitlines() if line.strip()]

    def records(self) -> list[dict[str, Any]]:
        """Each log line (a JSON object; anything else, such as a traceback, is left out)."""
        found = []
        for line in self.log.splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
        return found

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.records() if r.get("event") == name]

    def messages(self) -> list[str]:
        """What the plugin's own code logged (``LOGGER.info(...)``: the samples), in order."""
        return [r["msg"] for r in self.records() if "msg" in r]

    def stop(self, limit: float = 10) -> int:
        return sigterm(
            self.process, limit, lambda: f"NRI plugin {self.name} ignored SIGTERM; log:\n{self.log}"
        )


@contextlib.contextmanager
def stub_plugin(
    containerd: Containerd, workdir: Path, plugin: str, env: dict[str, str] | None = None, **config: Any
) -> Iterator[StubPlugin]:
    """Run ``plugin`` (``adjuster`` or ``sample:NAME``) on containerd's NRI socket until synchronized;
    at the end it must exit 0 on SIGTERM."""
    socket = nri_socket(containerd)
    if not socket.exists():
        pytest.skip(
            f"containerd {containerd.version} serves no NRI socket at {socket} (NRI is 1.7 and later)"
        )
    name = plugin.removeprefix("sample:")
    log_path, seen_path = workdir / f"{name}.log", workdir / f"{name}.seen.jsonl"
    config = {**config, "plugin": plugin, "socket": str(socket), "seen": str(seen_path)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.nri_stub_process", json.dumps(config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=REPO,
            env={**os.environ, **(env or {})},
        )
    running = StubPlugin(name, process, log_path, seen_path)
    try:
        wait_until(
            lambda: bool(running.events("nri_stub_ready")) or process.poll() is not None,
            30,
            f"NRI plugin {name} synchronized",
        )
        assert process.poll() is None, f"NRI plugin {name} exited with {process.returncode}:\n{running.log}"
        yield running
    finally:
        code = running.stop()
    assert 0 == code, f"NRI plugin {name} exited with {code}; log:\n{running.log}"


def oci_spec(cri: Cri, container_id: str) -> dict[str, Any]:
    """containerd's OCI runtime spec of the container, as its verbose ContainerStatus reports it."""
    reply = cri.runtime.ContainerStatus(
        pb.ContainerStatusRequest(container_id=container_id, verbose=True), timeout=TIMEOUT
    )
    spec: dict[str, Any] = verbose_info(reply)["runtimeSpec"]
    return spec


def hook_script(workdir: Path) -> tuple[Path, Path]:
    """An OCI hook that appends its arguments to a trace file: (the hook, the trace)."""
    hook, trace = workdir / "hook.sh", workdir / "hook-trace.txt"
    hook.write_text(f'#!/bin/sh\necho "$*" >> {trace}\n')
    hook.chmod(0o755)
    return hook, trace


def started(cri: Cri, container_id: str) -> int:
    """Start the container; its PID once its own command runs (not runc's init)."""
    start(cri, container_id)
    pid = container_pid(cri, container_id)
    cmdline = Path(f"/proc/{pid}/cmdline")
    wait_until(lambda: cmdline.read_bytes().split(b"\0")[0] == b"sh", what="the container's sh exec'd")
    return pid


def limits(pid: int, name: str) -> tuple[str, str]:
    """The soft and hard value of one line of /proc/PID/limits (``Max open files``...)."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith(name):
            soft, hard = line[len(name) :].split()[:2]
            return soft, hard
    raise AssertionError(f"no {name!r} in /proc/{pid}/limits")


def char_device(pid: int, path: str) -> tuple[int, int]:
    """Major and minor of the character device ``path`` inside the container's root."""
    st = os.stat(f"/proc/{pid}/root{path}")
    assert stat.S_ISCHR(st.st_mode), f"{path} in the container is not a character device: {st}"
    return os.major(st.st_rdev), os.minor(st.st_rdev)


#: An env var the CRI request sets, which the remover asks to remove too.
CRI_ENV = ("KRPROXY_FROM_CRI", "1")


def test_adjustments_reach_the_oci_spec(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """Stub plugins add a mount, a device, an rlimit, an OCI hook and env vars, and remove one of
    those env vars: containerd's OCI spec shows each, and the running container has each."""
    shared = short_tmp / "shared"
    shared.mkdir()
    (shared / "note.txt").write_text("from the host\n")
    hook, trace = hook_script(short_tmp)
    dropped, _ = plugin_process.DROPPED_ENV
    with contextlib.ExitStack() as stack:
        adjuster = stack.enter_context(
            stub_plugin(containerd, short_tmp, "adjuster", mount_source=str(shared), hook=str(hook))
        )
        remover = stack.enter_context(
            stub_plugin(containerd, short_tmp, "remover", remove_env=[dropped, CRI_ENV[0]])
        )
        pods = stack.enter_context(cleanup(direct))
        pod = pod_config(containerd.cgroup_parent, "stub")
        pod.annotations[plugin_process.ANNOTATION] = "yes"
        container = container_config(containerd.busybox)
        container.envs.append(pb.KeyValue(key=CRI_ENV[0], value=CRI_ENV[1]))
        pod_id = run_pod(direct, pod, pods)
        cid = create_container(direct, pod_id, pod, container)
        spec = oci_spec(direct, cid)
        pid = started(direct, cid)
        env = environ(pid)
        nofile = limits(pid, "Max open files")
        device = char_device(pid, plugin_process.DEVICE["path"])
        note = Path(f"/proc/{pid}/root{plugin_process.MOUNT_DESTINATION}/note.txt").read_text()
    # NRI shows each plugin the container as the plugins before it left it.
    [(adjuster_saw)], [(remover_saw)] = adjuster.seen(), remover.seen()
    assert "=".join(CRI_ENV) in adjuster_saw["env"]
    assert "=".join(plugin_process.DROPPED_ENV) in remover_saw["env"]

    key, value = plugin_process.ENV
    spec_env = spec["process"]["env"]
    assert f"{key}={value}" in spec_env and value == env.get(key)
    assert [] == [e for e in spec_env if e.startswith(f"{dropped}=")]
    assert dropped not in env
    # NRI's removal takes out what a plugin before added; the runtime's own env is not passed on to be
    # removed (containerd/nri pkg/adaptation adjustEnv, 0.6.1 to 0.12): it stays.
    assert "=".join(CRI_ENV) in spec_env and CRI_ENV[1] == env.get(CRI_ENV[0])

    rtype, soft, hard = plugin_process.RLIMIT
    assert {"type": rtype, "soft": soft, "hard": hard} in spec["process"]["rlimits"]
    assert (str(soft), str(hard)) == nofile

    [mount] = [m for m in spec["mounts"] if m["destination"] == plugin_process.MOUNT_DESTINATION]
    assert (str(shared), "bind") == (mount["source"], mount["type"])
    assert {"rbind", "ro"} <= set(mount["options"])
    assert "from the host\n" == note

    dev = plugin_process.DEVICE
    [added] = [d for d in spec["linux"]["devices"] if d["path"] == dev["path"]]
    assert (dev["type"], dev["major"], dev["minor"], 0o666) == (
        added["type"],
        added["major"],
        added["minor"],
        added["fileMode"],
    )
    assert (dev["major"], dev["minor"]) == device

    assert [{"path": str(hook), "args": [str(hook), "prestart", "loop"]}] == spec["hooks"]["prestart"]
    assert ["prestart loop"] == trace.read_text().splitlines()  # runc ran it


# --------------------------------------------------------------------------- NRI's samples (examples/nri)


def test_template_sample_sees_lifecycle(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """The template is synchronized, then called at each event of a pod's life it has a handler for."""
    with stub_plugin(containerd, short_tmp, "sample:template") as plugin, cleanup(direct) as pods:
        pod = pod_config(containerd.cgroup_parent, "template")
        pod_id = run_pod(direct, pod, pods)
        cid = create_container(direct, pod_id, pod, container_config(containerd.busybox))
        started(direct, cid)
        update(direct, cid, cpu_period=100_000, cpu_quota=50_000)
        direct.runtime.StopContainer(pb.StopContainerRequest(container_id=cid), timeout=TIMEOUT)
        direct.runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=TIMEOUT)
        name = pod.metadata.name
        expected = [
            f"RunPodSandbox krproxy-e2e/{name}",
            f"CreateContainer {name}/loop",
            f"UpdateContainer {name}/loop",
            f"StopContainer {name}/loop",
            f"RemoveContainer {name}/loop",
        ]
        wait_until(lambda: expected[-1] in plugin.messages(), what="the template's RemoveContainer")
    messages = plugin.messages()
    assert messages[0].startswith("synchronized: ")
    assert expected == [m for m in messages if name in m]


def test_logger_sample_logs_in_order(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """The logger is sent every pod and container event of a lifecycle, in the order they happen."""
    with stub_plugin(containerd, short_tmp, "sample:logger") as plugin:
        pod = pod_config(containerd.cgroup_parent, "logger")
        with cleanup(direct) as pods:
            pod_id = run_pod(direct, pod, pods)
            cid = create_container(direct, pod_id, pod, container_config(containerd.busybox))
            started(direct, cid)
            direct.runtime.StopContainer(pb.StopContainerRequest(container_id=cid), timeout=TIMEOUT)
            direct.runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=TIMEOUT)
        name = pod.metadata.name
        wait_until(
            lambda: any(
                m.startswith(f"REMOVE_POD_SANDBOX: pod krproxy-e2e/{name}") for m in plugin.messages()
            ),
            what="the logger's REMOVE_POD_SANDBOX",
        )
    events = [m.split(":", 1)[0] for m in plugin.messages() if f"krproxy-e2e/{name}" in m]
    assert [
        "RUN_POD_SANDBOX",
        "CREATE_CONTAINER",
        "POST_CREATE_CONTAINER",
        "START_CONTAINER",
        "POST_START_CONTAINER",
        "REMOVE_CONTAINER",
        "STOP_POD_SANDBOX",
        "REMOVE_POD_SANDBOX",
    ] == events


def test_device_injector_sample(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """The pod's device and mount annotations for a container land in its OCI spec and in it."""
    shared = short_tmp / "shared"
    shared.mkdir()
    (shared / "note.txt").write_text("injected\n")
    devices = [{"path": "/dev/injected-zero", "type": "c", "major": 1, "minor": 5, "file_mode": 0o600}]
    mounts = [{"source": str(shared), "destination": "/injected", "type": "bind", "options": ["rbind"]}]
    with stub_plugin(containerd, short_tmp, "sample:device_injector"), cleanup(direct) as pods:
        pod = pod_config(containerd.cgroup_parent, "devices")
        pod.annotations["devices.noderesource.dev/container.loop"] = json.dumps(devices)
        pod.annotations["mounts.noderesource.dev/container.loop"] = json.dumps(mounts)
        pod_id = run_pod(direct, pod, pods)
        cid = create_container(direct, pod_id, pod, container_config(containerd.busybox))
        other = create_container(direct, pod_id, pod, container_config(containerd.busybox, "other"))
        spec, other_spec = oci_spec(direct, cid), oci_spec(direct, other)
        pid = started(direct, cid)
        device = char_device(pid, "/dev/injected-zero")
        note = Path(f"/proc/{pid}/root/injected/note.txt").read_text()
    [added] = [d for d in spec["linux"]["devices"] if d["path"] == "/dev/injected-zero"]
    assert ("c", 1, 5, 0o600) == (added["type"], added["major"], added["minor"], added["fileMode"])
    assert (1, 5) == device
    [mount] = [m for m in spec["mounts"] if m["destination"] == "/injected"]
    assert str(shared) == mount["source"]
    assert "injected\n" == note
    assert [] == [d for d in other_spec["linux"].get("devices", []) if d["path"] == "/dev/injected-zero"]
    assert [] == [m for m in other_spec["mounts"] if m["destination"] == "/injected"]


def test_hook_injector_sample(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """Every container gets the prestart and poststop hook and runc runs both; a pod annotated to skip
    gets none."""
    hook, trace = hook_script(short_tmp)
    with (
        stub_plugin(containerd, short_tmp, "sample:hook_injector", env={"HOOK_PATH": str(hook)}),
        cleanup(direct) as pods,
    ):
        pod = pod_config(containerd.cgroup_parent, "hooks")
        skip = pod_config(containerd.cgroup_parent, "nohooks")
        skip.annotations["hook-injector.krproxy.dev/skip"] = "true"
        pod_id, skip_id = run_pod(direct, pod, pods), run_pod(direct, skip, pods)
        cid = create_container(direct, pod_id, pod, container_config(containerd.busybox))
        skipped = create_container(direct, skip_id, skip, container_config(containerd.busybox, "skipped"))
        spec, skipped_spec = oci_spec(direct, cid), oci_spec(direct, skipped)
        started(direct, cid)
        started(direct, skipped)
        direct.runtime.StopContainer(pb.StopContainerRequest(container_id=cid), timeout=TIMEOUT)
        wait_until(lambda: "poststop loop" in trace.read_text(), what="the poststop hook ran")
    assert [{"path": str(hook), "args": [str(hook), "prestart", "loop"]}] == spec["hooks"]["prestart"]
    assert [{"path": str(hook), "args": [str(hook), "poststop", "loop"]}] == spec["hooks"]["poststop"]
    assert ["prestart loop", "poststop loop"] == trace.read_text().splitlines()
    assert {} == skipped_spec.get("hooks", {})


def test_ulimit_adjuster_sample(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """Annotated ulimits are the container's rlimits; a bad one fails only that container's creation,
    with the plugin's reason."""
    good = "- type: nofile\n  soft: 1024\n  hard: 4096\n- type: RLIMIT_NPROC\n  soft: 100\n  hard: 200\n"
    bad = "- type: RLIMIT_NOFILE\n  soft: 9\n  hard: 1\n"
    with stub_plugin(containerd, short_tmp, "sample:ulimit_adjuster"), cleanup(direct) as pods:
        pod = pod_config(containerd.cgroup_parent, "ulimits")
        pod.annotations["ulimits.noderesource.dev/container.loop"] = good
        pod.annotations["ulimits.nri.containerd.io/container.bad"] = bad
        pod_id = run_pod(direct, pod, pods)
        cid = create_container(direct, pod_id, pod, container_config(containerd.busybox))
        spec = oci_spec(direct, cid)
        pid = started(direct, cid)
        nofile, nproc = limits(pid, "Max open files"), limits(pid, "Max processes")
        with pytest.raises(grpc.RpcError) as refused:
            create_container(direct, pod_id, pod, container_config(containerd.busybox, "bad"))
    assert {"type": "RLIMIT_NOFILE", "soft": 1024, "hard": 4096} in spec["process"]["rlimits"]
    assert {"type": "RLIMIT_NPROC", "soft": 100, "hard": 200} in spec["process"]["rlimits"]
    assert (("1024", "4096"), ("100", "200")) == (nofile, nproc)
    assert "plugin 30-ulimit-adjuster: adjust failed: RLIMIT_NOFILE: soft 9 is above hard 1" in (
        refused.value.details() or ""
    )


def validation_or_skip(containerd: Containerd, plugin: StubPlugin) -> None:
    """Skip unless the runtime subscribed ``plugin`` to ValidateContainerAdjustment (NRI's validators)."""
    for warning in plugin.events("nri_stub_events_unavailable"):
        if "VALIDATE_CONTAINER_ADJUSTMENT" in warning["events"]:
            pytest.skip(
                f"containerd {containerd.version}'s NRI has no validation plugins "
                f"(ValidateContainerAdjustment): {warning['reason']}"
            )


def test_validator_sample_refuses_hooks(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """Where the runtime's NRI has validators: hooks injected into a pod not allowed them fail the
    creation with the validator's reason; a pod that allows them gets its container."""
    hook, _ = hook_script(short_tmp)
    with contextlib.ExitStack() as stack:
        validator = stack.enter_context(stub_plugin(containerd, short_tmp, "sample:validator"))
        validation_or_skip(containerd, validator)
        stack.enter_context(
            stub_plugin(containerd, short_tmp, "sample:hook_injector", env={"HOOK_PATH": str(hook)})
        )
        pods = stack.enter_context(cleanup(direct))
        pod = pod_config(containerd.cgroup_parent, "validated")
        allowed = pod_config(containerd.cgroup_parent, "allowed")
        allowed.annotations["validator.krproxy.dev/allow-hooks"] = "true"
        pod_id, allowed_id = run_pod(direct, pod, pods), run_pod(direct, allowed, pods)
        with pytest.raises(grpc.RpcError) as refused:
            create_container(direct, pod_id, pod, container_config(containerd.busybox))
        cid = create_container(direct, allowed_id, allowed, container_config(containerd.busybox))
        spec = oci_spec(direct, cid)
    assert "OCI hooks are not allowed in this pod" in (refused.value.details() or "")
    assert spec["hooks"]["prestart"]


def test_differ_sample_sees_changes(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """Where the runtime's NRI has validators: the differ is shown what the plugins before it changed."""
    with contextlib.ExitStack() as stack:
        differ = stack.enter_context(stub_plugin(containerd, short_tmp, "sample:differ"))
        validation_or_skip(containerd, differ)
        stack.enter_context(stub_plugin(containerd, short_tmp, "sample:ulimit_adjuster"))
        pods = stack.enter_context(cleanup(direct))
        pod = pod_config(containerd.cgroup_parent, "differ")
        pod.annotations["ulimits.noderesource.dev/container.loop"] = "- {type: nofile, soft: 1, hard: 2}\n"
        pod_id = run_pod(direct, pod, pods)
        create_container(direct, pod_id, pod, container_config(containerd.busybox))
        wait_until(lambda: "container loop: rlimits[RLIMIT_NOFILE]" in differ.messages(), what="the diff")
