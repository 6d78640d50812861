"""Store recovery reads a list answer item by item (krproxy.hooks.listing): one record it cannot use among
good ones is left out by id with its reason (a field of the wrong wire type, an oversized annotation, an
item cut short, an id that is not UTF-8), one whose strings are not UTF-8 (what containerd 1.6 stores) is
kept and read with U+FFFD, and every other record is read as it came."""

from __future__ import annotations

from typing import Any

import pytest

from krproxy import protowire
from krproxy.hooks import listing, validate, wire
from krproxy.hooks.listing import Unusable

PodSandbox = wire.message_class("PodSandbox", writing=True)
Container = wire.message_class("Container", writing=True)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return protowire.varint(number << 3 | 2) + protowire.varint(len(payload)) + payload


def pod(ident: str, **annotations: str) -> bytes:
    message = PodSandbox(id=ident, runtime_handler="runc")
    message.metadata.name = f"name-{ident}"
    for key, value in annotations.items():
        message.annotations.add(key=key, value=value)
    return bytes(message.SerializeToString())


def entry(key: bytes, value: bytes) -> bytes:
    return field(1, key) + field(2, value)


def answer(*items: bytes) -> bytes:
    return b"".join(field(1, item) for item in items)


def ids(listed: listing.Listed) -> list[str]:
    return [item.id for item in listed.items]


GOOD = (pod("good-1", a="1"), pod("good-2"))


def with_bad(bad: bytes) -> listing.Listed:
    """A list answer whose middle item is *bad*, read as recovery reads it."""
    return listing.read_list(answer(GOOD[0], bad, GOOD[1]), "PodSandbox", "pod")


def test_good_items_are_read_as_they_came() -> None:
    """Items that decode are read in their order with every field, nothing left out or repaired."""
    listed = listing.read_list(answer(*GOOD), "PodSandbox", "pod")
    assert ["good-1", "good-2"] == ids(listed)
    assert ([], []) == (listed.left_out, listed.repaired)
    assert {"a": "1"} == wire.entries(listed.items[0].annotations)
    assert "name-good-1" == listed.items[0].metadata.name


def test_annotation_not_utf8_is_read_with_replacement() -> None:
    """An annotation value that is not UTF-8 (containerd 1.6 lists it back) keeps its pod, read with U+FFFD,
    and the repair is reported by the pod's id and the annotation's key."""
    bad = pod("bad") + field(6, entry(b"note", b"caf\xe9 \xff"))
    listed = with_bad(bad)
    assert ["good-1", "bad", "good-2"] == ids(listed)
    assert {"note": "caf\ufffd \ufffd"} == wire.entries(listed.items[1].annotations)
    [repaired] = listed.repaired
    assert ("pod", "bad") == (repaired.kind, repaired.id)
    assert "annotations['note']" in repaired.reason
    assert [] == listed.left_out


def test_nested_string_not_utf8_is_repaired() -> None:
    """A string inside a sub-message (the metadata's name) is repaired as one at the top is."""
    bad = pod("bad") + field(2, field(1, b"\xc3\x28"))  # metadata.name: merged, the later name wins
    listed = with_bad(bad)
    assert "\ufffd(" == listed.items[1].metadata.name
    assert "metadata.name" in listed.repaired[0].reason


def test_id_not_utf8_is_left_out() -> None:
    """A record whose id is not UTF-8 is left out: no caller (kubelet decodes strictly) can name it."""
    listed = with_bad(field(1, b"id-\xff"))
    assert ["good-1", "good-2"] == ids(listed)
    [left] = listed.left_out
    assert ("pod", "id-\ufffd") == (left.kind, left.id)
    assert "not UTF-8" in left.reason


def test_field_of_the_wrong_wire_type_is_left_out() -> None:
    """A known field sent with another wire type (annotations as a varint), which Go reads as an unknown
    field, leaves its record out with the field named: what is missing may be what its hooks need."""
    bad = pod("bad") + protowire.varint(6 << 3 | 0) + protowire.varint(7)
    listed = with_bad(bad)
    assert ["good-1", "good-2"] == ids(listed)
    assert [
        Unusable("pod", "bad", "field 6 (annotations) with wire type 0: Go reads the record without it")
    ] == (listed.left_out)


def test_wrong_wire_type_inside_a_sub_message() -> None:
    """The rule holds at any depth: metadata.name sent as a varint names its path."""
    bad = pod("bad") + field(2, protowire.varint(1 << 3 | 0) + protowire.varint(1))
    [left] = with_bad(bad).left_out
    assert "field 1 (metadata.name) with wire type 0" in left.reason


def test_oversized_annotation_is_left_out() -> None:
    """An annotation value over the hook answers' limit (Kubernetes' for all of a pod's annotations) leaves
    its record out, naming the annotation; one at the limit is kept."""
    at_limit = pod("at-limit", big="x" * validate.MAX_VALUE)
    over = pod("over", big="x" * (validate.MAX_VALUE + 1))
    listed = with_bad(at_limit)
    assert "at-limit" in ids(listed)
    listed = with_bad(over)
    assert ["good-1", "good-2"] == ids(listed)
    [left] = listed.left_out
    assert "over" == left.id
    assert f"annotations['big']: {validate.MAX_VALUE + 1} characters" in left.reason


def test_oversized_label_key_is_left_out() -> None:
    """A label key over MAX_KEY characters leaves its record out."""
    message = PodSandbox(id="long-key")
    message.labels.add(key="k" * (validate.MAX_KEY + 1), value="v")
    [left] = with_bad(bytes(message.SerializeToString())).left_out
    assert "long-key" == left.id
    assert left.reason.startswith(f"labels: a key of {validate.MAX_KEY + 1} characters")


def test_truncated_item_is_left_out_by_its_id() -> None:
    """An item cut short (its last field announces more bytes than it has) is left out under the id read
    before the cut; one cut before its id is named by its place in the list."""
    cut = pod("cut", a="1")[:-1]
    listed = with_bad(cut)
    assert ["good-1", "good-2"] == ids(listed)
    [left] = listed.left_out
    assert "cut" == left.id
    assert left.reason.startswith("does not decode (")
    [left] = with_bad(b"\x0a\x05ab").left_out
    assert "(item 1)" == left.id


def test_item_without_id_is_left_out() -> None:
    """An item with no id is left out: nothing could name it."""
    [left] = with_bad(bytes(PodSandbox(runtime_handler="runc").SerializeToString())).left_out
    assert ("(item 1)", "no id") == (left.id, left.reason)


def test_unreadable_framing_fails_the_whole_answer() -> None:
    """An answer whose own framing is cut (the last item announces more bytes than remain) cannot be told
    apart item by item: it raises, and recovery retries."""
    with pytest.raises(protowire.DecodeError):
        listing.read_list(answer(*GOOD)[:-1], "PodSandbox", "pod")


def test_other_fields_of_the_answer_are_skipped() -> None:
    """A field of the answer other than its items (unknown to the schema) is skipped, as Go skips it."""
    data = answer(GOOD[0]) + protowire.varint(2 << 3 | 0) + protowire.varint(5) + answer(GOOD[1])
    assert ["good-1", "good-2"] == ids(listing.read_list(data, "PodSandbox", "pod"))


def test_container_items_follow_the_same_rules() -> None:
    """ListContainers items: a label value that is not UTF-8 is repaired, a truncated one left out."""
    good: Any = Container(id="c1", pod_sandbox_id="p1")
    repaired = bytes(Container(id="c2", pod_sandbox_id="p1").SerializeToString()) + field(
        8, entry(b"k", b"\xfe")
    )
    cut = bytes(Container(id="c3", pod_sandbox_id="p1").SerializeToString()) + b"\x2a\x09ab"
    listed = listing.read_list(
        answer(bytes(good.SerializeToString()), repaired, cut), "Container", "container"
    )
    assert ["c1", "c2"] == ids(listed)
    assert {"k": "\ufffd"} == wire.entries(listed.items[1].labels)
    assert [("container", "c3")] == [(u.kind, u.id) for u in listed.left_out]


def test_status_answer_is_read_by_the_same_rules() -> None:
    """A status answer's strings not UTF-8 are repaired; one with a field of the wrong type is unusable."""
    status = field(1, field(1, b"p1") + field(8, entry(b"k", b"\xff")))  # status.annotations
    read = listing.read(status, "PodSandboxStatusResponse")
    assert read.message is not None
    assert {"k": "\ufffd"} == wire.entries(read.message.status.annotations)
    assert "status.annotations['k']" in read.repaired
    wrong = field(1, field(1, b"p1") + protowire.varint(2 << 3 | 0) + b"\x01")
    assert listing.read(wrong, "PodSandboxStatusResponse").message is None
