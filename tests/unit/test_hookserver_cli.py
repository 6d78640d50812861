"""Standalone's pure pieces, the registration file format and the CLI's argument handling."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re

import pytest

from krproxy.hookserver import FailurePolicy, PodSelector, Stage, registration_json, targets_from_cri
from krproxy.hookserver._registration import remove_registration, write_registration
from krproxy.hookserver._standalone import cgroup_parent_from_info, find_kubelet_cgroup
from krproxy.hookserver.cli import add_subcommands, build_app
from krproxy.hookserver.testing import FakeNode
from krproxy.proto.runtime import v1 as cri


class TestRegistration:
    def test_koordlet_shape(self) -> None:
        """Compact JSON, koordlet's keys in koordlet's order."""
        text = registration_json("/run/x.sock", FailurePolicy.IGNORE, [Stage.PRE_RUN_POD_SANDBOX])
        assert (
            '{"remote-endpoint":"/run/x.sock","failure-policy":"Ignore","runtime-hooks":["PreRunPodSandbox"]}'
            == text
        )

    def test_atomic_write_and_remove(self, tmp_path: pathlib.Path) -> None:
        """The file appears whole under its name, no temp file is left, and removal is idempotent."""
        path = write_registration(str(tmp_path / "d"), "me", "{}")
        assert ["me.json"] == os.listdir(tmp_path / "d")
        remove_registration(path)
        remove_registration(path)
        assert [] == os.listdir(tmp_path / "d")


class TestStandalonePure:
    def test_cgroup_parent_from_containerd_info(self) -> None:
        """containerd's verbose info: config.linux.cgroup_parent, else the runtime spec's cgroupsPath."""
        info = {"info": json.dumps({"config": {"linux": {"cgroup_parent": "/kubepods/pod1"}}})}
        assert "/kubepods/pod1" == cgroup_parent_from_info(info, "sandbox")
        spec = {"info": json.dumps({"runtimeSpec": {"linux": {"cgroupsPath": "/kubepods/pod1/sandbox"}}})}
        assert "/kubepods/pod1" == cgroup_parent_from_info(spec, "sandbox")
        systemd = {
            "info": json.dumps({"runtimeSpec": {"linux": {"cgroupsPath": "kp-pod1.slice:cri-containerd:x"}}})
        }
        assert "kp-pod1.slice" == cgroup_parent_from_info(systemd, "x")
        assert "" == cgroup_parent_from_info({"info": "not json"}, "sandbox")
        assert "" == cgroup_parent_from_info({}, "sandbox")

    def test_targets_keep_ready_pods_and_running_containers(self) -> None:
        """NOTREADY sandboxes and non-running containers are not targets; resources come from status."""
        meta = cri.PodSandboxMetadata(name="p", uid="u1", namespace="ns")
        sandboxes = [
            cri.PodSandbox(id="s1", metadata=meta, labels={"koordinator.sh/qosClass": "BE"}),
            cri.PodSandbox(id="s2", metadata=meta, state=cri.PodSandboxState.SANDBOX_NOTREADY),
        ]
        containers = [
            cri.Container(
                id="c1",
                pod_sandbox_id="s1",
                metadata=cri.ContainerMetadata(name="a"),
                state=cri.ContainerState.CONTAINER_RUNNING,
            ),
            cri.Container(id="c2", pod_sandbox_id="s1", state=cri.ContainerState.CONTAINER_EXITED),
            cri.Container(id="c3", pod_sandbox_id="s2", state=cri.ContainerState.CONTAINER_RUNNING),
        ]
        statuses = {
            "c1": cri.ContainerStatus(
                id="c1", resources=cri.ContainerResources(linux=cri.LinuxContainerResources(cpuset_cpus="3"))
            )
        }
        (target,) = targets_from_cri(
            sandboxes, {}, containers, statuses, find_cgroup_parent=lambda uid: f"/k/pod{uid}"
        )
        assert ("p", "/k/podu1", "BE") == (
            target.pod.meta.name,
            target.pod.cgroup_parent,
            target.pod.qos_class.value,
        )
        assert [("c1", "a", "3")] == [(c.id, c.name, c.resources.cpuset_cpus) for c in target.containers]

    @pytest.mark.parametrize("version", [1, 2])
    def test_find_kubelet_cgroup(self, tmp_path: pathlib.Path, version: int) -> None:
        """The pod cgroup is found in kubelet's usual places (cgroupfs and systemd)."""
        node = FakeNode(tmp_path, cgroup_version=version).create()
        node.add_cgroup("/kubepods/burstable/podu1")
        node.add_cgroup("kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podu_2.slice")
        ex = node.executor()
        assert "/kubepods/burstable/podu1" == find_kubelet_cgroup(ex, "u1")
        assert "kubepods-besteffort-podu_2.slice" == find_kubelet_cgroup(ex, "u-2")
        assert "" == find_kubelet_cgroup(ex, "nope")


class TestCli:
    def _parse(self, *argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser(prog="krproxy")
        add_subcommands(parser.add_subparsers(dest="command", required=True))
        return parser.parse_args(argv)

    def test_serve_flags(self, tmp_path: pathlib.Path) -> None:
        """serve takes koordlet's options; build_app installs the built-ins with the plugin policy."""
        node = FakeNode(tmp_path).create()
        args = self._parse(
            "hooks",
            "serve",
            "--socket",
            "/tmp/x.sock",
            "--hook-dir",
            str(tmp_path),
            "--failure-policy",
            "Fail",
            "--plugin-failure-policy",
            "Fail",
            "--cgroup-root",
            str(node.cgroup_root),
            "--resctrl-root",
            str(node.resctrl_root),
        )
        assert ("serve", "/tmp/x.sock", "Fail") == (args.hooks_command, args.socket, args.failure_policy)
        app = build_app(args)
        assert FailurePolicy.FAIL == app.plugin_failure_policy
        assert 2 == app.executor.cgroup_version
        assert (
            "cpusuppress",
            "groupidentity",
            "resctrl",
        ) == app.rules.names()
        assert Stage.PRE_CREATE_CONTAINER in app.registry.stages()

    def test_standalone_flags(self) -> None:
        """standalone takes the CRI endpoint and interval; bad choices are refused."""
        args = self._parse("hooks", "standalone", "--cri-endpoint", "unix:///run/c.sock", "--interval", "2")
        assert ("standalone", "unix:///run/c.sock", 2.0) == (
            args.hooks_command,
            args.cri_endpoint,
            args.interval,
        )
        with pytest.raises(SystemExit):
            self._parse("hooks", "serve", "--failure-policy", "Maybe")

    def test_standalone_selector_flags(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--namespace/--selector/--all-pods are parsed; a bad selector exits 2 saying what is wrong."""
        args = self._parse(
            "hooks", "standalone", "--namespace", "batch", "-l", "app=x", "--all-pods", "--selector", "bad"
        )
        assert (["batch"], ["app=x", "bad"], True) == (args.namespace, args.selector, args.all_pods)
        assert 2 == args.func(args)
        assert "'bad' is not key=value" in capsys.readouterr().err


class TestPodSelectorParse:
    """``--selector`` takes kubectl's equality terms; anything else is refused, never read as a
    label no pod has (which would select nothing, silently)."""

    def test_equality_terms(self) -> None:
        """``a=b``, kubectl's ``a==b`` and spaces; several -l values all apply."""
        selector = PodSelector.parse([], ["app=x, tier==batch", "team = a"])
        assert {"app": "x", "tier": "batch", "team": "a"} == dict(selector.labels)

    @pytest.mark.parametrize(
        ("term", "message"),
        [
            ("app!=x", "'app!=x': only key=value"),
            ("env in (a", "'env in (a' is not key=value"),
            ("!app", "'!app' is not key=value"),
            ("app", "'app' is not key=value"),
        ],
    )
    def test_other_terms_are_refused(self, term: str, message: str) -> None:
        with pytest.raises(ValueError, match=re.escape(message)):
            PodSelector.parse([], [term])

    def test_one_key_two_values_is_refused(self) -> None:
        """kubectl would require both (no pod matches): refused, naming the key."""
        with pytest.raises(ValueError, match="label 'app' is given two values"):
            PodSelector.parse([], ["app=x", "app=y"])
