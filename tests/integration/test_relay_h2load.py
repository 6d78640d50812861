"""nghttp2's ``h2load``, a third-party HTTP/2 client, against krproxy in front of the fake
containerd: every request completes, also with ``--header-table-size=0`` (which fails every
request with COMPRESSION_ERROR when the relay does not acknowledge the smaller table).

h2load sends what it is told: POST with ``-d`` (a file holding one 5-byte-prefixed gRPC
message) and the gRPC headers, so each request is a valid unary gRPC call. (A plain GET is not
a gRPC call: the fake containerd answers it 4xx, directly as through krproxy, and h2load counts
every such answer as failed.) ``scripts/install-debian-command h2load nghttp2-client``
(run by ``nox -s tests``) installs Debian's nghttp2-client; without h2load the test is skipped.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import trio
from cri_api.v1 import api_pb2 as pb

from krproxy.fakes.containerd import FakeContainerd
from tests.integration.support import start_proxy

H2LOAD = shutil.which("h2load")
pytestmark = pytest.mark.skipif(
    H2LOAD is None,
    reason="h2load not installed (Debian: nghttp2-client; run scripts/install-debian-command h2load nghttp2-client)",
)


def _h2load(socket: str, data: Path, *extra: str) -> dict[str, int]:
    assert H2LOAD is not None
    out = subprocess.run(
        [
            H2LOAD,
            f"--base-uri=unix:{socket}",
            "-n",
            "400",
            "-c",
            "4",
            "-m",
            "20",
            "-d",
            str(data),
            "-H",
            "content-type: application/grpc",
            "-H",
            "te: trailers",
            *extra,
            "http://localhost/runtime.v1.RuntimeService/Version",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    ).stdout
    requests = re.search(
        r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored", out
    )
    statuses = re.search(r"status codes: (\d+) 2xx", out)
    assert requests is not None and statuses is not None, out
    total, done, succeeded, failed, errored = map(int, requests.groups())
    return {
        "total": total,
        "done": done,
        "succeeded": succeeded,
        "failed": failed,
        "errored": errored,
        "2xx": int(statuses.group(1)),
    }


@pytest.mark.parametrize("extra", [(), ("--header-table-size=0",)], ids=["default", "header-table-size-0"])
async def test_h2load_completes_every_grpc_request(
    fake_containerd: tuple[FakeContainerd, str],
    nursery: trio.Nursery,
    sockdir: str,
    short_tmp: Path,
    extra: tuple[str, ...],
) -> None:
    fake, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    message = pb.VersionRequest(version="v1").SerializeToString()
    data = short_tmp / "version.grpc"
    data.write_bytes(b"\x00" + len(message).to_bytes(4, "big") + message)
    got = await trio.to_thread.run_sync(_h2load, proxy.config.listen, data, *extra)
    assert {"total": 400, "done": 400, "succeeded": 400, "failed": 0, "errored": 0, "2xx": 400} == got
    assert len(fake.requests("Version")) > 0
