"""``krproxy nri`` within the request timeout containerd's NRI goes by, when Configure does not say it.

NRI drops a plugin that answers later than its request timeout (``plugin_request_timeout`` in
containerd's configuration: a deadline exceeded is fatal to the connection) and creates the container
without it. NRI 0.8 and later say the timeout in Configure; containerd 1.7's NRI 0.6.1 says nothing
(krproxy assumes NRI's default, 2 s), but each ttrpc request carries its own deadline, which krproxy's
budget keeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from tests.e2e.support import TIMEOUT, Containerd, Cri, container_config, pod_config, start_plugin
from tests.e2e.test_containerd_hooks import cleanup, run_pod
from tests.e2e.test_nri_containerd import hooks_in_effect, krproxy_nri

#: containerd 1.7's NRI section (version 2 configuration) with a request timeout of 1 s.
SHORT_TIMEOUT = """\
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  disable_connections = false
  plugin_request_timeout = "1s"
"""


@contextlib.contextmanager
def request_timeout_of_1s(containerd: Containerd, workdir: Path) -> Iterator[None]:
    """containerd restarted with NRI's request timeout at 1 s; restarted without it afterwards."""
    if containerd.release != (1, 7):
        pytest.skip(f"containerd {containerd.version}: only 1.7's NRI (0.6.1) leaves the timeout unsaid")
    imported = workdir / "nri-timeout.toml"
    imported.write_text(SHORT_TIMEOUT)
    containerd.crash()
    containerd.config_imports = [str(imported)]
    containerd.start()
    try:
        yield
    finally:
        containerd.crash()
        containerd.config_imports = []
        containerd.start()


def test_the_request_s_own_deadline_is_kept(containerd: Containerd, direct: Cri, short_tmp: Path) -> None:
    """containerd 1.7 with ``plugin_request_timeout = "1s"`` (which its Configure does not say) and a
    ``Fail`` hook server taking 1.4 s: krproxy goes by the deadline each ttrpc request carries, so the
    server fails within it (0.8 s), containerd refuses the container, and krproxy stays registered: no
    container is created without its hook."""
    with request_timeout_of_1s(containerd, short_tmp), krproxy_nri(containerd, short_tmp) as daemon:
        plugin = start_plugin(
            daemon,
            "slow",
            hooks=["PreCreateContainer"],
            failure_policy="Fail",
            delay={"PreCreateContainer": 1.4},
        )
        try:
            hooks_in_effect(daemon)
            pod = pod_config(containerd.cgroup_parent, "timeout")
            with cleanup(direct) as pods:
                pod_id = run_pod(direct, pod, pods)
                request = pb.CreateContainerRequest(
                    pod_sandbox_id=pod_id, config=container_config(containerd.busybox), sandbox_config=pod
                )
                with pytest.raises(grpc.RpcError) as refused:
                    direct.runtime.CreateContainer(request, timeout=TIMEOUT)
        finally:
            assert 0 == plugin.stop()
        log = daemon.log
    assert "hook server slow failed PreCreateContainer: no answer within 0.7" in str(refused.value.details())
    assert "nri_disconnected" not in log
