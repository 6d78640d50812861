"""The fake containerd against the real one: the same generated CRI call sequences (hypothesis, seeded)
sent to ``python -m krproxy.fakes.containerd --imitate V`` and to real containerd V in lockstep; every
difference of status code or resulting state (the run's pods and containers, their states) fails unless
it is one of :data:`KNOWN`, each listed with its reason in docs/testing.md ("The fake against the real
containerd").

Bounded for CI: five explicit sequences (one per rule where versions differ: Stop of an unknown id, a
reserved name, CreateContainer in a stopped pod, an ambiguous prefix, an empty id and pod resize) and
``examples(30)`` generated ones of up to 12 steps (about a minute per version);
``KRPROXY_FUZZ_EXAMPLES=N`` runs N (see tests/fuzz/__init__.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cri_api.v1 import api_pb2 as pb
from hypothesis import Phase, example, given, seed, settings

from tests.e2e import differential
from tests.e2e.differential import START, Difference, Ref, Side, Step
from tests.e2e.support import REPO, Containerd, Cri, sigterm, wait_until
from tests.fuzz import examples

DOCS = REPO / "docs" / "testing.md"


#: The accepted differences: none. Each one found is a rule the fake must learn.
KNOWN: tuple[differential.Known, ...] = ()


def imitated(containerd: Containerd) -> str:
    """The fake's ``--imitate`` for the real runtime: its major.minor ("1.6.20~ds1" -> "1.6")."""
    match = re.match(r"(\d+\.\d+)", containerd.version)
    assert match, containerd.version
    return match.group(1)


@pytest.fixture(scope="module")
def fake_side(containerd: Containerd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Side]:
    """A fake containerd process imitating the real one's version, with the real one's image pulled."""
    version = imitated(containerd)
    workdir = Path(tmp_path_factory.mktemp("fakediff"))
    socket = str(workdir / "fake.sock")
    log = open(workdir / "fake.log", "wb")  # noqa: SIM115 - closed at teardown
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "krproxy.fakes.containerd", "--socket", socket),
            "--imitate",
            version,
            "--require-pulled-images",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        cwd=workdir,
    )
    try:
        wait_until(lambda: os.path.exists(socket) or process.poll() is not None, 30, "fake containerd socket")
        assert process.poll() is None, (workdir / "fake.log").read_text()
        with Cri.connect(socket) as cri:
            cri.image.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=containerd.busybox)), timeout=30)
            yield Side(cri, containerd.busybox, "x")
    finally:
        code = sigterm(process, 10, lambda: "fake containerd ignored SIGTERM")
        log.close()
    assert 0 == code


@pytest.fixture(scope="module")
def real_side(containerd: Containerd) -> Iterator[Side]:
    with Cri.connect(containerd.socket) as cri:
        yield Side(cri, containerd.busybox, "x", cgroup_parent=containerd.cgroup_parent)


def test_fake_answers_as_the_real_containerd(fake_side: Side, real_side: Side) -> None:
    """Every step of each generated sequence has the same status code and leaves the same pods and
    containers, in the same states, on the fake imitating this version as on the real runtime. All
    sequences run; the failure lists each kind of difference found, with the first sequence showing it."""
    found: list[tuple[list[Step], Difference]] = []

    @seed(35)
    @settings(
        max_examples=examples(30), deadline=None, phases=(Phase.explicit, Phase.generate), database=None
    )
    @given(sequence=differential.sequences())
    @example(
        sequence=[*START, Step("stop", Ref("ctr", 0, "unknown")), Step("stop_pod", Ref("pod", 0, "unknown"))]
    )
    @example(
        sequence=[
            *START,
            Step("run"),
            Step("create", Ref("pod", 0, "full")),
            Step("stop_pod", Ref("pod", 0, "full")),
        ]
    )
    @example(
        sequence=[*START, Step("stop_pod", Ref("pod", 0, "prefix")), Step("create", Ref("pod", 0, "full"), 1)]
    )
    @example(sequence=[*START, Step("run", slot=1), Step("remove_pod", Ref("pod", 0, "ambiguous"))])
    @example(
        sequence=[*START, Step("remove", Ref("ctr", 0, "empty")), Step("update_pod", Ref("pod", 0, "full"))]
    )
    def explore(sequence: list[Step]) -> None:
        differences = differential.run(sequence, (fake_side, real_side), uuid.uuid4().hex[:10])
        found.extend((sequence, d) for d in differential.unexplained(differences, KNOWN))

    explore()
    assert not found, differential.summary(found, ("fake", "containerd"))


def test_every_known_difference_is_documented() -> None:
    """docs/testing.md says what :data:`KNOWN` holds: each accepted difference by id and reason, or none."""
    missing = differential.undocumented("test_containerd_fake_differential.py", KNOWN, DOCS.read_text())
    assert not missing, missing
