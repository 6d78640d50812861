"""krproxy.nri.encoding.encode: NRI's messages serialized by plan, byte for byte what betterproto2's
``bytes(message)`` writes (mutable messages and frozen records alike), and what it refuses."""

from __future__ import annotations

import pathlib
from typing import Any

import betterproto2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from krproxy.nri import encoding
from krproxy.nri.encoding import encode
from krproxy.nri.records import frozen, parse_frozen
from krproxy.proto.nri.pkg.api import v1alpha1 as api

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "nri"


def same(message: Any) -> bytes:
    got = encode(message)
    assert bytes(message) == got
    return got


@pytest.mark.parametrize(
    ("cls", "name"),
    [(api.CreateContainerRequest, "CreateContainerRequest"), (api.StateChangeEvent, "StateChangeEvent")],
)
def test_requests_from_containerd(cls: type[Any], name: str) -> None:
    """containerd 2.1.9's requests, decoded by betterproto2 and by upb into frozen records, encode back
    to the bytes containerd sent."""
    payload = (DATA / f"containerd-2.1.9-{name}.bin").read_bytes()
    assert payload == same(cls.parse(payload)) == same(parse_frozen(cls, payload))


def test_every_kind_of_field() -> None:
    """Enums (single, repeated: packed), maps of strings and of messages (string and int32 keys, empty
    keys and values), repeated messages (empty ones too), negative numbers, set-but-empty sub-messages,
    booleans, unknown fields."""
    owners = api.OwningPlugins(
        owners={
            "": api.FieldOwners(
                simple={1: "10-a", 0: "", -3: "x"}, compound={8: api.CompoundFieldOwners(owners={"PATH": ""})}
            )
        }
    )
    container = api.Container(
        id="ctr-1",
        state=api.ContainerState.CONTAINER_RUNNING,
        labels={"b": "2", "a": "1"},
        env=["PATH=/bin", ""],
        mounts=[api.Mount(destination="/d", options=["ro"]), api.Mount()],
        rlimits=[api.PosixRlimit(type="RLIMIT_NOFILE", hard=2, soft=1)],
        pid=7,
        created_at=-5,
        linux=api.LinuxContainer(
            oom_score_adj=api.OptionalInt(value=-998),
            resources=api.LinuxResources(cpu=api.LinuxCpu(cpus="0-1", quota=api.OptionalInt64(value=-1))),
            namespaces=[api.LinuxNamespace(type="pid")],
        ),
    )
    adjust = api.ContainerAdjustment(
        linux=api.LinuxContainerAdjustment(),  # set, empty: written as an empty sub-message
        hooks=api.Hooks(prestart=[api.Hook(path="/h", args=["a"], timeout=api.OptionalInt(value=0))]),
    )
    request = api.ValidateContainerAdjustmentRequest(
        pod=api.PodSandbox(id="p"),
        container=container,
        adjust=adjust,
        owners=owners,
        plugins=[api.PluginInstance(name="a"), api.PluginInstance()],
    )
    payload = same(request)
    same(frozen(request))
    same(parse_frozen(api.ValidateContainerAdjustmentRequest, payload))
    subscribed = api.ConfigureResponse(events=-1)
    same(subscribed)
    updates = api.UpdateContainersRequest(
        update=[api.ContainerUpdate(container_id="c", ignore_failure=True)],
        evict=[api.ContainerEviction(container_id="d", reason="r")],
    )
    same(updates)
    unknown = api.StateChangeEvent.parse(
        bytes(api.StateChangeEvent(event=api.Event.RUN_POD_SANDBOX)) + b"\xf8\x3f\x01"
    )
    assert encode(unknown).endswith(b"\xf8\x3f\x01")
    same(unknown)


def packed_fields() -> list[tuple[type[Any], str]]:
    """Every repeated number or enum field of NRI's schema (proto3 packs them)."""
    return [
        (cls, name)
        for cls in vars(api).values()
        if isinstance(cls, type) and issubclass(cls, betterproto2.Message) and cls is not betterproto2.Message
        for name, meta in cls._betterproto.meta_by_field_name.items()
        if meta.repeated and meta.proto_type in ("enum", "uint32", "int32", "int64", "uint64", "bool")
    ]


@pytest.mark.parametrize(("cls", "name"), packed_fields())
def test_packed_numbers(cls: type[Any], name: str) -> None:
    """Repeated numbers and enums are packed, empty or not, as betterproto2 writes them."""
    meta = cls._betterproto.meta_by_field_name[name]
    values: list[Any] = [0, 1, 300, 70000]
    if meta.proto_type == "enum":
        values = list(cls._betterproto.cls_by_field[name])
    for some in ([], values):
        same(cls(**{name: some}))
        same(frozen(cls(**{name: some})))


def test_number_out_of_range_refused() -> None:
    """A number outside 64 bits is refused, where betterproto2 writes a varint no reader takes."""
    with pytest.raises(ValueError, match="64-bit"):
        encode(api.PosixRlimit(hard=1 << 64))
    with pytest.raises(ValueError, match="64-bit"):
        encode(api.OptionalInt64(value=-(1 << 63) - 1))


texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)
numbers = st.integers(-(1 << 63), (1 << 63) - 1)


@given(
    env=st.lists(st.tuples(texts, texts), max_size=4),
    annotations=st.dictionaries(texts, texts, max_size=4),
    mounts=st.lists(st.tuples(texts, st.lists(texts, max_size=2)), max_size=3),
    oom=st.none() | st.integers(-(1 << 31), (1 << 31) - 1),
    limit=st.none() | numbers,
    shares=st.none() | st.integers(0, (1 << 64) - 1),
    devices=st.lists(st.tuples(texts, st.integers(-(1 << 63), (1 << 63) - 1)), max_size=2),
)
def test_any_adjustment(
    env: list[tuple[str, str]],
    annotations: dict[str, str],
    mounts: list[tuple[str, list[str]]],
    oom: int | None,
    limit: int | None,
    shares: int | None,
    devices: list[tuple[str, int]],
) -> None:
    resources = api.LinuxResources(
        memory=None if limit is None else api.LinuxMemory(limit=api.OptionalInt64(value=limit)),
        cpu=None if shares is None else api.LinuxCpu(shares=api.OptionalUInt64(value=shares)),
    )
    adjust = api.ContainerAdjustment(
        env=[api.KeyValue(key=k, value=v) for k, v in env],
        annotations=annotations,
        mounts=[api.Mount(destination=d, options=o) for d, o in mounts],
        linux=api.LinuxContainerAdjustment(
            resources=resources,
            oom_score_adj=None if oom is None else api.OptionalInt(value=oom),
            devices=[api.LinuxDevice(path=p, major=m) for p, m in devices],
        ),
    )
    response = api.CreateContainerResponse(adjust=adjust, update=[api.ContainerUpdate(container_id="c")])
    same(response)
    same(frozen(response))


def test_prepare_plans_every_class_held() -> None:
    """prepare() plans the answer and every message it holds (maps of messages too)."""
    assert encoding.prepare(api.CreateContainerResponse) > 30
    assert {api.ContainerAdjustment, api.LinuxDevice, api.Hook} <= set(encoding._PLANS)
    assert api.LinuxNetDevice in set(encoding._PLANS)  # LinuxContainerAdjustment.net_devices' values
