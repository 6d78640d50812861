"""A long-running process's heap on transparent huge pages: the daemon's, ``krproxy nri``'s, a hook server's.

Each of them serves calls that come one at a time, milliseconds apart (kubelet's creates), and
between two calls the node's other processes run on the same CPUs and take the caches and the TLB:
each call meets a cold process. Its Python then walks the page tables for every 4 KiB page of the
heap it touches (the objects, frames, dicts and code objects of every function it runs, scattered
over tens of MiB: 280-510 pages a call for the SDK bench's hook server). On 2 MiB pages the same
heap is a few dozen TLB entries. Where the node's THP setting is ``madvise`` (the common default),
only memory advised ``MADV_HUGEPAGE`` gets them: :func:`heap_on_huge_pages` advises the process's
anonymous private read-write mappings (the C heap, Python's object arenas, thread stacks) and
collapses what they hold now (``MADV_COLLAPSE``, Linux 6.1; before it, khugepaged collapses them in
its time). Only whole aligned 2 MiB pages of a mapping can be huge, and only what is mapped when it
runs: Python's arenas mapped on their own (1 MiB each) and memory mapped later (the C heap's growth
is a mapping of its own) stay on small pages until it runs again.
Measured in the hook anchor (docs/performance.md): a hook server's and the daemon's CPU per call
3-10 % lower, resident memory within 1 %.

:func:`advise_heap` is what the processes call, once they are set up, in a thread (collapsing 50
MiB takes about 0.1 s, the GIL let go meanwhile): not with ``KRPROXY_HUGE_PAGES=0`` in the
environment. Nothing else changes: files, code and shared memory are never advised, and where the
kernel has no THP or refuses (a sandbox without /proc, a seccomp filter) the process stays as it was.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Mapping

import trio

from krproxy import log

LOGGER = logging.getLogger("krproxy.hugepages")

#: ``0`` in the environment: :func:`advise_heap` leaves the process's memory on the pages it has.
VARIABLE = "KRPROXY_HUGE_PAGES"

#: madvise(2)'s advice values (linux/mman.h).
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25

#: The size of a huge page where the kernel does not say (x86-64's PMD).
DEFAULT_HUGE_PAGE = 2 << 20

_HPAGE_SIZE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"


def _libc_madvise() -> Callable[[int, int], None]:
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int

    def advise(start: int, size: int) -> None:
        """MADV_HUGEPAGE for the range (an OSError if refused), then MADV_COLLAPSE where it can."""
        if madvise(start, size, MADV_HUGEPAGE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        madvise(start, size, MADV_COLLAPSE)  # (EINVAL before 6.1, EAGAIN short of memory: left to khugepaged)

    return advise


def _huge_page_size() -> int:
    try:
        with open(_HPAGE_SIZE) as f:
            return int(f.read())
    except (OSError, ValueError):
        return DEFAULT_HUGE_PAGE


def heap_on_huge_pages(
    maps: str = "/proc/self/maps", advise: Callable[[int, int], None] | None = None
) -> int:
    """Advise the 2 MiB-aligned part of each anonymous, private, read-write mapping in ``maps`` (the
    C heap and anonymous ones; none with a file or another name) onto huge pages with ``advise(start,
    size)`` (madvise(2)). The bytes advised: 0 where ``maps`` cannot be read, and none after the first
    refusal of the kernel's (any OSError: no THP in the kernel, a seccomp filter)."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
        if advise is None:
            advise = _libc_madvise()
    except (OSError, AttributeError):  # (AttributeError: a C library without madvise)
        return 0
    huge = _huge_page_size()
    advised = 0
    for line in lines:
        fields = line.split()
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3] != "p" or fields[4] != "0":
            continue
        if len(fields) > 5 and fields[5] != "[heap]":
            continue
        low, high = (int(x, 16) for x in fields[0].split("-"))
        start = (low + huge - 1) & -huge
        end = high & -huge
        if end <= start:
            continue
        try:
            advise(start, end - start)
        except OSError:
            return advised
        advised += end - start
    return advised


async def advise_heap(what: str, environ: Mapping[str, str] = os.environ) -> int:
    """:func:`heap_on_huge_pages` in a thread, unless ``environ`` has ``KRPROXY_HUGE_PAGES=0``; logs
    what was advised at debug level (``what``: the process's state then, as "started"). The bytes
    advised."""
    if environ.get(VARIABLE) == "0":
        return 0
    advised = await trio.to_thread.run_sync(heap_on_huge_pages)
    log.event(LOGGER, "heap_on_huge_pages", level=logging.DEBUG, when=what, advised_mib=advised >> 20)
    return advised
