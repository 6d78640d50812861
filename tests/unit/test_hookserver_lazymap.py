"""Tests of the served SDK's lazy maps and echoed answers (69aeedd, 322ac87: ``_wire`` and
``_context.LazyMap``), from a plugin's side and from the reader of its answer.

A record's labels, annotations and envs are :class:`LazyMap` objects on the served path and
``mappingproxy`` objects on the in-process one (:meth:`PodInfo.from_proto`): a plugin must not
tell them apart by anything it may do with a read-only map, text included (a plugin may write
``str(labels)`` into an annotation). The answer echoes the request's entries as they came, then
the changes: every reader of the protocol (betterproto2, krproxy's upb reader in
:mod:`krproxy.hooks.answers`, protobuf's own maps, and Go's protobuf as koord-runtime-proxy reads
an answer, tests/godecode: a key repeated on the wire keeps its last value) must see
``{**request, **changes}``, also when the request itself repeats a key.
"""

from __future__ import annotations

import copy
import json
import pickle
import random
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hypothesis import given
from hypothesis import strategies as st

from krproxy.hooks import answers
from krproxy.hookserver import ContainerContext, ContainerInfo, PodContext, PodInfo, _wire, container_response
from krproxy.proto import descriptors
from krproxy.proto.runtime import v1alpha1 as pb
from tests.unit.godecode_support import go_decode, godecode  # noqa: F401 - the fixture
from tests.unit.hook_messages import texts

LABELS = {"app": "web", "tier": "front", "é": "ü"}


def _pair(labels: dict[str, str]) -> tuple[Any, MappingProxyType[str, str]]:
    """The served record's labels and the in-process record's, for the same request."""
    req = pb.PodSandboxHookRequest(labels=labels)
    _, served = _wire.pod_info(bytes(req.SerializeToString()))
    in_process = PodInfo.from_proto(req)
    assert served.labels.__class__.__name__ == "LazyMap"
    assert isinstance(in_process.labels, MappingProxyType)
    return served.labels, in_process.labels


def _outcome(op: Any, m: Any) -> tuple[str, Any]:
    try:
        return "ok", op(m)
    except Exception as err:  # the kind of error is what a plugin sees
        return "raises", type(err)


#: What a plugin may do with a read-only map, and what it gets.
OPERATIONS = {
    "str": str,
    "format": lambda m: f"labels={m}",
    "format-spec": lambda m: format(m, ""),
    "repr": repr,
    "len": len,
    "bool": bool,
    "list": list,
    "reversed": lambda m: list(reversed(m)),
    "sorted": sorted,
    "dict": dict,
    "items": lambda m: list(m.items()),
    "keys-eq-set": lambda m: m.keys() == set(LABELS),
    "items-and": lambda m: m.items() & {("app", "web")},
    "values": lambda m: list(m.values()),
    "get": lambda m: (m.get("app"), m.get("x"), m.get("x", "d")),
    "in": lambda m: ("app" in m, "x" in m, 5 in m),
    "in-unhashable": lambda m: [] in m,
    "missing": lambda m: m["x"],
    "eq-dict": lambda m: (m == LABELS, LABELS == m, m != LABELS, m == {}),
    "eq-other": lambda m: (m == list(LABELS.items()), m == None),  # noqa: E711
    "or": lambda m: (m | {"x": "1"}, {"x": "1"} | m, MappingProxyType({"x": "1"}) | m),
    "or-list": lambda m: m | [("x", "1")],
    "copy": lambda m: m.copy(),
    "hash": hash,
    "json": json.dumps,
    "pickle": pickle.dumps,
    "setitem": lambda m: m.__setitem__("x", "1"),
    "update": lambda m: m.update({}),
    "pop": lambda m: m.pop("app"),
    "order": lambda m: m < m,
}


@pytest.mark.parametrize("labels", [LABELS, {}], ids=["labels", "empty"])
@pytest.mark.parametrize("name", OPERATIONS)
def test_a_plugin_cannot_tell_the_lazy_map_from_the_mappingproxy(name: str, labels: dict[str, str]) -> None:
    served, in_process = _pair(labels)
    assert _outcome(OPERATIONS[name], in_process) == _outcome(OPERATIONS[name], served)


def test_copies_of_a_records_maps_read_the_request() -> None:
    """copy.copy and copy.deepcopy refuse a mappingproxy but take a LazyMap (it holds the upb
    field): more than the in-process path allows, and what they give reads as the map."""
    served, _ = _pair(LABELS)
    assert LABELS == dict(copy.copy(served)) == dict(copy.deepcopy(served))


@pytest.mark.parametrize("field", [1, 2])  # key, value of the entry
def test_a_non_utf8_map_entry_is_a_decode_error_before_plugins(field: int) -> None:
    """Not read lazily inside the plugin: refused when the request is decoded, so the call is
    answered INVALID_ARGUMENT naming the message (``_service._answer``)."""
    good = bytes(pb.ContainerResourceHookRequest(container_envs={"AB": "CD"}).SerializeToString())
    bad = good.replace(b"AB" if field == 1 else b"CD", b"\xff\xfe")
    assert bad != good
    with pytest.raises(_wire.DecodeError):
        _wire.container_info(bad)


# -- the answer, as every reader reads it ------------------------------------------------------

#: The hook protocol's classes with real map fields (not their entries): protobuf's map semantics.
_MAPS = descriptor_pool.DescriptorPool()
_MAPS.Add(descriptor_pb2.FileDescriptorProto.FromString(descriptors.RUNTIME_HOOK_V1ALPHA1))
_RESPONSE = message_factory.GetMessageClass(
    _MAPS.FindMessageTypeByName("runtime.v1alpha1.ContainerResourceHookResponse")
)


def _entry(field: int, key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    inner = b"\x0a" + bytes([len(k)]) + k + b"\x12" + bytes([len(v)]) + v
    return bytes([field << 3 | 2, len(inner)]) + inner


def _request_with_entries(envs: list[tuple[str, str]], annotations: list[tuple[str, str]]) -> bytes:
    """A ContainerResourceHookRequest whose maps hold these entries in this order, repeated keys
    included (as a hostile or odd proxy may send them)."""
    number = {f.name: f.number for f in _wire.ContainerResourceHookRequest.DESCRIPTOR.fields}
    return b"".join(_entry(number["container_envs"], k, v) for k, v in envs) + b"".join(
        _entry(number["container_annotations"], k, v) for k, v in annotations
    )


short = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=4).filter(
    lambda s: len(s.encode()) < 60
)
entry_lists = st.lists(st.tuples(st.sampled_from(["A", "B", "é"]) | short, short), max_size=5)


@given(
    envs=entry_lists,
    annotations=entry_lists,
    add_envs=st.dictionaries(short, short, max_size=3),
    set_annotations=st.dictionaries(st.sampled_from(["A", "B", "é"]) | texts, short, max_size=3),
)
def test_every_reader_reads_the_answer_as_request_then_changes(
    envs: list[tuple[str, str]],
    annotations: list[tuple[str, str]],
    add_envs: dict[str, str],
    set_annotations: dict[str, str],
) -> None:
    raw = _request_with_entries(envs, annotations)
    upb_req, info = _wire.container_info(raw)
    assert dict(envs) == dict(info.envs) and list(dict(envs)) == list(info.envs)  # last value, first place
    ctx = ContainerContext(info)
    ctx.response.add_envs.update(add_envs)
    ctx.response.annotations.update(set_annotations)
    answer = _wire.container_reply(upb_req, ctx)
    want_envs, want_annotations = {**dict(envs), **add_envs}, {**dict(annotations), **set_annotations}
    expected = container_response(pb.ContainerResourceHookRequest.parse(raw), ctx)
    assert (want_envs, want_annotations) == (expected.container_envs, expected.container_annotations)
    readings = {
        "betterproto2": pb.ContainerResourceHookResponse.parse(answer),
        "krproxy": answers.decode(pb.ContainerResourceHookResponse, answer),
    }
    for reader, got in readings.items():
        assert list(want_envs.items()) == list(got.container_envs.items()), reader
        assert list(want_annotations.items()) == list(got.container_annotations.items()), reader
    spec = _RESPONSE.FromString(answer)  # protobuf's maps (grpc-go's reading: the last value wins)
    assert (want_envs, want_annotations) == (dict(spec.container_envs), dict(spec.container_annotations))


# -- what a plugin may put in an answer's map ---------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [("X", 5, "int"), ("X", b"v", "bytes"), (b"X", "v", "bytes"), (5, "v", "int"), ("X", ["v"], "list")],
)
@pytest.mark.parametrize("where", ["annotations", "add_envs"])
def test_a_non_str_value_or_key_fails_naming_key_and_type(
    where: str, key: Any, value: Any, named: str
) -> None:
    """Refused as the in-process path (betterproto2) refuses it, with a message a plugin author can
    act on: the map, the key, the type; never the value (it may be a credential)."""
    upb_req, info = _wire.container_info(b"")
    ctx = ContainerContext(info)
    getattr(ctx.response, where)[key] = value
    with pytest.raises(TypeError, match=rf"{where}\[{key!r}\].*{named}.*str") as raised:
        _wire.container_reply(upb_req, ctx)
    if isinstance(value, bytes):
        assert repr(value) not in str(raised.value)
    with pytest.raises((TypeError, AttributeError)):  # the in-process path refuses it too
        bytes(container_response(pb.ContainerResourceHookRequest(), ctx))


def test_a_pod_answers_non_str_label_fails_naming_it() -> None:
    """A pod answer's label that is no str fails the call naming it."""
    upb_req, info = _wire.pod_info(b"")
    ctx = PodContext(info)
    ctx.response.labels["team"] = 7  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"labels\['team'\].*int"):
        _wire.pod_reply(upb_req, ctx)


def test_a_str_subclass_is_taken_as_its_text() -> None:
    class Name(str):
        pass

    upb_req, info = _wire.container_info(b"")
    ctx = ContainerContext(info)
    ctx.response.add_envs[Name("K")] = Name("v")
    got = pb.ContainerResourceHookResponse.parse(_wire.container_reply(upb_req, ctx))
    assert {"K": "v"} == got.container_envs


def test_records_of_either_path_compare_equal() -> None:
    req = pb.ContainerResourceHookRequest(
        pod_labels=LABELS, container_envs={"A": "1"}, container_annotations={"b": "2"}
    )
    _, served = _wire.container_info(bytes(req.SerializeToString()))
    assert ContainerInfo.from_proto(req) == served
    assert str(ContainerInfo.from_proto(req)) == str(served)


# -- Go's reading (google.golang.org/protobuf, as koord-runtime-proxy reads an answer) --------


def _go_reads(program: str, tmp_path: Path, message: str, answer: bytes) -> dict[str, Any]:
    descriptor = tmp_path / "hook.desc"
    if not descriptor.exists():
        descriptor.write_bytes(descriptors.RUNTIME_HOOK_V1ALPHA1)
    done = go_decode(program, descriptor, f"runtime.v1alpha1.{message}", answer)
    assert 0 == done.returncode, done.stderr.decode()
    return dict(json.loads(done.stdout))


@pytest.mark.parametrize("seed", range(12))
def test_go_reads_the_answer_as_request_then_changes(godecode: str, tmp_path: Path, seed: int) -> None:  # noqa: F811
    """Requests repeating keys, plugins changing some of them and adding others: Go's decoder
    keeps a repeated key's last value, so it reads ``{**request, **changes}``, as krproxy does."""
    rng = random.Random(seed)
    keys = ["A", "B", "é", "", "PATH"]
    envs = [(rng.choice(keys), rng.choice(["1", "2", "ü", ""])) for _ in range(rng.randrange(6))]
    annotations = [(rng.choice(keys), rng.choice(["x", "y"])) for _ in range(rng.randrange(6))]
    raw = _request_with_entries(envs, annotations)
    upb_req, info = _wire.container_info(raw)
    ctx = ContainerContext(info)
    ctx.response.add_envs.update(
        {rng.choice(keys): rng.choice(["new", "ñ"]) for _ in range(rng.randrange(3))}
    )
    ctx.response.annotations.update({rng.choice(keys): "set" for _ in range(rng.randrange(3))})
    answer = _wire.container_reply(upb_req, ctx)
    got = _go_reads(godecode, tmp_path, "ContainerResourceHookResponse", answer)
    assert {**dict(envs), **ctx.response.add_envs} == got.get("container_envs", {})
    assert {**dict(annotations), **ctx.response.annotations} == got.get("container_annotations", {})
    krproxy = answers.decode(pb.ContainerResourceHookResponse, answer)
    assert (got.get("container_envs", {}), got.get("container_annotations", {})) == (
        krproxy.container_envs,
        krproxy.container_annotations,
    )


def test_go_reads_a_pod_answer_s_changed_label(godecode: str, tmp_path: Path) -> None:  # noqa: F811
    req = pb.PodSandboxHookRequest(labels={"app": "web", "tier": "front"}, annotations={"a": "1"})
    upb_req, info = _wire.pod_info(bytes(req.SerializeToString()))
    ctx = PodContext(info)
    ctx.response.labels["tier"] = "back"
    got = _go_reads(godecode, tmp_path, "PodSandboxHookResponse", _wire.pod_reply(upb_req, ctx))
    assert {"app": "web", "tier": "back"} == got["labels"] and {"a": "1"} == got["annotations"]
