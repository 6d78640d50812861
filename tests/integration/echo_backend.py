"""A stand-alone echo backend for tests that must kill the backend process (SIGKILL).

Run: python tests/integration/echo_backend.py SOCKET
Every method echoes its request; a request of b"hang" is never answered, and one of
b"sleep:SECONDS" is answered after that many seconds.
"""

from __future__ import annotations

import functools
import sys

import trio

from krproxy import rpc


async def _handle(stream: rpc.Stream) -> None:
    while (message := await stream.recv_message()) is not None:
        if message == b"hang":
            await trio.sleep_forever()
        elif message.startswith(b"sleep:"):
            await trio.sleep(float(message.removeprefix(b"sleep:")))
        await stream.send_message(message)


def _fallback(path: str) -> rpc.Handler:
    return _handle


async def main(path: str) -> None:
    await rpc.Server({}, fallback=_fallback).serve(path)


if __name__ == "__main__":
    trio.run(functools.partial(main, sys.argv[1]))
