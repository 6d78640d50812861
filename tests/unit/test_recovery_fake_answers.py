"""The fake containerd's encoded answers (RuntimeState.ENCODED_CALLS), which store recovery calls in bulk:
exactly the bytes of the message answers, whatever happened to the records since."""

from __future__ import annotations

import random
from typing import Any

import pytest

from krproxy.fakes.containerd import Code, CriError, RuntimeState, sequential_ids, stepping_clock
from krproxy.proto.runtime import v1 as cri


class TestEncodedAnswers:
    @staticmethod
    def _assert_same_bytes(state: RuntimeState) -> None:
        sandboxes, containers = list(state.sandboxes), list(state.containers)
        requests: dict[str, list[Any]] = {
            "list_pod_sandbox": [
                cri.ListPodSandboxRequest(),
                *(cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(id=i[:12])) for i in sandboxes),
                cri.ListPodSandboxRequest(
                    filter=cri.PodSandboxFilter(
                        state=cri.PodSandboxStateValue(state=cri.PodSandboxState.SANDBOX_NOTREADY)
                    )
                ),
                cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(label_selector={"app": "web"})),
            ],
            "pod_sandbox_status": [
                cri.PodSandboxStatusRequest(pod_sandbox_id=i, verbose=True) for i in sandboxes
            ],
            "list_containers": [
                cri.ListContainersRequest(),
                *(cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=i)) for i in sandboxes),
                *(cri.ListContainersRequest(filter=cri.ContainerFilter(id=i[:12])) for i in containers),
                cri.ListContainersRequest(
                    filter=cri.ContainerFilter(
                        state=cri.ContainerStateValue(state=cri.ContainerState.CONTAINER_EXITED)
                    )
                ),
            ],
            "container_status": [
                cri.ContainerStatusRequest(container_id=i, verbose=True) for i in containers
            ],
        }
        assert set(requests) == RuntimeState.ENCODED_CALLS
        for method, method_requests in requests.items():
            for request in method_requests:
                # Lists come shuffled on every call: the same seed gives both paths the same order.
                state.settings.order = random.Random(7)
                expected = bytes(getattr(state, method)(request).SerializeToString())
                state.settings.order = random.Random(7)
                assert expected == getattr(state, f"{method}_encoded")(request), (method, request)

    def test_same_bytes_as_the_message_answers(self) -> None:
        state = RuntimeState(clock=lambda: 1_700_000_000_000_000_000, new_id=sequential_ids())
        seeded = state.seed(3, 2)
        pod_id = state.run_pod_sandbox(
            cri.RunPodSandboxRequest(
                config=cri.PodSandboxConfig(
                    metadata=cri.PodSandboxMetadata(name="web", uid="u1", namespace="default"),
                    labels={"z": "1", "app": "web"},
                    linux=cri.LinuxPodSandboxConfig(
                        security_context=cri.LinuxSandboxSecurityContext(
                            namespace_options=cri.NamespaceOption(network=cri.NamespaceMode.NODE)
                        )
                    ),
                ),
                runtime_handler="runc",
            )
        ).pod_sandbox_id
        container_id = state.create_container(
            cri.CreateContainerRequest(
                pod_sandbox_id=pod_id,
                config=cri.ContainerConfig(
                    metadata=cri.ContainerMetadata(name="app", attempt=1),
                    image=cri.ImageSpec(image="busybox"),
                    mounts=[cri.Mount(container_path="/data", host_path="/srv", readonly=True)],
                    log_path="app/1.log",
                ),
            )
        ).container_id
        self._assert_same_bytes(state)

        # Every kind of change, each checked: a changed record is a new one, nothing kept goes stale.
        changes = [
            lambda: state.start_container(cri.StartContainerRequest(container_id=container_id)),
            lambda: state.update_container_resources(
                cri.UpdateContainerResourcesRequest(
                    container_id=seeded[0],
                    linux=cri.LinuxContainerResources(cpu_shares=2, unified={"a": "b"}),
                )
            ),
            lambda: state.stop_container(cri.StopContainerRequest(container_id=seeded[1], timeout=10)),
            lambda: state.exit_container(seeded[2], 137, "OOMKilled"),
            lambda: state.remove_container(cri.RemoveContainerRequest(container_id=seeded[3])),
            lambda: state.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod_id)),
            lambda: state.remove_pod_sandbox(
                cri.RemovePodSandboxRequest(pod_sandbox_id=state.containers[seeded[4]].pod_sandbox_id)
            ),
        ]
        for change in changes:
            change()
            self._assert_same_bytes(state)

    def test_unknown_ids_fail_the_same(self) -> None:
        state = RuntimeState()
        with pytest.raises(CriError) as sandbox:
            state.pod_sandbox_status_encoded(cri.PodSandboxStatusRequest(pod_sandbox_id="nope"))
        with pytest.raises(CriError) as container:
            state.container_status_encoded(cri.ContainerStatusRequest(container_id="nope"))

        assert (Code.NOT_FOUND, Code.NOT_FOUND) == (sandbox.value.code, container.value.code)

    def test_seeding_reads_the_clock_as_before(self) -> None:
        """Preparing the encodings reads no clock: timestamps stay those of one reading per seeded pod."""
        state = RuntimeState(clock=stepping_clock(start=0, step=1))
        state.seed(2, 2)
        pod_id = state.run_pod_sandbox(
            cri.RunPodSandboxRequest(config=cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="x")))
        ).pod_sandbox_id

        assert [0, 1, 2] == [s.created_at for s in state.sandboxes.values()]
        assert pod_id == list(state.sandboxes)[-1]
