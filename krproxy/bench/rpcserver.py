"""An echo gRPC server for the benchmark's CPU-per-call case of :mod:`krproxy.rpc` (issue 24).

``python -m krproxy.bench.rpcserver ENGINE SOCKET`` serves ``/krproxy.bench.Echo/Echo`` (the
request back, as a hook server that changes nothing answers) and ``/krproxy.bench.Echo/Cpu``
(this process's user+system CPU seconds so far, as text, from ``getrusage``: finer than
/proc's clock ticks) until SIGTERM. ENGINE is ``rpc`` (:class:`krproxy.rpc.Server`) or
``relay`` (a :class:`krproxy.relay.Relay` answering through an interceptor, as the fake
plugin did before krproxy.rpc: the reference the server must stay close to).
"""

from __future__ import annotations

import resource
import signal
import sys
from collections.abc import Sequence

import trio

from krproxy.forward import Forward, Reply
from krproxy.relay import Relay
from krproxy.rpc import Server, unary
from krproxy.unixsock import bind_unix_socket

ECHO = "/krproxy.bench.Echo/Echo"
CPU = "/krproxy.bench.Echo/Cpu"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _echo(message: bytes) -> bytes:
    return message


async def _cpu(message: bytes) -> bytes:
    return b"%.6f" % cpu_seconds()


async def _serve_rpc(path: str) -> None:
    await Server({ECHO: unary(_echo), CPU: unary(_cpu)}).serve(path)


async def _serve_relay(path: str) -> None:
    async def intercept(method: str, request: bytes, forward: Forward) -> Reply:
        return Reply(await (_cpu if method == CPU else _echo)(request))

    relay = Relay(enforce_deadlines=False)
    relay.configure(None, None, {ECHO: intercept, CPU: intercept}, unary_paths=[ECHO, CPU])
    sock = bind_unix_socket(path)
    try:
        await relay.serve(sock)
    finally:
        sock.close()


async def _main(engine: str, path: str) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve_rpc if engine == "rpc" else _serve_relay, path)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                return


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] not in ("rpc", "relay"):
        print("usage: python -m krproxy.bench.rpcserver rpc|relay SOCKET", file=sys.stderr)
        return 2
    trio.run(_main, args[0], args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
