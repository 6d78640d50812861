"""The fake containerd's version rules (krproxy.fakes.containerd.versions): each answer where containerd
1.6, 1.7, 2.1 and 2.3 differ, as measured on the real runtimes (1.6.20, 1.7.24, 2.1.9 here; 2.3.4 in
shared/notes/real-containerd.md)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from krproxy.fakes.containerd.records import Code, CriError
from krproxy.fakes.containerd.state import RuntimeState
from krproxy.fakes.containerd.versions import IMITATIONS, imitation, route
from krproxy.grpcstatus import GRPCError, Status
from krproxy.proto.runtime import v1 as cri
from tests.unit.test_fake_containerd_state import create, new_state, run_pod

VERSIONS = list(IMITATIONS)
SERVICE = "runtime.v1.RuntimeService"
METHODS = {SERVICE: frozenset({"RunPodSandbox", "Version"})}


def answer(fn: Callable[[], object]) -> tuple[Code | None, str]:
    """``(code, message)`` of a failed call, ``(None, "")`` of one that succeeded."""
    try:
        fn()
    except CriError as err:
        return err.code, err.message
    return None, ""


def two_sharing_a_prefix(state: RuntimeState) -> tuple[str, str, str]:
    """Two pods whose ids share a first character, and that character."""
    seen: dict[str, str] = {}
    n = 0
    while True:
        pod = run_pod(state, f"p{n}")
        n += 1
        if pod[0] in seen:
            return seen[pod[0]], pod, pod[0]
        seen[pod[0]] = pod


class TestIds:
    @pytest.mark.parametrize("version", VERSIONS)
    def test_a_unique_prefix_names_the_object(self, version: str) -> None:
        """StartContainer and StopPodSandbox given 12 characters act on the object they begin."""
        s = new_state(imitate=version)
        pod = run_pod(s)
        ctr = create(s, pod)
        s.start_container(cri.StartContainerRequest(container_id=ctr[:12]))
        s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod[:12]))
        assert (cri.ContainerState.CONTAINER_EXITED, cri.PodSandboxState.SANDBOX_NOTREADY) == (
            s.containers[ctr].state,
            s.sandboxes[pod].state,
        )

    @pytest.mark.parametrize(
        ("version", "words"),
        [
            ("1.6", "Prefix can't be empty"),
            ("1.7", "prefix can't be empty"),
            ("2.3", "prefix can't be empty"),
        ],
    )
    def test_an_empty_id_is_unknown(self, version: str, words: str) -> None:
        """An empty id is UNKNOWN in every call that looks one up, removes included (not NOT_FOUND or OK)."""
        s = new_state(imitate=version)
        run_pod(s)
        calls: list[Callable[[], object]] = [
            lambda: s.container_status(cri.ContainerStatusRequest(container_id="")),
            lambda: s.start_container(cri.StartContainerRequest(container_id="")),
            lambda: s.stop_container(cri.StopContainerRequest(container_id="")),
            lambda: s.remove_container(cri.RemoveContainerRequest(container_id="")),
            lambda: s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id="")),
            lambda: s.remove_pod_sandbox(cri.RemovePodSandboxRequest(pod_sandbox_id="")),
        ]
        answers = [answer(call) for call in calls]
        assert [Code.UNKNOWN] * len(calls) == [code for code, _ in answers]
        assert all(message.endswith(f'"": {words}') for _, message in answers), answers

    @pytest.mark.parametrize("version", VERSIONS)
    def test_an_ambiguous_prefix_is_unknown(self, version: str) -> None:
        """A prefix of two ids is UNKNOWN "Multiple IDs found", and Remove of it removes nothing."""
        s = new_state(imitate=version)
        first, second, prefix = two_sharing_a_prefix(s)
        code, message = answer(
            lambda: s.remove_pod_sandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=prefix))
        )
        assert Code.UNKNOWN == code
        assert message.endswith(f'"{prefix}": Multiple IDs found with provided prefix: {prefix}'), message
        assert {first, second} <= set(s.sandboxes)

    @pytest.mark.parametrize("version", VERSIONS)
    def test_remove_of_an_unknown_id_is_ok(self, version: str) -> None:
        s = new_state(imitate=version)
        assert [(None, ""), (None, "")] == [
            answer(lambda: s.remove_container(cri.RemoveContainerRequest(container_id="0" * 64))),
            answer(lambda: s.remove_pod_sandbox(cri.RemovePodSandboxRequest(pod_sandbox_id="0" * 64))),
        ]


class TestVersionDifferences:
    @pytest.mark.parametrize(
        ("version", "code"), [("1.6", Code.NOT_FOUND), ("1.7", None), ("2.1", None), ("2.3", None)]
    )
    def test_stop_of_an_unknown_id(self, version: str, code: Code | None) -> None:
        """StopContainer and StopPodSandbox of an unknown id: NOT_FOUND on 1.6, OK from 1.7 on."""
        s = new_state(imitate=version)
        assert [code, code] == [
            answer(lambda: s.stop_container(cri.StopContainerRequest(container_id="0" * 64)))[0],
            answer(lambda: s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id="0" * 64)))[0],
        ]

    @pytest.mark.parametrize(
        ("version", "code"),
        [
            ("1.6", Code.UNKNOWN),
            ("1.7", Code.UNKNOWN),
            ("2.1", Code.FAILED_PRECONDITION),
            ("2.3", Code.FAILED_PRECONDITION),
        ],
    )
    def test_a_reserved_name(self, version: str, code: Code) -> None:
        """A second pod, or container, of the same name: UNKNOWN up to 1.7, FAILED_PRECONDITION on 2.x."""
        s = new_state(imitate=version)
        pod = run_pod(s)
        create(s, pod)
        assert [code, code] == [answer(lambda: run_pod(s))[0], answer(lambda: create(s, pod))[0]]

    @pytest.mark.parametrize(
        ("version", "creates"), [("1.6", False), ("1.7", False), ("2.1", True), ("2.3", True)]
    )
    def test_create_in_a_stopped_pod(self, version: str, creates: bool) -> None:
        """CreateContainer in a NOTREADY pod: NOT_FOUND (no running task) up to 1.7; 2.x creates it."""
        s = new_state(imitate=version)
        pod = run_pod(s)
        s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod))
        code, _ = answer(lambda: create(s, pod))
        assert (None if creates else Code.NOT_FOUND, 1 if creates else 0) == (code, len(s.containers))

    @pytest.mark.parametrize(
        ("version", "answers"), [("1.6", False), ("1.7", False), ("2.1", False), ("2.3", True)]
    )
    def test_pod_resize_only_on_2_3(self, version: str, answers: bool) -> None:
        s = new_state(imitate=version)
        pod = run_pod(s)
        request = cri.UpdatePodSandboxResourcesRequest(pod_sandbox_id=pod)
        code, _ = answer(lambda: s.update_pod_sandbox_resources(request))
        assert (None if answers else Code.UNIMPLEMENTED) == code

    def test_an_explicit_pod_resize_wins_over_the_version(self) -> None:
        s = new_state(imitate="1.6", pod_resize=True)
        pod = run_pod(s)
        assert (None, "") == answer(
            lambda: s.update_pod_sandbox_resources(cri.UpdatePodSandboxResourcesRequest(pod_sandbox_id=pod))
        )

    @pytest.mark.parametrize("version", VERSIONS)
    def test_version_reports_the_imitated_runtime(self, version: str) -> None:
        reply = new_state(imitate=version).version(cri.VersionRequest())
        assert reply.runtime_version.startswith(f"v{version}.")

    def test_the_default_is_1_6(self) -> None:
        assert "1.6" == RuntimeState().settings.imitate.version

    def test_a_version_chosen_later_is_every_part_s(self) -> None:
        """A version set on the state's settings after it was made (as FakeContainerd(imitate=...)
        does) is the one its tables, its container calls and its pod calls all answer as."""
        s = new_state(imitate="1.6")
        s.settings.imitate = "1.7"
        pod = run_pod(s)
        lookup = answer(lambda: s.container_status(cri.ContainerStatusRequest(container_id="")))
        stop = answer(lambda: s.stop_container(cri.StopContainerRequest(container_id="f" * 64)))
        stop_pod = answer(lambda: s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id="f" * 64)))
        assert (Code.UNKNOWN, (None, ""), (None, "")) == (lookup[0], stop, stop_pod)
        assert "prefix can't be empty" in lookup[1]
        assert pod in s.sandboxes

    def test_2_x_names_2_1_and_unknown_versions_are_refused(self) -> None:
        assert "2.1" == imitation("2.x").version
        with pytest.raises(ValueError, match=r"no imitation of containerd '1\.5'"):
            imitation("1.5")


def routed(path: str, version: str) -> tuple[str, str] | tuple[Status, str]:
    try:
        return route(path, METHODS, imitation(version))
    except GRPCError as err:
        return err.status, err.message or ""


class TestRouting:
    @pytest.mark.parametrize("version", ["1.6", "1.7"])
    def test_a_slash_less_path_is_routed_before_grpc_1_79_3(self, version: str) -> None:
        assert (SERVICE, "RunPodSandbox") == routed(f"{SERVICE}/RunPodSandbox", version)

    @pytest.mark.parametrize("version", ["2.1", "2.3"])
    def test_a_slash_less_path_is_malformed_on_2_x(self, version: str) -> None:
        path = f"{SERVICE}/RunPodSandbox"
        assert (Status.UNIMPLEMENTED, f'malformed method name: "{path}"') == routed(path, version)

    @pytest.mark.parametrize(
        ("path", "message"),
        [
            (f"//{SERVICE}/Version", f"unknown service /{SERVICE}"),
            (f"/{SERVICE}/Version/", f"unknown service {SERVICE}/Version"),
            (f"/{SERVICE}/Version?x", f"unknown method Version?x for service {SERVICE}"),
            (f"/{SERVICE}/Versio%6E", f"unknown method Versio%6E for service {SERVICE}"),
            ("/runtime.v1.runtimeservice/Version", "unknown service runtime.v1.runtimeservice"),
        ],
    )
    @pytest.mark.parametrize("version", VERSIONS)
    def test_other_spellings_are_unimplemented(self, version: str, path: str, message: str) -> None:
        """Doubled or trailing slashes, a query, percent-encoding, other case: grpc-go's words, every version."""
        assert (Status.UNIMPLEMENTED, message) == routed(path, version)

    @pytest.mark.parametrize(
        ("version", "status"), [("1.6", Status.RESOURCE_EXHAUSTED), ("2.1", Status.UNIMPLEMENTED)]
    )
    def test_a_name_without_slash_is_malformed(self, version: str, status: Status) -> None:
        """No ``/`` at all: malformed, which the grpc-go of 1.6 answers with RESOURCE_EXHAUSTED."""
        assert [(status, 'malformed method name: "Version"'), (status, 'malformed method name: "/x"')] == [
            routed("Version", version),
            routed("/x", version),
        ]


class TestStartFailure:
    @pytest.mark.parametrize("version", VERSIONS)
    def test_a_start_in_a_stopped_pod_leaves_it_exited(self, version: str) -> None:
        """StartContainer of a CREATED container whose pod stopped: UNKNOWN "sandbox container ... is not
        running", and containerd marks the container EXITED (128, "StartError"), seen on 2.1.9 by the
        differential test."""
        s = new_state(imitate=version)
        pod = run_pod(s)
        ctr = create(s, pod)
        s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod))
        code, message = answer(lambda: s.start_container(cri.StartContainerRequest(container_id=ctr)))
        record = s.containers[ctr]
        assert (Code.UNKNOWN, f'sandbox container "{pod}" is not running') == (code, message)
        assert (cri.ContainerState.CONTAINER_EXITED, 128, "StartError") == (
            record.state,
            record.exit_code,
            record.reason,
        )
