"""krproxy._supervise.retry: store recovery retried while the runtime is down, its warnings backing off."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from krproxy import _supervise


async def _down_for(seconds: float, errors: list[str]) -> None:
    """Retry an attempt that fails with the next of ``errors`` (the last one repeated) for ``seconds``."""

    async def attempt() -> None:
        raise ConnectionRefusedError(errors.pop(0) if len(errors) > 1 else errors[0])

    with trio.move_on_after(seconds):
        await _supervise.retry(attempt, retry_on=(OSError,), runtime="/run/c.sock")


def _retries(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [r.krproxy_fields for r in caplog.records if r.getMessage() == "recovery_retry"]  # type: ignore[attr-defined]


async def test_an_hour_down_is_a_few_warnings_with_still(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A runtime down for an hour (virtual time; an attempt every 5 s once backed off, ~720 failures):
    the first failure, then the 2nd, 4th, 8th... with ``still=N``; it logged every one."""
    caplog.set_level(logging.WARNING, logger="krproxy.recovery")
    await _down_for(3600, ["refused"])
    logged = _retries(caplog)
    assert "still" not in logged[0]
    stills = [fields["still"] for fields in logged[1:]]
    assert [2**n for n in range(1, len(stills) + 1)] == stills
    assert 9 == len(stills)  # 2 .. 512 of the ~725 failures
    assert all("refused" in str(fields["error"]) for fields in logged)


async def test_a_new_error_is_logged_at_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """When the error changes, the new one is logged at its first failure and counted afresh."""
    caplog.set_level(logging.WARNING, logger="krproxy.recovery")
    await _down_for(60, ["refused", "refused", "refused", "no such file"])
    logged = _retries(caplog)
    assert "refused" in str(logged[0]["error"]) and "still" not in logged[0]
    assert 2 == logged[1]["still"] and "refused" in str(logged[1]["error"])
    assert "no such file" in str(logged[2]["error"]) and "still" not in logged[2]
