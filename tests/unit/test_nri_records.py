"""krproxy.nri.records: NRI's records as handlers see them, read-only all the way down."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from krproxy.nri.records import FrozenRecordError, frozen, is_frozen, thaw
from krproxy.proto.nri.pkg.api import v1alpha1 as api


def container() -> api.Container:
    memory = api.LinuxMemory(limit=api.OptionalInt64(value=1 << 30))
    return api.Container(
        id="ctr-1",
        name="app",
        env=["PATH=/bin", "MODE=a"],
        annotations={"a": "1"},
        mounts=[api.Mount(destination="/data", source="/srv", options=["rbind"])],
        linux=api.LinuxContainer(resources=api.LinuxResources(memory=memory, unified={"k": "v"})),
    )


def test_frozen_keeps_class_and_fields() -> None:
    """The view is an instance of NRI's message class with the same fields and the same wire bytes."""
    original = container()
    view = frozen(original)
    assert isinstance(view, api.Container) and is_frozen(view) and not is_frozen(original)
    assert (view.id, view.env, dict(view.annotations)) == ("ctr-1", ("PATH=/bin", "MODE=a"), {"a": "1"})
    assert view.linux is not None and view.linux.resources is not None
    assert view.linux.resources.memory is not None and view.linux.resources.memory.limit is not None
    assert view.linux.resources.memory.limit.value == 1 << 30
    assert bytes(view) == bytes(original)
    assert view == original and original == view
    assert view.to_dict() == original.to_dict()


@pytest.mark.parametrize(
    "change",
    [
        lambda c: setattr(c, "name", "x"),
        lambda c: delattr(c, "id"),
        lambda c: setattr(c.mounts[0], "destination", "/x"),
        lambda c: setattr(c.linux, "resources", None),
        lambda c: setattr(c.linux.resources.memory.limit, "value", 1),
    ],
    ids=["field", "delete", "nested list item", "nested message", "deep"],
)
def test_setting_a_field_raises(change: object) -> None:
    """Setting or deleting any field, at any depth, raises FrozenRecordError saying what to do."""
    view = frozen(container())
    with pytest.raises(FrozenRecordError, match=r"read-only: .* answer a change instead"):
        change(view)  # type: ignore[operator]


def test_lists_and_maps_read_only() -> None:
    """Repeated fields are tuples and maps read-only mappings, nested ones too."""
    view = frozen(container())
    with pytest.raises(AttributeError):
        view.env.append("X=1")  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        view.annotations["b"] = "2"  # type: ignore[index]
    assert view.linux is not None and view.linux.resources is not None
    with pytest.raises(TypeError):
        view.linux.resources.unified["k"] = "w"  # type: ignore[index]
    with pytest.raises(TypeError):
        view.mounts[0].options[0] = "ro"  # type: ignore[index]


def test_view_is_a_copy() -> None:
    """Changing the message afterwards does not show in the view."""
    original = container()
    view = frozen(original)
    original.env.append("LATER=1")
    original.annotations["later"] = "1"
    assert "LATER=1" not in view.env and "later" not in view.annotations


def test_thaw_gives_a_mutable_copy() -> None:
    """thaw() is a plain message of NRI's class, equal to the record, changed without touching it."""
    view = frozen(container())
    copy_ = thaw(view)
    assert type(copy_) is api.Container and copy_ == view
    copy_.env.append("X=1")
    copy_.name = "other"
    assert view.name == "app" and "X=1" not in view.env


def test_copies_and_truth() -> None:
    """copy.copy and deepcopy give the record itself; an empty record is falsy as a message is."""
    view = frozen(container())
    assert copy.copy(view) is view and copy.deepcopy(view) is view
    assert not frozen(api.Container()) and not frozen(api.Hooks())
    assert frozen(api.Container(env=["A=1"]))
    assert frozen(view) is view
    assert repr(frozen(api.Container(name="x"))) == "frozen(Container(name='x'))"


def test_frozen_record_in_an_answer() -> None:
    """A frozen mount can go into an adjustment the handler builds: it serializes as the original."""
    view = frozen(container())
    answer = api.ContainerAdjustment(mounts=[view.mounts[0]])
    assert bytes(answer) == bytes(api.ContainerAdjustment(mounts=[container().mounts[0]]))


@given(
    st.lists(st.text(max_size=8), max_size=4),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
)
def test_round_trip_any_content(env: list[str], annotations: dict[str, str]) -> None:
    """For any env and annotations the view serializes as the message and thaws back equal."""
    original = api.Container(env=env, annotations=annotations)
    view = frozen(original)
    assert bytes(view) == bytes(original)
    assert thaw(view) == original
    assert bool(view) == bool(original)
