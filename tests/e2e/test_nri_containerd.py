"""``krproxy nri`` with a real containerd: a hook server's changes land in the real cgroup files and env with
no proxy in the CRI path, and the same hook server through ``krproxy serve`` gives the same result.

containerd 2.x serves NRI by default and ``scripts/containerd-sandbox`` turns it on for 1.7 (NRI 0.6.1:
no timeouts in Configure); its socket is in the sandbox's own /run, reachable from here as
``DIR/run/nri/nri.sock``. 1.6 has no NRI: the tests are skipped there, with the reason. Pods are
created by a CRI client straight to containerd, with kubelet's deadlines. containerd 2.3 (NRI 0.12)
records a deprecation for a plugin that leaves its events to StateChange: no test may leave one.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from tests.e2e import test_containerd_pod_resize as resize_e2e
from tests.e2e.support import (
    TIMEOUT,
    Containerd,
    Cri,
    Plugin,
    Proxy,
    container_config,
    container_pid,
    pod_config,
    start_plugin,
    wait_until,
)
from tests.e2e.test_containerd_hooks import (
    LIMITED_CGROUP,
    LIMITS,
    MiB,
    cgroup_values,
    cleanup,
    create_container,
    run_pod,
    start,
    update,
)

#: The hook server's configuration, the same in both modes.
HOOKS = ["PreCreateContainer", "PreUpdateContainerResources"]
RESOURCES = {"PreCreateContainer": LIMITS, "PreUpdateContainerResources": {"cpu_quota": 20_000}}
ENVS = {"PreCreateContainer": {"KRPROXY_HOOKED": "yes"}}


def nri_socket(containerd: Containerd) -> Path:
    return containerd.dir / "run" / "nri" / "nri.sock"


def start_nri(
    containerd: Containerd, workdir: Path, log_name: str = "krproxy-nri.log", extra: tuple[str, ...] = ()
) -> Proxy:
    """Start ``krproxy nri ... EXTRA`` on containerd's NRI socket with hook dir ``workdir/hooks``."""
    (workdir / "hooks").mkdir(exist_ok=True)
    log_path = workdir / log_name
    command = [sys.executable, "-m", "krproxy", "nri", "--nri-socket", str(nri_socket(containerd))]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*command, "--hook-dir", str(workdir / "hooks"), *extra],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=workdir,
        )
    return Proxy(process, "", log_path, workdir)  # the same handle: a process, its log and hook dir


@contextlib.contextmanager
def krproxy_nri(containerd: Containerd, workdir: Path, extra: tuple[str, ...] = ()) -> Iterator[Proxy]:
    """``krproxy nri ... EXTRA`` on containerd's NRI socket, hook dir ``workdir/hooks``; must exit 0 on
    SIGTERM."""
    socket = nri_socket(containerd)
    if not socket.exists():
        pytest.skip(
            f"containerd {containerd.version} serves no NRI socket at {socket} (NRI is 1.7 and later)"
        )
    daemon = start_nri(containerd, workdir, extra=extra)
    try:
        synchronized(daemon, 1)
        yield daemon
    finally:
        code = daemon.terminate()
    assert 0 == code, f"krproxy nri exited with {code}; log:\n{daemon.log}"


def synchronized(daemon: Proxy, times: int) -> None:
    """Wait until containerd synchronized krproxy ``times`` times (it re-registers when its hooks change)."""
    wait_until(
        lambda: daemon.log.count("event=nri_synchronized") >= times or daemon.process.poll() is not None,
        30,
        f"krproxy nri synchronized {times} times",
    )
    assert daemon.process.poll() is None, f"krproxy nri exited; log:\n{daemon.log}"


def nri_deprecations(containerd: Containerd) -> list[str]:
    """The lines of ``ctr deprecations list`` recording a plugin's use of NRI's deprecated interface
    (containerd 2.3: StateChange instead of NRI 0.12's dedicated event methods)."""
    listed = subprocess.run(
        [containerd.ctr, "--address", containerd.socket, "deprecations", "list"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert 0 == listed.returncode, f"ctr deprecations list failed: {listed.stderr}"
    return [line for line in listed.stdout.splitlines() if "nri-plugin-interface" in line]


def hooks_in_effect(daemon: Proxy) -> None:
    """Wait until the hook servers krproxy nri loaded last are in effect: its ``nri_hooks_published`` after
    the last registration said no re-registration was needed, or a synchronization followed it."""

    def in_effect() -> bool:
        lines = daemon.log.splitlines()
        registered = [i for i, line in enumerate(lines) if "event=plugin_registered" in line]
        published = [i for i, line in enumerate(lines) if "event=nri_hooks_published" in line]
        if not published or (registered and published[-1] < registered[-1]):
            return False
        last = published[-1]
        return "resubscribe=false" in lines[last] or any(
            "event=nri_synchronized" in line for line in lines[last:]
        )

    try:
        wait_until(
            lambda: in_effect() or daemon.process.poll() is not None, 30, "krproxy nri hooks in effect"
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; log:\n{daemon.log}") from None
    assert daemon.process.poll() is None, f"krproxy nri exited; log:\n{daemon.log}"


def environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


def lifecycle(cri: Cri, containerd: Containerd, direct: Cri) -> dict[str, object]:
    """Run a pod and a container through ``cri``, update its resources as kubelet would; what landed."""
    pod = pod_config(containerd.cgroup_parent, "nri")
    container = container_config(containerd.busybox)
    container.linux.resources.cpu_shares = 256
    with cleanup(direct) as pods:
        pod_id = run_pod(cri, pod, pods)
        cid = create_container(cri, pod_id, pod, container)
        start(cri, cid)
        pid = container_pid(direct, cid)
        # StartContainer returns once runc has told its init to exec; until it has, /proc/PID holds
        # runc init's environment, not the container's.
        cmdline = Path(f"/proc/{pid}/cmdline")
        wait_until(lambda: cmdline.read_bytes().split(b"\0")[0] == b"sh", what="the container's sh exec'd")
        created = cgroup_values(pid)
        env = environ(pid).get("KRPROXY_HOOKED", "")
        request = pb.UpdateContainerResourcesRequest(
            container_id=cid,
            linux=pb.LinuxContainerResources(
                cpu_period=100_000, cpu_quota=50_000, cpu_shares=512, memory_limit_in_bytes=64 * MiB
            ),
        )
        cri.runtime.UpdateContainerResources(request, timeout=TIMEOUT)
        updated = cgroup_values(pid)
    return {"created": created, "env": env, "updated": updated}


def test_hook_server_through_nri(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """PreCreateContainer's cpu, memory, cpuset and env, and PreUpdateContainerResources' quota, reach the
    container created straight through containerd."""
    with krproxy_nri(containerd, short_tmp) as daemon:
        plugin = start_plugin(
            daemon, "limits", hooks=HOOKS, failure_policy="Fail", resources=RESOURCES, envs=ENVS
        )
        try:
            hooks_in_effect(daemon)  # re-registered if its new hook server needs other events
            landed = lifecycle(direct, containerd, direct)
        finally:
            assert 0 == plugin.stop()
    assert LIMITED_CGROUP == landed["created"]
    assert "yes" == landed["env"]
    updated = landed["updated"]
    assert isinstance(updated, dict)
    assert ("20000", "512") == (updated["cpu.cfs_quota_us"], updated["cpu.shares"])
    [request] = plugin.requests("PreCreateContainer")
    assert "krproxy-e2e" == request["pod_meta"]["namespace"]


def test_parity_with_proxy_mode(
    containerd: Containerd, direct: Cri, short_tmp: Path, proxy: Proxy, plugins: Callable[..., Plugin]
) -> None:
    """The same hook server gives the same cgroup values and env through ``krproxy serve`` and ``krproxy nri``
    on every point NRI supports (create: cpu, memory, cpuset, env; update: resources)."""
    plugins("limits", hooks=HOOKS, failure_policy="Fail", resources=RESOURCES, envs=ENVS)
    with Cri.connect(proxy.socket) as via_proxy:
        proxied = lifecycle(via_proxy, containerd, direct)
    nri_dir = short_tmp / "nri"
    nri_dir.mkdir()
    with krproxy_nri(containerd, nri_dir) as daemon:
        plugin = start_plugin(
            daemon, "limits", hooks=HOOKS, failure_policy="Fail", resources=RESOURCES, envs=ENVS
        )
        try:
            hooks_in_effect(daemon)
            through_nri = lifecycle(direct, containerd, direct)
        finally:
            assert 0 == plugin.stop()
    assert proxied == through_nri
    assert os.path.exists(proxy.socket)


def test_restarts_lose_no_hook(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """``krproxy nri`` killed mid-lifecycle and started again, then containerd crashed and restarted: each
    time the next CreateContainer reaches the hook server, with the pod's labels and annotations."""
    with krproxy_nri(containerd, short_tmp) as daemon:
        plugin = start_plugin(daemon, "watch", hooks=["PreCreateContainer"])
        try:
            hooks_in_effect(daemon)
            pod = pod_config(containerd.cgroup_parent, "restart")
            pod.labels["app"] = "nri-restart"
            pod.annotations["krproxy.e2e/note"] = "kept"
            with cleanup(direct) as pods:
                pod_id = run_pod(direct, pod, pods)
                daemon.process.kill()  # mid-lifecycle: the pod runs, its container is not created yet
                daemon.process.wait()
                restarted = start_nri(containerd, short_tmp, "krproxy-nri-2.log")
                daemon.process, daemon.log_path = restarted.process, restarted.log_path
                synchronized(daemon, 1)
                create_container(direct, pod_id, pod, container_config(containerd.busybox))
            [request] = plugin.requests("PreCreateContainer")
            assert ("nri-restart", "kept") == (
                request["pod_labels"]["app"],
                request["pod_annotations"]["krproxy.e2e/note"],
            )

            containerd.crash()
            containerd.start()  # same DIR and socket path
            synchronized(daemon, 2)  # reconnected and synchronized by the new containerd
            with cleanup(direct) as pods:
                after = pod_config(containerd.cgroup_parent, "after")  # (a uid of its own: made once)
                pod_id = run_pod(direct, after, pods)
                create_container(direct, pod_id, after, container_config(containerd.busybox))
            assert 2 == len(plugin.requests("PreCreateContainer"))
        finally:
            assert 0 == plugin.stop()


#: Every hook point NRI mode runs a hook server at: krproxy subscribes to every event of a lifecycle.
EVERY_HOOK = [
    "PreRunPodSandbox",
    "PreCreateContainer",
    "PreStartContainer",
    "PostStartContainer",
    "PreUpdateContainerResources",
    "PostStopContainer",
    "PostStopPodSandbox",
]


def test_every_event_without_the_deprecated_interface(
    containerd: Containerd, direct: Cri, short_tmp: Path
) -> None:
    """A pod's whole lifecycle with a hook server on every hook point: each point reaches it, and
    containerd records no use of NRI's deprecated interface — on 2.3 (NRI 0.12) no
    ``io.containerd.deprecation/nri-plugin-interface`` in ``ctr deprecations list`` and no "deprecated
    interface" warning in its log, which krproxy answering the dedicated event methods Unimplemented
    (falling back to StateChange) leaves for each of seven events."""
    with krproxy_nri(containerd, short_tmp) as daemon:
        plugin = start_plugin(daemon, "every", hooks=EVERY_HOOK)
        try:
            hooks_in_effect(daemon)
            pod = pod_config(containerd.cgroup_parent, "every")
            with cleanup(direct) as pods:
                pod_id = run_pod(direct, pod, pods)
                cid = create_container(direct, pod_id, pod, container_config(containerd.busybox))
                start(direct, cid)
                update(direct, cid, cpu_period=100_000, cpu_quota=50_000)
                direct.runtime.StopContainer(pb.StopContainerRequest(container_id=cid), timeout=TIMEOUT)
                direct.runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=TIMEOUT)
            wait_until(lambda: "PostStopPodSandbox" in plugin.hooks_called(), what="PostStopPodSandbox")
            called = plugin.hooks_called()
        finally:
            assert 0 == plugin.stop()
        configured = [line for line in daemon.log.splitlines() if "event=nri_configured" in line]
    assert EVERY_HOOK == sorted(set(called), key=EVERY_HOOK.index)
    assert [] == nri_deprecations(containerd)
    log = (containerd.dir / "containerd.log").read_text(errors="replace")
    assert [] == [line for line in log.splitlines() if "deprecated interface" in line]
    if containerd.release >= (2, 3):  # the version exchange: containerd says its NRI version
        assert "nri=v0.12" in configured[-1], configured


def test_pod_resize_through_nri(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """containerd 2.3 and later (NRI 0.12) raises UpdatePodSandbox for UpdatePodSandboxResources: the
    PreUpdatePodSandboxResources hook servers get the pod's labels and annotations with the requested
    resources and overhead, and a Fail server's refusal fails the call, straight to containerd."""
    if containerd.release < (2, 3):
        pytest.skip(
            f"containerd {containerd.version} raises no NRI UpdatePodSandbox (NRI 0.12, containerd 2.3 and "
            "later; test_nri_plugin_operations.py covers it against the fake runtime)"
        )
    hook = resize_e2e.HOOK
    with krproxy_nri(containerd, short_tmp) as daemon:
        watch = start_plugin(daemon, "aa-watch", hooks=[hook])
        guard = start_plugin(
            daemon, "zz-guard", hooks=[hook], failure_policy="Fail", error={hook: "no more cpu"}
        )
        try:
            hooks_in_effect(daemon)
            pod = pod_config(containerd.cgroup_parent, "resize")
            pod.labels.update(resize_e2e.LABELS)
            pod.annotations.update(resize_e2e.ANNOTATIONS)
            with cleanup(direct) as pods:
                pod_id = run_pod(direct, pod, pods)
                with pytest.raises(grpc.RpcError) as refused:
                    direct.runtime.UpdatePodSandboxResources(
                        resize_e2e.resize_request(pod_id), timeout=TIMEOUT
                    )
        finally:
            assert 0 == watch.stop()
            assert 0 == guard.stop()
    assert "hook server zz-guard failed PreUpdatePodSandboxResources" in refused.value.details()
    assert "no more cpu" in refused.value.details()
    [request] = watch.requests(hook)
    assert resize_e2e.LABELS.items() <= request["labels"].items()
    assert resize_e2e.ANNOTATIONS.items() <= request["annotations"].items()
    assert resize_e2e.RESOURCES.items() <= request["resources"].items()
    assert resize_e2e.OVERHEAD.items() <= request["overhead"].items()
    assert [] == nri_deprecations(containerd)
