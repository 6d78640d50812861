"""The hook records' own helpers (krproxy.hooks.model): FrozenMap's dict-backed methods and evolve."""

from __future__ import annotations

import attrs
import pytest

from krproxy.hooks.model import (
    ContainerAnswer,
    ContainerInfo,
    FrozenMap,
    PodAnswer,
    PodInfo,
    PodResize,
    Resources,
    evolve,
)
from tests.records import FULL_RESOURCES, WEB_POD

CONTAINER = ContainerInfo(
    pod_sandbox_id="s1",
    pod=WEB_POD,
    name="app",
    attempt=1,
    id="c1",
    annotations={"a": "1"},
    resources=FULL_RESOURCES,
    envs={"E": "2"},
    pod_cgroup_parent="/kubepods",
)
#: Each record with another of its class whose fields all differ from it.
PAIRS = [
    (FULL_RESOURCES, Resources()),
    (WEB_POD, PodInfo(resources=FULL_RESOURCES, overhead=Resources())),
    (CONTAINER, ContainerInfo()),
    (PodResize(pod_sandbox_id="s1", pod=WEB_POD), PodResize(pod_sandbox_id="s2", pod=PodInfo())),
    (
        PodAnswer(labels={"l": "1"}, cgroup_parent="/p", resources=Resources(cpu_shares=2)),
        PodAnswer(annotations={"a": "1"}),
    ),
    (
        ContainerAnswer(annotations={"a": "1"}, envs={"E": "2"}),
        ContainerAnswer(resources=Resources(), pod_cgroup_parent="/p"),
    ),
]


class TestEvolve:
    @pytest.mark.parametrize(("record", "other"), PAIRS, ids=lambda r: type(r).__name__)
    def test_as_attrs_evolve(self, record: object, other: object) -> None:
        """Each field changed alone gives what attrs.evolve gives, and nothing changed an equal copy."""
        for field in attrs.fields(type(record)):
            changed = {field.name: getattr(other, field.name)}

            assert attrs.evolve(record, **changed) == evolve(record, **changed) != record
        assert record == evolve(record)
        assert record is not evolve(record)

    def test_converters_run(self) -> None:
        """A changed map is converted as the records' __init__ converts it."""
        assert FrozenMap({"b": "2"}) == evolve(CONTAINER, annotations={"b": "2"}).annotations
        assert FrozenMap() == evolve(CONTAINER, envs=None).envs

    def test_unknown_field(self) -> None:
        """A name the record has no field of is refused, as attrs.evolve refuses it."""
        with pytest.raises(TypeError):
            evolve(CONTAINER, nope=1)

    def test_only_records(self) -> None:
        """A class with a private or a non-init field is not copied (its fields would be lost)."""

        @attrs.frozen
        class Private:
            a: int = 0
            _b: int = 0

        with pytest.raises(TypeError, match="not a record"):
            evolve(Private(), a=1)


class TestFrozenMap:
    def test_get(self) -> None:
        """get answers as a dict's, with or without a default."""
        m = FrozenMap({"a": "1"})

        assert ("1", None, "d") == (m.get("a"), m.get("b"), m.get("b", "d"))

    def test_copies(self) -> None:
        """dict(), keys() and values() give the map's items in order."""
        m = FrozenMap([("b", "2"), ("a", "1")])

        assert (["b", "a"], ["2", "1"], {"b": "2", "a": "1"}) == (list(m.keys()), list(m.values()), dict(m))

    def test_equality(self) -> None:
        """Equal to a FrozenMap or any mapping of the same items, in any order; not to other things."""
        m = FrozenMap([("b", "2"), ("a", "1")])

        assert m == FrozenMap([("a", "1"), ("b", "2")])
        assert m == {"a": "1", "b": "2"}
        assert m != FrozenMap({"a": "1"})
        assert m != [("b", "2"), ("a", "1")]
