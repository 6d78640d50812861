"""tests/godecode, Go's protobuf reading (google.golang.org/protobuf, as containerd and
koord-runtime-proxy read bytes), for the tests that compare krproxy's reading with Go's: the
``godecode`` fixture builds it, :func:`go_decode` runs it.

Messages go to one process per program and descriptor (a process per message cost 9 ms of CPU;
the property tests send hundreds), which reads them one after the other: started on first use,
stopped when the module that used it is done (the fixture's teardown closes its input)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The running processes, by (program, descriptor's bytes).
_BATCHES: dict[tuple[str, bytes], subprocess.Popen[bytes]] = {}


@pytest.fixture(scope="module")
def godecode() -> Iterator[str]:
    """tests/godecode, built by scripts/install-go-client from the packages it unpacked (never
    downloads); without them the Go cases are skipped with its reason."""
    path = built_go_program("godecode", "no Go decoder")
    try:
        yield path
    finally:
        _stop_batches()


def built_go_program(program: str, missing: str) -> str:
    """tests/<program>'s binary, built by scripts/install-go-client from the packages it unpacked
    (never downloads); without them the test is skipped, ``missing`` and the script's reason said."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "install-go-client"), "--offline", "--program", program],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    path = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or not os.access(path, os.X_OK):
        pytest.skip(f"{missing}: {done.stdout.strip() or done.stderr.strip()}")
    return path


def _stop_batches() -> None:
    while _BATCHES:
        _, process = _BATCHES.popitem()
        assert process.stdin is not None
        process.stdin.close()  # the end of its input: it exits 0
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _batch(godecode: str, descriptor: bytes, path: Path) -> subprocess.Popen[bytes]:
    key = (godecode, descriptor)
    process = _BATCHES.get(key)
    if process is None or process.poll() is not None:
        process = subprocess.Popen(
            [godecode, "-descriptor", str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        _BATCHES[key] = process
    return process


def _read(process: subprocess.Popen[bytes], size: int) -> bytes:
    assert process.stdout is not None
    data = process.stdout.read(size)
    if len(data) < size:  # it ended: say why
        assert process.stderr is not None
        process.wait(timeout=30)
        why = process.stderr.read().decode(errors="replace")
        raise AssertionError(f"krproxy-godecode ended (exit {process.returncode}): {why}")
    return data


def go_decode(
    godecode: str, descriptor: Path, message: str, data: bytes
) -> subprocess.CompletedProcess[bytes]:
    """tests/godecode's reading of *data* as the message *message* (full name) of the descriptor set in
    the file *descriptor*, as a process of its own would end: exit 0 with its protojson reading (proto
    names) on stdout, 1 when Go refuses the bytes, 2 with "panic: ..." on stderr when Go's reading panics."""
    process = _batch(godecode, descriptor.read_bytes(), descriptor)
    assert process.stdin is not None
    name = message.encode()
    process.stdin.write(struct.pack(">I", len(name)) + name + struct.pack(">I", len(data)) + data)
    process.stdin.flush()
    code, size = struct.unpack(">BI", _read(process, 5))
    text = _read(process, size)
    argv = [godecode, "-descriptor", str(descriptor)]
    if code == 0:
        return subprocess.CompletedProcess(argv, 0, text, b"")
    return subprocess.CompletedProcess(argv, code, b"", b"krproxy-godecode: " + text + b"\n")
