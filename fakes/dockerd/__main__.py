"""``python -m krproxy.fakes.dockerd --socket PATH``: run the fake Docker Engine API until SIGINT/SIGTERM."""

from __future__ import annotations

import functools
import logging
import signal
import sys
from collections.abc import Sequence

import trio

from krproxy import _argparse
from krproxy.fakes.dockerd.server import FakeDockerd, run_fake_dockerd
from krproxy.fakes.dockerd.state import DockerState


async def _main(path: str, cgroup_driver: str) -> None:
    fake = FakeDockerd(DockerState(cgroup_driver=cgroup_driver))
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(run_fake_dockerd, path, fake))
            print(path, flush=True)
            name = ""
            async for signum in signals:
                name = signal.Signals(signum).name
                nursery.cancel_scope.cancel()
                break
    # Said whatever --log-level is: the one line a user sees from a quiet fake is that it stopped.
    print(f"python -m krproxy.fakes.dockerd: stopped by {name}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _argparse.Parser(prog="python -m krproxy.fakes.dockerd", description=__doc__)
    parser.add_argument("--socket", required=True, metavar="PATH", help="unix socket to listen on")
    parser.add_argument(
        "--cgroup-driver", default="cgroupfs", choices=["cgroupfs", "systemd"], help="what dockerd reports"
    )
    levels = ["debug", "info", "warning", "error"]
    parser.add_argument(
        "--log-level", default="warning", type=_argparse.choice_of(levels), choices=levels, help="any case"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s %(message)s")
    trio.run(_main, args.socket, args.cgroup_driver)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
