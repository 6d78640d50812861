"""krproxy.hooks.answers: plugin answers decoded with upb must be the betterproto2 messages ``FromString``
gives (merge and validation read those), for well-formed answers and for everything else a plugin can send:
unknown fields, fields with the wrong wire type, repeated map keys, bytes that are no message. Explicit
cases, then hypothesis (budget: tests/fuzz/__init__.py). And the request path decodes through it, reading
a well-formed answer straight into its record (``answers.read``): the record ``answer_from_hook`` makes of
betterproto2's message."""

from __future__ import annotations

import functools
import json
from typing import Any, cast

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.hooks import answers, dispatch
from krproxy.hooks.convert import answer_from_hook, wrong_types
from krproxy.hooks.merge import merge_container_info
from krproxy.hooks.model import ContainerAnswer, ContainerInfo, PodAnswer
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import Registry
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.fuzz import INT64, examples, linux_resources

Container = hookapi.ContainerResourceHookResponse
Pod = hookapi.PodSandboxHookResponse
UNKNOWN = b"\xa8\x06\x01"  # field 101, varint 1

RESOURCES = hookapi.LinuxContainerResources(
    cpu_shares=512,
    cpuset_cpus="0-1",
    hugepage_limits=[hookapi.HugepageLimit(page_size="2MB", limit=5), hookapi.HugepageLimit()],
    unified={"memory.high": "1G", "": ""},
)

CASES: dict[str, tuple[type[Any], bytes]] = {
    "empty": (Container, b""),
    "an env": (Container, bytes(Container(container_envs={"BENCH": "1"}))),
    "everything": (
        Container,
        bytes(
            Container(
                container_annotations={"a": "1", "b": ""},
                container_resources=RESOURCES,
                pod_cgroup_parent="/kubepods/p",
                container_envs={"A": "1", "": "x"},
            )
        ),
    ),
    "empty resources, present": (
        Container,
        bytes(Container(container_resources=hookapi.LinuxContainerResources())),
    ),
    "unknown field": (Container, bytes(Container(container_envs={"A": "1"})) + UNKNOWN),
    "unknown field in the resources": (
        Container,
        b"\x12" + bytes([len(bytes(RESOURCES)) + 3]) + bytes(RESOURCES) + UNKNOWN,
    ),
    "pod_cgroup_parent as a varint": (Container, b"\x18\x05"),
    "cpu_shares as a string": (Container, b"\x12\x04\x18\x02ab"),
    "a map key sent twice": (
        Container,
        bytes(Container(container_annotations={"a": "1", "b": "2"}))
        + bytes(Container(container_annotations={"a": "3"})),
    ),
    "a map entry without its value": (Container, b"\x0a\x03\x0a\x01k"),
    "a pod answer": (
        Pod,
        bytes(Pod(labels={"l": "1"}, annotations={"a": ""}, cgroup_parent="/p", resources=RESOURCES)),
    ),
    "a pod answer with an unknown field": (Pod, bytes(Pod(cgroup_parent="/p")) + UNKNOWN),
}


def same_as_betterproto2(cls: type[Any], data: bytes) -> None:
    try:
        reference = cls.FromString(data)
    except Exception as err:  # whatever betterproto2 raises, decode must raise the same
        with pytest.raises(type(err)):
            answers.decode(cls, data)
        return
    got = answers.decode(cls, data)
    assert type(got) is cls
    assert reference == got
    assert repr(reference) == repr(got)  # map order too
    if wrong_types(reference):
        # A field sent with another wire type holds a value of the wrong type, which the dispatcher refuses
        # before anything reads it; serializing one is no test of decode, and a message field holding a
        # varint's int makes betterproto2 allocate that many bytes (b"\x10\xe1\x9e\xa8\xa0\xd2;": 2 TB).
        return
    assert bytes(reference) == bytes(got)  # unknown fields too
    read = answers.read(cls, data)
    if isinstance(read, (ContainerAnswer, PodAnswer)):
        assert answer_from_hook(reference) == read
        assert repr(answer_from_hook(reference)) == repr(read)  # map order too
    else:  # betterproto2's reading: the dispatcher checks its types and converts it
        assert type(read) is cls
        assert repr(reference) == repr(read)


@pytest.mark.parametrize(("cls", "data"), CASES.values(), ids=CASES.keys())
def test_same_message_as_betterproto2(cls: type[Any], data: bytes) -> None:
    same_as_betterproto2(cls, data)


@pytest.mark.parametrize("data", [b"\x0a\x05ab", b"\x12\x02\xff\xff", b"\x1a\x02\xc3\x28"])
def test_bytes_that_are_no_answer_raise_as_betterproto2_raises(data: bytes) -> None:
    same_as_betterproto2(Container, data)


def test_a_known_answer_does_not_go_through_betterproto2(monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of the module: the upb path serves a well-formed answer; betterproto2 is the fallback."""
    data = CASES["everything"][1]
    expected = Container.FromString(data)

    def refuse(data: bytes) -> Any:
        raise AssertionError("decoded with betterproto2")

    monkeypatch.setattr(Container, "FromString", refuse)
    assert expected == answers.decode(Container, data)


def test_the_dispatcher_reads_plugin_answers_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatcher.run hands the plugin's bytes to answers.read (betterproto2 refused here): the chain's
    record has the plugin's env."""
    data = CASES["an env"][1]

    class Answering(dispatch.Dispatcher):
        async def _unary(self, plugin: Any, path: str, request: bytes, within: float) -> bytes:
            return data

    def refuse(data: bytes) -> Any:
        raise AssertionError("decoded with betterproto2")

    monkeypatch.setattr(Container, "FromString", refuse)
    dispatcher = Answering(cast(Any, None))
    registration = {"remote-endpoint": "/run/p.sock", "runtime-hooks": ["PreCreateContainer"]}
    dispatcher.publish(Registry().apply("p.json", json.dumps(registration).encode()))
    result = trio.run(
        functools.partial(
            dispatcher.run,
            HookPoint.PRE_CREATE_CONTAINER,
            ContainerInfo(name="c"),
            lambda record: b"",
            merge_container_info,
        )
    )
    assert {"BENCH": "1"} == dict(result.value.envs)


def test_a_known_answer_is_read_without_betterproto2(monkeypatch: pytest.MonkeyPatch) -> None:
    """answers.read builds no betterproto2 answer for a well-formed one, and none goes through wrong_types."""
    data = CASES["everything"][1]
    expected = answer_from_hook(Container.FromString(data))

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("read through betterproto2")

    monkeypatch.setattr(Container, "FromString", refuse)
    monkeypatch.setattr(Container, "__init__", refuse)
    monkeypatch.setattr(dispatch, "wrong_types", refuse)
    got = answers.read(Container, data)
    assert expected == got
    assert expected.resources is not None  # (the case carries them: their conversion is covered)
    assert got is dispatch._record(got)


def test_resources_are_read_without_betterproto2(monkeypatch: pytest.MonkeyPatch) -> None:
    """answers.read builds no betterproto2 LinuxContainerResources or HugepageLimit on the way to the
    record: a pod answer's resources and a container answer's, hugepages and unified entries included."""
    expected = {
        name: answer_from_hook(CASES[name][0].FromString(CASES[name][1]))
        for name in ("everything", "a pod answer", "empty resources, present")
    }

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("resources read through betterproto2")

    monkeypatch.setattr(hookapi.LinuxContainerResources, "__init__", refuse)
    monkeypatch.setattr(hookapi.HugepageLimit, "__init__", refuse)
    for name, record in expected.items():
        got = answers.read(*CASES[name])
        assert record == got, name
        assert repr(record) == repr(got), name  # map and hugepage order too


def test_a_loosely_decoded_answer_is_refused_by_the_dispatcher() -> None:
    """A field sent with another wire type: read gives betterproto2's message, whose wrong types the
    dispatcher refuses as before."""
    read = answers.read(*CASES["pod_cgroup_parent as a varint"])
    assert type(read) is Container
    with pytest.raises(dispatch.InvalidAnswer, match="wrong"):
        dispatch._record(read)


names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6)
string_maps = st.dictionaries(names, names, max_size=3)
hugepages = st.lists(
    st.builds(hookapi.HugepageLimit, page_size=names, limit=st.integers(0, (1 << 64) - 1)), max_size=2
)
resources = st.none() | linux_resources(
    hookapi.LinuxContainerResources,
    names,
    unified=string_maps,
    hugepage_limits=hugepages,
    memory_swap_limit_in_bytes=INT64,
)
container_answers = st.builds(
    Container,
    container_annotations=string_maps,
    container_resources=resources,
    pod_cgroup_parent=names,
    container_envs=string_maps,
)
pod_answers = st.builds(
    Pod, labels=string_maps, annotations=string_maps, cgroup_parent=names, resources=resources
)


@settings(max_examples=examples(200))
@given(
    answer=container_answers | pod_answers,
    tail=st.sampled_from([b"", UNKNOWN, b"\x18\x05", b"\x0a\x03\x0a\x01k"]),
)
def test_fuzz_answers_decode_as_betterproto2(answer: Any, tail: bytes) -> None:
    same_as_betterproto2(type(answer), bytes(answer) + tail)


@settings(max_examples=examples(300))
@given(data=st.binary(max_size=40))
def test_fuzz_any_bytes_decode_as_betterproto2(data: bytes) -> None:
    same_as_betterproto2(Container, data)
    same_as_betterproto2(Pod, data)


def test_a_huge_varint_message_field_compares_unserialized() -> None:
    """Hypothesis found it: container_resources as the varint 2049304039265. bytes() of such a message asks
    betterproto2 for that many bytes (MemoryError, or gigabytes really allocated for a smaller int)."""
    same_as_betterproto2(Container, b"\x10\xe1\x9e\xa8\xa0\xd2;")
