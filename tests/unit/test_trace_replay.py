"""Offline trace logic: ID mapping, normalisation, differences, replay with a scripted target, the
trace backend's matching, and show's filters."""

from __future__ import annotations

import attrs

from krproxy.grpcstatus import Status
from krproxy.proto.runtime import v1 as cri
from krproxy.trace import messages
from krproxy.trace.backend import TraceAnswers
from krproxy.trace.format import TraceRecord
from krproxy.trace.replay import Answer, replay
from krproxy.trace.show import Filter, decode_calls, parse_time, show

RUNTIME = "/runtime.v1.RuntimeService/"


def rec(
    number: int,
    method: str,
    request: object,
    reply: object | None,
    *,
    status: Status = Status.OK,
    message: str | None = None,
    forwarded: object | None = None,
) -> TraceRecord:
    return TraceRecord(
        number=number,
        path=RUNTIME + method,
        started=1_700_000_000.0 + number,
        seconds=0.002,
        backend_seconds=0.001,
        request=bytes(request),  # type: ignore[call-overload]
        forwarded=bytes(forwarded) if forwarded is not None else None,  # type: ignore[call-overload]
        reply=bytes(reply) if reply is not None else None,  # type: ignore[call-overload]
        replies=1 if reply is not None else 0,
        status=status,
        message=message,
        hooks=(),
    )


def lifecycle(pod: str = "p-old", container: str = "c-old", annotation: str = "yes") -> list[TraceRecord]:
    return [
        rec(
            1,
            "RunPodSandbox",
            cri.RunPodSandboxRequest(config=_pod()),
            cri.RunPodSandboxResponse(pod_sandbox_id=pod),
        ),
        rec(
            2,
            "CreateContainer",
            cri.CreateContainerRequest(pod_sandbox_id=pod, config=_container()),
            cri.CreateContainerResponse(container_id=container),
        ),
        rec(
            3,
            "ContainerStatus",
            cri.ContainerStatusRequest(container_id=container),
            cri.ContainerStatusResponse(
                status=cri.ContainerStatus(id=container, created_at=123, annotations={"limited": annotation})
            ),
        ),
        rec(
            4,
            "RemoveContainer",
            cri.RemoveContainerRequest(container_id=container),
            None,
            status=Status.NOT_FOUND,
            message=f"container {container} not found",
        ),
    ]


def _pod() -> cri.PodSandboxConfig:
    return cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="web", namespace="prod", uid="u1"))


def _container() -> cri.ContainerConfig:
    return cri.ContainerConfig(metadata=cri.ContainerMetadata(name="app"))


class ScriptedTarget:
    """Answers like ``lifecycle(new ids)`` and remembers what it was sent."""

    def __init__(self, annotation: str = "yes") -> None:
        self.answers = {r.path: r for r in lifecycle("p-new", "c-new", annotation)}
        self.sent: list[tuple[str, bytes]] = []

    def __call__(self, path: str, request: bytes, timeout: float) -> Answer:
        self.sent.append((path, request))
        r = self.answers[path]
        return Answer(r.status, r.message, r.reply)


class TestReplay:
    def test_identical_with_new_ids(self) -> None:
        """A target assigning other IDs and other timestamps still replays with zero differences."""
        target = ScriptedTarget()
        report = replay(lifecycle(), target)
        assert (4, 0, 0) == (report.identical, report.different, report.skipped)
        assert {"p-old": "p-new", "c-old": "c-new"} == report.ids
        assert report.ok

    def test_later_requests_carry_the_new_ids(self) -> None:
        """Requests after RunPodSandbox/CreateContainer are sent with the IDs the target assigned."""
        target = ScriptedTarget()
        replay(lifecycle(), target)
        create = cri.CreateContainerRequest.parse(target.sent[1][1])
        status = cri.ContainerStatusRequest.parse(target.sent[2][1])
        assert ("p-new", "c-new") == (create.pod_sandbox_id, status.container_id)

    def test_changed_answer_is_reported_readably(self) -> None:
        """A different annotation in the reply is one difference, with its path and both values."""
        report = replay(lifecycle(), ScriptedTarget(annotation="no"))
        assert not report.ok
        lines = list(report.lines())
        assert "call #3 /runtime.v1.RuntimeService/ContainerStatus: 1 difference(s)" in lines
        assert '    reply.status.annotations.limited: recorded "yes", replay "no"' in lines
        assert lines[-1].startswith("MISMATCH 4 calls: 3 identical, 1 different")

    def test_status_differences(self) -> None:
        """A different status code is a difference even without replies."""
        target = ScriptedTarget()
        target.answers[RUNTIME + "RemoveContainer"] = rec(
            4, "RemoveContainer", cri.RemoveContainerRequest(), cri.RemoveContainerResponse()
        )
        report = replay(lifecycle(), target)
        (result,) = [r for r in report.results if r.differences]
        assert [
            ("status", "NOT_FOUND", "OK"),
            ("message", "container c-old not found", None),
            ("reply", None, {}),
        ] == [(d.where, d.recorded, d.actual) for d in result.differences]

    def test_streams_are_skipped(self) -> None:
        """Server-streaming and unknown methods are skipped, not sent."""
        events = rec(9, "GetContainerEvents", cri.GetEventsRequest(), None)
        unknown = attrs.evolve(rec(10, "Y", cri.VersionRequest(), None), path="/runtime.v9.X/Y")
        target = ScriptedTarget()
        report = replay([events, unknown], target)
        assert (2, []) == (report.skipped, target.sent)

    def test_send_runtime_sends_what_the_runtime_got(self) -> None:
        """``send="runtime"``: the forwarded request (what krproxy and its hooks made of
        kubelet's), with the target's ids; a record nothing changed sends its request."""
        records = lifecycle()
        config = _container()
        config.envs.append(cri.KeyValue(key="HOOKED", value=b"1"))
        changed = cri.CreateContainerRequest(pod_sandbox_id="p-old", config=config)
        records[1] = attrs.evolve(records[1], forwarded=bytes(changed))
        by_default, as_runtime = ScriptedTarget(), ScriptedTarget()
        replay(records, by_default)
        replay(records, as_runtime, send="runtime")
        sent = cri.CreateContainerRequest.parse(as_runtime.sent[1][1])
        assert ("p-new", ["HOOKED"]) == (sent.pod_sandbox_id, [e.key for e in sent.config.envs])
        assert [] == cri.CreateContainerRequest.parse(by_default.sent[1][1]).config.envs
        assert by_default.sent[2] == as_runtime.sent[2]

    def test_timing_keeps_gaps(self) -> None:
        """With timing, the replay sleeps until each call's recorded offset from the first."""
        slept: list[float] = []
        replay(lifecycle(), ScriptedTarget(), timing=True, speed=2.0, sleep=slept.append, clock=lambda: 0.0)
        assert [0.5, 1.0, 1.5] == slept


class TestNormalise:
    def test_volatile_fields_are_blanked_but_presence_kept(self) -> None:
        """A set timestamp becomes a mark; an unset one stays absent."""
        plain = messages.to_plain(cri.ContainerStatus(id="x", created_at=5, exit_code=1))
        assert {"id": "x", "created_at": messages.VOLATILE_MARK, "exit_code": 1} == messages.normalise(plain)

    def test_ids_mapped_back(self) -> None:
        """Target IDs anywhere in a reply are replaced by the recorded ones."""
        assert {"items": [{"id": "old"}]} == messages.normalise({"items": [{"id": "new"}]}, {"new": "old"})


class TestTraceAnswers:
    def test_matching_request_wins_over_order(self) -> None:
        """A request equal to a later recorded one is answered by that one."""
        answers = TraceAnswers(
            [
                *lifecycle("p1", "c1"),
                rec(
                    5,
                    "ContainerStatus",
                    cri.ContainerStatusRequest(container_id="c2"),
                    cri.ContainerStatusResponse(),
                ),
            ]
        )
        picked = answers.answer(
            RUNTIME + "ContainerStatus", bytes(cri.ContainerStatusRequest(container_id="c2"))
        )
        assert picked is not None and 5 == picked.number

    def test_sequential_then_repeated_then_missing(self) -> None:
        """An unmatched changing call takes the next unused one, then the last again; unknown methods get None."""
        answers = TraceAnswers(lifecycle())
        other = bytes(cri.RemoveContainerRequest(container_id="zzz"))
        first = answers.answer(RUNTIME + "RemoveContainer", other)
        again = answers.answer(RUNTIME + "RemoveContainer", other)
        assert (4, 4) == (first.number if first else None, again.number if again else None)
        assert None is answers.answer(RUNTIME + "Version", b"")
        stats = answers.statistics()
        assert (0, 1, 1, 1) == (stats.exact, stats.sequential, stats.repeated, stats.missing)

    def test_reads_follow_the_last_change_and_use_nothing_up(self) -> None:
        """Read-only calls answer from the state after the last changing call, however often they come."""
        status = cri.ContainerStatusRequest(container_id="c")
        records = [
            rec(1, "ContainerStatus", status, cri.ContainerStatusResponse(info={"n": "1"})),
            rec(
                2, "StartContainer", cri.StartContainerRequest(container_id="c"), cri.StartContainerResponse()
            ),
            rec(3, "ContainerStatus", status, cri.ContainerStatusResponse(info={"n": "3"})),
        ]
        answers = TraceAnswers(records)
        path = RUNTIME + "ContainerStatus"
        early = [answers.answer(path, bytes(status)) for _ in range(3)]
        answers.answer(RUNTIME + "StartContainer", bytes(cri.StartContainerRequest(container_id="c")))
        late = [answers.answer(path, bytes(status)) for _ in range(2)]
        assert [1, 1, 1, 3, 3] == [r.number for r in early + late if r is not None]

    def test_forwarded_request_is_what_the_runtime_saw(self) -> None:
        """Requests are matched against the forwarded (hook-changed) request when there is one."""
        seen = cri.CreateContainerRequest(
            pod_sandbox_id="p", config=cri.ContainerConfig(annotations={"hooked": "1"})
        )
        record = rec(
            1,
            "CreateContainer",
            cri.CreateContainerRequest(pod_sandbox_id="p"),
            cri.CreateContainerResponse(container_id="c"),
            forwarded=seen,
        )
        answers = TraceAnswers([record])
        assert record == answers.answer(RUNTIME + "CreateContainer", bytes(seen))
        assert 1 == answers.statistics().exact


class TestShow:
    def test_filters_by_pod_name_and_container_name(self) -> None:
        """Pods are found by namespace/name and containers by name, learnt from Run/Create records."""
        calls = list(decode_calls(lifecycle()))
        assert [1, 2, 3, 4] == [c.record.number for c in calls if Filter(pod="prod/web").matches(c)]
        assert [2, 3, 4] == [c.record.number for c in calls if Filter(container="app").matches(c)]
        assert [3] == [c.record.number for c in calls if Filter(methods=("containerstatus",)).matches(c)]

    def test_time_window(self) -> None:
        """--since and --until bound the start time, inclusively."""
        since, until = parse_time("2023-11-14T22:13:22Z"), parse_time("1700000003")
        calls = [
            c.record.number for c in decode_calls(lifecycle()) if Filter(since=since, until=until).matches(c)
        ]
        assert [2, 3] == calls

    def test_table_lists_status_and_names(self) -> None:
        """The table has a header and one row per call, errors with their status."""
        header, *rows = show(lifecycle(), Filter())
        assert header.split()[:3] == ["#", "started", "(UTC)"]
        assert 4 == len(rows)
        assert "NOT_FOUND container c-old not found" in rows[3]
        assert "prod/web" in rows[0] and "app" in rows[2]
