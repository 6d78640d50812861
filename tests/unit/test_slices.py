"""systemd slice names and the cgroup paths they stand for (krproxy/hooks/slices.py), and their users.

The rule is runc's ``ExpandSlice`` (libcontainer/cgroups/systemd): ``a-b-c.slice`` is
``/a.slice/a-b.slice/a-b-c.slice``, ``-.slice`` is the root slice ``/``, and a name with an empty
component (``a--b.slice``, ``-a.slice``, ``a-.slice``, ``.slice``) or a ``/`` is no slice name at all
(runc refuses it). Docker mode shows a non-slice value to plugins as sent; the SDK's cgroup
directories for kubelet's own parents (three QoS classes, two drivers) are what they always were.
"""

from __future__ import annotations

import pytest

from krproxy.docker import convert
from krproxy.hooks import validate
from krproxy.hooks.slices import is_slice_name, slice_path
from krproxy.hookserver import container_cgroup_dir, pod_cgroup_dir

#: Names runc's ExpandSlice refuses ("invalid slice name"): no slice, whatever else they look like.
NOT_SLICE_NAMES = ["", ".slice", "a--b.slice", "-a.slice", "a-.slice", "--.slice", "a/b.slice", "kubepods"]


class TestSliceNames:
    def test_root_slice(self) -> None:
        """``-.slice`` is systemd's root slice: the root cgroup, not ``/.slice/-.slice``."""
        assert (True, "/") == (is_slice_name("-.slice"), slice_path("-.slice"))

    @pytest.mark.parametrize("name", NOT_SLICE_NAMES)
    def test_names_runc_refuses_are_no_slice_names(self, name: str) -> None:
        assert not is_slice_name(name)

    @pytest.mark.parametrize(
        ("name", "path"),
        [
            ("x.slice", "/x.slice"),
            ("a-b-c.slice", "/a.slice/a-b.slice/a-b-c.slice"),
            ("a.b_c:d-e.slice", "/a.b_c:d.slice/a.b_c:d-e.slice"),
        ],
    )
    def test_each_dash_opens_a_level(self, name: str, path: str) -> None:
        assert (True, path) == (is_slice_name(name), slice_path(name))


class TestUsers:
    def test_docker_root_slice(self) -> None:
        """Docker mode shows ``-.slice`` as the root cgroup, and writes the root back as ``-.slice``."""
        assert "/" == convert.to_cri_cgroup_parent("systemd", "-.slice")
        assert "-.slice" == convert.to_docker_cgroup_parent("systemd", "/")

    @pytest.mark.parametrize("name", NOT_SLICE_NAMES)
    def test_docker_shows_a_non_slice_as_sent(self, name: str) -> None:
        """docker-mode.md: a value that is not a slice name is shown to plugins as sent."""
        assert name == convert.to_cri_cgroup_parent("systemd", name)

    def test_sdk_root_slice(self) -> None:
        """A pod in the root slice: its directory is the hierarchy root, its container's scope right below."""
        assert ("", "cri-containerd-abc.scope") == (
            pod_cgroup_dir("-.slice"),
            container_cgroup_dir("-.slice", "abc"),
        )

    def test_validation_root_slice_covers_everything(self) -> None:
        assert validate.is_below("/kubepods.slice", "-.slice")
        assert not validate.is_below("-.slice", "kubepods.slice")

    @pytest.mark.parametrize(
        ("parent", "pod_dir", "container_dir"),
        [
            ("/kubepods/pod1", "kubepods/pod1", "kubepods/pod1/abc"),
            ("/kubepods/burstable/pod1", "kubepods/burstable/pod1", "kubepods/burstable/pod1/abc"),
            ("/kubepods/besteffort/pod1", "kubepods/besteffort/pod1", "kubepods/besteffort/pod1/abc"),
            (
                "kubepods-pod1_2.slice",
                "kubepods.slice/kubepods-pod1_2.slice",
                "kubepods.slice/kubepods-pod1_2.slice/cri-containerd-abc.scope",
            ),
            (
                "kubepods-burstable-pod1_2.slice",
                "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1_2.slice",
                "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1_2.slice/cri-containerd-abc.scope",
            ),
            (
                "kubepods-besteffort-pod1_2.slice",
                "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1_2.slice",
                "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1_2.slice/cri-containerd-abc.scope",
            ),
        ],
    )
    def test_sdk_dirs_of_kubelets_parents(self, parent: str, pod_dir: str, container_dir: str) -> None:
        """Guaranteed, burstable and besteffort pods on cgroupfs and systemd: the directories kubelet and
        containerd create (unchanged by the shared slice_path)."""
        assert (pod_dir, container_dir) == (pod_cgroup_dir(parent), container_cgroup_dir(parent, "abc"))

    @pytest.mark.parametrize("name", ["kubepods-.slice", "a--b.slice", "-a.slice", "-.slice", ".slice"])
    def test_validation_refuses_what_runc_refuses(self, name: str) -> None:
        """A plugin answer with a cgroup parent runc cannot expand (or the root) is refused at the proxy,
        under the plugin's failure policy, rather than failing the pod in runc."""
        assert validate.check_cgroup_parent(name) is not None
