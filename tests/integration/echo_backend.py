"""A stand-alone echo backend for tests that must kill the backend process (SIGKILL).

Run: python tests/integration/echo_backend.py SOCKET
Every method echoes its request; a request of b"hang" is never answered, and one of
b"sleep:SECONDS" is answered after that many seconds.
"""

from __future__ import annotations

import asyncio
import functools
import sys

import grpclib.const
import grpclib.server
import trio
import trio_asyncio

from krproxy import _grpc


async def _handle(stream: grpclib.server.Stream[bytes, bytes]) -> None:
    async for message in stream:
        if message == b"hang":
            await asyncio.sleep(3600)
        elif message.startswith(b"sleep:"):
            await asyncio.sleep(float(message.removeprefix(b"sleep:")))
        await stream.send_message(message)


def _fallback(path: str) -> grpclib.const.Handler:
    return grpclib.const.Handler(_handle, grpclib.const.Cardinality.STREAM_STREAM, bytes, bytes)


async def main(path: str) -> None:
    async with trio_asyncio.open_loop():
        await _grpc.serve([], path, codec=_grpc.BytesCodec(), fallback=_fallback)


if __name__ == "__main__":
    trio.run(functools.partial(main, sys.argv[1]))
