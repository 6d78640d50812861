"""Tests of krproxy.hooks.answers (upb first, betterproto2 where they read the wire differently): answers
a plugin may send that the module's own tests did not build. Each must decode to what betterproto2's
``FromString`` gives (the module's contract; merge and validation read that message), and a map entry whose
key or value has the wrong wire type must still reach :func:`krproxy.hooks.convert.wrong_types` (the
answer is then refused) instead of being read as an empty string."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy import protowire
from krproxy.hooks import answers, convert
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.fuzz import examples
from tests.unit.test_hooks_answers import same_as_betterproto2

Container = hookapi.ContainerResourceHookResponse
Pod = hookapi.PodSandboxHookResponse
Resources = hookapi.LinuxContainerResources


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return protowire.varint(number << 3 | 2) + protowire.varint(len(payload)) + payload


def varint_field(number: int, value: int) -> bytes:
    return protowire.varint(number << 3) + protowire.varint(value)


SHARES = bytes(Resources(cpu_shares=5))
QUOTA = bytes(Resources(cpu_quota=7))
CPUS = bytes(Resources(cpuset_cpus="1"))

CASES: dict[str, tuple[type[Any], bytes]] = {
    # protobuf would merge the two; betterproto2 keeps the last one, and so must decode
    "the resources twice": (Container, field(2, SHARES) + field(2, QUOTA)),
    "the resources twice, a field between": (Container, field(2, SHARES) + field(3, b"/p") + field(2, CPUS)),
    "the resources twice, the second empty": (Container, field(2, SHARES) + field(2, b"")),
    "a pod's resources twice": (Pod, field(4, SHARES) + field(4, QUOTA)),
    "a pod's resources three times": (Pod, field(4, SHARES) + field(4, QUOTA) + field(4, CPUS)),
    # a map entry's key or value with the wrong wire type (betterproto2: a wrong-typed key or value)
    "an annotation's value as a varint": (Container, field(1, field(1, b"a") + varint_field(2, 5))),
    "an annotation's key as a varint": (Container, field(1, varint_field(1, 5) + field(2, b"v"))),
    "an env's value as a fixed32": (Container, field(4, field(1, b"A") + b"\x15\x00\x00\x00\x00")),
    "a unified entry's key as a varint": (Container, field(2, field(9, varint_field(1, 1)))),
    "a pod label's value as a varint": (Pod, field(1, field(1, b"l") + varint_field(2, 3))),
    # odd but well-typed: the two decoders agree already
    "a map entry with an unknown field": (Container, field(1, field(1, b"a") + field(2, b"v") + b"\x18\x01")),
    "a map entry, value before key": (Container, field(1, field(2, b"v") + field(1, b"k"))),
    "a map entry, its key twice": (Container, field(1, field(1, b"a") + field(1, b"b") + field(2, b"v"))),
    "a string twice": (Container, field(3, b"a") + field(3, b"b")),
    "cpu_shares twice": (Container, field(2, varint_field(3, 1) + varint_field(3, 2))),
    "an overlong varint": (Container, field(2, b"\x18\x85\x80\x80\x00")),
    "a negative int64": (Container, field(2, varint_field(3, (1 << 64) - 1))),
    "a varint of 11 bytes": (Container, field(2, b"\x18" + b"\xff" * 10 + b"\x01")),
    "a hugepage limit twice": (Container, field(2, field(8, b"\x10\x01") + field(8, b"\x10\x02"))),
    "a hugepage page size not UTF-8": (Container, field(2, field(8, field(1, b"\xff")))),
    "a group": (Container, b"\xab\x06\xac\x06"),
    "a resources message as a varint": (Container, b"\x10\x05"),
}


@pytest.mark.parametrize(("cls", "data"), CASES.values(), ids=CASES.keys())
def test_decodes_as_betterproto2(cls: type[Any], data: bytes) -> None:
    same_as_betterproto2(cls, data)


@pytest.mark.parametrize(
    "case",
    [
        "an annotation's value as a varint",
        "an annotation's key as a varint",
        "an env's value as a fixed32",
        "a unified entry's key as a varint",
        "a pod label's value as a varint",
    ],
)
def test_a_wrong_typed_map_entry_is_refused(case: str) -> None:
    """The answer is refused (it does not decode, or wrong_types names the field: the dispatcher refuses
    both), not applied with an empty key or value."""
    cls, data = CASES[case]
    try:
        answer = answers.decode(cls, data)
    except Exception:  # betterproto2's refusal (a fixed32 where a string is)
        return
    assert convert.wrong_types(answer)


def test_a_single_resources_field_still_skips_betterproto2(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check for a repeated resources field costs the usual answer no betterproto2 decode, even when
    the field's tag byte also occurs inside a value."""
    data = bytes(Container(container_envs={"\x12": "\x12"}, container_resources=Resources(cpu_shares=0x12)))

    def refuse(data: bytes) -> Any:
        raise AssertionError("decoded with betterproto2")

    expected = Container.FromString(data)
    monkeypatch.setattr(Container, "FromString", refuse)
    assert expected == answers.decode(Container, data)


map_entries = st.lists(
    st.sampled_from(
        [field(1, b"k"), field(2, b"v"), field(1, b""), varint_field(1, 1), varint_field(2, 2), b"\x18\x01"]
    ),
    max_size=3,
).map(b"".join)
resources_bodies = st.lists(
    st.sampled_from([varint_field(3, 5), varint_field(2, 1), field(6, b"0"), field(8, b"\x10\x01"), b""])
    | map_entries.map(lambda entry: field(9, entry)),
    max_size=3,
).map(b"".join)
container_fields = st.one_of(
    map_entries.map(lambda entry: field(1, entry)),
    map_entries.map(lambda entry: field(4, entry)),
    resources_bodies.map(lambda body: field(2, body)),
    st.sampled_from([field(3, b"/p"), varint_field(3, 1), b"\xa8\x06\x01"]),
)


@settings(max_examples=examples(300))
@given(st.lists(container_fields, max_size=5).map(b"".join))
def test_fuzz_well_framed_answers_decode_as_betterproto2(data: bytes) -> None:
    """Answers built of well-framed fields in any order, any number of times, with wrong wire types."""
    same_as_betterproto2(Container, data)
