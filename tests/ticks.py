"""A task that counts the turns the trio loop gives it: a test's evidence that the loop kept serving
other tasks while something else (a flood of input, a job in a thread) was going on (no tests here)."""

from __future__ import annotations

import trio


class Ticks:
    """Start :meth:`run` in a nursery; :attr:`count` grows by one each *interval* the loop lets it run."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.count = 0

    async def run(self) -> None:
        while True:
            await trio.sleep(self.interval)
            self.count += 1
