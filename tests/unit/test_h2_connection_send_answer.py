"""krproxy.h2's ``send_answer``: a unary answer (headers, one DATA frame, trailers) framed in one step,
in memory against the ``h2`` library as the peer (it checks every frame we send).

Where the three frames go out at once, the bytes are those ``send_headers``, ``send_data`` and
``send_trailers`` in turn give; where one of those would queue, reset or refuse, ``send_answer``
sends nothing and says so (False), so that a driver sends the three in turn as before.
"""

from __future__ import annotations

import h2.events
import h2.settings
import pytest

from krproxy.h2 import frames as f
from krproxy.h2.connection import Connection
from tests.unit.h2peer import REQUEST, RESPONSE
from tests.unit.test_h2_connection_fast_paths import _H2Peer, _server_with_h2_client

HEADERS = f.encode_headers(RESPONSE)
MESSAGE = b"\x00\x00\x00\x00\x05hello"
TRAILERS = f.encode_headers([(b"grpc-status", b"0")])


def _opened(settings: dict[int, int] | None = None) -> tuple[Connection, _H2Peer]:
    """Our server with the peer's request on stream 1 (ended), nothing answered yet."""
    ours, peer = _server_with_h2_client()
    if settings:
        peer.h2.update_settings(settings)
        peer.exchange()
    peer.h2.send_headers(1, REQUEST, end_stream=True)
    peer.exchange()
    return ours, peer


@pytest.mark.parametrize("headers_first", [False, True], ids=["whole", "after-headers"])
def test_an_answer_that_fits_is_the_three_sends_bytes(headers_first: bool) -> None:
    """The answer's bytes are those of the three sends in turn (headers left out when sent already),
    the stream ends and the windows shrink by the data."""
    ours, _ = _opened()
    theirs, _ = _opened()
    for conn in (ours, theirs):
        conn.data_to_send()
        if headers_first:
            conn.send_headers(1, HEADERS)
    assert ours.send_answer(1, None if headers_first else HEADERS, MESSAGE, TRAILERS)
    if not headers_first:
        theirs.send_headers(1, HEADERS)
    theirs.send_data(1, MESSAGE)
    theirs.send_trailers(1, TRAILERS)
    assert theirs.data_to_send() == ours.data_to_send()
    stream = ours.streams[1]
    assert stream.send_ended and stream.headers_sent
    windows = (theirs.sender.send_window, theirs.streams[1].send_window)
    assert windows == (ours.sender.send_window, stream.send_window)


def test_the_peer_reads_the_whole_answer() -> None:
    """The ``h2`` peer takes the frames: the response headers, the message, the trailers, the end."""
    ours, peer = _opened()
    assert ours.send_answer(1, HEADERS, MESSAGE, TRAILERS)
    peer.to_theirs()
    kinds = [e.__class__ for e in peer.theirs if e.__class__ is not h2.events.SettingsAcknowledged]
    assert [
        h2.events.ResponseReceived,
        h2.events.DataReceived,
        h2.events.TrailersReceived,
        h2.events.StreamEnded,
    ] == kinds[-4:]
    [data] = [e for e in peer.theirs if isinstance(e, h2.events.DataReceived)]
    assert MESSAGE == data.data


@pytest.mark.parametrize(
    "why", ["stream-window", "frame-size", "reset", "ended", "headers-twice", "no-headers"]
)
def test_an_answer_that_would_wait_sends_nothing(why: str) -> None:
    """False and not a byte sent (the stream's state as it was) where the three sends would not all go
    out at once or would refuse: data beyond the peer's stream window or frame size, a stream the peer
    reset or that ended, headers given after headers went out, no headers before the data."""
    settings = {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 4} if why == "stream-window" else None
    ours, peer = _opened(settings)
    message = MESSAGE
    headers: bytes | None = HEADERS
    if why == "frame-size":
        message = b"m" * (f.DEFAULT_MAX_FRAME + 1)
    elif why == "reset":
        peer.h2.reset_stream(1)
        peer.exchange()
    elif why == "ended":
        ours.send_headers(1, HEADERS, True)
    elif why == "headers-twice":
        ours.send_headers(1, HEADERS)
    elif why == "no-headers":
        headers = None
    ours.data_to_send()
    stream = ours.streams.get(1)
    before = None if stream is None else (stream.send_window, stream.headers_sent, stream.send_ended)
    assert not ours.send_answer(1, headers, message, TRAILERS)
    assert b"" == ours.data_to_send()
    stream = ours.streams.get(1)
    assert before == (
        None if stream is None else (stream.send_window, stream.headers_sent, stream.send_ended)
    )


def test_an_answer_over_the_peer_s_header_list_limit_sends_nothing() -> None:
    """A block over the peer's SETTINGS_MAX_HEADER_LIST_SIZE is left to the three sends (which reset the
    stream, as grpc-go's server does): ``send_answer`` sends nothing."""
    ours, _ = _opened({h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 40})
    big = f.encode_headers([(b"grpc-status", b"0"), (b"grpc-message", b"x" * 200)])
    ours.data_to_send()
    assert not ours.send_answer(1, HEADERS, MESSAGE, big)
    assert b"" == ours.data_to_send()
    assert not ours.streams[1].headers_sent
