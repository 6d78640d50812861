"""One caller's oversized answer ends only its own call, on real containerd, with grpc-go callers.

containerd echoes an unknown id in its error: a StartContainer naming a 5 MiB container id is
answered with a ``grpc-message`` of over 5 MiB, a header block far beyond the 1 MiB krproxy
reads. krproxy advertises SETTINGS_MAX_HEADER_LIST_SIZE on its runtime connection, so
containerd's grpc-go resets that one stream instead of sending the block
(docs/security.md, "Header list limits, per side"); before, krproxy ended the runtime
connection it shares between all callers, and every call on it failed UNAVAILABLE.

Both callers are tests/goclient (grpc-go set up as kubelet's), each with its own connection:
one runs an ExecSync that waits in the container until told to end, the other sends the 5 MiB
id meanwhile; only then is the ExecSync let go.
Straight to containerd the same pair is run too, to note what containerd alone does.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

from cri_api.v1 import api_pb2 as pb

from krproxy import kubelet
from tests.e2e.support import Containerd, Cri, Proxy, running_pod, wait_until
from tests.e2e.test_containerd_proxy import running
from tests.integration.test_grpc_go_client import goclient  # noqa: F401 - the fixture

RUNTIME = "/runtime.v1.RuntimeService/"
#: The id's length: well under the 16 MiB message limit of every side, far over 1 MiB of headers.
HUGE_ID = 5 * 1024 * 1024


def _client(binary: str, socket: str, method: str, request: Path, *extra: str) -> list[str]:
    return [binary, "-socket", socket, "-method", RUNTIME + method, "-request-file", str(request), *extra]


def _summary(done: subprocess.CompletedProcess[bytes] | tuple[bytes, bytes], code: int) -> dict[str, Any]:
    out, err = (done.stdout, done.stderr) if isinstance(done, subprocess.CompletedProcess) else done
    assert 0 == code, err.decode()
    summary: dict[str, Any] = json.loads(out)
    return summary


def _huge_id_beside_exec(
    binary: str, socket: str, direct: Cri, container_id: str, work: Path
) -> dict[str, Any]:
    """Run an ExecSync through ``socket`` that waits for a file in the container; while it
    waits, a StartContainer with a 5 MiB id from another grpc-go client; then the file is made
    (straight through containerd). The two summaries and the ExecSync's answer."""
    marker = f"huge-{uuid.uuid4().hex[:8]}"
    wait_then_echo = f"while [ ! -e /tmp/{marker} ]; do sleep 0.1; done; echo {marker}"
    exec_request = work / "exec.bin"
    exec_request.write_bytes(
        pb.ExecSyncRequest(
            container_id=container_id, cmd=["sh", "-c", wait_then_echo], timeout=60
        ).SerializeToString()
    )
    huge_request = work / "huge.bin"
    huge_request.write_bytes(pb.StartContainerRequest(container_id="c" * HUGE_ID).SerializeToString())
    answer = work / "exec-answer.bin"
    timeout = f"{kubelet.exec_sync_timeout(60)}s"
    argv = _client(binary, socket, "ExecSync", exec_request, "-timeout", timeout, "-save-answer", str(answer))
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as exec_client:
        try:
            wait_until(lambda: running(marker), limit=30, what="the exec process running in the container")
            huge = subprocess.run(
                _client(binary, socket, "StartContainer", huge_request), capture_output=True, timeout=120
            )
            exec_still_running = exec_client.poll() is None
            touch = pb.ExecSyncRequest(container_id=container_id, cmd=["touch", f"/tmp/{marker}"], timeout=10)
            direct.runtime.ExecSync(touch, timeout=kubelet.exec_sync_timeout(10))
            out = exec_client.communicate(timeout=120)
        finally:
            if exec_client.poll() is None:
                exec_client.kill()
    reply = pb.ExecSyncResponse.FromString(answer.read_bytes()) if answer.exists() else None
    return {
        "huge": _summary(huge, huge.returncode),
        "exec": _summary(out, exec_client.returncode),
        "exec_still_running": exec_still_running,
        "exec_reply": (reply.exit_code, reply.stdout) if reply is not None else None,
        "marker": marker,
    }


def _codes(summary: dict[str, Any]) -> dict[str, int]:
    codes: dict[str, int] = summary["codes"]
    return codes


def test_huge_id_ends_only_its_call_via_proxy(
    goclient: str,  # noqa: F811 - the fixture
    containerd: Containerd,
    proxy: Proxy,
    direct: Cri,
    tmp_path: Path,
) -> None:
    """Through krproxy: the 5 MiB id's StartContainer fails INTERNAL (containerd reset it), the
    other client's ExecSync, in flight meanwhile, completes with its output, and krproxy
    serves on (a Version call, no connection error in its log)."""
    with running_pod(direct, containerd) as pod:
        got = _huge_id_beside_exec(goclient, proxy.socket, direct, pod.container_id, tmp_path)
        with Cri.connect(proxy.socket) as cri:
            version = cri.runtime.Version(pb.VersionRequest(), timeout=30)
    assert got["exec_still_running"], json.dumps(got["exec"])[:3000]
    assert {"OK": 1} == _codes(got["exec"]), got["exec"]
    assert (0, f"{got['marker']}\n".encode()) == got["exec_reply"]
    assert {"INTERNAL": 1} == _codes(got["huge"]), json.dumps(got["huge"])[:3000]
    assert version.runtime_name == "containerd"
    assert "header block too large" not in proxy.log


def test_huge_id_ends_only_its_call_direct(
    goclient: str,  # noqa: F811 - the fixture
    containerd: Containerd,
    direct: Cri,
    tmp_path: Path,
) -> None:
    """Straight to containerd, for comparison: the ExecSync completes too, and the 5 MiB call is
    NOT_FOUND with the id echoed whole (grpc-go's client advertises no header list limit, so
    containerd sends its 5 MiB message, read against the client's own 16 MiB limit). Through
    krproxy that caller gets INTERNAL instead: the one difference, docs/security.md says why."""
    with running_pod(direct, containerd) as pod:
        got = _huge_id_beside_exec(goclient, containerd.socket, direct, pod.container_id, tmp_path)
    assert {"NOT_FOUND": 1} == _codes(got["huge"]), json.dumps(got["huge"])[:3000]
    assert len(got["huge"]["messages"]["NOT_FOUND"][0]) > HUGE_ID  # the id echoed whole
    assert got["exec_still_running"], json.dumps(got["exec"])[:3000]
    assert {"OK": 1} == _codes(got["exec"]), got["exec"]
    assert (0, f"{got['marker']}\n".encode()) == got["exec_reply"]
