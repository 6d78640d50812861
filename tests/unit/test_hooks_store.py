"""The in-memory pod/container store (krproxy.hooks.store)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from krproxy.hooks.model import ContainerInfo, FrozenMap, PodInfo, Resources
from krproxy.hooks.store import HookStore, StoreStatistics

POD = PodInfo(name="web", uid="u1", namespace="default")


def container(name: str, sandbox: str = "sb1") -> ContainerInfo:
    return ContainerInfo(pod_sandbox_id=sandbox, pod=POD, name=name, id=f"id-{name}")


class TestHookStore:
    def test_put_get_pod(self) -> None:
        """A stored pod is found by sandbox id; an unknown id gives None."""
        store = HookStore()

        store.put_pod("sb1", POD)

        assert (POD, None) == (store.get_pod("sb1"), store.get_pod("sb2"))

    def test_delete_pod_keeps_containers(self) -> None:
        """StopPodSandbox's delete drops only the pod record, like the reference."""
        store = HookStore()
        store.put_pod("sb1", POD)
        store.put_container("c1", container("a"))

        deleted = store.delete_pod("sb1")

        assert (POD, None, container("a")) == (deleted, store.get_pod("sb1"), store.get_container("c1"))
        assert StoreStatistics(pods=0, containers=1, orphan_containers=1) == store.statistics()

    def test_remove_pod_drops_its_containers(self) -> None:
        """RemovePodSandbox drops the pod and its containers, not other pods' containers."""
        store = HookStore()
        store.put_pod("sb1", POD)
        store.put_pod("sb2", POD)
        store.put_container("c1", container("a"))
        store.put_container("c2", container("b"))
        store.put_container("c3", container("c", sandbox="sb2"))

        dropped = store.remove_pod("sb1")

        assert ("c1", "c2") == dropped
        assert ({"sb2": POD}, {"c3": container("c", sandbox="sb2")}) == (store.pods(), store.containers())

    def test_container_lifecycle(self) -> None:
        """Containers are put, updated in place and deleted by container id."""
        store = HookStore()
        store.put_container("c1", container("a"))
        updated = container("a2")

        was_there = store.update_container("c1", updated)
        deleted = store.delete_container("c1")

        assert (True, updated, None) == (was_there, deleted, store.get_container("c1"))

    def test_update_does_not_resurrect(self) -> None:
        """Updating a container that was dropped meanwhile does not store it again."""
        store = HookStore()

        assert (False, None) == (store.update_container("c1", container("a")), store.get_container("c1"))

    def test_delete_missing(self) -> None:
        """Deleting unknown ids is harmless and returns None."""
        store = HookStore()

        assert (None, None, ()) == (store.delete_pod("x"), store.delete_container("x"), store.remove_pod("x"))

    def test_load_replaces(self) -> None:
        """load replaces the whole content with the recovered records."""
        store = HookStore()
        store.put_pod("old", POD)
        store.put_container("old", container("old"))

        store.load([("sb1", POD)], [("c1", container("a")), ("c2", container("b"))])

        assert ({"sb1": POD}, ["c1", "c2"]) == (store.pods(), sorted(store.containers()))
        assert StoreStatistics(pods=1, containers=2, orphan_containers=0) == store.statistics()

    def test_snapshots_are_copies(self) -> None:
        """pods() and containers() return copies the caller may change freely."""
        store = HookStore()
        store.put_pod("sb1", POD)

        store.pods().clear()

        assert POD == store.get_pod("sb1")

    def test_statistics_frozen_empty(self) -> None:
        """An empty store reports zeros."""
        assert StoreStatistics(pods=0, containers=0, orphan_containers=0) == HookStore().statistics()

    def test_counts_the_pods_of_a_label(self) -> None:
        """count_label counts the stored pods carrying it, through put, replace, delete, remove and load."""
        skipping = PodInfo(name="s", uid="u2", namespace="default", labels=FrozenMap({"skip": "true"}))
        store = HookStore()
        store.put_pod("sb1", skipping)
        assert 0 == store.labelled  # nothing counted yet
        store.count_label("skip", "true")
        seen = [store.labelled]

        store.put_pod("sb2", skipping)
        seen.append(store.labelled)
        store.put_pod("sb2", skipping)  # replaced by itself: counted once
        seen.append(store.labelled)
        store.put_pod("sb2", POD)  # replaced by a pod without the label
        seen.append(store.labelled)
        store.delete_pod("sb1")
        seen.append(store.labelled)
        store.put_pod("sb3", skipping)
        store.remove_pod("sb3")
        seen.append(store.labelled)
        store.load([("a", skipping), ("b", skipping), ("c", POD)], [])
        seen.append(store.labelled)
        store.delete_pod("missing")
        seen.append(store.labelled)

        assert [1, 2, 2, 1, 0, 0, 2, 2] == seen


_SANDBOXES = st.sampled_from(["sb1", "sb2", "sb3"])
_LABELS = st.sampled_from([{}, {"skip": "true"}, {"skip": "false"}, {"other": "true"}])
_PODS = st.builds(
    lambda labels: PodInfo(name="p", uid="u", namespace="default", labels=FrozenMap(labels)), _LABELS
)
#: One write of the store's: what the request path, recovery and a resize do to it.
_WRITES = st.one_of(
    st.tuples(st.just("put"), _SANDBOXES, _PODS),
    st.tuples(st.just("delete"), _SANDBOXES),
    st.tuples(st.just("remove"), _SANDBOXES),
    st.tuples(st.just("resize"), _SANDBOXES, st.integers(0, 4)),
    st.tuples(st.just("load"), st.lists(st.tuples(_SANDBOXES, _PODS), max_size=3)),
    st.tuples(st.just("count"), st.sampled_from([("skip", "true"), ("other", "true")])),
)


def _write(store: HookStore, write: tuple[Any, ...]) -> None:
    op, *args = write
    if op == "put":
        store.put_pod(*args)
        store.put_container(f"c-{args[0]}", container(args[0], args[0]))
    elif op == "delete":
        store.delete_pod(*args)
    elif op == "remove":
        store.remove_pod(*args)
    elif op == "resize":
        store.resize_pod(args[0], Resources(cpu_shares=args[1]), None)
    elif op == "load":
        store.load(args[0], [])
    else:
        store.count_label(*args[0])


@given(st.lists(_WRITES, max_size=12))
def test_label_count_follows_every_write(writes: list[tuple[Any, ...]]) -> None:
    """After any writes (put, replace, delete, remove, resize, load, a new label counted), ``labelled`` is
    the number of stored pods carrying the counted label (a hooked CreateContainer's watch reads it)."""
    store = HookStore()
    counted = ("skip", "true")
    store.count_label(*counted)
    for write in writes:
        _write(store, write)
        if write[0] == "count":
            counted = write[1]
        assert sum(1 for pod in store.pods().values() if pod.has_label(*counted)) == store.labelled
