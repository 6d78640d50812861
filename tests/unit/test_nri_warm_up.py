"""krproxy.nri._events.warm_up: after it, an event's answers are written and hook servers' answers read
without betterproto2 resolving any class's field metadata (which it otherwise does at each class's first
use, from its type hints, and caches on the class: ~90 ms for the first CreateContainer after krproxy nri
started). Run in a fresh interpreter, since the metadata stays for the life of the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import sys
    import attrs
    from krproxy.hooks.model import ContainerInfo, Resources
    from krproxy.nri import _events, convert
    from krproxy.proto.nri.pkg.api import v1alpha1 as api
    from krproxy.proto.runtime import v1alpha1 as hookapi

    if sys.argv[1] == "warm":
        _events.warm_up()
    def prepared():  # the classes whose metadata betterproto2 has resolved (it caches it on the class)
        return {
            name
            for module in (api, hookapi)
            for name, cls in vars(module).items()
            if isinstance(cls, type) and "_betterproto_meta" in vars(cls)
        }
    ready = prepared()

    before = ContainerInfo(id="c", annotations={"a": "1"}, envs={"E": "1"}, resources=Resources(cpu_shares=2))
    after = attrs.evolve(
        before,
        annotations={"a": "2"},
        envs={"E": "2"},
        resources=Resources(cpu_shares=4, cpu_quota=5, memory_limit_in_bytes=6, oom_score_adj=7),
    )
    for a, b in ((before, before), (before, after)):
        adjusted = convert.adjustment(a, b)
        bytes(api.CreateContainerResponse(adjust=adjusted.adjust))
    update, _ = convert.resources_update(before.resources, after.resources)
    bytes(api.UpdateContainerResponse(update=[api.ContainerUpdate(linux=api.LinuxContainerUpdate(resources=update))]))
    bytes(api.StopContainerResponse())
    bytes(api.Empty())
    answer = hookapi.ContainerResourceHookResponse(
        container_annotations={"a": "b"},
        container_resources=hookapi.LinuxContainerResources(
            cpu_shares=1, hugepage_limits=[hookapi.HugepageLimit(page_size="2MB", limit=1)]
        ),
        container_envs={"E": "1"},
    )
    hookapi.ContainerResourceHookResponse.FromString(bytes(answer))
    hookapi.PodSandboxHookResponse.FromString(bytes(hookapi.PodSandboxHookResponse(labels={"a": "b"})))
    print(",".join(sorted(prepared() - ready)))
    """
)


def _resolved(mode: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], check=True, capture_output=True, text=True, timeout=120
    )
    return [name for name in done.stdout.strip().split(",") if name]


def test_nothing_is_resolved_on_the_event_path_after_warm_up() -> None:
    assert [] == _resolved("warm")


def test_without_it_the_first_answers_resolve_their_classes() -> None:
    """The check above can fail: without warm_up the same code resolves classes."""
    assert "ContainerAdjustment" in _resolved("cold")
