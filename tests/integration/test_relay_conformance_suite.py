"""Every case of the public HTTP/2 conformance suite (h2spec's, ``tests/integration/h2_cases.py``)
against the relay, as raw frames over its unix socket.

A case whose verdict needs the runtime's answer (a response, a body under flow control, a stream
the runtime ended) runs in front of the fake containerd; the others in front of a runtime that
accepts the connection's bytes and never answers, so that no answer of the runtime can end a
stream before the case's next frame arrives (the race the h2spec run held the runtime's bytes
back for). docs/testing.md maps each case to this test; ``test_the_docs_table_is_every_case``
keeps that table and :data:`CASES` the same.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from krproxy.fakes.containerd import FakeContainerd
from krproxy.relay import Relay
from tests.integration.h2_cases import CASES, PATH, SECTIONS, check, run
from tests.integration.support import LIVENESS_LIMIT, serve_relay_to

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def silent_runtime(short_tmp: Path) -> Iterator[str]:
    """A runtime socket that takes connections into its backlog and never answers."""
    path = str(short_tmp / "silent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind(path)
        silent.listen(64)
        yield path


@pytest.mark.parametrize("case", list(CASES))
async def test_h2spec_case(
    nursery: trio.Nursery,
    relay: Relay,
    short_tmp: Path,
    fake_containerd: tuple[FakeContainerd, str],
    silent_runtime: str,
    case: str,
) -> None:
    """The relay answers the case's frames as RFC 9113 and RFC 7541 ask (h2_cases.Expect)."""
    played = CASES[case]
    runtime = fake_containerd[1] if played.needs_runtime else silent_runtime
    listen = await serve_relay_to(nursery, relay, runtime, str(short_tmp), [PATH])
    seen = await trio.to_thread.run_sync(run, listen, played, LIVENESS_LIMIT)
    check(played, seen)


def docs_table() -> dict[str, tuple[str, str]]:
    """docs/testing.md's h2spec table: case -> (section, test named)."""
    text = (ROOT / "docs" / "testing.md").read_text()
    rows = re.findall(r"^\| `((?:generic|hpack|http2)/[\d.]+/\d+)` \| ([^|]+?) \| (.+?) \|$", text, re.M)
    return {case: (section.strip(), tests) for case, section, tests in rows}


def test_the_docs_table_is_every_case() -> None:
    """Each of the 146 cases has a row naming its section and this test, and no row names another."""
    table = docs_table()
    assert 146 == len(CASES)
    assert sorted(CASES) == sorted(table)
    for case, (section, tests) in table.items():
        number = case.rsplit("/", 1)[0].split("/", 1)[1]
        assert f"{number} {SECTIONS[case.rsplit('/', 1)[0]]}: {CASES[case].title}" == section, case
        assert f"`test_relay_conformance_suite.py::test_h2spec_case[{case}]`" in tests, case


def test_every_test_the_table_names_exists() -> None:
    """Every other test a row names (``file.py::test`` or ``file.py`` case ``name``) is defined there."""
    missing = []
    for case, (_, tests) in docs_table().items():
        for file, name in re.findall(r"`(test_\w+\.py)::(\w+)", tests):
            found = list((ROOT / "tests").rglob(file))
            if not found or not re.search(rf"^\s*(?:async\s+)?def {name}\b", found[0].read_text(), re.M):
                missing.append(f"{case}: {file}::{name}")
        for file, name in re.findall(r"`(test_\w+\.py)` case `([\w^-]+)`", tests):
            found = list((ROOT / "tests").rglob(file))
            if not found or f'"{name}"' not in found[0].read_text():
                missing.append(f"{case}: {file} case {name}")
    assert [] == missing
