"""Tests of a process's heap advised onto transparent huge pages (:mod:`krproxy.hugepages`): the
anonymous read-write mappings are advised (whole 2 MiB pages of them), files and the rest are not, a
kernel or a system that refuses leaves the process as it was, without an error, and
``KRPROXY_HUGE_PAGES=0`` turns it off; a hook server advises before its registration is written."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import trio

from krproxy import hugepages
from krproxy.hookserver import HookServer, _service

HUGE = 2 << 20


def flags_of(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def address_of(region: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc")


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(), reason="a kernel without THP"
)
def test_anonymous_memory_is_advised_files_are_not(tmp_path: Path) -> None:
    """A private anonymous read-write mapping of 8 MiB gets the huge-page advice ("hg"); a file's and a
    shared one do not."""
    region = mmap.mmap(-1, 4 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    shared = mmap.mmap(-1, 4 * HUGE)
    backing = tmp_path / "file"
    backing.write_bytes(b"\0" * 4 * HUGE)
    with backing.open("r+b") as fh:
        mapped = mmap.mmap(fh.fileno(), 4 * HUGE)
    try:
        start, file_start, shared_start = address_of(region), address_of(mapped), address_of(shared)
        advised = hugepages.heap_on_huge_pages()
        assert advised >= 2 * HUGE
        assert "hg" in flags_of(start + 2 * HUGE)
        assert "hg" not in flags_of(file_start)
        assert "hg" not in flags_of(shared_start)
    finally:
        mapped.close()
        shared.close()
        region.close()


def test_only_whole_huge_pages_are_advised(tmp_path: Path) -> None:
    """Of a mapping's range only the 2 MiB-aligned part is advised; one smaller than that is left."""
    maps = tmp_path / "maps"
    maps.write_text(
        "00200000-00a00000 rw-p 00000000 00:00 0 \n"  # 8 MiB, aligned
        "00a00000-00a10000 rw-p 00000000 00:00 0 \n"  # 64 KiB
        "00b00000-01300000 r--p 00000000 08:01 42 /usr/lib/x.so\n"  # a file
        "01300000-01b00000 r-xp 00000000 00:00 0 \n"  # no write: code
        "02100000-02a00000 rw-p 00000000 00:00 0                  [heap]\n"
        "7ffd0000000-7ffd0a00000 rw-p 00000000 00:00 0             [stack]\n"
    )
    advised: list[tuple[int, int]] = []
    assert 8 * HUGE == hugepages.heap_on_huge_pages(
        str(maps), lambda start, size: advised.append((start, size))
    )
    assert [(0x200000, 4 * HUGE), (0x2200000, 4 * HUGE)] == advised


def test_a_refusal_leaves_it_as_it_was(tmp_path: Path) -> None:
    """No /proc (a sandbox), or madvise refused (no THP in the kernel): nothing advised, no error."""
    assert 0 == hugepages.heap_on_huge_pages(str(tmp_path / "missing"))

    def refuse(start: int, size: int) -> None:
        raise OSError(22, "Invalid argument")

    maps = tmp_path / "maps"
    maps.write_text("00200000-00a00000 rw-p 00000000 00:00 0 \n")
    assert 0 == hugepages.heap_on_huge_pages(str(maps), refuse)


@pytest.mark.parametrize(("setting", "advised"), [(None, 1), ("1", 1), ("0", 0)])
async def test_advise_heap_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, setting: str | None, advised: int
) -> None:
    """``advise_heap`` advises in a thread of its own (the event loop goes on meanwhile) and says how
    much; ``KRPROXY_HUGE_PAGES=0`` in the environment leaves the memory alone."""
    threads: list[bool] = []

    def advise() -> int:
        threads.append(trio.lowlevel.in_trio_run())  # (False: not on the loop's thread)
        return 4 * HUGE

    monkeypatch.setattr(hugepages, "heap_on_huge_pages", advise)
    environ = {} if setting is None else {hugepages.VARIABLE: setting}
    assert 4 * HUGE * advised == await hugepages.advise_heap("started", environ)
    assert [False] * advised == threads


async def test_a_hook_server_advises_before_it_registers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve`` advises its process's heap once it is set up (the plugins imported, the socket
    listening) and before its registration file exists: no proxy calls it while the kernel collapses
    the pages."""
    registered: list[bool] = []

    def advise() -> int:
        registered.append(any(tmp_path.glob("*.json")))
        return 0

    monkeypatch.setattr(hugepages, "heap_on_huge_pages", advise)
    monkeypatch.delenv(hugepages.VARIABLE, raising=False)
    options = _service.ServeOptions(socket=str(tmp_path / "s.sock"), hook_dir=str(tmp_path))
    async with trio.open_nursery() as nursery:
        path = await nursery.start(_service.serve, HookServer(), options)
        assert path.endswith(".json")
        assert [False] == registered
        nursery.cancel_scope.cancel()
