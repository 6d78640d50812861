"""``nox -s bench`` / ``python -m krproxy.bench``: what the proxy costs, direct vs through krproxy.

Everything runs as separate processes on unix sockets in a temp dir: the fake containerd (the
backend, seeded with 1000 pods), fake hook plugins, several ``krproxy serve`` daemons, and
grpcio client processes (:mod:`krproxy.bench.client`) that alternate between direct and
proxied targets block by block after a warm-up (CreateContainer: call by call, each target in a pod
created through it), so machine noise hits both alike.

Cases (issue 8): small passthrough latency (Version, ContainerStatus); large passthrough
(ListContainers of 1000 containers, ~860 KB); throughput with 32 concurrent callers; hooked
CreateContainer with one and with three chained plugins, and with one SDK plugin (:mod:`krproxy.bench.sdk`,
``--only-sdk-create``); small calls while another client is
stuck with ~20 MB of answers unread (issue 16); the same with recording on (when
``--record`` exists); store recovery of 1000 pods / 3000 containers and the RSS after it; RSS
and open fds after 100k calls; NRI mode against containerd 2.x (pod start and a plain call, with
and without ``krproxy nri`` registered; ``--only-nri`` runs just these). CPU per unary call of
:mod:`krproxy.rpc`'s server beside a relay interceptor (``--only-rpc-server``). Against Go anchors of our
own: passthrough against a grpc-go raw-forwarding proxy (:mod:`krproxy.bench.anchor`, ``--only-go-anchor``),
and a hooked CreateContainer through krproxy and an SDK hook server against a grpc-go proxy doing
koord-runtime-proxy's hook work and a grpc-go hook server (:mod:`krproxy.bench.hookanchor`,
``--only-hook-anchor``). Prints a table
(medians, p99s, proxy/direct) with each target marked met or missed, and writes the figures
as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Sequence

from krproxy.bench._support import _scratch, non_negative_ms
from krproxy.bench.anchor import go_anchor, report_go_anchor
from krproxy.bench.hookanchor import hook_anchor, report_hook_anchor
from krproxy.bench.micro import header_flood, report_header_flood, report_rpc_server_cpu, rpc_server_cpu
from krproxy.bench.nri import nri, report_nri
from krproxy.bench.proxy import run as run
from krproxy.bench.report import report as report
from krproxy.bench.wrapper import (
    report_runc_wrapper,
    report_runc_wrapper_containerd,
    runc_wrapper,
    runc_wrapper_containerd,
)

__all__ = ["main", "report", "run"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m krproxy.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--small-calls", type=int, default=2000)
    parser.add_argument("--large-calls", type=int, default=50)
    parser.add_argument("--create-calls", type=int, default=300)
    parser.add_argument("--throughput-seconds", type=float, default=5.0)
    parser.add_argument("--leak-calls", type=int, default=100_000)
    parser.add_argument("--real-pods", type=int, default=10, help="pods created in the real containerd")
    parser.add_argument("--real-containers-per-pod", type=int, default=20)
    parser.add_argument("--json", default="bench-results.json", metavar="FILE", help="default: %(default)s")
    parser.add_argument("--wrapper-calls", type=int, default=200, help="runs per runc wrapper variant")
    parser.add_argument(
        "--flood-calls", type=int, default=1000, help="Version calls per header-flood measurement"
    )
    parser.add_argument(
        "--wrapper-blocks", type=int, default=10, help="wrapper on containerd: blocks per runtime handler"
    )
    parser.add_argument("--wrapper-pods", type=int, default=4, help="wrapper on containerd: pods per block")
    parser.add_argument(
        "--only-runc-wrapper", action="store_true", help="measure only what the OCI hooks runc wrapper adds"
    )
    parser.add_argument(
        "--only-nri", action="store_true", help="measure only the NRI mode cases (--nri-containerd)"
    )
    parser.add_argument(
        "--nri-containerd",
        default="2.x",
        choices=["2.x", "1.7"],
        help="NRI cases: which containerd (containerd-sandbox fetch --version); default %(default)s",
    )
    parser.add_argument(
        "--only-header-flood",
        action="store_true",
        help="measure only Version calls while another caller floods krproxy with header blocks",
    )
    parser.add_argument(
        "--only-sdk-create",
        action="store_true",
        help="measure only CreateContainer through krproxy with one SDK plugin, beside direct, one fake plugin"
        " and a grpc-go raw-forwarding proxy",
    )
    parser.add_argument(
        "--only-rpc-server",
        action="store_true",
        help="measure only the CPU per unary call of krproxy.rpc's server (hook servers' engine)",
    )
    parser.add_argument(
        "--nri-blocks", type=int, default=4, help="NRI cases: blocks per state (with/without)"
    )
    parser.add_argument("--nri-pods", type=int, default=5, help="NRI cases: pods started per block")
    parser.add_argument(
        "--nri-version-calls", type=int, default=500, help="NRI cases: Version calls per block"
    )
    parser.add_argument(
        "--only-go-anchor",
        action="store_true",
        help="measure only krproxy against a grpc-go raw-forwarding proxy on real containerd",
    )
    parser.add_argument("--anchor-pods", type=int, default=20, help="Go anchor: pods in the containerd")
    parser.add_argument(
        "--anchor-calls", type=int, default=6000, help="Go anchor: calls of the mix per round"
    )
    parser.add_argument("--anchor-rounds", type=int, default=3, help="Go anchor: rounds per proxy")
    parser.add_argument(
        "--only-hook-anchor",
        action="store_true",
        help="measure only a hooked CreateContainer through krproxy and the SDK against a grpc-go hook proxy"
        " and hook server",
    )
    parser.add_argument(
        "--hook-anchor-calls", type=int, default=300, help="hook anchor: creates per target and round"
    )
    parser.add_argument("--hook-anchor-rounds", type=int, default=5, help="hook anchor: rounds")
    parser.add_argument(
        "--hook-anchor-idle-ms",
        type=non_negative_ms,
        default=0.0,
        help="hook anchor: milliseconds the client idles before each create (default 0: back to back;"
        " the targets are for that)",
    )
    parser.add_argument(
        "--anchor-runtime",
        choices=["containerd", "fake"],
        default="containerd",
        help="Go anchor: in front of real containerd (the sandbox) or the fake containerd",
    )
    args = parser.parse_args(argv)
    if args.only_go_anchor:
        with _scratch() as workdir:
            results = {"go_anchor": go_anchor(workdir, args)}
        print("\n".join(report_go_anchor(results["go_anchor"])))
    elif args.only_hook_anchor:
        with _scratch() as workdir:
            results = {"hook_anchor": hook_anchor(workdir, args)}
        print("\n".join(report_hook_anchor(results["hook_anchor"])))
    elif args.only_nri:
        workdir = tempfile.mkdtemp(prefix="krproxy-bench-")
        try:
            results = {"nri": nri(workdir, args)}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print("\n".join(report_nri(results["nri"])))
    elif args.only_header_flood:
        results = {"header_flood": header_flood(args.flood_calls, [1 << 20, 384 << 10, 4095])}
        print("\n".join(report_header_flood(results["header_flood"])))
    elif args.only_sdk_create:
        from krproxy.bench.sdk import report_sdk_create, sdk_create  # here: see proxy.run

        with _scratch() as workdir:
            results = {"sdk_CreateContainer": sdk_create(workdir, args.create_calls)}
        print("\n".join(report_sdk_create(results["sdk_CreateContainer"])))
    elif args.only_rpc_server:
        results = {"rpc_server": rpc_server_cpu(args.small_calls)}
        print("\n".join(report_rpc_server_cpu(results["rpc_server"])))
    elif args.only_runc_wrapper:
        workdir = tempfile.mkdtemp(prefix="krproxy-bench-")
        try:
            results = {
                "runc_wrapper": runc_wrapper(workdir, args.wrapper_calls),
                "runc_wrapper_containerd": runc_wrapper_containerd(workdir, args),
            }
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        lines = report_runc_wrapper(results["runc_wrapper"])
        print("\n".join(lines + report_runc_wrapper_containerd(results["runc_wrapper_containerd"])))
    else:
        results = run(args)
        results["rpc_server"] = rpc_server_cpu(args.small_calls)
        print(report(results))
        print("\n".join(report_rpc_server_cpu(results["rpc_server"])))
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nJSON written to {args.json}")
    return 0
