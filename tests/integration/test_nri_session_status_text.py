"""(3195fff's question, every place krproxy writes a status message: NRI too): an NRI handler's
error text with a character UTF-8 cannot encode (a lone surrogate, as a surrogateescape'd path gives)
is answered, escaped, and the session goes on: its encoding raised UnicodeEncodeError in the
session's task, which ended the session, the plugin's connection to containerd with it."""

from __future__ import annotations

import pytest
import trio

from krproxy.grpcstatus import Status
from krproxy.nri._session import TtrpcError
from tests.integration.support import LIVENESS_LIMIT
from tests.integration.test_nri_session import PLUGIN, _Pair, pair  # noqa: F401 - the fixture


async def test_a_non_utf8_message_is_answered_and_session_goes_on(
    pair: _Pair,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A message utf8 cannot encode is answered and the session goes on."""

    async def fail(payload: bytes) -> bytes:
        raise TtrpcError(Status.FAILED_PRECONDITION, "no cgroup at /sys/fs/cgroup/\udcff")

    monkeypatch.setitem(pair.plugin._handlers, (PLUGIN, "Fail"), fail)
    with trio.fail_after(LIVENESS_LIMIT):
        with pytest.raises(TtrpcError) as info:
            await pair.runtime.call(PLUGIN, "Fail", b"")
        assert (Status.FAILED_PRECONDITION, "no cgroup at /sys/fs/cgroup/\\udcff") == (
            info.value.code,
            info.value.message,
        )
        assert b"echo:x" == await pair.runtime.call(PLUGIN, "Echo", b"x")
