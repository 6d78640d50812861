"""The NRI bench's Python plugin, written with the SDK's stub (:class:`krproxy.hookserver.nri.NriStub`):
the same plugin as ``tests/gonristub`` on containerd's own Go stub. It is told of each RunPodSandbox
and adds one env var at each CreateContainer; it prints ``synchronized`` on stderr once the runtime has
synchronized it, and exits when the runtime closes the connection or on SIGTERM.

    python -m krproxy.bench.nristub --socket NRI_SOCKET [--name bench-python] [--idx 40]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import trio

from krproxy.hookserver.nri import NriStub
from krproxy.proto.nri.pkg.api import v1alpha1 as api

__all__ = ["ENV", "bench_plugin", "main"]

#: The env var both bench plugins add (the Go one with the value "go").
ENV = ("KRPROXY_BENCH_PLUGIN", "python")


def bench_plugin(socket: str, name: str = "bench-python", index: str = "40") -> NriStub:
    """The plugin: a RunPodSandbox handler that does nothing, a CreateContainer handler adding :data:`ENV`."""
    stub = NriStub(name, index, socket)

    @stub.on(api.Event.RUN_POD_SANDBOX)
    def run_pod_sandbox(pod: api.PodSandbox) -> None:
        return None

    @stub.create_container
    def create_container(pod: api.PodSandbox, container: api.Container) -> api.ContainerAdjustment:
        return api.ContainerAdjustment(env=[api.KeyValue(key=ENV[0], value=ENV[1])])

    return stub


async def _serve(stub: NriStub) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(stub.run)
        await stub.synchronized.wait()
        print("synchronized", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m krproxy.bench.nristub", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--socket", default="/var/run/nri/nri.sock", help="the runtime's NRI socket")
    parser.add_argument("--name", default="bench-python")
    parser.add_argument("--idx", default="40")
    args = parser.parse_args(argv)
    trio.run(_serve, bench_plugin(args.socket, args.name, args.idx))
    return 0


if __name__ == "__main__":
    sys.exit(main())
