"""The SDK's NRI stub prepares betterproto2's field metadata of every message it reads and writes, and
the plans :func:`krproxy.nri.encoding.encode` writes its answers by, before it connects
(``NriStub.run``), so that the first CreateContainer after a plugin's start does not pay for them (~30 ms
and ~1 ms, inside the runtime's request timeout). Run in a fresh interpreter, since both stay for the
life of the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import sys
    import trio
    from krproxy.hookserver.nri import NriStub
    from krproxy.proto.nri.pkg.api import v1alpha1 as api

    stub = NriStub("warm", "10", "/nonexistent/nri.sock")

    @stub.create_container
    def adjust(pod, container):
        return api.ContainerAdjustment(
            env=[api.KeyValue(key="A", value="1")],
            linux=api.LinuxContainerAdjustment(resources=api.LinuxResources(cpu=api.LinuxCpu(cpus="0"))),
        )

    @stub.on(api.Event.RUN_POD_SANDBOX)
    def ran(pod):
        return None

    if sys.argv[1] == "run":
        try:
            trio.run(stub.run)
        except OSError:
            pass  # nobody serves NRI there: run() got as far as connecting
    from krproxy.nri import encoding

    def prepared():  # the classes whose metadata betterproto2 has resolved (it caches it on the class)
        meta = {n for n, c in vars(api).items() if isinstance(c, type) and "_betterproto_meta" in vars(c)}
        return meta | {"plan:" + c.__name__ for c in encoding._PLANS}  # and those encode() has planned
    ready = prepared()
    pod = api.PodSandbox(id="p", name="web", linux=api.LinuxPodSandbox(cgroup_parent="/kubepods"))
    container = api.Container(
        id="c", pod_sandbox_id="p", name="app", env=["PATH=/bin"],
        mounts=[api.Mount(destination="/data", source="/srv", type="bind", options=["rbind"])],
        linux=api.LinuxContainer(
            resources=api.LinuxResources(memory=api.LinuxMemory(limit=api.OptionalInt64(value=1))),
            oom_score_adj=api.OptionalInt(value=1),
        ),
    )
    # plain handlers: the stub answers at once, as the session calls it on its reader's task
    stub._create_container(bytes(api.CreateContainerRequest(pod=pod, container=container)))
    stub._state_change(bytes(api.StateChangeEvent(event=api.Event.RUN_POD_SANDBOX, pod=pod)))
    print(",".join(sorted(prepared() - ready)))
    """
)


def _resolved(mode: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], check=True, capture_output=True, text=True, timeout=120
    )
    return [name for name in done.stdout.strip().split(",") if name]


def test_nothing_is_resolved_on_the_event_path_after_run() -> None:
    assert [] == _resolved("run")


def test_without_run_the_first_events_resolve_their_classes() -> None:
    """The check above can fail: without run() the same events resolve classes."""
    resolved = _resolved("cold")
    assert "CreateContainerRequest" in resolved
    assert "plan:CreateContainerResponse" in resolved
