"""The daemon's heap goes onto huge pages once its store is recovered (:mod:`krproxy.hugepages`):
the imports, the relay and the store are in memory then."""

from __future__ import annotations

import pytest
import trio

from krproxy import hugepages
from krproxy.fakes.containerd import FakeContainerd

from .support import start_proxy, wait_until


async def test_the_daemon_advises_its_heap_once_recovered(
    fake_containerd: tuple[FakeContainerd, str],
    nursery: trio.Nursery,
    sockdir: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A daemon in front of the fake containerd advises its heap once, when its store is recovered."""
    advised: list[str] = []

    def advise() -> int:
        advised.append("advised")
        return 0

    monkeypatch.setattr(hugepages, "heap_on_huge_pages", advise)
    monkeypatch.delenv(hugepages.VARIABLE, raising=False)
    _fake, backend = fake_containerd
    daemon = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    await wait_until(lambda: daemon.hooks.recovered and bool(advised))
    await trio.sleep(0.05)  # (a second advice would be made by now)
    assert 1 == len(advised)
