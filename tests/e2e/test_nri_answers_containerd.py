"""A hook server's answer as containerd's NRI applies it, against the same answer through ``krproxy serve``.

NRI gives some spellings of an adjustment a meaning of its own (a key beginning with ``-`` marks a
removal) and applies some fields its own way (a memory swap limit); the container proxy mode creates is
the reference: what NRI mode cannot give the same way it must not give another way, and says so
(``nri_change_not_applied``). Every value is read from the runtime (ContainerStatus's verbose
``runtimeSpec``, the cgroup files), never from krproxy or the hook server.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
from cri_api.v1 import api_pb2 as pb

from tests.e2e.support import (
    TIMEOUT,
    Containerd,
    Cri,
    Plugin,
    Proxy,
    cgroup_file,
    cgroups_of,
    container_config,
    container_pid,
    pod_config,
    start_plugin,
    verbose_info,
)
from tests.e2e.test_containerd_hooks import MiB, cleanup, create_container, run_pod, start
from tests.e2e.test_nri_containerd import hooks_in_effect, krproxy_nri

HOOKS = ["PreCreateContainer"]


def landed(cri: Cri, containerd: Containerd, direct: Cri) -> dict[str, Any]:
    """Create and start a container through ``cri`` (kubelet's env ``FOO=bar``, annotation ``x=y``,
    memory limit 64 MiB); its spec's env (but PATH and HOSTNAME) and annotations, its CRI annotations and
    its memory cgroup's limits."""
    pod = pod_config(containerd.cgroup_parent, "answers")
    container = container_config(containerd.busybox)
    container.envs.append(pb.KeyValue(key="FOO", value="bar"))
    container.annotations["x"] = "y"
    container.linux.resources.memory_limit_in_bytes = 64 * MiB
    with cleanup(direct) as pods:
        pod_id = run_pod(cri, pod, pods)
        cid = create_container(cri, pod_id, pod, container)
        start(cri, cid)
        reply = direct.runtime.ContainerStatus(
            pb.ContainerStatusRequest(container_id=cid, verbose=True), timeout=TIMEOUT
        )
        spec = verbose_info(reply)["runtimeSpec"]
        memory = cgroups_of(container_pid(direct, cid))["memory"]
        return {
            "env": sorted(e for e in spec["process"]["env"] if not e.startswith(("PATH=", "HOSTNAME="))),
            "spec_annotations": spec.get("annotations", {}),
            "status_annotations": dict(reply.status.annotations),
            "limit": cgroup_file("memory", memory, "memory.limit_in_bytes"),
            "memsw": cgroup_file("memory", memory, "memory.memsw.limit_in_bytes"),
        }


@attrs.frozen
class Landed:
    """What landed through ``krproxy serve`` and through ``krproxy nri`` (:func:`landed`), the
    PreCreateContainer request the hook server got in each, and krproxy nri's warnings."""

    proxied: dict[str, Any]
    through_nri: dict[str, Any]
    proxy_request: dict[str, Any]
    nri_request: dict[str, Any]
    not_applied: list[str]


def both_modes(
    containerd: Containerd,
    direct: Cri,
    short_tmp: Path,
    proxy: Proxy,
    plugins: Callable[..., Plugin],
    **answer: Any,
) -> Landed:
    """A hook server answering ``answer`` (plugin_process's config) at PreCreateContainer, through
    ``krproxy serve`` then through ``krproxy nri``."""
    served = plugins("answer", hooks=HOOKS, failure_policy="Fail", **answer)
    with Cri.connect(proxy.socket) as via_proxy:
        proxied = landed(via_proxy, containerd, direct)
    nri_dir = short_tmp / "nri"
    nri_dir.mkdir()
    with krproxy_nri(containerd, nri_dir) as daemon:
        plugin = start_plugin(daemon, "answer", hooks=HOOKS, failure_policy="Fail", **answer)
        try:
            hooks_in_effect(daemon)
            through_nri = landed(direct, containerd, direct)
        finally:
            assert 0 == plugin.stop()
        log = daemon.log
    [proxy_request] = served.requests("PreCreateContainer")
    [nri_request] = plugin.requests("PreCreateContainer")
    warnings = [line for line in log.splitlines() if "event=nri_change_not_applied" in line]
    return Landed(proxied, through_nri, proxy_request, nri_request, warnings)


def test_removal_marks_are_withheld(
    containerd: Containerd, direct: Cri, short_tmp: Path, proxy: Proxy, plugins: Callable[..., Plugin]
) -> None:
    """An env var ``-FOO`` and an annotation ``-io.kubernetes.cri.container-name`` reach the container as
    named through ``krproxy serve``; through ``krproxy nri`` they would be NRI's removal marks (the
    runtime's own annotation removed from the spec): withheld, and said, and kubelet's ``FOO`` stays."""
    name = "io.kubernetes.cri.container-name"
    both = both_modes(
        containerd,
        direct,
        short_tmp,
        proxy,
        plugins,
        envs={"PreCreateContainer": {"-FOO": "1", "NEW": "n"}},
        annotations={"PreCreateContainer": {f"-{name}": "v"}},
    )
    assert ["-FOO=1", "FOO=bar", "NEW=n"] == both.proxied["env"]
    assert "v" == both.proxied["status_annotations"][f"-{name}"]
    assert "loop" == both.proxied["spec_annotations"][name]
    assert ["FOO=bar", "NEW=n"] == both.through_nri["env"]
    assert "loop" == both.through_nri["spec_annotations"][name]
    [said] = [line for line in both.not_applied if "removal mark" in line]
    assert f"fields=annotations[-{name}],env[-FOO] " in said


def test_swap_is_said_not_applied(
    containerd: Containerd, direct: Cri, short_tmp: Path, proxy: Proxy, plugins: Callable[..., Plugin]
) -> None:
    """A swap limit of the hook server's own lands in ``memory.memsw.limit_in_bytes`` through ``krproxy
    serve``; containerd's NRI sets the swap limit to the memory limit whatever a plugin asks, so
    ``krproxy nri`` says it is not applied."""
    both = both_modes(
        containerd,
        direct,
        short_tmp,
        proxy,
        plugins,
        resources={"PreCreateContainer": {"memory_swap_limit_in_bytes": 128 * MiB}},
    )
    assert (str(64 * MiB), str(128 * MiB)) == (both.proxied["limit"], both.proxied["memsw"])
    assert (str(64 * MiB), str(64 * MiB)) == (both.through_nri["limit"], both.through_nri["memsw"])
    [said] = [line for line in both.not_applied if "memory_swap_limit_in_bytes" in line]
    assert "sets the memory swap limit to the memory limit" in said


def test_annotations_land_in_the_spec(
    containerd: Containerd, direct: Cri, short_tmp: Path, proxy: Proxy, plugins: Callable[..., Plugin]
) -> None:
    """Where a hook server's container annotation lands differs, as NRI defines it: through ``krproxy
    serve`` in the container's CRI annotations (ContainerStatus), not in its OCI spec; through ``krproxy
    nri`` in the OCI spec, not in the CRI annotations. The hook server is shown kubelet's annotations
    (``x``) and env (``FOO``) in both, and in NRI mode the OCI spec's too (containerd's
    ``io.kubernetes.cri.*``, ``PATH``)."""
    both = both_modes(
        containerd, direct, short_tmp, proxy, plugins, annotations={"PreCreateContainer": {"z": "w"}}
    )
    assert ("w", None) == (
        both.proxied["status_annotations"].get("z"),
        both.proxied["spec_annotations"].get("z"),
    )
    assert (None, "w") == (
        both.through_nri["status_annotations"].get("z"),
        both.through_nri["spec_annotations"].get("z"),
    )
    assert {"x": "y"} == both.proxy_request["container_annotations"]
    seen = both.nri_request["container_annotations"]
    assert ("y", "loop") == (seen["x"], seen["io.kubernetes.cri.container-name"])
    assert {"FOO": "bar"} == both.proxy_request["container_envs"]
    envs = both.nri_request["container_envs"]
    assert "bar" == envs["FOO"] and "PATH" in envs


def oom_score_adj(cri: Cri, containerd: Containerd, direct: Cri, requested: int = 0) -> str:
    """Create (kubelet's ``oom_score_adj``: *requested*) and start a container through ``cri``; its
    process's ``oom_score_adj``."""
    pod = pod_config(containerd.cgroup_parent, "oom")
    container = container_config(containerd.busybox)
    container.linux.resources.oom_score_adj = requested
    with cleanup(direct) as pods:
        pod_id = run_pod(cri, pod, pods)
        cid = create_container(cri, pod_id, pod, container)
        start(cri, cid)
        return Path(f"/proc/{container_pid(direct, cid)}/oom_score_adj").read_text().strip()


def test_a_restricted_oom_score_adj_is_withheld(
    containerd: Containerd, direct: Cri, short_tmp: Path, proxy: Proxy, plugins: Callable[..., Plugin]
) -> None:
    """containerd's ``restrict_oom_score_adj`` (set by the sandbox: root has no CAP_SYS_RESOURCE) keeps a
    container at or above containerd's own ``oom_score_adj``: a hook server's ``-500`` gives containerd's
    own through ``krproxy serve``. NRI's adjustment goes around the restriction (on 2.1 the spec said -500
    and runc failed to start the container); ``krproxy nri``, reading the setting from
    ``--containerd-config``, withholds it and says so: the container starts as without the hook (krproxy
    does not know containerd's own value to send instead)."""
    own = Path(f"/proc/{containerd.state['pid']}/oom_score_adj").read_text().strip()
    assert -500 < int(own)
    unhooked = oom_score_adj(direct, containerd, direct)
    answer = {"resources": {"PreCreateContainer": {"oom_score_adj": -500}}}
    plugins("oom", hooks=HOOKS, failure_policy="Fail", **answer)
    with Cri.connect(proxy.socket) as via_proxy:
        assert own == oom_score_adj(via_proxy, containerd, direct)
    nri_dir = short_tmp / "nri"
    nri_dir.mkdir()
    flags = ("--containerd-config", str(containerd.dir / "config.toml"))
    with krproxy_nri(containerd, nri_dir, flags) as daemon:
        plugin = start_plugin(daemon, "oom", hooks=HOOKS, failure_policy="Fail", **answer)
        try:
            hooks_in_effect(daemon)
            assert unhooked == oom_score_adj(direct, containerd, direct)
        finally:
            assert 0 == plugin.stop()
        log = daemon.log
    assert "event=nri_cri_settings restrict_oom_score_adj=yes" in log
    [said] = [line for line in log.splitlines() if "fields=oom_score_adj lowered" in line.replace('"', "")]
    assert "restrict_oom_score_adj" in said


def test_a_restricted_oom_score_adj_above_containerd_s_is_applied(
    containerd: Containerd, direct: Cri, short_tmp: Path, proxy: Proxy, plugins: Callable[..., Plugin]
) -> None:
    """With ``restrict_oom_score_adj``, kubelet asking 900 and a hook server answering a value below 900
    but above containerd's own: containerd gives the hook's value through ``krproxy serve`` (it only keeps a
    container at or above its *own* ``oom_score_adj``); ``krproxy nri`` gives it too."""
    if containerd.major < 2:
        pytest.skip("containerd 1.7's NRI (0.6.1) has no oom_score_adj adjustment")
    own = int(Path(f"/proc/{containerd.state['pid']}/oom_score_adj").read_text())
    lowered = (own + 900) // 2
    assert own < lowered < 900
    answer = {"resources": {"PreCreateContainer": {"oom_score_adj": lowered}}}
    plugins("oom", hooks=HOOKS, failure_policy="Fail", **answer)
    with Cri.connect(proxy.socket) as via_proxy:
        assert str(lowered) == oom_score_adj(via_proxy, containerd, direct, 900)
    nri_dir = short_tmp / "nri"
    nri_dir.mkdir()
    flags = ("--containerd-config", str(containerd.dir / "config.toml"))
    with krproxy_nri(containerd, nri_dir, flags) as daemon:
        plugin = start_plugin(daemon, "oom", hooks=HOOKS, failure_policy="Fail", **answer)
        try:
            hooks_in_effect(daemon)
            assert str(lowered) == oom_score_adj(direct, containerd, direct, 900)
        finally:
            assert 0 == plugin.stop()
