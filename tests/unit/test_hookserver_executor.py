"""The executor writes only under its roots, per cgroup version, and reports changes."""

from __future__ import annotations

import os
import pathlib

import pytest

from krproxy.hookserver import (
    CgroupFile,
    Change,
    Executor,
    PathOutsideRootError,
    container_cgroup_dir,
    pod_cgroup_dir,
)
from krproxy.hookserver._cgroups import shares_to_weight
from krproxy.hookserver._executor import CgroupWriteError
from krproxy.hookserver.testing import FakeNode

POD = "/kubepods/besteffort/pod1"


class TestPaths:
    @pytest.mark.parametrize(
        ("file", "v1", "v2"),
        [
            (
                CgroupFile.CPU_SHARES,
                "cpu/kubepods/besteffort/pod1/cpu.shares",
                "kubepods/besteffort/pod1/cpu.weight",
            ),
            (
                CgroupFile.CFS_QUOTA,
                "cpu/kubepods/besteffort/pod1/cpu.cfs_quota_us",
                "kubepods/besteffort/pod1/cpu.max",
            ),
            (
                CgroupFile.CPUSET_CPUS,
                "cpuset/kubepods/besteffort/pod1/cpuset.cpus",
                "kubepods/besteffort/pod1/cpuset.cpus",
            ),
            (
                CgroupFile.CPU_USAGE,
                "cpuacct/kubepods/besteffort/pod1/cpuacct.usage",
                "kubepods/besteffort/pod1/cpu.stat",
            ),
        ],
    )
    def test_file_per_version(self, file: CgroupFile, v1: str, v2: str) -> None:
        """v1 puts each controller in its own hierarchy; v2 has one tree with renamed files."""
        assert (v1, v2) == (file.path(POD, 1), file.path(POD, 2))

    def test_cgroupfs_dirs(self) -> None:
        """cgroupfs: the pod dir is the cgroup parent; the container dir is parent/<id>."""
        assert "kubepods/besteffort/pod1" == pod_cgroup_dir(POD)
        assert "kubepods/besteffort/pod1/abc" == container_cgroup_dir(POD, "abc")

    def test_systemd_dirs(self) -> None:
        """systemd: slices nest by their dash-separated prefix; containers are cri-containerd scopes."""
        parent = "kubepods-besteffort-pod1_2.slice"
        assert "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1_2.slice" == pod_cgroup_dir(
            parent
        )
        assert container_cgroup_dir(parent, "abc").endswith("pod1_2.slice/cri-containerd-abc.scope")

    @pytest.mark.parametrize(
        ("shares", "weight"),
        # runc's (opencontainers/cgroups) values; 2000 → 170 is what runc issue 4896 shows for v1.4.
        [
            (0, 0),
            (1, 1),
            (2, 1),
            (3, 2),
            (1024, 100),
            (2000, 170),
            (262143, 10000),
            (262144, 10000),
            (262145, 10000),
            (10**9, 10000),
        ],
    )
    def test_shares_to_weight(self, shares: int, weight: int) -> None:
        """runc's conversion: 0 is "unset" (0), the ends and the defaults meet (2 → 1, 1024 → 100,
        262144 → 10000), and values beyond the v1 range are clamped to the v2 range."""
        assert weight == shares_to_weight(shares)

    def test_negative_shares_refused(self) -> None:
        with pytest.raises(ValueError, match="negative"):
            shares_to_weight(-1)


class TestExecutor:
    @pytest.mark.parametrize("version", [1, 2])
    def test_set_reports_old_and_new_and_skips_unchanged(self, tmp_path: pathlib.Path, version: int) -> None:
        """A write reports old → new; writing the same value again changes nothing."""
        node = FakeNode(tmp_path, cgroup_version=version).create()
        node.add_cgroup(POD)
        ex = node.executor()
        change = ex.set(POD, CgroupFile.CFS_QUOTA, 50000)
        expected = ("-1", "50000") if version == 1 else ("max 100000", "50000 100000")
        assert change is not None
        assert expected == (change.old, change.new)
        assert expected[1] == node.read(POD, CgroupFile.CFS_QUOTA)
        assert ex.set(POD, CgroupFile.CFS_QUOTA, 50000) is None

    def test_v2_conversions(self, tmp_path: pathlib.Path) -> None:
        """v2: shares become cpu.weight, quota −1 becomes "max <period>", memory ≤0 becomes "max"."""
        node = FakeNode(tmp_path).create()
        node.add_cgroup(POD)
        node.write(POD, CgroupFile.CFS_QUOTA, "20000 50000")
        ex = node.executor()
        ex.set(POD, CgroupFile.CPU_SHARES, 2)
        ex.set(POD, CgroupFile.CFS_QUOTA, -1)
        ex.set(POD, CgroupFile.MEMORY_LIMIT, 1 << 30)
        assert ("1", "max 50000", str(1 << 30)) == (
            node.read(POD, CgroupFile.CPU_SHARES),
            node.read(POD, CgroupFile.CFS_QUOTA),
            node.read(POD, CgroupFile.MEMORY_LIMIT),
        )

    @pytest.mark.parametrize("version", [1, 2])
    def test_zero_shares_write_nothing(self, tmp_path: pathlib.Path, version: int) -> None:
        """cpu.shares 0 means "unset" (as for runc): neither cpu.shares nor cpu.weight is written
        (the kernel would take 0 as its minimum: shares 2, weight 1)."""
        node = FakeNode(tmp_path, cgroup_version=version).create()
        node.add_cgroup(POD)
        before = node.read(POD, CgroupFile.CPU_SHARES)
        assert node.executor().set(POD, CgroupFile.CPU_SHARES, 0) is None
        assert before == node.read(POD, CgroupFile.CPU_SHARES)

    @pytest.mark.parametrize("version", [1, 2])
    def test_negative_shares_named_in_the_error(self, tmp_path: pathlib.Path, version: int) -> None:
        node = FakeNode(tmp_path, cgroup_version=version).create()
        node.add_cgroup(POD)
        with pytest.raises(CgroupWriteError, match=r"'-5'.*cpu\.(shares|weight).*negative"):
            node.executor().set(POD, CgroupFile.CPU_SHARES, -5)

    @pytest.mark.parametrize("version", [1, 2])
    def test_shares_written_per_version(self, tmp_path: pathlib.Path, version: int) -> None:
        """v1 takes the shares as they are, v2 their weight."""
        node = FakeNode(tmp_path, cgroup_version=version).create()
        node.add_cgroup(POD)
        node.executor().set(POD, CgroupFile.CPU_SHARES, 2048)
        assert ("2048" if version == 1 else str(shares_to_weight(2048))) == node.read(
            POD, CgroupFile.CPU_SHARES
        )

    def test_detects_version(self, tmp_path: pathlib.Path) -> None:
        """cgroup.controllers at the root means v2."""
        v2 = FakeNode(tmp_path / "a").create()
        v1 = FakeNode(tmp_path / "b", cgroup_version=1).create()
        assert (2, 1) == (
            Executor.for_roots(v2.cgroup_root, v2.resctrl_root).cgroup_version,
            Executor.for_roots(v1.cgroup_root, v1.resctrl_root).cgroup_version,
        )

    def test_missing_file_is_not_created(self, tmp_path: pathlib.Path) -> None:
        """A cgroup that does not exist is an error, never a new directory (that would be a new cgroup)."""
        node = FakeNode(tmp_path).create()
        with pytest.raises(FileNotFoundError):
            node.executor().set("/kubepods/besteffort/podX", CgroupFile.CPU_IDLE, 1)
        assert not (node.cgroup_root / "kubepods").exists()

    @pytest.mark.parametrize("bad", ["/../../etc", "../outside", "/kubepods/../../outside"])
    def test_refuses_dotdot(self, tmp_path: pathlib.Path, bad: str) -> None:
        """``..`` that climbs out of the root is refused before anything is touched."""
        node = FakeNode(tmp_path).create()
        (tmp_path / "outside").mkdir()
        with pytest.raises(PathOutsideRootError):
            node.executor().set(bad, CgroupFile.CPU_IDLE, 1)

    def test_refuses_symlink_out(self, tmp_path: pathlib.Path) -> None:
        """A symlink inside the root pointing outside is resolved and refused."""
        node = FakeNode(tmp_path).create()
        outside = tmp_path / "elsewhere"
        outside.mkdir()
        (outside / "cpu.idle").write_text("0\n")
        os.symlink(outside, node.cgroup_root / "evil")
        with pytest.raises(PathOutsideRootError):
            node.executor().set("/evil", CgroupFile.CPU_IDLE, 1)
        assert "0\n" == (outside / "cpu.idle").read_text()

    def test_refuses_resctrl_escape(self, tmp_path: pathlib.Path) -> None:
        """Resctrl paths are confined to the resctrl root too."""
        node = FakeNode(tmp_path).create()
        with pytest.raises(PathOutsideRootError):
            node.executor().resctrl_add_tasks("../cgroup", [1])
        with pytest.raises(ValueError, match="bad resctrl group"):
            node.executor().resctrl_group("..", ["L3:0=f"])

    def test_resctrl_group_and_tasks(self, tmp_path: pathlib.Path) -> None:
        """A group is created with its schemata; tasks are appended once each."""
        node = FakeNode(tmp_path).create()
        ex = node.executor()
        changes = ex.resctrl_group("BE", ["L3:0=f", "MB:0=50"])
        assert 2 == len(changes)
        assert "L3:0=f\nMB:0=50" == node.read_resctrl("BE/schemata")
        assert [] == ex.resctrl_group("BE", ["L3:0=f", "MB:0=50"])
        assert [Change(str(ex.resctrl_path("BE/tasks")), None, "7")] == ex.resctrl_add_tasks("BE", [7])
        ex.resctrl_add_tasks("BE", [7, 8])
        assert "7\n8" == node.read_resctrl("BE/tasks")
