"""The fake containerd's pure core, no sockets: lookups and lists, ExecSync, images and events."""

from __future__ import annotations

import re

import pytest

from krproxy.fakes.containerd.records import (
    Code,
    ExecResult,
    normalize_image_name,
)
from krproxy.proto.runtime import v1 as cri
from tests.unit.test_fake_containerd_state import (
    CS,
    EV,
    SS,
    container_in,
    create,
    error_code,
    new_state,
    remove,
    run_pod,
    running,
    start,
    status,
    stop,
)


class TestLookupsAndLists:
    def test_ids_are_64_hex_and_deterministic(self) -> None:
        """Two states with the default generator hand out the same 64-hex IDs."""
        a, b = new_state(), new_state()
        ids = [run_pod(a), run_pod(b)]
        assert ids[0] == ids[1]
        assert re.fullmatch(r"[0-9a-f]{64}", ids[0])

    def test_prefix_lookup(self) -> None:
        """A unique ID prefix finds the container; an unknown prefix is NOT_FOUND."""
        s, ctr = container_in(CS.CONTAINER_CREATED)
        assert ctr == status(s, ctr[:8]).id
        assert Code.NOT_FOUND == error_code(lambda: status(s, "zz"))

    def test_container_filters(self) -> None:
        """Filters on id prefix, pod, state and labels combine with AND."""
        s = new_state()
        web, db = run_pod(s, "web"), run_pod(s, "db")
        a, b = create(s, web, "a"), create(s, db, "b")
        start(s, b)

        def ids(**kw: object) -> set[str]:
            flt = cri.ContainerFilter(**kw)  # type: ignore[arg-type]
            return {c.id for c in s.list_containers(cri.ListContainersRequest(filter=flt)).containers}

        running = cri.ContainerStateValue(state=CS.CONTAINER_RUNNING)
        assert [{a, b}, {a}, {b}, {b}, set(), {a}] == [
            ids(),
            ids(id=a[:10]),
            ids(pod_sandbox_id=db),
            ids(state=running),
            ids(state=running, label_selector={"name": "a"}),
            ids(pod_sandbox_id=web[:10]),
        ]

    def test_sandbox_filters(self) -> None:
        """ListPodSandbox filters on state and labels."""
        s = new_state()
        web, db = run_pod(s, "web", tier="front"), run_pod(s, "db")
        s.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id=db))

        def ids(**kw: object) -> set[str]:
            flt = cri.PodSandboxFilter(**kw)  # type: ignore[arg-type]
            return {p.id for p in s.list_pod_sandbox(cri.ListPodSandboxRequest(filter=flt)).items}

        assert [{web, db}, {db}, {web}, {web}] == [
            ids(),
            ids(state=cri.PodSandboxStateValue(state=SS.SANDBOX_NOTREADY)),
            ids(label_selector={"tier": "front"}),
            ids(id=web),
        ]

    def test_resources_round_trip(self) -> None:
        """ContainerStatus reports the resources from create, then from the last update."""
        s, ctr = container_in(CS.CONTAINER_RUNNING)
        before = status(s, ctr).resources
        s.update_container_resources(
            cri.UpdateContainerResourcesRequest(
                container_id=ctr, linux=cri.LinuxContainerResources(cpu_shares=2048, cpuset_cpus="0-1")
            )
        )
        after = status(s, ctr).resources
        assert before is not None and before.linux is not None
        assert after is not None and after.linux is not None
        assert (512, 2048, "0-1") == (
            before.linux.cpu_shares,
            after.linux.cpu_shares,
            after.linux.cpuset_cpus,
        )

    def test_seed(self) -> None:
        """seed() adds READY pods with RUNNING containers carrying 6 labels and 6 annotations."""
        s = new_state()
        ids = s.seed(pods=10, containers_per_pod=2)
        containers = s.list_containers(cri.ListContainersRequest()).containers
        assert (20, 10, sorted(ids)) == (len(containers), len(s.sandboxes), sorted(c.id for c in containers))
        assert {(CS.CONTAINER_RUNNING, 6, 6)} == {
            (c.state, len(c.labels), len(c.annotations)) for c in containers
        }
        assert [] == s.take_events()


class TestExecSync:
    def test_default_echoes(self) -> None:
        """Without a script, exec exits 0 and echoes the command line."""
        s, ctr = container_in(CS.CONTAINER_RUNNING)
        reply = s.exec_sync(cri.ExecSyncRequest(container_id=ctr, cmd=["ls", "-l"]))
        assert (0, b"ls -l", b"") == (reply.exit_code, reply.stdout, reply.stderr)

    def test_scripted(self) -> None:
        """A scripted command answers its scripted result."""
        s, ctr = container_in(CS.CONTAINER_RUNNING)
        s.script_exec(["false"], ExecResult(exit_code=1, stderr=b"nope"))
        reply = s.exec_sync(cri.ExecSyncRequest(container_id=ctr, cmd=["false"]))
        assert (1, b"", b"nope") == (reply.exit_code, reply.stdout, reply.stderr)

    def test_not_running(self) -> None:
        """Exec in a container that is not running is UNKNOWN."""
        s, ctr = container_in(CS.CONTAINER_EXITED)
        assert Code.UNKNOWN == error_code(
            lambda: s.exec_sync(cri.ExecSyncRequest(container_id=ctr, cmd=["ls"]))
        )


class TestImages:
    @pytest.mark.parametrize(
        ("name", "expected"),
        [
            ("busybox", "docker.io/library/busybox:latest"),
            ("busybox:1.36", "docker.io/library/busybox:1.36"),
            ("library/nginx", "docker.io/library/nginx:latest"),
            ("quay.io/x/y", "quay.io/x/y:latest"),
            ("localhost:5000/y:2", "localhost:5000/y:2"),
            ("registry.k8s.io/pause:3.9", "registry.k8s.io/pause:3.9"),
        ],
    )
    def test_normalize(self, name: str, expected: str) -> None:
        """Short image names expand the way containerd expands them."""
        assert expected == normalize_image_name(name)

    def test_pull_status_remove(self) -> None:
        """Pull records a deterministic image; status finds it by short name; remove forgets it."""
        s = new_state()
        ref = s.pull_image(cri.PullImageRequest(image=cri.ImageSpec(image="busybox"))).image_ref
        found = s.image_status(cri.ImageStatusRequest(image=cri.ImageSpec(image="docker.io/library/busybox")))
        s.remove_image(cri.RemoveImageRequest(image=cri.ImageSpec(image=ref)))
        gone = s.image_status(cri.ImageStatusRequest(image=cri.ImageSpec(image="busybox")))
        assert found.image is not None
        assert (ref, None) == (found.image.id, gone.image)
        assert (
            ref
            == new_state().pull_image(cri.PullImageRequest(image=cri.ImageSpec(image="busybox"))).image_ref
        )

    def test_missing_image(self) -> None:
        """Status of a missing image is empty and removing it succeeds."""
        s = new_state()
        s.remove_image(cri.RemoveImageRequest(image=cri.ImageSpec(image="nope")))
        assert cri.ImageStatusResponse() == s.image_status(
            cri.ImageStatusRequest(image=cri.ImageSpec(image="nope"))
        )

    def test_create_requires_pull_when_strict(self) -> None:
        """With require_pulled_images, creating from an image nobody pulled is NOT_FOUND."""
        s = new_state(require_pulled_images=True)
        pod = run_pod(s)
        assert Code.NOT_FOUND == error_code(lambda: create(s, pod))


class TestEvents:
    def test_lifecycle_events(self) -> None:
        """A pod and container lifecycle yields the events containerd sends, in order."""
        s = new_state()
        pod, ctr = running(s)
        stop(s, ctr)
        remove(s, ctr)
        s.remove_pod_sandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod))
        events = s.take_events()
        assert [
            (pod, EV.CONTAINER_CREATED_EVENT),
            (pod, EV.CONTAINER_STARTED_EVENT),
            (ctr, EV.CONTAINER_CREATED_EVENT),
            (ctr, EV.CONTAINER_STARTED_EVENT),
            (ctr, EV.CONTAINER_STOPPED_EVENT),
            (ctr, EV.CONTAINER_DELETED_EVENT),
            (pod, EV.CONTAINER_STOPPED_EVENT),
            (pod, EV.CONTAINER_DELETED_EVENT),
        ] == [(e.container_id, e.container_event_type) for e in events]
        assert [] == s.take_events()

    def test_event_carries_statuses(self) -> None:
        """An event carries the pod status and the pod's container statuses at that moment."""
        s = new_state()
        pod, ctr = running(s)
        event = s.take_events()[-1]
        assert event.pod_sandbox_status is not None
        assert (pod, [(ctr, CS.CONTAINER_RUNNING)]) == (
            event.pod_sandbox_status.id,
            [(c.id, c.state) for c in event.containers_statuses],
        )
