"""A graceful stop delivers the last answers whole.

Found with the grpc-go client (test_grpc_go_client.py, a restart under steady calls with 1.3 MB
answers): 1 run in 4 one call failed UNAVAILABLE "error reading from server: unexpected EOF,
received prior goaway: code: NO_ERROR". A call ends for the relay when its trailers are queued
to the caller's connection, not when they are written; the drain waited for the calls only, so
the daemon closed a connection whose queue still held the end of an answer. grpc-go saw the
connection cut in the middle of a frame of a stream the final GOAWAY said was processed (so it
does not send it again): a lost call.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import h2.settings
import trio

from krproxy import rpc
from krproxy.daemon import Daemon
from tests.integration.support import start_proxy, start_scripted_backend, wait_until
from tests.integration.test_relay_hostile import RawCaller

BIG = "/krproxy.test.Drain/Big"  # forwarded raw, and not a call of the store's recovery
ANSWER = 4 << 20  # far more than a unix socket's buffer holds


async def _big(stream: rpc.Stream, messages: list[bytes]) -> None:
    await stream.send_message(b"x" * ANSWER)


def _clients(proxy: Daemon) -> list[Any]:
    return list(proxy.relay.transport._clients)


def _read_to_eof(sock: socket.socket, stream_id: int) -> tuple[int, bool]:
    """Read the connection to its end (raw: h2 refuses frames after a GOAWAY); the answer's
    DATA bytes on ``stream_id`` and whether its trailers (HEADERS with END_STREAM) came."""
    data = bytearray()
    while chunk := sock.recv(1 << 20):
        data += chunk
    got, ended, at = 0, False, 0
    while at + 9 <= len(data):
        length = int.from_bytes(data[at : at + 3], "big")
        kind, flags, stream = (
            data[at + 3],
            data[at + 4],
            int.from_bytes(data[at + 5 : at + 9], "big") & 0x7FFFFFFF,
        )
        if stream == stream_id and kind == 0x0:  # DATA (no padding from the relay)
            got += min(length, len(data) - at - 9)
        elif stream == stream_id and kind == 0x1 and flags & 0x1:  # HEADERS, END_STREAM
            ended = at + 9 + length <= len(data)
        at += 9 + length
    return got, ended


async def test_a_stop_writes_out_a_queued_answer_before_closing(nursery: trio.Nursery, sockdir: str) -> None:
    """A stop writes out an answer queued before it ends the connection."""
    backend, _ = await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))
    backend.behaviours[BIG] = _big
    proxy = await start_proxy(nursery, sockdir)
    caller = await trio.to_thread.run_sync(RawCaller, proxy.config.listen)
    try:
        # Windows large enough for the whole answer: the relay queues all of it at once, and the
        # call is over for it while most of the answer still waits in the connection's queue.
        caller.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
        caller.conn.increment_flow_control_window(2**31 - 1 - 65_535)
        stream_id = caller.open(BIG, b"")
        await wait_until(lambda: proxy.relay.transport.in_flight == 0 and BIG in backend.started)
        [ep] = _clients(proxy)
        assert ep.out  # the answer's end is queued, not written: the caller reads nothing yet
        proxy.request_shutdown()
        await wait_until(lambda: ep.goaway == "final")  # the drain's last step (the PING went unanswered)
        got = await trio.to_thread.run_sync(_read_to_eof, caller.sock, stream_id)
    finally:
        caller.sock.close()
    assert (5 + ANSWER, True) == got
