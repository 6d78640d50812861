"""Replay compares lists whose order the runtime does not define as multisets.

containerd lists images, containers and sandboxes in map order, which changes from call to call:
the same 16 images in another order must be no difference, while a changed, missing or extra
element still is one, named by its ID. Lists whose order means something stay positional, and every
repeated field of a reply is classified one way or the other.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import attrs
import betterproto2
from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.grpcstatus import Cardinality, Status
from krproxy.methods import cri_methods
from krproxy.proto.runtime import v1 as cri
from krproxy.trace import messages
from krproxy.trace.messages import IdMap
from krproxy.trace.replay import Answer, compare
from tests.unit.test_trace_replay import rec

IMAGE = "/runtime.v1.ImageService/ListImages"
DOCS = Path(__file__).parents[2] / "docs" / "trace-format.md"


def image(n: int, *, size: int = 0, tags: tuple[str, ...] = ()) -> cri.Image:
    return cri.Image(
        id=f"sha256:{n:04x}",
        repo_tags=list(tags) or [f"registry.local/img{n}:latest", f"registry.local/img{n}:v{n}"],
        repo_digests=[f"registry.local/img{n}@sha256:{n:064x}"],
        size=size or 1000 + n,
    )


def images_diff(recorded: list[cri.Image], actual: list[cri.Image]) -> list[tuple[str, Any, Any]]:
    # rec() builds RuntimeService records; ListImages belongs to the ImageService.
    record = rec(1, "ListImages", cri.ListImagesRequest(), cri.ListImagesResponse(images=recorded))
    record = attrs.evolve(record, path=IMAGE)
    answer = Answer(Status.OK, None, bytes(cri.ListImagesResponse(images=actual)))
    return [(d.where, d.recorded, d.actual) for d in compare(record, answer, IdMap())]


class TestImages:
    @settings(max_examples=60, deadline=None)
    @given(st.data(), st.integers(min_value=0, max_value=16))
    def test_any_permutation_is_no_difference(self, data: st.DataObject, count: int) -> None:
        """The same images, each with its tags in any order, listed in any order: no difference."""
        recorded = [image(n) for n in range(count)]
        actual = [
            image(n, tags=tuple(data.draw(st.permutations(list(image(n).repo_tags)))))
            for n in data.draw(st.permutations(range(count)))
        ]
        assert [] == images_diff(recorded, actual)

    def test_changed_element_is_named_by_its_id(self) -> None:
        """A different size of one image among 16 shuffled ones is one difference naming that image."""
        recorded = [image(n) for n in range(16)]
        actual = [image(n, size=5 if n == 7 else 0) for n in reversed(range(16))]
        assert [('reply.images[id="sha256:0007"].size', "1007", "5")] == images_diff(recorded, actual)

    def test_missing_and_extra_elements(self) -> None:
        """An image the replay lacks and one it has in addition are reported whole, by ID."""
        recorded = [image(n) for n in range(3)]
        actual = [image(2), image(0), image(9)]
        diff = images_diff(recorded, actual)
        assert [
            ('reply.images[id="sha256:0001"]', messages.to_plain(image(1)), None),
            ('reply.images[id="sha256:0009"]', None, messages.to_plain(image(9))),
        ] == diff

    def test_all_missing(self) -> None:
        """An empty list (absent from the reply) against a full one names every element."""
        diff = images_diff([image(1), image(2)], [])
        assert ['reply.images[id="sha256:0001"]', 'reply.images[id="sha256:0002"]'] == [d[0] for d in diff]

    def test_changed_tag_inside_an_element(self) -> None:
        """A tag renamed inside one image is a missing and an extra tag of that image."""
        recorded = [image(1, tags=("a:1", "b:1"))]
        actual = [image(1, tags=("c:1", "a:1"))]
        assert [
            ('reply.images[id="sha256:0001"].repo_tags["b:1"]', "b:1", None),
            ('reply.images[id="sha256:0001"].repo_tags["c:1"]', None, "c:1"),
        ] == images_diff(recorded, actual)

    def test_multiset_counts_duplicates(self) -> None:
        """The same element twice is not the same as once."""
        diff = images_diff([image(1), image(1)], [image(1)])
        assert [('reply.images[id="sha256:0001"]', messages.to_plain(image(1)), None)] == diff

    def test_elements_of_one_name_match_in_any_order_of_their_sets(self) -> None:
        """Two images of one name (both without an ID here), listed in another order and each with its tags
        in another order, are the same multiset: no difference (matching compared them order-sensitively,
        then paired the leftovers by position, and reported ten false differences)."""
        recorded = [cri.Image(repo_tags=["a:1", "b:1"], size=1), cri.Image(repo_tags=["c:1", "d:1"], size=2)]
        actual = [cri.Image(repo_tags=["d:1", "c:1"], size=2), cri.Image(repo_tags=["b:1", "a:1"], size=1)]
        assert [] == images_diff(recorded, actual)

    @settings(max_examples=40, deadline=None)
    @given(st.data(), st.integers(min_value=1, max_value=12))
    def test_one_change_among_elements_of_one_name_is_reported(self, data: st.DataObject, count: int) -> None:
        """Among images of one name in any order, each with its tags in any order, one changed size is
        reported (as that image on each side: the name cannot tell which recorded image it was), and
        nothing else."""
        recorded = [image(n) for n in range(count)]
        changed = data.draw(st.integers(min_value=0, max_value=count - 1))
        actual = [
            image(
                n, size=5 if n == changed else 0, tags=tuple(data.draw(st.permutations(image(n).repo_tags)))
            )
            for n in data.draw(st.permutations(range(count)))
        ]
        for item in (*recorded, *actual):
            item.id = ""
        diff = images_diff(recorded, actual)
        sizes = {(d[1], d[2]) for d in diff if d[0] == "reply.images[id=(absent)].size"}
        assert {(str(1000 + changed), "5")} == sizes
        assert all(d[0].startswith("reply.images[id=(absent)]") for d in diff)


def container(cid: str, state: cri.ContainerState = cri.ContainerState.CONTAINER_RUNNING) -> cri.Container:
    return cri.Container(id=cid, pod_sandbox_id="p", state=state, created_at=5)


class TestRuntimeLists:
    def _diff(self, method: str, recorded: Any, actual: Any, ids: IdMap | None = None) -> list[str]:
        record = rec(1, method, getattr(cri, f"{method}Request")(), recorded)
        answer = Answer(Status.OK, None, bytes(actual))
        return [d.describe() for d in compare(record, answer, ids or IdMap())]

    def test_containers_with_new_ids_in_another_order(self) -> None:
        """Container IDs the replay learnt are mapped back before elements are matched."""
        ids = IdMap({"c1": "n1", "c2": "n2", "c3": "n3"})
        recorded = cri.ListContainersResponse(containers=[container("c1"), container("c2"), container("c3")])
        actual = cri.ListContainersResponse(containers=[container("n3"), container("n1"), container("n2")])
        assert [] == self._diff("ListContainers", recorded, actual, ids)

    def test_container_state_change_names_the_container(self) -> None:
        recorded = cri.ListContainersResponse(containers=[container("c1"), container("c2")])
        actual = cri.ListContainersResponse(
            containers=[container("c2", cri.ContainerState.CONTAINER_EXITED), container("c1")]
        )
        assert [
            'reply.containers[id="c2"].state: recorded "CONTAINER_RUNNING", replay "CONTAINER_EXITED"'
        ] == self._diff("ListContainers", recorded, actual)

    def test_sandboxes(self) -> None:
        """ListPodSandbox items in another order: none; one more sandbox: named."""
        a, b, c = (cri.PodSandbox(id=i, state=cri.PodSandboxState.SANDBOX_READY) for i in "abc")
        recorded = cri.ListPodSandboxResponse(items=[a, b])
        assert [] == self._diff("ListPodSandbox", recorded, cri.ListPodSandboxResponse(items=[b, a]))
        diff = self._diff("ListPodSandbox", recorded, cri.ListPodSandboxResponse(items=[b, c, a]))
        assert 1 == len(diff) and diff[0].startswith('reply.items[id="c"]: recorded (absent), replay {')

    def test_stats_are_keyed_by_their_attributes_id(self) -> None:
        """Stats carry their container's ID in attributes; volatile usage figures are not compared."""

        def stats(cid: str, usage: int, name: str = "app") -> cri.ContainerStats:
            return cri.ContainerStats(
                attributes=cri.ContainerAttributes(id=cid, metadata=cri.ContainerMetadata(name=name)),
                cpu=cri.CpuUsage(timestamp=usage, usage_core_nano_seconds=cri.UInt64Value(usage)),
                swap=cri.SwapUsage(timestamp=usage, swap_usage_bytes=cri.UInt64Value(usage)),
            )

        recorded = cri.ListContainerStatsResponse(stats=[stats("c1", 1), stats("c2", 2)])
        same = cri.ListContainerStatsResponse(stats=[stats("c2", 20), stats("c1", 10)])
        renamed = cri.ListContainerStatsResponse(stats=[stats("c2", 20), stats("c1", 10, "web")])
        assert [] == self._diff("ListContainerStats", recorded, same)
        assert [
            'reply.stats[attributes.id="c1"].attributes.metadata.name: recorded "app", replay "web"'
        ] == self._diff("ListContainerStats", recorded, renamed)

    def test_pod_stats_counters_are_volatile(self) -> None:
        """Network and process counters of pod stats move between calls: not compared; interfaces by name."""

        def stats(rx: int, processes: int, *names: str) -> cri.PodSandboxStats:
            interfaces = [cri.NetworkInterfaceUsage(name=n, rx_bytes=cri.UInt64Value(rx)) for n in names]
            return cri.PodSandboxStats(
                attributes=cri.PodSandboxAttributes(id="p"),
                linux=cri.LinuxPodSandboxStats(
                    network=cri.NetworkUsage(interfaces=interfaces),
                    process=cri.ProcessUsage(process_count=cri.UInt64Value(processes)),
                ),
            )

        def reply(s: cri.PodSandboxStats) -> cri.ListPodSandboxStatsResponse:
            return cri.ListPodSandboxStatsResponse(stats=[s])

        recorded = reply(stats(1, 2, "eth0", "lo"))
        assert [] == self._diff("ListPodSandboxStats", recorded, reply(stats(50, 3, "lo", "eth0")))
        assert [
            """reply.stats[attributes.id="p"].linux.network.interfaces[name="eth1"]: recorded (absent), """
            """replay {"name": "eth1", "rx_bytes": "<volatile>"}""",
        ] == self._diff("ListPodSandboxStats", recorded, reply(stats(50, 3, "lo", "eth0", "eth1")))

    def test_metric_values_are_volatile(self) -> None:
        """ListPodSandboxMetrics samples move between calls: a Metric's value is not compared, while
        its name, type and label values are (and an absent value still differs from a set one)."""

        def reply(value: int | None, *labels: str) -> cri.ListPodSandboxMetricsResponse:
            metric = cri.Metric(
                name="container_cpu_usage_seconds_total",
                metric_type=cri.MetricType.COUNTER,
                label_values=list(labels),
                value=None if value is None else cri.UInt64Value(value),
            )
            container = cri.ContainerMetrics(container_id="c", metrics=[metric])
            return cri.ListPodSandboxMetricsResponse(
                pod_metrics=[cri.PodSandboxMetrics(pod_sandbox_id="p", container_metrics=[container])]
            )

        recorded = reply(1500, "cpu0")
        assert [] == self._diff("ListPodSandboxMetrics", recorded, reply(2750, "cpu0"))
        relabelled = self._diff("ListPodSandboxMetrics", recorded, reply(2750, "cpu1"))
        assert 2 == len(relabelled) and all("label_values" in d for d in relabelled)  # one gone, one new
        assert 1 == len(self._diff("ListPodSandboxMetrics", recorded, reply(None, "cpu0")))

    def test_value_is_volatile_in_metrics_only(self) -> None:
        """The rule is for Metric.value, not every field named value: an image's uid still counts."""

        def images(uid: int) -> cri.ListImagesResponse:
            return cri.ListImagesResponse(images=[cri.Image(id="sha256:1", uid=cri.Int64Value(uid))])

        assert ['reply.images[id="sha256:1"].uid.value: recorded "1", replay "1000"'] == self._diff_images(
            images(1), images(1000)
        )

    def _diff_images(self, recorded: Any, actual: Any) -> list[str]:
        record = attrs.evolve(rec(1, "ListImages", cri.ListImagesRequest(), recorded), path=IMAGE)
        return [d.describe() for d in compare(record, Answer(Status.OK, None, bytes(actual)), IdMap())]

    def test_ordered_lists_stay_positional(self) -> None:
        """Mounts echo the caller's order, which takes effect: reversed mounts are a difference."""

        def status(*paths: str) -> cri.ContainerStatusResponse:
            mounts = [cri.Mount(container_path=p, host_path="/h" + p) for p in paths]
            return cri.ContainerStatusResponse(status=cri.ContainerStatus(id="c", mounts=mounts))

        diff = self._diff("ContainerStatus", status("/a", "/b"), status("/b", "/a"))
        assert 4 == len(diff) and diff[0].startswith("reply.status.mounts[0].container_path:")


def _repeated_reply_fields() -> set[tuple[str, str]]:
    """Every (message, field) of a repeated, non-map field reachable from a unary CRI reply."""
    found: set[tuple[str, str]] = set()
    seen: set[type] = set()

    def walk(cls: type[betterproto2.Message]) -> None:
        if cls in seen:
            return
        seen.add(cls)
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            meta = field.metadata["betterproto"]
            if meta.map_meta is not None:
                continue
            if meta.repeated:
                found.add((cls.__name__, field.name))
            child = cls._betterproto.cls_by_field.get(field.name)  # type: ignore[attr-defined]
            if isinstance(child, type) and issubclass(child, betterproto2.Message):
                walk(child)

    for path in cri_methods():
        types = messages.method_types(path)
        if types is not None and types.cardinality is Cardinality.UNARY_UNARY:
            walk(types.reply)
    return found


class TestClassification:
    def test_every_repeated_reply_field_is_decided(self) -> None:
        """A repeated field of a reply is either unordered or ordered, never both, never neither."""
        unordered, ordered = set(messages.UNORDERED), set(messages.ORDERED)
        assert set() == unordered & ordered
        assert _repeated_reply_fields() == unordered | ordered

    def test_keys_name_fields_of_the_element(self) -> None:
        """Each key path of an unordered list exists in its element's message."""
        by_name = {cls.__name__: cls for cls in vars(cri).values() if isinstance(cls, type)}
        for (message, field), rule in messages.UNORDERED.items():
            element = by_name[message]._betterproto.cls_by_field[field]
            for path in rule.key:
                cls = element
                for part in path.split("."):
                    assert part in cls._betterproto.meta_by_field_name, (message, field, path)
                    cls = cls._betterproto.cls_by_field[part]

    def test_docs_list_the_unordered_fields(self) -> None:
        """docs/trace-format.md names every field compared as a multiset, with its key."""
        text = DOCS.read_text()
        for (message, field), rule in messages.UNORDERED.items():
            key = ", ".join(f"`{k}`" for k in rule.key) or "the value"
            assert f"| `{message}.{field}` | {key} |" in text, (message, field)

    def test_docs_tables_hold_exactly_the_classified_fields(self) -> None:
        """The two tables of docs/trace-format.md name every classified field once, and nothing else: an
        ordered field missing from the docs, or a row for a field the code no longer has, fails."""
        rows = re.findall(r"^\| `(\w+)\.(\w+)` \|", DOCS.read_text(), re.MULTILINE)
        assert len(rows) == len(set(rows))
        assert set(messages.UNORDERED) | set(messages.ORDERED) == set(rows)


class TestSampleTimes:
    def test_a_sample_time_set_on_one_side_only_is_no_difference(self) -> None:
        """containerd answers a writable layer with or without its sample time, depending on its collector."""
        layer = cri.FilesystemUsage(
            fs_id=cri.FilesystemIdentifier(mountpoint="/m"), used_bytes=cri.UInt64Value(1)
        )
        sampled = cri.FilesystemUsage(
            timestamp=7, fs_id=cri.FilesystemIdentifier(mountpoint="/m"), used_bytes=cri.UInt64Value(1)
        )

        def reply(usage: cri.FilesystemUsage) -> cri.ListContainerStatsResponse:
            stats = cri.ContainerStats(attributes=cri.ContainerAttributes(id="c"), writable_layer=usage)
            return cri.ListContainerStatsResponse(stats=[stats])

        record = rec(1, "ListContainerStats", cri.ListContainerStatsRequest(), reply(layer))
        assert () == compare(record, Answer(Status.OK, None, bytes(reply(sampled))), IdMap())
        moved = cri.FilesystemUsage(timestamp=7, fs_id=cri.FilesystemIdentifier(mountpoint="/elsewhere"))
        assert ['reply.stats[attributes.id="c"].writable_layer.fs_id.mountpoint'] == [
            d.where
            for d in compare(record, Answer(Status.OK, None, bytes(reply(moved))), IdMap())
            if d.where.endswith("mountpoint")
        ]
