"""Review of 3195fff: :func:`krproxy.relay._grpc.status_message` on text UTF-8 cannot encode."""

from __future__ import annotations

import urllib.parse

from hypothesis import given
from hypothesis import strategies as st

from krproxy.relay._grpc import MAX_STATUS_MESSAGE, status_message


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
