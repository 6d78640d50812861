"""krproxy.hooks.idprefix: ids read as containerd's truncindex reads them, the refusal worded as containerd's,
and the request rewritten to name the full id.

The reference model below is containerd's ``TruncIndex.Get`` written plainly: visit every stored id the key is
a prefix of; none is "not found", two or more "ambiguous", an empty key refused first. The index must answer
as it does for any set of ids and any key, its fast paths (the dict hit, the bisection) included.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from krproxy import protowire
from krproxy.grpcstatus import Status
from krproxy.hooks import _reading as reading
from krproxy.hooks import idprefix
from krproxy.hooks.idprefix import IdIndex, IdRefused
from krproxy.hooks.store import HookStore
from krproxy.proto.runtime import v1 as cri

A = "3cdc06a66d67" + "a" * 52
B = "3cdc06a66d67" + "b" * 52
C = "9f" + "0" * 62


def truncindex_get(ids: set[str], key: str) -> str | None:
    """containerd's truncindex: the one stored id *key* is a prefix of; raises IdRefused as it errs."""
    if key == "":
        raise IdRefused(key)
    found = [ident for ident in ids if ident.startswith(key)]
    if len(found) > 1:
        raise IdRefused(key)
    return found[0] if found else None


def outcome(resolve: Any, key: str) -> tuple[str, str | None]:
    try:
        return ("id", resolve(key))
    except IdRefused as refused:
        return ("refused", refused.reason)


CASES = [
    # (stored ids, key, expected outcome)
    ({A, C}, A, ("id", A)),
    ({A, C}, A[:12], ("id", A)),
    ({A, C}, "9", ("id", C)),
    ({A, B, C}, A[:12], ("refused", "Multiple IDs found with provided prefix: 3cdc06a66d67")),
    ({A, B, C}, A[:13], ("id", A)),
    ({A, B, C}, A, ("id", A)),
    ({A, C}, "", ("refused", "prefix can't be empty")),
    (set(), "", ("refused", "prefix can't be empty")),
    ({A, C}, "zz", ("id", None)),
    ({A, C}, A + "0", ("id", None)),
    (set(), A, ("id", None)),
    # ids of different lengths: one that is a prefix of another is ambiguous even as itself (the trie's visit)
    ({"abc", "abcd"}, "abc", ("refused", "Multiple IDs found with provided prefix: abc")),
    ({"abc", "abcd"}, "abcd", ("id", "abcd")),
    ({"abc", "abd"}, "abc", ("id", "abc")),
    ({"ab", "abc", "b"}, "b", ("id", "b")),
]


@pytest.mark.parametrize(("ids", "key", "expected"), CASES)
def test_resolve_as_truncindex(ids: set[str], key: str, expected: tuple[str, str | None]) -> None:
    """Each case answers as containerd's truncindex: a unique prefix names its id, an empty key and a prefix of
    two ids are refused with its messages, a key that is no stored id's prefix names nothing."""
    assert expected == outcome(IdIndex(ids).resolve, key)
    assert expected == outcome(lambda k: truncindex_get(ids, k), key)


IDS = st.text(alphabet="0123ab", min_size=1, max_size=6)


@given(ids=st.sets(IDS, max_size=12), key=st.text(alphabet="0123abz", max_size=7))
def test_resolve_agrees_with_the_model(ids: set[str], key: str) -> None:
    """For any ids (of mixed lengths, sharing prefixes) and any key, the index answers as the model."""
    assert outcome(lambda k: truncindex_get(ids, k), key) == outcome(IdIndex(ids).resolve, key)


@given(ids=st.sets(st.text(alphabet="0123456789abcdef", min_size=8, max_size=8), min_size=1, max_size=12))
def test_every_stored_id_and_unique_prefix_names_it(ids: set[str]) -> None:
    """With ids of one length (containerd's case), each names itself, and each of its prefixes that no other
    id shares names it too."""
    index = IdIndex(ids)
    for ident in ids:
        assert ident == index.resolve(ident)
        for cut in range(1, len(ident)):
            others = [other for other in ids if other != ident and other.startswith(ident[:cut])]
            if not others:
                assert ident == index.resolve(ident[:cut])


class IndexAgainstModel(RuleBasedStateMachine):
    """Ids added and dropped in any order: the index answers as the model of the ids it holds then."""

    def __init__(self) -> None:
        super().__init__()
        self.index = IdIndex()
        self.model: set[str] = set()

    @rule(ident=IDS)
    def add(self, ident: str) -> None:
        self.index.add(ident)
        self.model.add(ident)

    @rule(ident=IDS)
    def discard(self, ident: str) -> None:
        self.index.discard(ident)
        self.model.discard(ident)

    @rule(ids=st.sets(IDS, max_size=6))
    def replace(self, ids: set[str]) -> None:
        self.index.replace(ids)
        self.model = set(ids)

    @rule(key=st.text(alphabet="0123abz", max_size=7))
    def resolve(self, key: str) -> None:
        assert outcome(lambda k: truncindex_get(self.model, k), key) == outcome(self.index.resolve, key)

    @invariant()
    def same_ids(self) -> None:
        assert len(self.model) == len(self.index)
        assert all(ident in self.index for ident in self.model)


test_index_against_the_model = IndexAgainstModel.TestCase


MESSAGES = [
    # measured on containerd 1.7.24 and 2.1.9 (1.6.20: "Prefix can't be empty")
    ("StartContainer", "", 'an error occurred when try to find container "": prefix can\'t be empty'),
    (
        "StopContainer",
        "3",
        'an error occurred when try to find container "3": Multiple IDs found with provided prefix: 3',
    ),
    ("UpdateContainerResources", "", "failed to find container: prefix can't be empty"),
    (
        "StopPodSandbox",
        "a",
        'an error occurred when try to find sandbox "a": Multiple IDs found with provided prefix: a',
    ),
    ("CreateContainer", "", 'failed to find sandbox id "": prefix can\'t be empty'),
    ("UpdatePodSandboxResources", "d", "failed to find sandbox: Multiple IDs found with provided prefix: d"),
]


@pytest.mark.parametrize(("method", "key", "message"), MESSAGES)
def test_refusal_is_worded_as_containerd(method: str, key: str, message: str) -> None:
    """The refusal is UNKNOWN with the message containerd's method wraps around the truncindex error."""
    error = idprefix.refusal(method, IdRefused(key))

    assert (Status.UNKNOWN, message) == (error.status, error.message)


@pytest.mark.parametrize(
    ("text", "quoted"),
    [("", '""'), ("abc", '"abc"'), ('a"b\\c', r'"a\"b\\c"'), ("\n\x01\x7f", r'"\n\x01\x7f"'), ("é", '"é"')],
)
def test_go_quote_writes_as_strconv_quote(text: str, quoted: str) -> None:
    """Go's %q: quotes and backslashes escaped, control characters as escapes, printable ones kept."""
    assert quoted == idprefix.go_quote(text)


def test_with_id_keeps_the_other_fields_and_names_the_full_id() -> None:
    """The rewritten request reads as the full id, every other field as sent (a timeout, an unknown field),
    also when the id came twice."""
    unknown = protowire.varint(99 << 3 | 0) + protowire.varint(7)
    data = bytes(cri.StopContainerRequest(container_id="3cdc", timeout=30)) + unknown + b"\x0a\x023c"

    rewritten = reading.with_id(data, 1, A)

    assert cri.StopContainerRequest(container_id=A, timeout=30) == cri.StopContainerRequest.FromString(
        rewritten
    )
    assert unknown in rewritten
    assert 1 == rewritten.count(b"\x0a"), "the id comes once"


def test_with_id_refuses_bytes_that_do_not_parse() -> None:
    """A truncated message raises the wire reader's DecodeError (the caller writes it with betterproto2)."""
    with pytest.raises(protowire.DecodeError):
        reading.with_id(b"\x0a\x05ab", 1, A)


def test_store_resolves_and_forgets_by_full_id() -> None:
    """The store resolves pods and containers apart; a pod removed drops its containers' ids from the index
    too, so a prefix no longer names them; load replaces both indexes."""
    from tests.unit.test_hooks_store import POD, container

    store = HookStore()
    store.put_pod(A, POD)
    store.put_container(B, container("x", sandbox=A))

    assert (A, None) == (store.resolve_pod(A[:12]), store.resolve_pod(B[:13]))
    assert (B, None) == (store.resolve_container(B[:13]), store.resolve_container(A[:13]))
    with pytest.raises(IdRefused):
        store.resolve_container("")

    store.remove_pod(A)

    assert (None, None) == (store.resolve_pod(A[:12]), store.resolve_container(B[:13]))
    store.load([(C, POD)], [(A, container("y", sandbox=C))])
    assert (C, A, None) == (store.resolve_pod("9"), store.resolve_container("3"), store.resolve_container(B))
