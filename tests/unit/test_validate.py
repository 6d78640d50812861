"""Validation of plugin answers (krproxy.hooks.validate), table by table."""

from __future__ import annotations

from typing import Any

import pytest

from krproxy.hooks.model import ContainerAnswer, ContainerInfo, PodAnswer, PodInfo, Resources
from krproxy.hooks.validate import (
    check_answer,
    check_cgroup_parent,
    check_container_answer,
    check_cpu_list,
    check_pod_answer,
    check_resources,
    is_below,
)

POD_PARENT = "/kubepods/burstable/pod-u1"
POD = PodInfo(name="web", uid="u1", cgroup_parent=POD_PARENT)
CONTAINER = ContainerInfo(pod=POD, name="app", pod_cgroup_parent=POD_PARENT)


class TestCgroupParent:
    @pytest.mark.parametrize(
        "value",
        [
            "/kubepods",
            "/kubepods/burstable/pod-u1",
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podu1.slice",
            "kubepods-burstable-podu1.slice",
            "kubepods.slice",
        ],
    )
    def test_clean_paths_and_slices_pass(self, value: str) -> None:
        """Absolute clean cgroupfs paths and systemd slice names (bare or expanded) are accepted."""
        assert None is check_cgroup_parent(value)

    @pytest.mark.parametrize(
        ("value", "problem"),
        [
            ("/", "the root cgroup"),
            ("/kubepods/../system.slice", "not a clean path (empty, '.' or '..' components)"),
            ("/kubepods/./x", "not a clean path (empty, '.' or '..' components)"),
            ("/kubepods//x", "not a clean path (empty, '.' or '..' components)"),
            ("/kubepods/", "not a clean path (empty, '.' or '..' components)"),
            ("kubepods/burstable", "not an absolute path"),
            ("kubepods", "neither an absolute path nor a systemd slice name"),
            ("-.slice", "neither an absolute path nor a systemd slice name"),
            ("a--b.slice", "neither an absolute path nor a systemd slice name"),
            ("kube pods.slice", "neither an absolute path nor a systemd slice name"),
            ("/kube\0pods", "contains a NUL character"),
            ("/" + "a" * 5000, "longer than 4096 bytes"),
        ],
    )
    def test_bad_paths_are_named(self, value: str, problem: str) -> None:
        """Each malformed cgroup parent gets its own reason."""
        assert problem == check_cgroup_parent(value)


class TestIsBelow:
    @pytest.mark.parametrize(
        ("child", "parent", "expected"),
        [
            ("/kubepods/pod1", "/kubepods/pod1", True),
            ("/kubepods/pod1/sub", "/kubepods/pod1", True),
            ("/kubepods/pod10", "/kubepods/pod1", False),
            ("/kubepods", "/kubepods/pod1", False),
            ("kubepods-pod1-sub.slice", "kubepods-pod1.slice", True),
            ("kubepods-pod1.slice", "/kubepods.slice/kubepods-pod1.slice", True),
            ("kubepods-pod10.slice", "kubepods-pod1.slice", False),
            ("/anything", "/", True),
        ],
    )
    def test_subtree(self, child: str, parent: str, expected: bool) -> None:
        """Below means the same cgroup or a descendant, on path components; slices expand first."""
        assert expected == is_below(child, parent)


class TestCpuList:
    @pytest.mark.parametrize("value", ["", "0", "0-3", "0-3,8,10-15", "0-15:2/4", "7-7"])
    def test_valid(self, value: str) -> None:
        """Linux cpu lists (with the kernel's stride form) are accepted."""
        assert None is check_cpu_list(value)

    @pytest.mark.parametrize(
        ("value", "problem"),
        [
            ("3-1", "range '3-1' runs backwards"),
            ("0,,1", "'' is not a cpu number or range"),
            ("a", "'a' is not a cpu number or range"),
            ("-1", "'-1' is not a cpu number or range"),
            ("0-3 ", "'0-3 ' is not a cpu number or range"),
            ("0-7:3/2", "stride '0-7:3/2' is not used/group with 0 < used <= group"),
            ("123456", "'123456' is not a cpu number or range"),
        ],
    )
    def test_invalid(self, value: str, problem: str) -> None:
        """Malformed cpu lists are named with the offending element."""
        assert problem == check_cpu_list(value)


def resources(**fields: Any) -> Resources:
    return Resources(**fields)


class TestResources:
    @pytest.mark.parametrize(
        "fields",
        [
            {},
            {"cpu_period": 100_000, "cpu_quota": 200_000, "cpu_shares": 1024},
            {"cpu_period": 1000, "cpu_quota": -1, "cpu_shares": 2},
            {"cpu_period": 1_000_000, "cpu_shares": 262_144},
            {"memory_limit_in_bytes": 1 << 50, "memory_swap_limit_in_bytes": -1},
            {"oom_score_adj": -1000},
            {"oom_score_adj": 1000},
            {"cpuset_cpus": "0-3", "cpuset_mems": "0"},
            {"unified": {"memory.high": "max", "cpu.weight": "100"}},
        ],
    )
    def test_in_range(self, fields: dict[str, Any]) -> None:
        """Values a kubelet sends (zero meaning unset) pass."""
        assert [] == check_resources(resources(**fields))

    @pytest.mark.parametrize(
        ("fields", "problem"),
        [
            ({"cpu_period": 999}, "r.cpu_period=999 is not 0 or 1000..1000000 µs"),
            ({"cpu_period": 1_000_001}, "r.cpu_period=1000001 is not 0 or 1000..1000000 µs"),
            ({"cpu_period": -5}, "r.cpu_period=-5 is not 0 or 1000..1000000 µs"),
            ({"cpu_quota": -2}, "r.cpu_quota=-2 is not -1 (unlimited) or more"),
            ({"cpu_shares": 1}, "r.cpu_shares=1 is not 0 or 2..262144"),
            ({"cpu_shares": 262_145}, "r.cpu_shares=262145 is not 0 or 2..262144"),
            ({"memory_limit_in_bytes": -1}, "r.memory_limit_in_bytes=-1 is not 0..1 PiB"),
            (
                {"memory_limit_in_bytes": (1 << 50) + 1},
                f"r.memory_limit_in_bytes={(1 << 50) + 1} is not 0..1 PiB",
            ),
            ({"memory_swap_limit_in_bytes": -2}, "r.memory_swap_limit_in_bytes=-2 is not -1..1 PiB"),
            ({"oom_score_adj": 1001}, "r.oom_score_adj=1001 is not -1000..1000"),
            ({"oom_score_adj": -1001}, "r.oom_score_adj=-1001 is not -1000..1000"),
            ({"cpuset_cpus": "0-"}, "r.cpuset_cpus: '0-' is not a cpu number or range"),
            ({"cpuset_mems": "2-1"}, "r.cpuset_mems: range '2-1' runs backwards"),
            ({"unified": {"../cpu.max": "1"}}, "r.unified key '../cpu.max' is not a cgroup file name"),
            ({"unified": {"": "1"}}, "r.unified key '' is not a cgroup file name"),
            ({"unified": {"cpu.max": "1\x002"}}, "r.unified[cpu.max] contains a NUL character"),
        ],
    )
    def test_out_of_range(self, fields: dict[str, Any], problem: str) -> None:
        """Each absurd value is named with its field and the allowed range."""
        assert [problem] == check_resources(resources(**fields), "r")

    def test_every_problem_is_listed(self) -> None:
        """Several bad fields give several violations, in field order."""
        answer = resources(cpu_shares=1, oom_score_adj=5000)
        assert 2 == len(check_resources(answer))


class TestPodAnswer:
    @pytest.mark.parametrize(
        ("answer", "expected"),
        [
            (PodAnswer(), []),
            (PodAnswer(cgroup_parent="/kubepods/besteffort/pod-u1"), []),
            (PodAnswer(cgroup_parent="/elsewhere"), []),
            (PodAnswer(labels={"a": "1"}, annotations={"b/c": ""}), []),
            (
                PodAnswer(cgroup_parent="/kubepods/../../etc"),
                ["cgroup_parent '/kubepods/../../etc': not a clean path (empty, '.' or '..' components)"],
            ),
            (PodAnswer(cgroup_parent="/"), ["cgroup_parent '/': the root cgroup"]),
            (PodAnswer(labels={"": "x"}), ["labels has an empty key"]),
            (
                PodAnswer(annotations={"a\0b": "x"}),
                ["annotations key 'a\\x00b' contains a NUL character"],
            ),
            (
                PodAnswer(annotations={"a": "x\0"}),
                ["annotations[a] contains a NUL character"],
            ),
            # Pod resources are never applied in CRI mode, so they are not checked.
            (PodAnswer(resources=resources(cpu_shares=-1)), []),
        ],
    )
    def test_table(self, answer: PodAnswer, expected: list[str]) -> None:
        """A pod answer may move the pod anywhere clean; maps need non-empty NUL-free keys."""
        assert expected == check_pod_answer(POD, answer)

    def test_echo_of_the_current_parent_is_never_wrong(self) -> None:
        """Whatever kubelet sent as the cgroup parent may be echoed back."""
        pod = PodInfo(cgroup_parent="odd")
        assert [] == check_pod_answer(pod, PodAnswer(cgroup_parent="odd"))


class TestContainerAnswer:
    @pytest.mark.parametrize(
        ("answer", "expected"),
        [
            (ContainerAnswer(), []),
            (ContainerAnswer(pod_cgroup_parent=POD_PARENT), []),
            (ContainerAnswer(pod_cgroup_parent=POD_PARENT + "/sub"), []),
            (
                ContainerAnswer(pod_cgroup_parent="/kubepods"),
                ["pod_cgroup_parent '/kubepods': outside the pod's cgroup '/kubepods/burstable/pod-u1'"],
            ),
            (
                ContainerAnswer(pod_cgroup_parent=POD_PARENT + "/../../x"),
                [
                    f"pod_cgroup_parent '{POD_PARENT}/../../x': "
                    "not a clean path (empty, '.' or '..' components)"
                ],
            ),
            (ContainerAnswer(envs={"PATH": "/bin", "A_1": ""}), []),
            (
                ContainerAnswer(envs={"A=B": "1"}),
                ["env name 'A=B' is not a name (empty, or contains '=' or NUL)"],
            ),
            (
                ContainerAnswer(envs={"": "1"}),
                ["env name '' is not a name (empty, or contains '=' or NUL)"],
            ),
            (
                ContainerAnswer(envs={"A": "x\0y"}),
                ["env A value contains a NUL character"],
            ),
            (
                ContainerAnswer(annotations={"": "1"}),
                ["container_annotations has an empty key"],
            ),
            (
                ContainerAnswer(resources=resources(memory_limit_in_bytes=-1)),
                ["container_resources.memory_limit_in_bytes=-1 is not 0..1 PiB"],
            ),
        ],
    )
    def test_table(self, answer: ContainerAnswer, expected: list[str]) -> None:
        """A container answer keeps the container inside its pod's cgroup, with sane resources and env names."""
        assert expected == check_container_answer(CONTAINER, answer)

    def test_pod_moved_by_a_pod_hook_is_allowed(self) -> None:
        """The pod record's own cgroup parent (set by PreRunPodSandbox) counts as the pod's cgroup too."""
        info = ContainerInfo(pod=PodInfo(cgroup_parent="/kubepods/moved-u1"), pod_cgroup_parent=POD_PARENT)
        answer = ContainerAnswer(pod_cgroup_parent="/kubepods/moved-u1")
        assert [] == check_container_answer(info, answer)

    def test_unknown_pod_parent_checks_syntax_only(self) -> None:
        """Without a known pod cgroup, any clean path is accepted, and an unclean one still refused."""
        info = ContainerInfo()
        good = ContainerAnswer(pod_cgroup_parent="/anywhere")
        bad = ContainerAnswer(pod_cgroup_parent="relative")
        assert ([], 1) == (check_container_answer(info, good), len(check_container_answer(info, bad)))


class TestCheckAnswer:
    def test_dispatches_on_record_and_answer_type(self) -> None:
        """Pod records get pod rules, container records container rules, anything else no rules."""
        bad_pod = PodAnswer(labels={"": "x"})
        bad_container = ContainerAnswer(envs={"=": "x"})
        assert (1, 1, 0, 0) == (
            len(check_answer(POD, bad_pod)),
            len(check_answer(CONTAINER, bad_container)),
            len(check_answer(POD, bad_container)),
            len(check_answer(object(), bad_pod)),
        )
