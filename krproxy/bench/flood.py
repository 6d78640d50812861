"""A caller that sends huge header blocks (for the hostile-peer tests and the bench).

:func:`send_header_blocks` opens one HTTP/2 connection and sends header blocks of one-byte
indexed fields (``:method: GET`` again and again: HPACK's cheapest field to send and, at ~2 µs
each in Python, far from the cheapest to decode) one after the other until told to stop,
opening a new connection whenever the relay closes one (a 1 MiB block decodes past the 16 MiB
list limit: COMPRESSION_ERROR). The hostile-peer tests hold one such block in its decoder;
:func:`krproxy.bench.header_flood` times another client's Version calls through ``krproxy
serve`` before and while it floods (``python -m krproxy.bench --only-header-flood``).

``nox -s bench`` runs it with 1 MiB and 4095-byte blocks (its row "another caller floods"; the
same target as a stuck client's: the usual latency, at most twice the idle median plus 0.5 ms)."""

from __future__ import annotations

import socket
import threading

from krproxy.h2 import frames as f


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


__all__ = ["send_header_blocks"]
