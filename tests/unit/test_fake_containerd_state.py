"""The fake containerd's pure core: state machines, lookups, images, events — no sockets."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.fakes.containerd.records import (
    CONTAINER_TRANSITIONS,
    EXIT_CODE_KILLED,
    Code,
    CriError,
    Op,
    sequential_ids,
    stepping_clock,
)
from krproxy.fakes.containerd.state import RuntimeState
from krproxy.proto.runtime import v1 as cri

CS = cri.ContainerState
SS = cri.PodSandboxState
EV = cri.ContainerEventType


def new_state(**kwargs: object) -> RuntimeState:
    return RuntimeState(clock=stepping_clock(), new_id=sequential_ids(), **kwargs)  # type: ignore[arg-type]


def run_pod(state: RuntimeState, name: str = "web", **labels: str) -> str:
    config = cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, uid=f"uid-{name}", namespace="default"),
        labels={"app": name, **labels},
    )
    return state.run_pod_sandbox(cri.RunPodSandboxRequest(config=config)).pod_sandbox_id


def create(state: RuntimeState, pod_id: str, name: str = "app", cpu_shares: int = 512) -> str:
    config = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name=name),
        image=cri.ImageSpec(image="nginx:1.25"),
        labels={"name": name},
        linux=cri.LinuxContainerConfig(resources=cri.LinuxContainerResources(cpu_shares=cpu_shares)),
    )
    return state.create_container(
        cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=config)
    ).container_id


def start(state: RuntimeState, ctr_id: str) -> None:
    state.start_container(cri.StartContainerRequest(container_id=ctr_id))


def running(state: RuntimeState) -> tuple[str, str]:
    """A pod "web" and its container "app", started: their ids."""
    pod_id = run_pod(state)
    ctr_id = create(state, pod_id)
    start(state, ctr_id)
    return pod_id, ctr_id


def stop(state: RuntimeState, ctr_id: str, timeout: int = 10) -> None:
    state.stop_container(cri.StopContainerRequest(container_id=ctr_id, timeout=timeout))


def remove(state: RuntimeState, ctr_id: str) -> None:
    state.remove_container(cri.RemoveContainerRequest(container_id=ctr_id))


def status(state: RuntimeState, ctr_id: str) -> cri.ContainerStatus:
    reply = state.container_status(cri.ContainerStatusRequest(container_id=ctr_id)).status
    assert reply is not None
    return reply


def container_in(wanted: CS) -> tuple[RuntimeState, str]:
    """A fresh state holding one container in the ``wanted`` state."""
    s = new_state()
    ctr = create(s, run_pod(s))
    if wanted != CS.CONTAINER_CREATED:
        start(s, ctr)
    if wanted == CS.CONTAINER_EXITED:
        stop(s, ctr)
    return s, ctr


OPS: dict[Op, Callable[[RuntimeState, str], None]] = {
    Op.START: start,
    Op.STOP: stop,
    Op.EXIT: lambda s, c: s.exit_container(c, 1),
    Op.REMOVE: remove,
}


def error_code(fn: Callable[[], object]) -> Code:
    with pytest.raises(CriError) as info:
        fn()
    return info.value.code


class TestContainerStateMachine:
    @pytest.mark.parametrize(
        ("initial", "op", "expected"),
        [
            (CS.CONTAINER_CREATED, Op.START, CS.CONTAINER_RUNNING),
            (CS.CONTAINER_CREATED, Op.STOP, CS.CONTAINER_CREATED),
            (CS.CONTAINER_RUNNING, Op.STOP, CS.CONTAINER_EXITED),
            (CS.CONTAINER_RUNNING, Op.EXIT, CS.CONTAINER_EXITED),
            (CS.CONTAINER_EXITED, Op.STOP, CS.CONTAINER_EXITED),
            (CS.CONTAINER_RUNNING, Op.START, Code.UNKNOWN),
            (CS.CONTAINER_EXITED, Op.START, Code.UNKNOWN),
            (CS.CONTAINER_CREATED, Op.EXIT, Code.UNKNOWN),
            (CS.CONTAINER_EXITED, Op.EXIT, Code.UNKNOWN),
        ],
    )
    def test_transition(self, initial: CS, op: Op, expected: CS | Code) -> None:
        """Each (state, operation) pair either moves to the tabled state or is refused."""
        s, ctr = container_in(initial)
        if isinstance(expected, Code):
            assert expected == error_code(lambda: OPS[op](s, ctr))
            assert initial == status(s, ctr).state
        else:
            OPS[op](s, ctr)
            assert expected == status(s, ctr).state

    def test_table_matches_behaviour(self) -> None:
        """The transitions table only names real states and ops (it is the single source of truth)."""
        assert {Op.START, Op.STOP, Op.EXIT, Op.FAIL_START} == {op for _, op in CONTAINER_TRANSITIONS}

    def test_timestamps(self) -> None:
        """created_at < started_at < finished_at, all in nanoseconds from the injected clock."""
        s, ctr = container_in(CS.CONTAINER_EXITED)
        st_ = status(s, ctr)
        assert st_.created_at < st_.started_at < st_.finished_at
        assert st_.created_at > 1_600_000_000 * 10**9

    @pytest.mark.parametrize(
        ("timeout", "exit_code", "reason"), [(10, 0, "Completed"), (0, EXIT_CODE_KILLED, "Error")]
    )
    def test_stop_exit_code(self, timeout: int, exit_code: int, reason: str) -> None:
        """A graceful stop exits 0 "Completed"; a zero-timeout stop is a kill, 137 "Error"."""
        s, ctr = container_in(CS.CONTAINER_RUNNING)
        stop(s, ctr, timeout=timeout)
        st_ = status(s, ctr)
        assert (exit_code, reason) == (st_.exit_code, st_.reason)

    def test_exit_on_its_own(self) -> None:
        """exit_container records the given exit code and reason."""
        s, ctr = container_in(CS.CONTAINER_RUNNING)
        s.exit_container(ctr, 137, "OOMKilled")
        st_ = status(s, ctr)
        assert (CS.CONTAINER_EXITED, 137, "OOMKilled") == (st_.state, st_.exit_code, st_.reason)

    def test_start_in_notready_pod(self) -> None:
        """A created container cannot start once its pod is stopped."""
        s = new_state()
        pod = run_pod(s)
        ctr = create(s, pod)
        s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod))
        assert Code.UNKNOWN == error_code(lambda: start(s, ctr))


class TestRemoveContainer:
    def test_remove_running_kills_first(self) -> None:
        """Like containerd, removing a running container force-stops it, then removes it."""
        s, ctr = container_in(CS.CONTAINER_RUNNING)
        remove(s, ctr)
        events = [e.container_event_type for e in s.take_events()][-2:]
        assert ({}, [EV.CONTAINER_STOPPED_EVENT, EV.CONTAINER_DELETED_EVENT]) == (dict(s.containers), events)

    def test_remove_running_refused_when_configured(self) -> None:
        """With force_remove_running off, removing a running container is UNKNOWN and keeps it."""
        s = new_state(force_remove_running=False)
        ctr = create(s, run_pod(s))
        start(s, ctr)
        with pytest.raises(CriError) as info:
            remove(s, ctr)
        assert (Code.UNKNOWN, True) == (info.value.code, "still running" in info.value.message)
        assert CS.CONTAINER_RUNNING == status(s, ctr).state

    @pytest.mark.parametrize("initial", [CS.CONTAINER_CREATED, CS.CONTAINER_EXITED])
    def test_remove_stopped(self, initial: CS) -> None:
        """Created and exited containers are removed and disappear from lookups."""
        s, ctr = container_in(initial)
        remove(s, ctr)
        assert Code.NOT_FOUND == error_code(lambda: status(s, ctr))

    def test_remove_unknown_succeeds(self) -> None:
        """Removing an unknown container is not an error (containerd ignores missing ones)."""
        s = new_state()
        remove(s, "deadbeef")
        assert [] == s.take_events()

    def test_name_reusable_after_remove(self) -> None:
        """A container name is reserved while the container lives and free again afterwards."""
        s = new_state()
        pod = run_pod(s)
        first = create(s, pod)
        assert Code.UNKNOWN == error_code(lambda: create(s, pod))
        remove(s, first)
        assert first != create(s, pod)


class TestSandbox:
    def test_stop_kills_containers(self) -> None:
        """Stopping a pod kills its running containers (137) and marks it NOTREADY."""
        s = new_state()
        pod, _ = running(s)
        s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod))
        reply = s.pod_sandbox_status(cri.PodSandboxStatusRequest(pod_sandbox_id=pod))
        assert reply.status is not None
        assert SS.SANDBOX_NOTREADY == reply.status.state
        assert [(CS.CONTAINER_EXITED, EXIT_CODE_KILLED)] == [
            (c.state, c.exit_code) for c in reply.containers_statuses
        ]

    def test_stop_twice(self) -> None:
        """Stopping a NOTREADY pod again succeeds and emits nothing more."""
        s = new_state()
        pod = run_pod(s)
        s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod))
        s.take_events()
        s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod))
        assert [] == s.take_events()

    @pytest.mark.parametrize("stop_first", [True, False])
    def test_remove_in_either_state(self, stop_first: bool) -> None:
        """A pod can be removed READY or NOTREADY, and its containers go with it."""
        s = new_state()
        pod = run_pod(s)
        create(s, pod)
        if stop_first:
            s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod))
        s.remove_pod_sandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod))
        assert ({}, {}) == (dict(s.sandboxes), dict(s.containers))

    def test_unknown_ids(self) -> None:
        """Stop and status of an unknown pod are NOT_FOUND; remove of an unknown pod succeeds."""
        s = new_state()
        codes = [
            error_code(lambda: s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id="x"))),
            error_code(lambda: s.pod_sandbox_status(cri.PodSandboxStatusRequest(pod_sandbox_id="x"))),
        ]
        s.remove_pod_sandbox(cri.RemovePodSandboxRequest(pod_sandbox_id="x"))
        assert [Code.NOT_FOUND, Code.NOT_FOUND] == codes

    def test_duplicate_name_refused(self) -> None:
        """A second pod with the same name, namespace, uid and attempt is refused."""
        s = new_state()
        run_pod(s)
        assert Code.UNKNOWN == error_code(lambda: run_pod(s))

    def test_create_container_needs_ready_pod(self) -> None:
        """CreateContainer: unknown pod is NOT_FOUND, and so is a NOTREADY pod on containerd 1.6 ("no
        running task found"; measured on 1.6.20 and 1.7.24)."""
        s = new_state()
        pod = run_pod(s)
        s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod))
        assert [Code.NOT_FOUND, Code.NOT_FOUND] == [
            error_code(lambda: create(s, "nope")),
            error_code(lambda: create(s, pod)),
        ]

    def test_host_network_has_no_ip(self) -> None:
        """Pods get an IP unless they use the node's network namespace."""
        s = new_state()
        config = cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name="host", uid="u"),
            linux=cri.LinuxPodSandboxConfig(
                security_context=cri.LinuxSandboxSecurityContext(
                    namespace_options=cri.NamespaceOption(network=cri.NamespaceMode.NODE)
                )
            ),
        )
        host = s.run_pod_sandbox(cri.RunPodSandboxRequest(config=config)).pod_sandbox_id
        ips = [
            s.pod_sandbox_status(cri.PodSandboxStatusRequest(pod_sandbox_id=p)).status.network.ip  # type: ignore[union-attr]
            for p in (host, run_pod(s))
        ]
        assert ("", True) == (ips[0], ips[1].startswith("10.88."))


class TestPodResize:
    def test_recorded_as_sent(self) -> None:
        """containerd 2.3 keeps the overhead and resources of the last UpdatePodSandboxResources."""
        state = new_state(imitate="2.3")
        pod = run_pod(state)
        resources = cri.LinuxContainerResources(cpu_quota=150000, memory_limit_in_bytes=1 << 30)

        state.update_pod_sandbox_resources(
            cri.UpdatePodSandboxResourcesRequest(pod_sandbox_id=pod, resources=resources)
        )

        assert (None, resources) == (state.sandboxes[pod].overhead, state.sandboxes[pod].resources)

    def test_unknown_sandbox_is_not_found(self) -> None:
        state = new_state(imitate="2.3")
        request = cri.UpdatePodSandboxResourcesRequest(pod_sandbox_id="nope")

        assert Code.NOT_FOUND == error_code(lambda: state.update_pod_sandbox_resources(request))

    def test_older_containerd_answers_unimplemented(self) -> None:
        """containerd 1.6 to 2.1 lack the method: UNIMPLEMENTED, and nothing is recorded."""
        state = new_state(pod_resize=False)
        pod = run_pod(state)
        request = cri.UpdatePodSandboxResourcesRequest(
            pod_sandbox_id=pod, resources=cri.LinuxContainerResources(cpu_shares=2)
        )

        assert Code.UNIMPLEMENTED == error_code(lambda: state.update_pod_sandbox_resources(request))
        assert state.sandboxes[pod].resources is None


# -- invariants over random operation sequences -----------------------------------------------

ACTIONS = ["run", "stop_pod", "remove_pod", "create", "start", "stop", "kill", "exit", "remove", "update"]


class TestParts:
    def test_every_cri_call_is_found_by_name(self) -> None:
        """Each call of CRI_CALLS, and the encoded form of each of ENCODED_CALLS, is the state's by
        name (the server looks them up so), whichever part answers it."""
        s = new_state()
        names = [*RuntimeState.CRI_CALLS, *(f"{name}_encoded" for name in RuntimeState.ENCODED_CALLS)]
        assert [] == [name for name in sorted(names) if not callable(getattr(s, name, None))]

    def test_the_state_extends_no_part(self) -> None:
        """RuntimeState holds its tables and calls; none of them is a base of another."""
        from krproxy.fakes.containerd._tables import Tables
        from krproxy.fakes.containerd.containers import ContainerCalls
        from krproxy.fakes.containerd.images import ImageCalls

        kinds = (RuntimeState, Tables, ContainerCalls, ImageCalls)
        assert [(kind, object) for kind in kinds] == [kind.__mro__ for kind in kinds]


class TestInvariants:
    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 7)), max_size=50))
    def test_random_sequences(self, steps: list[tuple[str, int]]) -> None:
        """Whatever CRI calls arrive, the fake's state stays consistent and errors are CRI-shaped."""
        s = new_state()
        # Start from two pods with a container each, so short sequences already reach deep states.
        pods = [run_pod(s, "p0"), run_pod(s, "p1")]
        ctrs = [create(s, pods[0], "c0"), create(s, pods[1], "c1")]
        for action, n in steps:
            pod = pods[n % len(pods)] if pods else "missing"
            ctr = ctrs[n % len(ctrs)] if ctrs else "missing"
            try:
                if action == "run":
                    pods.append(run_pod(s, f"p{len(pods)}"))
                elif action == "stop_pod":
                    s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod))
                elif action == "remove_pod":
                    s.remove_pod_sandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod))
                elif action == "create":
                    ctrs.append(create(s, pod, f"c{len(ctrs)}"))
                elif action == "start":
                    start(s, ctr)
                elif action == "stop":
                    stop(s, ctr)
                elif action == "kill":
                    stop(s, ctr, timeout=0)
                elif action == "exit":
                    s.exit_container(ctr, n)
                elif action == "remove":
                    remove(s, ctr)
                else:
                    s.update_container_resources(
                        cri.UpdateContainerResourcesRequest(
                            container_id=ctr, linux=cri.LinuxContainerResources(cpu_shares=n)
                        )
                    )
            except CriError as err:
                assert err.code in {Code.NOT_FOUND, Code.UNKNOWN}
            self.check(s)

    @staticmethod
    def check(s: RuntimeState) -> None:
        sandboxes, containers = s.sandboxes, s.containers
        listed = s.list_containers(cri.ListContainersRequest()).containers
        assert sorted(containers) == sorted(c.id for c in listed)
        for c in containers.values():
            pod = sandboxes[c.pod_sandbox_id]
            if pod.state == SS.SANDBOX_NOTREADY:
                assert c.state != CS.CONTAINER_RUNNING
            if c.state == CS.CONTAINER_CREATED:
                assert (0, 0) == (c.started_at, c.finished_at)
            elif c.state == CS.CONTAINER_RUNNING:
                assert c.created_at < c.started_at and c.finished_at == 0
            elif c.reason == "StartError":  # a start that failed: never started (containerd's record)
                assert c.started_at == 0 and c.created_at < c.finished_at
            else:
                assert c.created_at < c.started_at < c.finished_at
        for event in s.take_events():
            if event.container_event_type == EV.CONTAINER_DELETED_EVENT:
                assert event.container_id not in containers and event.container_id not in sandboxes
