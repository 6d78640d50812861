"""The relay's routes: connecting to a runtime socket says why it cannot."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from krproxy.relay.route import connect_unix


@pytest.mark.parametrize(("make", "kind"), [("dir", "a directory"), ("file", "a regular file")])
def test_an_endpoint_that_is_no_socket_says_what_it_is(short_tmp: Path, make: str, kind: str) -> None:
    """A runtime endpoint that is a directory or a regular file is refused naming what it is ("Connection
    refused" for a directory said nothing of the typo), and the error still counts as a refusal."""
    path = short_tmp / "endpoint"
    path.mkdir() if make == "dir" else path.write_text("")
    with pytest.raises(ConnectionRefusedError) as caught:
        connect_unix(str(path))()
    assert f"not a socket but {kind}" == caught.value.strerror
    assert str(path) == caught.value.filename


def test_a_socket_nobody_listens_on_is_refused_as_the_kernel_says(short_tmp: Path) -> None:
    """A socket file with no listener keeps the kernel's own words."""
    path = str(short_tmp / "stale.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(path)  # bound, never listening: connect() is refused
        with pytest.raises(ConnectionRefusedError) as caught:
            connect_unix(path)()
    assert "Connection refused" in str(caught.value)
