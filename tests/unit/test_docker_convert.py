"""Docker JSON ⇄ hook records (krproxy.docker.convert), routes and the pure HTTP helpers."""

from __future__ import annotations

import attrs
import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from krproxy.docker import convert
from krproxy.docker._http import error_reply, raw_head, with_body_length
from krproxy.docker.convert import K8sName
from krproxy.docker.routes import Action, Route, query_value, route
from krproxy.docker.server import _hijacks
from krproxy.hooks import validate
from krproxy.hooks.model import ContainerInfo, PodAnswer, PodInfo, Resources
from krproxy.hooks.slices import slice_path
from krproxy.hookserver._cgroups import pod_cgroup_dir
from tests.records import DOCKER_HOST_RESOURCES, WEB_POD

HOST_CONFIG = {
    **DOCKER_HOST_RESOURCES,
    "MemorySwap": 2 << 30,
    "CgroupParent": "/kubepods/burstable/poduid",
}
RESOURCES = Resources(100_000, 200_000, 2048, 1 << 30, 900, "0-3", "0", memory_swap_limit_in_bytes=2 << 30)


class TestNames:
    def test_parses_dockershim_name(self) -> None:
        """A dockershim name yields container, pod, namespace, uid and attempt (inspect's ``/`` allowed)."""
        assert K8sName("app", "web", "prod", "uid-1", 3) == convert.parse_k8s_name(
            "/k8s_app_web_prod_uid-1_3"
        )

    @pytest.mark.parametrize(
        "name", ["", "web", "k8s_app_web_prod_uid_x", "k8s_a_b_c_d", "x8s_a_b_c_d_1", "k8s__b_c_d_1"]
    )
    def test_rejects_other_names(self, name: str) -> None:
        """Names that are not six ``_`` tokens starting with k8s and ending with a number are not kubelet's."""
        assert convert.parse_k8s_name(name) is None


class TestLabels:
    def test_split_by_annotation_prefix(self) -> None:
        """``annotation.`` labels are annotations (prefix removed), the rest are labels."""
        labels, annotations = convert.split_labels({"app": "web", "annotation.a.b/c": "1"})
        assert ({"app": "web"}, {"a.b/c": "1"}) == (dict(labels), dict(annotations))

    def test_sandbox_label(self) -> None:
        """Only ``io.kubernetes.docker.type=podsandbox`` marks a sandbox."""
        assert (True, False) == (
            convert.is_sandbox({"io.kubernetes.docker.type": "podsandbox"}),
            convert.is_sandbox({"io.kubernetes.docker.type": "container"}),
        )


class TestEnvs:
    def test_later_duplicate_wins(self) -> None:
        """The map keeps first-seen order and the later value; entries without ``=`` are left out."""
        envs = convert.envs_from_docker(["A=1", "B=x=y", "A=2", "BARE"])
        assert [("A", "2"), ("B", "x=y")] == list(envs.items())

    def test_rebuild_keeps_order_and_adds_sorted(self) -> None:
        """Rebuilt envs keep the original positions, drop duplicates, keep bare names, add new names sorted."""
        assert ["A=9", "BARE", "B=2", "C=3", "Z=0"] == convert.rebuild_env(
            ["A=1", "BARE", "B=2", "A=1"], {"A": "9", "B": "2", "Z": "0", "C": "3"}
        )

    @given(st.dictionaries(st.text("ABC_", min_size=1, max_size=3), st.text(max_size=3), max_size=5))
    def test_rebuild_round_trips(self, envs: dict[str, str]) -> None:
        """Rebuilding a map into an empty list and reading it back gives the map."""
        assert envs == dict(convert.envs_from_docker(convert.rebuild_env([], envs)))


#: koord-runtime-proxy's ToCriCgroupPath cases (pkg/runtimeproxy/server/docker utils_test.go), then ours.
SYSTEMD_PARENTS = [
    (
        "kubepods-burstable-djfklsjdf98.slice",
        "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-djfklsjdf98.slice",
    ),
    (
        "kubepods-besteffort-fsdfsdf.slice",
        "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-fsdfsdf.slice",
    ),
    ("kubepods-dfsdfsdf.slice", "/kubepods.slice/kubepods-dfsdfsdf.slice"),
    ("koordinator-dfsdfsdf.slice", "/koordinator.slice/koordinator-dfsdfsdf.slice"),
    ("dfsdfsdf.slice", "/dfsdfsdf.slice"),
    ("", ""),
    # A burstable pod outside kubepods stays outside it (the old rule put it under kubepods.slice).
    ("batch-burstable-pod1.slice", "/batch.slice/batch-burstable.slice/batch-burstable-pod1.slice"),
    (
        "kubepods-besteffort-pod7712555c_ce62_454a_9e18_9ff0217b8941.slice",
        "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod7712555c_ce62_454a_9e18_9ff0217b8941.slice",
    ),
    # Not a slice name: passed on as sent (dockerd refuses a systemd parent that is not "<name>.slice").
    ("/kubepods.slice/kubepods-pod1.slice", "/kubepods.slice/kubepods-pod1.slice"),
    ("burstable/djfklsjdf98", "burstable/djfklsjdf98"),
    ("kubepods", "kubepods"),
]

#: The cases whose parent is a slice name.
SLICE_NAMES = [(name, path) for name, path in SYSTEMD_PARENTS if name.endswith(".slice") and "/" not in name]


class TestCgroups:
    @pytest.mark.parametrize(("parent", "expected"), SYSTEMD_PARENTS)
    def test_systemd_slice_to_cri_path(self, parent: str, expected: str) -> None:
        """With the systemd driver a slice name becomes the path of its slice hierarchy, whatever its prefix."""
        assert expected == convert.to_cri_cgroup_parent("systemd", parent)

    @pytest.mark.parametrize(("parent", "expected"), SLICE_NAMES)
    def test_one_expansion_for_docker_mode_validation_and_the_sdk(self, parent: str, expected: str) -> None:
        """Docker mode, answer validation and the SDK's cgroup directories expand a slice the same way."""
        assert expected == slice_path(parent) == convert.to_cri_cgroup_parent("systemd", parent)
        assert expected.lstrip("/") == pod_cgroup_dir(parent)
        assert validate.is_below(expected + "/x", parent) and validate.is_below(parent, expected)

    @pytest.mark.parametrize(("parent", "expected"), SLICE_NAMES)
    def test_systemd_round_trip(self, parent: str, expected: str) -> None:
        """Back to Docker, the expanded path becomes the slice name it came from."""
        assert parent == convert.to_docker_cgroup_parent("systemd", expected)

    def test_cgroupfs_is_unchanged_both_ways(self) -> None:
        """With cgroupfs the path is the same in Docker and CRI form."""
        path = "/kubepods/burstable/pod1"
        assert (path, path) == (
            convert.to_cri_cgroup_parent("cgroupfs", path),
            convert.to_docker_cgroup_parent("cgroupfs", path),
        )

    def test_systemd_back_to_slice_name(self) -> None:
        """Back to Docker, a systemd path becomes its base name."""
        assert "x.slice" == convert.to_docker_cgroup_parent("systemd", "/kubepods.slice/x.slice")


class TestResources:
    def test_from_host_config(self) -> None:
        """The eight HostConfig resource keys map to the record; keys match case-insensitively."""
        assert RESOURCES == convert.resources_from_docker(HOST_CONFIG)
        assert Resources(cpu_shares=7) == convert.resources_from_docker({"cpushares": 7, "Memory": "x"})

    def test_update_config_has_no_oom_score(self) -> None:
        """An /update body's OomScoreAdj is not a request (docker update cannot change it)."""
        assert 0 == convert.update_from_docker({"OomScoreAdj": 5}).oom_score_adj

    def test_apply_update_writes_changed_fields_only(self) -> None:
        """Only fields the hooks changed are written, never OomScoreAdj; other keys stay."""
        old = Resources(cpu_shares=2, memory_limit_in_bytes=10)
        new = Resources(cpu_shares=4, memory_limit_in_bytes=10, oom_score_adj=7)
        body = {"Memory": 10, "RestartPolicy": {"Name": "no"}, "cpushares": 2}
        assert {"Memory": 10, "RestartPolicy": {"Name": "no"}, "cpushares": 4} == convert.apply_update(
            body, old, new
        )
        assert 2 == body["cpushares"]


class TestRecords:
    def test_pod_from_create(self) -> None:
        """A sandbox create body gives name, namespace, uid, attempt, split labels, cgroup parent, resources."""
        body = {
            "Labels": {"io.kubernetes.docker.type": "podsandbox", "app": "web", "annotation.a": "1"},
            "HostConfig": HOST_CONFIG,
        }
        pod = convert.pod_from_create(K8sName("POD", "web", "default", "u1", 1), body, "cgroupfs")
        assert (
            attrs.evolve(
                WEB_POD,
                runtime_handler="docker",
                labels={"io.kubernetes.docker.type": "podsandbox", "app": "web"},
                cgroup_parent="/kubepods/burstable/poduid",
                resources=RESOURCES,
            )
            == pod
        )

    def test_container_from_inspect(self) -> None:
        """Inspect output gives the full container record, resources and envs included."""
        pod = PodInfo(name="web", cgroup_parent="/p")
        inspect = {
            "Id": "c1",
            "Name": "/k8s_app_web_prod_u_2",
            "Config": {"Env": ["A=1"], "Labels": {"io.kubernetes.sandbox.id": "s1", "annotation.h": "x"}},
            "HostConfig": HOST_CONFIG,
        }
        assert ContainerInfo(
            pod_sandbox_id="s1",
            pod=pod,
            name="app",
            attempt=2,
            id="c1",
            annotations={"h": "x"},
            resources=RESOURCES,
            envs={"A": "1"},
            pod_cgroup_parent="/p",
        ) == convert.container_from_inspect(inspect, pod)

    def test_pod_from_inspect_without_k8s_name_falls_back(self) -> None:
        """A sandbox whose name does not parse gets the reference's values: Docker name and id."""
        pod = convert.pod_from_inspect({"Id": "abc", "Name": "/odd", "HostConfig": {}}, "cgroupfs")
        assert ("odd", "abc") == (pod.name, pod.uid)

    def test_apply_container_touches_only_changes(self) -> None:
        """Unchanged records leave the body as it was; changes reach HostConfig, Env and labels."""
        body = {"Env": ["A=1"], "Labels": {"x": "y", "annotation.h": "1"}, "HostConfig": dict(HOST_CONFIG)}
        info = convert.container_from_create(
            K8sName("app", "web", "prod", "u", 0), body, PodInfo(cgroup_parent="/p")
        )
        assert body == convert.apply_container(body, info, info, "cgroupfs")
        changed = ContainerInfo(
            pod=info.pod,
            name=info.name,
            annotations={"h": "2"},
            resources=Resources(cpu_quota=5),
            envs={"A": "1", "B": "2"},
            pod_cgroup_parent="/p/q",
        )
        out = convert.apply_container(body, info, changed, "cgroupfs")
        assert ["A=1", "B=2"] == out["Env"]
        assert {"x": "y", "annotation.h": "2"} == out["Labels"]
        assert (5, 0, "/p/q") == (
            out["HostConfig"]["CpuQuota"],
            out["HostConfig"]["CpuShares"],
            out["HostConfig"]["CgroupParent"],
        )

    def test_merge_docker_pod_applies_resources(self) -> None:
        """A PreRunPodSandbox answer's resources merge by updateResource; invalid ones are ignored."""
        pod = PodInfo(resources=Resources(cpu_shares=2, memory_limit_in_bytes=10))
        merged = convert.merge_docker_pod(
            pod,
            PodAnswer(resources=Resources(cpu_shares=8)),
        )
        assert Resources(cpu_shares=8, memory_limit_in_bytes=10) == merged.value.resources
        bad = PodAnswer(resources=Resources(memory_limit_in_bytes=-5))
        assert pod.resources == convert.merge_docker_pod(pod, bad).value.resources


class TestRoutes:
    @pytest.mark.parametrize(
        ("method", "target", "expected"),
        [
            (b"POST", b"/containers/create?name=x", Route(Action.CREATE)),
            (b"POST", b"/v1.41/containers/create", Route(Action.CREATE)),
            (b"POST", b"/v1.41/containers/abc/start", Route(Action.START, "abc")),
            (b"POST", b"/containers/abc/stop?t=10", Route(Action.STOP, "abc")),
            (b"POST", b"/v1.24/containers/abc/update", Route(Action.UPDATE, "abc")),
            (b"DELETE", b"/v1.41/containers/abc?force=1", Route(Action.REMOVE, "abc")),
            (b"GET", b"/containers/abc/start", None),
            (b"POST", b"/containers/abc/restart", Route(Action.RESTART, "abc")),
            (b"POST", b"/containers/abc/kill?signal=HUP", None),
            (b"POST", b"/containers/abc/attach?stream=1", None),
            (b"POST", b"/exec/abc/start", None),
            (b"GET", b"/v1.41/containers/json?all=1", None),
        ],
    )
    def test_route(self, method: bytes, target: bytes, expected: Route | None) -> None:
        """Only container create/start/restart/stop/update (any API version) and DELETE are intercepted."""
        assert expected == route(method, target)

    def test_query_value(self) -> None:
        """Query values are decoded; a missing one is empty."""
        assert ("k8s_a b", "") == (query_value(b"/c?name=k8s_a%20b", "name"), query_value(b"/c", "name"))


class TestHttpHelpers:
    def test_body_length_replaces_framing(self) -> None:
        """Content-Length and Transfer-Encoding are replaced by the new length; other headers keep order."""
        headers = [(b"Host", b"d"), (b"Transfer-Encoding", b"chunked"), (b"X", b"1")]
        assert [(b"Host", b"d"), (b"X", b"1"), (b"Content-Length", b"7")] == with_body_length(headers, 7)

    def test_error_reply_is_docker_json(self) -> None:
        """Errors carry dockerd's ``{"message": ...}`` body with the status phrase."""
        reply = error_reply(500, "hook server err")
        assert (b'{"message": "hook server err"}\n', b"Internal Server Error") == (reply.body, reply.reason)

    def test_raw_head(self) -> None:
        """A hijack head is written as received."""
        event = h11.InformationalResponse(status_code=101, headers=[("Upgrade", "tcp")], reason=b"UPGRADED")
        assert b"HTTP/1.1 101 UPGRADED\r\nUpgrade: tcp\r\n\r\n" == raw_head(event)

    @pytest.mark.parametrize(
        ("headers", "expected"),
        [
            ([("Content-Type", "application/vnd.docker.raw-stream")], True),
            ([("Content-Type", "application/vnd.docker.multiplexed-stream")], True),
            (
                [("Content-Type", "application/vnd.docker.raw-stream"), ("Transfer-Encoding", "chunked")],
                False,
            ),
            ([("Content-Type", "application/json")], False),
        ],
    )
    def test_hijack_detection(self, headers: list[tuple[str, str]], expected: bool) -> None:
        """A 200 is a hijack only with a raw/multiplexed stream type and no body framing."""
        assert expected == _hijacks(h11.Response(status_code=200, headers=headers))


class TestFieldNames:
    """Struct field names are matched as dockerd's Go decoder matches them (Unicode simple folding), and a
    field sent under two spellings, which Go decodes into one, merging, is refused."""

    def test_a_name_is_folded_as_go_folds_it(self) -> None:
        """``ſ`` (U+017F) is an ``s`` to Go's encoding/json: dockerd 20.10 read ``HoſtConfig`` as
        HostConfig (tests/e2e/test_docker_json_reading.py), so krproxy reads it so too."""
        assert 7 == convert.update_from_docker({"CpuShare\u017f": 7}).cpu_shares
        assert 7 == convert.update_from_docker({"CPU\u017fHARES": 7}).cpu_shares
        assert 3 == convert.update_from_docker({"cpushares": 3}).cpu_shares

    @pytest.mark.parametrize(
        "body",
        [
            {"CpuShares": 5, "cpushares": 6},
            {"CpuShares": 5, "CpuShare\u017f": 6},
            {"cpuShares": 1, "CPUSHARES": 2},
        ],
    )
    def test_a_field_under_two_spellings_is_refused(self, body: dict[str, int]) -> None:
        """Two keys naming one field: Go decodes both into it in turn, krproxy refuses to pick one."""
        with pytest.raises(convert.AmbiguousKey, match="name the same field"):
            convert.update_from_docker(body)

    def test_maps_keep_their_case(self) -> None:
        """Labels are a map, case-sensitive in Go: ``app`` and ``APP`` are two labels, not refused."""
        assert {"app": "1", "APP": "2"} == dict(convert.labels_of({"Labels": {"app": "1", "APP": "2"}}))
