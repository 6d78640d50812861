"""The NRI calls' own time as the runtime side of the socket sees it: a timing relay for the NRI bench.

containerd 2.1.9 (NRI 0.8.0) neither logs nor counts how long a plugin takes to answer, so the bench puts
this relay between containerd's NRI socket and the plugin (Python stub, Go stub or ``krproxy nri``
alike): the plugin connects to the relay, the relay connects to containerd, and every byte is forwarded
unchanged as soon as it is read. On the way it reads NRI's framing (:mod:`krproxy.nri._mux`) and ttrpc's
(:mod:`krproxy.nri._ttrpc`) and times each call of the runtime to the plugin (the Plugin service on
connection 1): from reading containerd's request to reading the plugin's answer. That is the wait
containerd sees, less the relay's forwarding of the answer (a few tens of microseconds, the same for
every plugin). :class:`CallTimer` is that reading, without I/O; :func:`relay` the trio driver.

    python -m krproxy.bench.nritiming --listen PLUGIN_SOCKET --runtime NRI_SOCKET --out CALLS.jsonl

writes one JSON line per answered call, ``{"method": "CreateContainer", "ms": 0.41}``, flushed at once.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

import attrs
import trio

from krproxy.nri import _mux, _ttrpc

__all__ = ["CallTimer", "main", "relay"]

#: Bytes read from either side at a time.
_CHUNK = 65536


@attrs.define
class _Side:
    """One direction of the socket: its multiplexer frames and connection 1's ttrpc bytes so far."""

    demux: _mux.Demultiplexer = attrs.field(factory=_mux.Demultiplexer)
    ttrpc: bytearray = attrs.field(factory=bytearray)

    def messages(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """The whole ttrpc messages of connection 1 that ``data`` completes: (stream id, type, payload)."""
        self.demux.receive_data(data)
        while (frame := self.demux.next_frame()) is not None:
            if frame[0] == _mux.PLUGIN_SERVICE_CONN:
                self.ttrpc += frame[1]
        out = []
        while len(self.ttrpc) >= _ttrpc.HEADER_LENGTH:
            length, stream, kind, _ = _ttrpc.decode_header(bytes(self.ttrpc[: _ttrpc.HEADER_LENGTH]))
            end = _ttrpc.HEADER_LENGTH + length
            if len(self.ttrpc) < end:
                break
            out.append((stream, kind, bytes(self.ttrpc[_ttrpc.HEADER_LENGTH : end])))
            del self.ttrpc[:end]
        return out


@attrs.define
class CallTimer:
    """The runtime's calls to the plugin, timed from the bytes each side sends (no I/O).

    Feed what the runtime sends with :meth:`from_runtime` and what the plugin sends with
    :meth:`from_plugin`, each with the time it was read; every answered call is passed to ``done`` as
    (method, seconds).
    """

    done: Callable[[str, float], None]
    _runtime: _Side = attrs.field(factory=_Side, init=False)
    _plugin: _Side = attrs.field(factory=_Side, init=False)
    _asked: dict[int, tuple[str, float]] = attrs.field(factory=dict, init=False)

    def from_runtime(self, data: bytes, now: float) -> None:
        for stream, kind, payload in self._runtime.messages(data):
            if kind == _ttrpc.MessageType.REQUEST:
                self._asked[stream] = (_ttrpc.Request.decode(payload).method, now)

    def from_plugin(self, data: bytes, now: float) -> None:
        for stream, kind, _ in self._plugin.messages(data):
            if kind == _ttrpc.MessageType.RESPONSE and stream in self._asked:
                method, asked = self._asked.pop(stream)
                self.done(method, now - asked)


async def _pump(
    source: trio.SocketStream, sink: trio.SocketStream, seen: Callable[[bytes, float], None]
) -> None:
    while data := await source.receive_some(_CHUNK):
        seen(data, time.perf_counter())
        await sink.send_all(data)
    await sink.send_eof()


async def relay(
    listen: str,
    runtime: str,
    out: TextIO,
    *,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve plugins on ``listen``, each relayed to the runtime's NRI socket ``runtime``; every answered
    call of the runtime to the plugin written to ``out`` as a JSON line. Runs until cancelled."""

    def done(method: str, seconds: float) -> None:
        out.write(json.dumps({"method": method, "ms": round(seconds * 1000, 4)}) + "\n")
        out.flush()

    async def handle(plugin: trio.SocketStream) -> None:
        timer = CallTimer(done)
        async with plugin, await trio.open_unix_socket(runtime) as containerd, trio.open_nursery() as nursery:
            nursery.start_soon(_pump, containerd, plugin, timer.from_runtime)
            nursery.start_soon(_pump, plugin, containerd, timer.from_plugin)

    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(listen)
    sock.listen(16)
    await trio.serve_listeners(handle, [trio.SocketListener(sock)], task_status=task_status)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m krproxy.bench.nritiming", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--listen", required=True, help="the socket the plugin connects to")
    parser.add_argument("--runtime", required=True, help="the runtime's NRI socket")
    parser.add_argument("--out", required=True, help="JSON lines of the timed calls")
    args = parser.parse_args(argv)
    if os.path.exists(args.listen):
        os.unlink(args.listen)
    with open(args.out, "a") as out:
        trio.run(relay, args.listen, args.runtime, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
