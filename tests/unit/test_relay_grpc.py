"""krproxy.relay.grpc's writing of gRPC fields, in memory.

- :func:`own_call_headers`, the header fields of a call the relay makes itself (0d51c9f): the
  pseudo-headers first, one ``grpc-timeout`` for what is left of the deadline (none without one;
  ``0n`` once it has passed; never shorter than what is left), then the metadata.
- :func:`status_message` on text UTF-8 cannot encode (3195fff): a lone surrogate is escaped, and
  any text fits in :data:`MAX_STATUS_MESSAGE` keeping its start.
- :func:`decompress_inline` reads a gzip message of several members whole, as Go does.
- The status fields krproxy writes: ``grpc-status-details-bin`` within :data:`MAX_STATUS_DETAILS`
  or left out, so that with the longest message they stay within 8 KiB of header list.
"""

from __future__ import annotations

import gzip
import math
import urllib.parse

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from krproxy.grpcstatus import GRPCError, Status
from krproxy.relay.grpc import (
    MAX_STATUS_DETAILS,
    MAX_STATUS_MESSAGE,
    decompress_inline,
    grpc_timeout,
    own_call_headers,
    status_fields,
    status_message,
)

# -- own_call_headers --------------------------------------------------------------------------

PATH = "/runtime.v1.RuntimeService/Version"
PSEUDO = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", PATH.encode()),
    (b":authority", b"localhost"),
]


def _timeouts(fields: list[tuple[bytes, bytes]]) -> list[bytes]:
    return [value for name, value in fields if name == b"grpc-timeout"]


async def test_no_deadline_no_grpc_timeout_and_the_metadata_last(mock_clock: trio.testing.MockClock) -> None:
    fields = own_call_headers(PATH, math.inf, [(b"x-a", b"1"), (b"x-b", b"2")])
    assert PSEUDO == fields[:4]
    assert [] == _timeouts(fields)
    assert [(b"x-a", b"1"), (b"x-b", b"2")] == fields[-2:]


async def test_a_past_deadline_is_0n_sub_ms_ones_not_rounded_down(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A deadline passed is 0n and a sub millisecond one is not rounded down."""
    now = trio.current_time()
    assert [b"0n"] == _timeouts(own_call_headers(PATH, now - 5, []))
    assert [b"0n"] == _timeouts(own_call_headers(PATH, now, []))
    for left in (1e-9, 4e-7, 0.0009, 0.5, 7 * 86400.0):
        (value,) = _timeouts(own_call_headers(PATH, now + left, []))
        seconds = grpc_timeout(value)
        assert seconds is not None and seconds >= left * (1 - 1e-9), (left, value)
        assert len(value) <= 9


async def test_the_timeout_comes_before_the_metadata(mock_clock: trio.testing.MockClock) -> None:
    fields = own_call_headers(PATH, trio.current_time() + 1, [(b"x-a", b"1")])
    names = [name for name, _ in fields]
    assert names.index(b"grpc-timeout") < names.index(b"x-a")
    assert all(name.startswith(b":") for name in names[:4]) and not any(n.startswith(b":") for n in names[4:])


# -- status_message ----------------------------------------------------------------------------


def test_a_lone_surrogate_is_escaped_not_an_error() -> None:
    assert b"a %5Cudcff b" == status_message("a \udcff b")


#: Characters whose encoded size differs: ASCII kept as is, '%' tripled, 2- and 4-byte UTF-8, lone surrogates.
_AWKWARD = st.sampled_from(["a", " ", "%", "é", "\U0001f600", "\udcff", "\ud800"])


@given(st.lists(st.one_of(st.characters(), _AWKWARD), max_size=6000).map("".join))  # st.text drops surrogates
def test_any_text_with_surrogates_fits_and_keeps_its_start(message: str) -> None:
    encoded = status_message(message)
    assert len(encoded) <= MAX_STATUS_MESSAGE
    read = urllib.parse.unquote(encoded.decode("ascii"))
    expected = message.encode("utf-8", "backslashreplace").decode()
    if " ... (" in read and read.endswith(" more characters cut by krproxy)"):
        kept = read[: read.rindex(" ... (")]
        assert expected.startswith(kept)
    else:
        assert expected == read


# -- status fields ------------------------------------------------------------------------------


def _list_size(fields: list[tuple[bytes, bytes]]) -> int:
    return sum(32 + len(name) + len(value) for name, value in fields)  # RFC 7541 §4.1


def test_status_details_within_the_bound_are_written() -> None:
    """Details whose base64 fits MAX_STATUS_DETAILS go out, unpadded; with the longest message
    the status fields stay within 8 KiB of header list (gRPC's suggested trailer limit)."""
    details = b"\x08\x05" * (MAX_STATUS_DETAILS * 3 // 8)
    fields = status_fields(Status.NOT_FOUND, "m" * 10_000, details)
    written = dict(fields)[b"grpc-status-details-bin"]
    assert len(written) <= MAX_STATUS_DETAILS and not written.endswith(b"=")
    assert _list_size(fields) <= 8192, _list_size(fields)


def test_status_details_over_the_bound_are_left_out() -> None:
    """Details too long for the bound cannot be cut (one google.rpc.Status): they are left out,
    the status and its message still written."""
    fields = status_fields(Status.NOT_FOUND, "no such pod", b"\x08\x05" * MAX_STATUS_DETAILS)
    assert [(b"grpc-status", b"5"), (b"grpc-message", b"no such pod")] == fields


def test_a_gzip_message_of_several_members_is_read_whole() -> None:
    """Go's gzip reader (containerd 1.7 and 2.1's grpc-go) reads concatenated members as one stream:
    so does krproxy, not the first member alone; bytes after a member that are not one are refused as
    Go refuses them."""
    assert b"abcdef" == decompress_inline(b"gzip", gzip.compress(b"abc") + gzip.compress(b"def"), 100)
    assert b"abc" == decompress_inline(b"gzip", gzip.compress(b"abc") + gzip.compress(b""), 100)
    for trailing in (b"x", b"\x1f\x8b", bytes(20)):
        with pytest.raises(GRPCError) as caught:
            decompress_inline(b"gzip", gzip.compress(b"abc") + trailing, 100)
        assert Status.INTERNAL == caught.value.status
