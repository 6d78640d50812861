"""What the served SDK's job costs in calls: each part of the bench's hook call (krproxy.bench.sdk's
plain function adding an env, on its minimal and its kubelet-sized request) against a budget, in
Python and C function calls as cProfile counts them (load-independent, unlike time).

The budgets are the counts when they were set, with one or two more (other versions of attrs, upb
or Python count a few differently); a change that adds layers to the job fails here first. The
figures before the cuts that set them are in their commits (git log -S'JOB_BUDGETS')."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from krproxy.bench import sdk
from krproxy.hookserver import HookServer, Stage, _wire
from krproxy.hookserver._executor import Executor
from krproxy.hookserver._service import HookService
from tests.unit.test_hooks_calls import calls_of

#: Calls a part may make at most: the counts when set (20, 8, 22), and one or two more.
JOB_BUDGETS = {"read": 22, "stage": 9, "finish": 24}

STAGE = Stage.PRE_CREATE_CONTAINER
REQUESTS = {"minimal": sdk.minimal_request(), "kubelet-sized": sdk.kubelet_sized_request()}


class _IdleWorker:
    """The worker as HookService's parts read it (they are called here directly)."""

    idle = True


def _parts(tmp_path: Path, request: bytes) -> dict[str, Callable[[], object]]:
    app = HookServer(executor=Executor.for_roots(str(tmp_path), str(tmp_path / "resctrl")))
    sdk.register(app)
    service = HookService(app, _IdleWorker())  # type: ignore[arg-type]
    level = service._container
    req, ctx = service._read(level, STAGE, request)
    result = app.run_stage(STAGE, ctx)
    return {
        "read": lambda: service._read(level, STAGE, request),
        "stage": lambda: app.run_stage(STAGE, ctx),
        "finish": lambda: service._finish(level, STAGE, req, ctx, result),
    }


@pytest.mark.parametrize("request_name", REQUESTS)
@pytest.mark.parametrize("part", JOB_BUDGETS)
def test_within_budget(tmp_path: Path, part: str, request_name: str) -> None:
    """Each part of the served job makes no more calls than its budget, whatever the request's size."""
    work = _parts(tmp_path, REQUESTS[request_name])[part]
    work()  # (a first call may import or cache)

    assert calls_of(work) <= JOB_BUDGETS[part]


def test_the_parts_do_the_work(tmp_path: Path) -> None:
    """The parts measured are the real ones: the plugin's env reaches the encoded answer."""
    reply = _parts(tmp_path, REQUESTS["minimal"])["finish"]()

    assert isinstance(reply, bytes)
    answer = _wire.ContainerResourceHookResponse.FromString(reply)
    assert {"BENCH": "bench"} == {e.key: e.value for e in answer.container_envs}
