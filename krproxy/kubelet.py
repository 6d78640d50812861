"""kubelet's deadlines for CRI calls, with its default flags (``pkg/kubelet/cri/remote/remote_runtime.go``).

The clients krproxy runs itself (``krproxy demo``, the end-to-end tests) use them, so that krproxy
is driven as kubelet drives it on a node: a deadline of 100 s or more is written with a coarser
``grpc-timeout`` unit than a short one, and once made every intercepted call fail (issue 15).
"""

from __future__ import annotations

#: kubelet's ``--runtime-request-timeout`` default (seconds): the deadline of every CRI call
#: not listed below.
RUNTIME_REQUEST_TIMEOUT = 120
#: RunPodSandbox gets twice the request timeout (it may pull the pause image).
RUN_POD_SANDBOX_TIMEOUT = 2 * RUNTIME_REQUEST_TIMEOUT
#: PullImage gets no deadline at all (kubelet only cancels it).


def stop_container_timeout(grace_period: int) -> int:
    """The deadline of ``StopContainer(timeout=grace_period)``: the grace period plus the request timeout."""
    return grace_period + RUNTIME_REQUEST_TIMEOUT


def exec_sync_timeout(command_timeout: int) -> int:
    """The deadline of ``ExecSync(timeout=command_timeout)`` (an exec probe): both timeouts added."""
    return command_timeout + RUNTIME_REQUEST_TIMEOUT
