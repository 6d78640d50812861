"""Tests of 0fb2852: ``h2.frames.request_header_problem`` remembers the fields it found good (at most
1024, started over when full). What it remembers may only save ``field_problem`` calls: whatever lists
came before (the same bytes in another place: a pseudo-header in trailers or after a regular field, te
content-length twice; a flood of distinct fields that restarts the memory), every list must get the
answer it gets from an empty memory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.h2 import frames
from tests.fuzz import examples

Headers = list[tuple[bytes, bytes]]

GOOD_REQUEST: Headers = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/runtime.v1.RuntimeService/Version"),
    (b"content-type", b"application/grpc"),
    (b"te", b"trailers"),
]


@pytest.fixture(autouse=True)
def _fresh_memory() -> Iterator[None]:
    frames._GOOD_FIELDS.clear()
    yield
    frames._GOOD_FIELDS.clear()


def from_empty_memory(headers: Headers, trailers: bool) -> str | None:
    saved = set(frames._GOOD_FIELDS)
    frames._GOOD_FIELDS.clear()
    try:
        return frames.request_header_problem(headers, trailers)
    finally:
        frames._GOOD_FIELDS.clear()
        frames._GOOD_FIELDS.update(saved)


CONTEXTS: dict[str, tuple[Headers, bool]] = {
    "a request's pseudo-header in trailers": ([(b":path", b"/runtime.v1.RuntimeService/Version")], True),
    "a pseudo-header after a regular field": (
        [(b":method", b"POST"), (b":scheme", b"http"), (b"te", b"trailers"), (b":path", b"/x")],
        False,
    ),
    "a pseudo-header twice": ([*GOOD_REQUEST, (b":method", b"POST")], False),
    "content-length twice": ([*GOOD_REQUEST, (b"content-length", b"5"), (b"content-length", b"5")], False),
    "no :path": (GOOD_REQUEST[:2] + GOOD_REQUEST[3:], False),
}


@pytest.mark.parametrize(("headers", "trailers"), CONTEXTS.values(), ids=CONTEXTS.keys())
def test_a_good_field_in_a_bad_place_is_refused_once_remembered(headers: Headers, trailers: bool) -> None:
    expected = from_empty_memory(headers, trailers)
    assert expected is not None
    frames.request_header_problem([*GOOD_REQUEST, (b"content-length", b"5")])  # the fields remembered good
    assert GOOD_REQUEST[0] in frames._GOOD_FIELDS
    assert expected == frames.request_header_problem(headers, trailers)


@pytest.mark.parametrize(
    "field",
    [
        (b"Content-Type", b"application/grpc"),
        (b"x", b" padded"),
        (b"x", b"a\x00b"),
        (b"x y", b"1"),
        (b"", b""),
    ],
)
def test_a_bad_field_is_never_remembered(field: tuple[bytes, bytes]) -> None:
    for _ in range(3):
        assert frames.request_header_problem([*GOOD_REQUEST, field]) is not None
    assert field not in frames._GOOD_FIELDS


def test_a_flood_of_distinct_fields_keeps_the_memory_bounded() -> None:
    """A flood of distinct fields keeps the memory bounded and the answers right."""
    for i in range(5000):
        assert frames.request_header_problem([*GOOD_REQUEST, (b"x-%d" % i, b"v")]) is None
        assert len(frames._GOOD_FIELDS) <= frames._GOOD_FIELDS_LIMIT
    assert frames.request_header_problem([*GOOD_REQUEST, (b"X-1", b"v")]) is not None
    assert frames.request_header_problem([(b":path", b"/x")], trailers=True) is not None


names = st.sampled_from(
    [b":method", b":scheme", b":path", b":authority", b":status", b"te", b"content-length", b"content-type",
     b"connection", b"grpc-timeout", b"x-a", b"X-A", b"", b"a b"]
)  # fmt: skip
field_values = st.sampled_from(
    [b"POST", b"http", b"/p", b"", b"trailers", b"5", b"5x", b" x", b"a\nb", b"1S"]
)
header_lists = st.lists(st.tuples(names, field_values), max_size=7)


@settings(max_examples=examples(300))
@given(
    before=st.lists(st.tuples(header_lists, st.booleans()), max_size=6),
    headers=header_lists,
    trailers=st.booleans(),
)
def test_fuzz_answers_do_not_depend_on_what_came_before(
    before: list[tuple[Headers, bool]], headers: Headers, trailers: bool
) -> None:
    expected = from_empty_memory(headers, trailers)
    for earlier, earlier_trailers in before:
        frames.request_header_problem(earlier, earlier_trailers)
        frames.request_header_problem(headers, not trailers)
    assert expected == frames.request_header_problem(headers, trailers)
    assert expected == frames.request_header_problem(headers, trailers)
