"""krproxy.nri.records.parse_frozen: a runtime's request decoded by upb straight into read-only views, the
same as betterproto2's decoding then ``frozen()`` (class, fields, wire bytes, read-only all the way down);
what upb would read differently goes through betterproto2."""

from __future__ import annotations

import pathlib
import types
from typing import Any

import betterproto2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from krproxy.nri.records import frozen, is_frozen, parse_frozen, prepare
from krproxy.proto.nri.pkg.api import v1alpha1 as api

#: Requests containerd 2.1.9 sent the bench's plugin (tests/data/nri: a pod start's CreateContainer and
#: its RunPodSandbox StateChange).
DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "nri"


def assert_same(expected: Any, got: Any) -> None:
    """``got`` holds what ``expected`` (``frozen(cls.parse(...))``) holds, in the same read-only types."""
    assert type(expected) is type(got)
    if isinstance(expected, betterproto2.Message):
        assert is_frozen(got)
        for name in expected.__dataclass_fields__:
            assert_same(getattr(expected, name), getattr(got, name))
    elif isinstance(expected, tuple):
        assert len(expected) == len(got)
        for a, b in zip(expected, got, strict=True):
            assert_same(a, b)
    elif isinstance(expected, types.MappingProxyType):
        assert list(expected) == list(got)  # wire order, as betterproto2 reads it
        for key in expected:
            assert_same(expected[key], got[key])
    else:
        assert expected == got


def check(cls: type[Any], payload: bytes) -> Any:
    got = parse_frozen(cls, payload)
    assert_same(frozen(cls.parse(payload)), got)
    assert bytes(got) == bytes(cls.parse(payload))
    return got


@pytest.mark.parametrize(
    ("cls", "name"),
    [(api.CreateContainerRequest, "CreateContainerRequest"), (api.StateChangeEvent, "StateChangeEvent")],
)
def test_requests_from_containerd(cls: type[Any], name: str) -> None:
    got = check(cls, (DATA / f"containerd-2.1.9-{name}.bin").read_bytes())
    assert got.pod is not None and got.pod.linux is not None and got.pod.linux.namespaces


def test_every_kind_of_field() -> None:
    """Enums (single and repeated), maps of strings and of messages (string and int32 keys), repeated
    messages, scalars and repeated scalars, set and unset sub-messages."""
    owners = api.OwningPlugins(
        owners={
            "ctr-1": api.FieldOwners(
                simple={1: "10-a", 7: "20-b"}, compound={8: api.CompoundFieldOwners(owners={"PATH": "10-a"})}
            )
        }
    )
    container = api.Container(
        id="ctr-1",
        state=api.ContainerState.CONTAINER_RUNNING,
        labels={"b": "2", "a": "1"},
        env=["PATH=/bin"],
        mounts=[api.Mount(destination="/d", options=["ro"]), api.Mount(destination="/e")],
        rlimits=[api.PosixRlimit(type="RLIMIT_NOFILE", hard=2, soft=1)],
        pid=7,
        created_at=-5,
        linux=api.LinuxContainer(
            oom_score_adj=api.OptionalInt(value=-998),
            resources=api.LinuxResources(cpu=api.LinuxCpu(cpus="0-1", quota=api.OptionalInt64(value=-1))),
        ),
    )
    request = api.ValidateContainerAdjustmentRequest(
        pod=api.PodSandbox(id="p"), container=container, owners=owners, plugins=[api.PluginInstance(name="a")]
    )
    got = check(api.ValidateContainerAdjustmentRequest, bytes(request))
    assert got.container.state is api.ContainerState.CONTAINER_RUNNING
    assert got.adjust is None and got.container.hooks is None  # unset stays None


def test_unknown_fields_kept_by_betterproto2() -> None:
    """A newer runtime's field (number 1023 here) is kept, as betterproto2 keeps it."""
    payload = (
        bytes(api.StateChangeEvent(event=api.Event.RUN_POD_SANDBOX, pod=api.PodSandbox(id="p")))
        + b"\xf8\x3f\x01"
    )
    got = parse_frozen(api.StateChangeEvent, payload)
    assert bytes(got) == payload and is_frozen(got)


def test_what_upb_cannot_decode_is_betterproto2s_error() -> None:
    bad_utf8 = b"\x0a\x02\xff\xfe"  # PodSandbox.id, not UTF-8
    with pytest.raises(UnicodeDecodeError):
        api.PodSandbox.parse(bad_utf8)
    with pytest.raises(UnicodeDecodeError):
        parse_frozen(api.PodSandbox, bad_utf8)


def test_prepare_counts_the_classes_held() -> None:
    assert prepare(api.CreateContainerRequest) > 20


texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)


@given(
    env=st.lists(texts, max_size=4),
    annotations=st.dictionaries(texts, texts, max_size=4),
    destinations=st.lists(texts, max_size=3),
    oom=st.none() | st.integers(-1000, 1000),
    state=st.sampled_from(list(api.ContainerState)),
)
def test_round_trip_any_content(
    env: list[str], annotations: dict[str, str], destinations: list[str], oom: int | None, state: Any
) -> None:
    linux = api.LinuxContainer(oom_score_adj=None if oom is None else api.OptionalInt(value=oom))
    container = api.Container(
        env=env,
        annotations=annotations,
        state=state,
        mounts=[api.Mount(destination=d) for d in destinations],
        linux=linux,
    )
    check(
        api.CreateContainerRequest,
        bytes(api.CreateContainerRequest(pod=api.PodSandbox(), container=container)),
    )


def test_fields_read_at_first_use() -> None:
    """A view reads a field from upb's message when it is first read, and keeps it: a handler that
    reads the container's name does not pay for the pod's and container's other records."""
    payload = (DATA / "containerd-2.1.9-CreateContainerRequest.bin").read_bytes()
    got = parse_frozen(api.CreateContainerRequest, payload)
    assert "container" not in vars(got) and "pod" not in vars(got)
    container = got.container
    assert container is got.container  # kept: the same record at every read
    assert {"container"} == {name for name in vars(got) if not name.startswith("_")}
    assert container.name and "mounts" not in vars(container)
    assert_same(frozen(api.CreateContainerRequest.parse(payload)), got)  # all of it, read at last
