"""``python -m krproxy.bench.h2core``: the in-memory exchange runs whole calls, and its call count
is a property of the code, not of the machine."""

from __future__ import annotations

import pytest

from krproxy.bench import h2core


def test_each_call_runs_to_its_end_on_both_sides() -> None:
    client, server = h2core._pair()
    h2core._calls(client, server, b"m" * 5000)(3)
    assert {} == client.streams == server.streams  # every stream answered, ended and released
    assert 7 == client.state.next_id  # streams 1, 3 and 5
    assert client.terminated is None and server.terminated is None


def test_the_call_count_is_the_same_in_every_run() -> None:
    first = h2core.count_calls(100, 50)
    assert first == h2core.count_calls(100, 50)
    assert first[0] > 10 and first[1] > 10


def test_main_prints_a_line_per_message_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert 0 == h2core.main(["--calls", "20", "--rounds", "1", "--sizes", "10,20000"])
    lines = capsys.readouterr().out.splitlines()
    assert ["10", "20000"] == [line.split("message")[1].split()[0] for line in lines[1:]]
