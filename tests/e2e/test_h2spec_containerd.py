"""h2spec against krproxy in front of a real containerd (each version of the e2e matrix).

The same run and verdict as tests/integration/test_h2spec.py (there in front of the fake
containerd), containerd's answers held back as there (``RUNTIME_DELAY``): every case passes but
the named exceptions, which a gRPC server answering at once cannot serve as h2spec assumes.
Skipped with the reason where h2spec, lzma or socat is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from tests.e2e.support import Containerd, start_proxy
from tests.integration.test_h2spec import EXCEPTIONS, RUNTIME_DELAY, SKIPPED, _run_h2spec, delayed
from tests.integration.test_h2spec import pytestmark as h2spec_marks

pytestmark = [
    *h2spec_marks,
    # In the full matrix (two containerd versions at a time) its verdicts varied from run to run:
    # generic/5/1 answered RST_STREAM on 2.1 and 2.3, http2/6.9.1/2 saw the connection closed
    # without the GOAWAY on 1.6, and http2/5.1.2/1 passed or not. Alone it passed on 1.7 and 2.3.
    # Until those causes are found it runs only when asked; tests/integration/test_h2spec.py (in
    # front of the fake containerd) runs in every test session.
    pytest.mark.skipif(
        not os.environ.get("KRPROXY_E2E_H2SPEC"),
        reason="h2spec in front of real containerd gives verdicts that vary per run (causes not yet "
        "found, docs/testing.md); run it with KRPROXY_E2E_H2SPEC=1",
    ),
]


async def test_h2spec_against_krproxy_before_containerd(
    containerd: Containerd, nursery: trio.Nursery, short_tmp: Path
) -> None:
    runtime = str(short_tmp / "delayed.sock")
    await delayed(nursery, containerd.socket, runtime, RUNTIME_DELAY)
    proxy = await trio.to_thread.run_sync(start_proxy, short_tmp, runtime)
    try:
        outcome, output = await trio.to_thread.run_sync(_run_h2spec, proxy.socket, short_tmp)
    finally:
        # Shielded: when the bridge's nursery fails the test, the cancellation must not skip this
        # (a failed run left its krproxy running).
        with trio.CancelScope(shield=True):
            code = await trio.to_thread.run_sync(proxy.terminate)
    failed = {case for case, verdict in outcome.items() if verdict == "failed"}
    skipped = {case for case, verdict in outcome.items() if verdict == "skipped"}
    summary = output.strip().splitlines()[-1] if output.strip() else "no output"
    print(f"h2spec: {summary}; failed: {', '.join(sorted(failed)) or 'none'}")
    assert 146 == len(outcome), summary
    assert set() == failed - set(EXCEPTIONS), output[-8000:]
    assert set() == skipped - set(SKIPPED), summary
    assert 0 == code, f"krproxy exited with {code}; log:\n{proxy.log}"
