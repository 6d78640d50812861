"""krproxy.hookserver._service: where a hook call's request is read. A blocking stage's runs in the
worker, but its request is read on the loop's thread first, where its bytes arrived (reading touches
no app state), unless it is large; a request that is no such message is answered there, no job queued."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import outcome
import pytest
import trio
import trio.testing

from krproxy.grpcstatus import GRPCError, Status
from krproxy.hookserver import ContainerContext, HookServer, Stage, _service, _wire
from krproxy.hookserver._executor import Executor
from krproxy.hookserver._service import AppWorker, HookService
from krproxy.hookserver.testing import container_request, pod_request
from tests.integration.support import LIVENESS_LIMIT

STAGE = Stage.PRE_CREATE_CONTAINER


async def _call(service: HookService, request: bytes, stage: Stage = STAGE) -> outcome.Outcome[bytes]:
    """One call of ``stage`` as the server starts it: its outcome, inline or late."""
    late: list[outcome.Outcome[bytes]] = []
    came = trio.Event()

    def done_late(result: outcome.Outcome[bytes]) -> None:
        late.append(result)
        came.set()

    got = service._start(
        service._pod if stage.is_pod_level else service._container, stage, request, done_late
    )
    if got is None:
        with trio.fail_after(LIVENESS_LIMIT):
            await came.wait()
        got = late[0]
    return got


def _record_reads(monkeypatch: pytest.MonkeyPatch, threads: dict[str, str]) -> None:
    """Both levels' readings record their thread as ``threads["read"]`` (patched before the service
    is made: its levels hold the functions)."""
    for name in ("pod_info", "container_info"):
        monkeypatch.setattr(_wire, name, _recording(getattr(_wire, name), threads))


def _recording(read: Callable[[bytes], Any], threads: dict[str, str]) -> Callable[[bytes], Any]:
    def recorded(request: bytes) -> Any:
        threads["read"] = threading.current_thread().name
        return read(request)

    return recorded


def _served(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, worker: AppWorker
) -> tuple[HookService, dict[str, str]]:
    """A service with one blocking function, recording the thread that read each request and the
    thread that ran the function."""
    threads: dict[str, str] = {}
    read = _wire.container_info

    def container_info(request: bytes) -> Any:
        threads["read"] = threading.current_thread().name
        return read(request)

    monkeypatch.setattr(_wire, "container_info", container_info)
    app = HookServer(executor=Executor.for_roots(str(tmp_path), str(tmp_path / "resctrl")))

    @app.hook(STAGE, name="blocking")
    def blocking(ctx: ContainerContext) -> None:
        threads["stage"] = threading.current_thread().name
        ctx.response.add_envs["SEEN"] = ctx.request.name

    return HookService(app, worker), threads


def _envs(reply: bytes) -> dict[str, str]:
    answer = _wire.ContainerResourceHookResponse.FromString(reply)
    return {e.key: e.value for e in answer.container_envs}


async def test_read_on_the_loop(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A blocking stage's request is read on the loop's thread; its function runs in the worker, and
    the answer carries what it did."""
    async with AppWorker.open() as worker:
        service, threads = _served(tmp_path, monkeypatch, worker)
        request = bytes(container_request(pod_request("web"), "app").SerializeToString())
        reply = (await _call(service, request)).unwrap()
        worker_name = worker._thread.name
    assert {"read": threading.current_thread().name, "stage": worker_name} == threads
    assert {"SEEN": "app"} == _envs(reply)


async def test_large_request_read_in_worker(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request of READ_ON_LOOP_BELOW bytes or more is read in the worker, not to hold up the loop."""
    async with AppWorker.open() as worker:
        service, threads = _served(tmp_path, monkeypatch, worker)
        big = container_request(pod_request("web"), "app")
        big.container_annotations["big"] = "x" * _service.READ_ON_LOOP_BELOW
        reply = (await _call(service, bytes(big.SerializeToString()))).unwrap()
        worker_name = worker._thread.name
    assert {"read": worker_name, "stage": worker_name} == threads
    assert {"SEEN": "app"} == _envs(reply)


async def test_bad_request_answered_without_a_job(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that is no ContainerResourceHookRequest is INVALID_ARGUMENT naming the message, answered
    at once: the worker gets no job and stays idle."""
    async with AppWorker.open() as worker:
        service, threads = _served(tmp_path, monkeypatch, worker)
        jobs: list[object] = []
        submit = worker.submit

        def recorded(*args: Any) -> Any:
            jobs.append(args)
            return submit(*args)

        monkeypatch.setattr(worker, "submit", recorded)
        got = service._start(service._container, STAGE, b"\xff\xff\xff", lambda result: None)
        assert worker.idle
    assert isinstance(got, outcome.Error)
    assert isinstance(got.error, GRPCError) and Status.INVALID_ARGUMENT == got.error.status
    assert "ContainerResourceHookRequest" in str(got.error.message)
    assert [] == jobs and "stage" not in threads


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        (Stage.PRE_CREATE_CONTAINER, "ContainerResourceHookRequest"),
        (Stage.PRE_RUN_POD_SANDBOX, "PodSandboxHookRequest"),
    ],
)
async def test_bad_request_says_what_to_send(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, stage: Stage, expected: str
) -> None:
    """A request that is no such message is INVALID_ARGUMENT saying how to fix it: the message the
    method takes (its package and the proto that defines it), strings in UTF-8."""
    async with AppWorker.open() as worker:
        service, _ = _served(tmp_path, monkeypatch, worker)
        level = service._pod if stage.is_pod_level else service._container
        got = service._start(level, stage, b"\x0a\x03\x0a\x01\xff", lambda result: None)
    assert isinstance(got, outcome.Error) and isinstance(got.error, GRPCError)
    message = str(got.error.message)
    assert Status.INVALID_ARGUMENT == got.error.status
    assert message.startswith(f"{stage.rpc_name}: the request is no {expected}")
    assert f"send {stage.rpc_name} a runtime.v1alpha1.{expected}" in message
    assert "protos/runtime_hook_v1alpha1.proto" in message and "UTF-8" in message


def _sized(size: int) -> bytes:
    """A container request of exactly ``size`` bytes (an annotation padded to fit)."""
    request = container_request(pod_request("web"), "app")
    pad = size
    while True:
        request.container_annotations["pad"] = "x" * max(pad, 0)
        got = bytes(request.SerializeToString())
        if len(got) == size:
            return got
        pad += size - len(got)


@pytest.mark.parametrize(
    ("size", "where"), [(_service.READ_ON_LOOP_BELOW - 1, "loop"), (_service.READ_ON_LOOP_BELOW, "worker")]
)
async def test_threshold_exact(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, size: int, where: str) -> None:
    """A request one byte under READ_ON_LOOP_BELOW is read on the loop's thread, one of exactly that
    many bytes in the worker; both are answered alike."""
    async with AppWorker.open() as worker:
        service, threads = _served(tmp_path, monkeypatch, worker)
        reply = (await _call(service, _sized(size))).unwrap()
        names = {"loop": threading.current_thread().name, "worker": worker._thread.name}
    assert {"read": names[where], "stage": names["worker"]} == threads
    assert {"SEEN": "app"} == _envs(reply)


@pytest.mark.parametrize("stage", list(Stage), ids=lambda s: s.value)
async def test_every_stage_read_on_the_loop(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, stage: Stage
) -> None:
    """Every hook point's call of a blocking stage, pod- or container-level, is read on the loop's
    thread and run in the worker, and its answer carries what the function did."""
    threads: dict[str, str] = {}
    _record_reads(monkeypatch, threads)
    app = HookServer(executor=Executor.for_roots(str(tmp_path), str(tmp_path / "resctrl")))

    @app.hook(stage, name="blocking")
    def blocking(ctx: Any) -> None:
        threads["stage"] = threading.current_thread().name
        ctx.response.annotations["seen"] = ctx.request.meta.name if stage.is_pod_level else ctx.request.name

    pod = pod_request("web")
    request = pod if stage.is_pod_level else container_request(pod, "app", id="c1")
    async with AppWorker.open() as worker:
        reply = (await _call(HookService(app, worker), bytes(request.SerializeToString()), stage)).unwrap()
        worker_name = worker._thread.name
    assert {"read": threading.current_thread().name, "stage": worker_name} == threads
    if stage.is_pod_level:
        answer = _wire.PodSandboxHookResponse.FromString(reply)
        assert {"seen": "web"} == {e.key: e.value for e in answer.annotations}
        assert pod.cgroup_parent == answer.cgroup_parent
    else:
        answer = _wire.ContainerResourceHookResponse.FromString(reply)
        assert {"seen": "app"} == {e.key: e.value for e in answer.container_annotations}
        assert pod.cgroup_parent == answer.pod_cgroup_parent


_NAMED = b"\x12\x05\x0a\x03app"  # container_meta {name: "app"}

#: Container requests read loosely (each as protobuf-go reads it too: a field of the wrong wire type
#: or an unknown number kept aside as unknown, a message field given twice merged, a scalar's last
#: value kept, a uint32 cut to 32 bits, unknown groups nested 99 deep) and three that are none (upb
#: refuses groups nested past 100, where protobuf-go's limit is 10,000: on either thread alike).
LOOSE = {
    "empty": b"",
    "unknown fields": _NAMED + b"\x98\x06\x01\xa2\x06\x03abc",
    "wrong wire types": b"\x10\x05\x40\x07" + _NAMED,
    "map entries loose": _NAMED + b"\x4a\x05\x08\x01\x12\x01v\x4a\x08\x0a\x01k\x12\x01w\x18\x01",
    "fields twice": _NAMED + b"\x12\x04\x1a\x02c1\x42\x01a\x42\x01b",
    "uint32 overflow": b"\x12\x0b\x0a\x03app\x10\x85\x80\x80\x80\x10",
    "groups nested 99": _NAMED + b"\x7b" * 99 + b"\x7c" * 99,
    "cut off": b"\x0a\xff\x01",
    # (protobuf-go reads this one: tests/unit/test_hooks_reading_go.py's xfail for the proxy's reading)
    "groups nested 101": _NAMED + b"\x7b" * 101 + b"\x7c" * 101,
    "invalid utf-8": _NAMED + b"\x42\x01\xff",
}


async def _answer(service: HookService, seen: list[str], request: bytes) -> tuple[str, Any]:
    """What the function saw and the answer's bytes, or the error's status and text."""
    seen.clear()
    got = await _call(service, request)
    if isinstance(got, outcome.Error):
        assert isinstance(got.error, GRPCError)
        return "error", (got.error.status, got.error.message, list(seen))
    return "reply", (got.unwrap(), list(seen))


@pytest.mark.parametrize("request_bytes", list(LOOSE.values()), ids=list(LOOSE))
async def test_loose_requests_read_alike(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, request_bytes: bytes
) -> None:
    """A request read loosely, or not at all, is read on the loop's thread exactly as in the worker:
    the function sees the same record and the call gets the same answer (or the same error)."""
    app = HookServer(executor=Executor.for_roots(str(tmp_path), str(tmp_path / "resctrl")))
    seen: list[str] = []

    @app.hook(STAGE, name="blocking")
    def blocking(ctx: ContainerContext) -> None:
        seen.append(repr(ctx.request))
        ctx.response.add_envs["SEEN"] = ctx.request.name

    async with AppWorker.open() as worker:
        service = HookService(app, worker)
        on_loop = await _answer(service, seen, request_bytes)
        monkeypatch.setattr(_service, "READ_ON_LOOP_BELOW", 0)  # every request read in the worker
        in_worker = await _answer(service, seen, request_bytes)
    assert in_worker == on_loop
    if on_loop[0] == "error":
        assert Status.INVALID_ARGUMENT == on_loop[1][0] and [] == on_loop[1][2]


def _named(name: str) -> bytes:
    return bytes(container_request(pod_request("web"), name).SerializeToString())


class _Answers:
    """The late answers of calls, by name, in the order they came; :meth:`wait` for ``count``."""

    def __init__(self) -> None:
        self.got: list[tuple[str, outcome.Outcome[bytes]]] = []
        self._changed = trio.Event()

    def to(self, name: str) -> Callable[[outcome.Outcome[bytes]], None]:
        def done_late(result: outcome.Outcome[bytes]) -> None:
            self.got.append((name, result))
            self._changed.set()

        return done_late

    async def wait(self, count: int) -> list[tuple[str, dict[str, str]]]:
        with trio.fail_after(LIVENESS_LIMIT):
            while len(self.got) < count:
                self._changed = trio.Event()
                await self._changed.wait()
        return [(name, _envs(result.unwrap())) for name, result in self.got]


async def test_read_while_a_job_runs(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls arriving while an earlier job (a ticker's, the policy watcher's) runs in the worker are
    read at once on the loop's thread, but their function runs after that job and sees the state it
    left; calls of one stage run and are answered in the order they came, and a bad one among them
    is answered at once without changing that order."""
    threads: dict[str, str] = {}
    _record_reads(monkeypatch, threads)
    app = HookServer(executor=Executor.for_roots(str(tmp_path), str(tmp_path / "resctrl")))
    state = {"policy": "before"}
    ran: list[str] = []

    @app.hook(STAGE, name="blocking")
    def blocking(ctx: ContainerContext) -> None:
        ran.append(ctx.request.name)
        ctx.response.add_envs["POLICY"] = state["policy"]

    gate = threading.Event()

    def earlier() -> None:
        assert gate.wait(LIVENESS_LIMIT)
        state["policy"] = "after"

    answers = _Answers()
    async with AppWorker.open() as worker:
        service = HookService(app, worker)
        assert worker.submit(lambda result: None, earlier) is None
        try:
            assert service._start(service._container, STAGE, _named("first"), answers.to("first")) is None
            bad = service._start(service._container, STAGE, b"\x0a\xff\x01", answers.to("bad"))
            assert service._start(service._container, STAGE, _named("second"), answers.to("second")) is None
            assert threading.current_thread().name == threads["read"] and [] == ran  # read, not yet run
            assert isinstance(bad, outcome.Error) and isinstance(bad.error, GRPCError)
            assert Status.INVALID_ARGUMENT == bad.error.status
        finally:
            gate.set()
        got = await answers.wait(2)
    assert ["first", "second"] == ran
    assert [("first", {"POLICY": "after"}), ("second", {"POLICY": "after"})] == got


async def test_read_while_a_task_holds_the_app(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A blocking stage's call arriving while an ``async def`` stage's task holds the app is read at
    once on the loop's thread; its function runs once that task has ended, after it."""
    threads: dict[str, str] = {}
    _record_reads(monkeypatch, threads)
    app = HookServer(executor=Executor.for_roots(str(tmp_path), str(tmp_path / "resctrl")))
    order: list[str] = []
    release = trio.Event()

    @app.hook(Stage.PRE_START_CONTAINER, name="awaits")
    async def awaits(ctx: ContainerContext) -> None:
        order.append("task began")
        await release.wait()
        order.append("task ended")

    @app.hook(STAGE, name="blocking")
    def blocking(ctx: ContainerContext) -> None:
        order.append("blocking")
        ctx.response.add_envs["SEEN"] = ctx.request.name

    answers = _Answers()
    async with AppWorker.open() as worker, trio.open_nursery() as nursery:
        service = HookService(app, worker, nursery)
        start = service._start(
            service._container, Stage.PRE_START_CONTAINER, _named("held"), answers.to("held")
        )
        assert start is None
        await trio.testing.wait_all_tasks_blocked()
        assert ["task began"] == order and not worker.idle
        threads.clear()  # (the held call's reading, on the loop)
        assert service._start(service._container, STAGE, _named("app"), answers.to("app")) is None
        assert threading.current_thread().name == threads["read"] and ["task began"] == order
        release.set()
        got = await answers.wait(2)
    assert ["task began", "task ended", "blocking"] == order
    assert [("held", {}), ("app", {"SEEN": "app"})] == got
