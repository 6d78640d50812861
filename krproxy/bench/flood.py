"""A caller that sends huge header blocks, and what the others' calls cost meanwhile.

:func:`send_header_blocks` opens one HTTP/2 connection and sends header blocks of one-byte
indexed fields (``:method: GET`` again and again: HPACK's cheapest field to send and, at ~2 µs
each in Python, far from the cheapest to decode) one after the other until told to stop,
opening a new connection whenever the relay closes one (a 1 MiB block decodes past the 16 MiB
list limit: COMPRESSION_ERROR). The tests hold one such block in its decoder; this module's
:func:`measure` times another client's Version calls through ``krproxy serve`` before and
while it floods::

    python -m krproxy.bench.flood [--calls 1000] [--sizes 1048576,393216,4095]

``nox -s bench`` runs it with 1 MiB and 4095-byte blocks (its row "another caller floods"; the
same target as a stuck client's: the usual latency, at most twice the idle median plus 0.5 ms).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import threading
from typing import Any

from krproxy.relay import frames as f


def send_header_blocks(path: str, size: int, stop: threading.Event, sent: list[int]) -> None:
    """Send ``size``-byte header blocks to the unix socket ``path`` until ``stop`` is set,
    appending each stream id to ``sent`` once its block is written whole. Reconnects when the
    peer closes the connection; nothing it answers is read."""
    block = b"\x82" * size
    while not stop.is_set():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(60)
            sock.connect(path)
            sock.sendall(f.PREFACE + f.settings([]))
            stream_id = 1
            try:
                while not stop.is_set():
                    sock.sendall(f.header_frames(stream_id, block, True, f.DEFAULT_MAX_FRAME))
                    sent.append(stream_id)
                    stream_id += 2
            except (BrokenPipeError, ConnectionResetError):
                continue  # closed by the relay: a new connection


def measure(calls: int, sizes: list[int]) -> dict[str, Any]:
    """Version latency through ``krproxy serve`` (in front of the fake containerd), idle and
    while :func:`send_header_blocks` floods it with blocks of each of ``sizes``."""
    from krproxy.bench import Processes, _client, _serve_args, _summary

    workdir = tempfile.mkdtemp(prefix="krflood-", dir="/tmp")
    procs = Processes(workdir)
    backend, proxy = os.path.join(workdir, "containerd.sock"), os.path.join(workdir, "krproxy.sock")

    def latency() -> dict[str, float]:
        got = _client(
            "latency", "--targets", proxy, "--method", "Version", "--calls", str(calls), "--blocks", "5"
        )
        return _summary(got["latencies_us"][proxy])

    results: dict[str, Any] = {}
    try:
        procs.start("containerd", ["-m", "fakes.containerd", "--socket", backend], backend)
        procs.start("krproxy", _serve_args(proxy, backend, os.path.join(workdir, "hooks")), proxy)
        results["idle"] = latency()
        for size in sizes:
            stop = threading.Event()
            sent: list[int] = []
            sender = threading.Thread(target=send_header_blocks, args=(proxy, size, stop, sent), daemon=True)
            sender.start()
            try:
                results[f"blocks_of_{size}"] = {**latency(), "blocks_sent": len(sent)}
            finally:
                stop.set()
                sender.join(60)
    finally:
        procs.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m krproxy.bench.flood", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--calls", type=int, default=1000, help="Version calls per measurement")
    parser.add_argument(
        "--sizes", default="1048576,393216,4095", help="header block sizes to flood with, comma-separated"
    )
    args = parser.parse_args(argv)
    results = measure(args.calls, [int(size) for size in args.sizes.split(",")])
    for label, r in results.items():
        blocks = f"   ({r['blocks_sent']} blocks sent)" if "blocks_sent" in r else ""
        print(f"Version, {label:<20} median {r['median_ms']:.3f} ms   p99 {r['p99_ms']:.3f} ms{blocks}")
    return 0


__all__ = ["main", "measure", "send_header_blocks"]

if __name__ == "__main__":
    sys.exit(main())
