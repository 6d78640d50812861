"""krproxy.relay.messages.Messages: gRPC's length-prefixed messages out of DATA payloads cut
anywhere (prefixes split across frames, several messages in one frame, empty messages)."""

from __future__ import annotations

import pytest

from krproxy.grpcstatus import GRPCError, Status
from krproxy.relay.messages import Inbox, Messages
from krproxy.relay.rpc import MessageTooLarge


def _framed(flag: int, message: bytes) -> bytes:
    return bytes([flag]) + len(message).to_bytes(4, "big") + message


MESSAGES = [(False, b"abc"), (True, b""), (False, b"x" * 70), (False, b""), (True, b"tail")]
STREAM = b"".join(_framed(int(compressed), message) for compressed, message in MESSAGES)


def _feed(chunks: list[bytes], limit: int = 1024) -> Messages:
    messages = Messages(limit)
    for chunk in chunks:
        messages.feed(chunk)
    return messages


def test_the_same_messages_however_the_bytes_are_cut() -> None:
    for size in range(1, len(STREAM) + 1):
        chunks = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
        messages = _feed(chunks)
        assert MESSAGES == list(messages.ready), size
        assert not messages.incomplete
    for cut in range(len(STREAM) + 1):
        for second in range(cut, len(STREAM) + 1):
            messages = _feed([STREAM[:cut], STREAM[cut:second], STREAM[second:]])
            assert MESSAGES == list(messages.ready), (cut, second)


def test_a_message_not_all_there_is_incomplete() -> None:
    for cut in range(1, len(_framed(0, b"abc"))):
        messages = _feed([_framed(0, b"abc")[:cut]])
        assert messages.incomplete and not messages.ready


def test_a_prefix_over_the_limit_raises_before_its_bytes_arrive() -> None:
    head = _framed(0, b"y" * 11)[:5]
    for cut in range(1, 5):
        messages = Messages(10)
        messages.feed(head[:cut])
        with pytest.raises(MessageTooLarge):
            messages.feed(head[cut:])


def test_a_flag_other_than_0_or_1_is_internal() -> None:
    with pytest.raises(GRPCError) as caught:
        _feed([_framed(0, b"ok"), _framed(2, b"no")[:3], _framed(2, b"no")[3:]])
    assert Status.INTERNAL == caught.value.status


class _Half:
    """What an Inbox asks of its half: stream credit given back (recorded here)."""

    def __init__(self) -> None:
        self.granted = 0

    def grant_stream(self, size: int) -> None:
        self.granted += size


def _inbox(*frames: bytes) -> tuple[Inbox, _Half]:
    half = _Half()
    inbox = Inbox(half, 1024)  # type: ignore[arg-type]
    for data in frames:
        inbox.arrived(data)
    return inbox, half


class TestTakeSole:
    def test_the_one_plain_message_is_taken(self) -> None:
        """A request of exactly one uncompressed message gives it, owing and granting nothing."""
        inbox, half = _inbox(_framed(0, b"abc"))

        assert b"abc" == inbox.take_sole()
        assert (0, 0) == (inbox.owed, half.granted)
        assert inbox.take() is None

    def test_anything_else_is_left_where_it_is(self) -> None:
        """Two messages, a compressed one, a message with part of another after it, or none: None,
        and the messages stay to be taken one by one."""
        cases = [
            (_framed(0, b"a") + _framed(0, b"b"),),
            (_framed(1, b"z"),),
            (_framed(0, b"a") + _framed(0, b"bc")[:3],),
            (),
        ]
        for frames in cases:
            inbox, _ = _inbox(*frames)
            before = list(inbox.messages.ready)

            assert inbox.take_sole() is None, frames
            assert before == list(inbox.messages.ready), frames
