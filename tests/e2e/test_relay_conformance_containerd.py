"""The HTTP/2 conformance cases whose verdict needs the runtime's answer, against ``krproxy serve``
in front of a real containerd (its grpc-go), each version of the e2e matrix.

tests/integration/h2_cases.py has the cases (h2spec's, by its numbering); the integration test
plays them all in front of the fake containerd. Here the ones that need an answer (a response, a
response body under the caller's flow control, a stream the runtime ended) go through to
containerd: its answers, its DATA frames split to the caller's windows, its refusal of a GET.
One krproxy serves every case of the module, one connection a case.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.support import Containerd, Proxy, serving_proxy
from tests.integration.h2_cases import CASES, check, run

RUNTIME_CASES = [case for case, played in CASES.items() if played.needs_runtime]
#: Requests other than POST: containerd 1.6 answers them not at all (its grpc-go drops the stream,
#: the call waits for its deadline); 1.7 and 2.1 refuse them.
NOT_POST = {"generic/4/1", "generic/4/2"}
#: Each read's bound: a liveness bound (containerd answers in milliseconds when the machine is idle).
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def krproxy(containerd: Containerd) -> Iterator[Proxy]:
    workdir = Path(tempfile.mkdtemp(prefix="kph2-", dir="/tmp"))
    try:
        with serving_proxy(workdir, containerd.socket) as daemon:
            yield daemon
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("case", RUNTIME_CASES)
def test_h2spec_case_before_containerd(krproxy: Proxy, containerd: Containerd, case: str) -> None:
    """krproxy answers the case as in front of the fake containerd, containerd's answers relayed."""
    if case in NOT_POST and containerd.release < (1, 7):
        pytest.skip("containerd 1.6 answers no GET or HEAD at all (seen on 1.6.20; docs/testing.md)")
    played = CASES[case]
    check(played, run(krproxy.socket, played, TIMEOUT))
