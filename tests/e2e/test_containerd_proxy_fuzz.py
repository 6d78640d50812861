"""A differential fuzzer through krproxy: generated CRI call sequences with mutated requests (a field of
the wrong wire type, a field twice, truncation, invalid UTF-8, a 1 MiB id, id prefixes and other id
forms, odd ``:path`` spellings) sent straight to real containerd and through ``krproxy serve`` in front
of the same containerd, in lockstep; the status code and the resulting state (the run's pods and
containers, their states) must be the same both ways. Through krproxy three ways: no hook server, a hook
server that changes nothing (``tests/e2e/plugin_process.py``, every hook), and the fake plugin
(``python -m krproxy.fakes.plugin``, which adds an annotation). With the first hook server, every call
the runtime accepted at a Pre hook point must also have reached the hook server: a call that passed a
hook point unhooked is a difference too.

Every difference fails unless it is one of :data:`KNOWN`, each listed with its reason in docs/testing.md
("krproxy against containerd direct"); an accepted difference that left the two sides apart ends its
sequence (``differential.run``). It runs in the e2e matrix, bounded for CI: four explicit sequences (a
slash-less RunPodSandbox; StartContainer and UpdateContainerResources by prefix; a RemovePodSandbox whose
id is not valid UTF-8; a 1 MiB id, then a call on the same connection) and ``examples(10)`` generated ones
of up to 12 steps per way, seeded; ``KRPROXY_FUZZ_EXAMPLES=N`` runs N per way.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from hypothesis import Phase, example, given, seed, settings

from tests.e2e import differential
from tests.e2e.differential import MUTATIONS, SPELLINGS, START, Difference, Ref, Side, Step
from tests.e2e.support import (
    REPO,
    Containerd,
    Cri,
    Plugin,
    Proxy,
    serving_proxy,
    sigterm,
    start_plugin,
    wait_registered,
)
from tests.fuzz import examples

DOCS = REPO / "docs" / "testing.md"
#: The Pre hook each verb reaches when the runtime accepts it.
PRE_HOOKS = {
    "run": "PreRunPodSandbox",
    "create": "PreCreateContainer",
    "start": "PreStartContainer",
    "update": "PreUpdateContainerResources",
}


def _slashless(d: Difference) -> bool:
    return d.step.spelling == "slashless" and d.second.code == "UNIMPLEMENTED"


def _gogo_wire_type(d: Difference) -> bool:
    # only while what krproxy forwarded was refused too: a call accepted through krproxy alone is no such case
    return (
        d.step.mutation == "wrong_wire_type"
        and d.first.code == "INTERNAL"
        and "wrong wireType" in d.first.message
        and d.second.code not in ("OK", "INTERNAL")
    )


def _gogo_utf8(d: Difference) -> bool:
    return (
        d.step.mutation == "invalid_utf8" and d.second.code == "INTERNAL" and d.first.state == d.second.state
    )


def _ambiguous_in_runtime(d: Difference) -> bool:
    return (
        d.step.ref is not None
        and d.step.ref.form in ("prefix", "ambiguous")
        and d.first.code == "UNKNOWN"
        and "multiple ids" in d.first.message.lower()
    )


#: The accepted differences, each a place krproxy reads a request otherwise than one runtime, on purpose
#: (docs/security.md's one-reading rule), with its reason; docs/testing.md lists each with the test that
#: holds krproxy's side of it.
KNOWN: tuple[differential.Known, ...] = (
    differential.Known(
        "slashless-path",
        _slashless,
        "krproxy refuses a slash-less :path UNIMPLEMENTED, as grpc-go 1.79.3 does, where the grpc-go of "
        "1.6 and 1.7 routes it (CVE-2026-33186)",
    ),
    differential.Known(
        "gogo-wire-type",
        _gogo_wire_type,
        "gogo (1.6, 1.7, 2.1) refuses a known field of another wire type, krproxy reads it as Go's "
        "protobuf APIv2 (2.3) does: an unknown field, dropped; the runtime refuses what krproxy forwards",
    ),
    differential.Known(
        "gogo-utf8",
        _gogo_utf8,
        "gogo (1.6, 1.7, 2.1) reads a string that is not UTF-8, krproxy refuses it as Go's protobuf "
        "APIv2 (2.3) does (INTERNAL); the runtime's answer changed nothing",
    ),
    differential.Known(
        "ambiguous-in-runtime",
        _ambiguous_in_runtime,
        "a prefix unique in krproxy's store and shared on the runtime with an object made around krproxy "
        "names the stored object, whose hooks ran; the runtime alone finds it ambiguous",
    ),
)


@attrs.define
class HookCounter:
    """Counts the echo plugin's calls per hook, to tell which steps reached it."""

    plugin: Plugin
    seen: dict[str, int] = attrs.field(factory=dict)

    def reset(self) -> None:
        self.seen = {hook: len(self.plugin.calls(hook)) for hook in PRE_HOOKS.values()}

    def __call__(self, step: Step, code: str) -> str | None:
        hook = PRE_HOOKS.get(step.verb)
        before = dict(self.seen)
        self.reset()
        if hook is None or code != "OK":
            return None
        if self.seen[hook] == before[hook]:
            return f"the runtime accepted it and {hook} was not called"
        return None


@pytest.fixture(scope="module")
def proxied(containerd: Containerd) -> Iterator[Proxy]:
    """One ``krproxy serve`` in front of containerd for the whole module (hook servers come and go)."""
    workdir = Path(tempfile.mkdtemp(prefix="kpfz-", dir="/tmp"))  # short: socket paths hold 108 bytes
    try:
        with serving_proxy(workdir, containerd.socket) as daemon:
            yield daemon
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def way(request: pytest.FixtureRequest, proxied: Proxy) -> Iterator[HookCounter | None]:
    """The hook servers registered for this way: none, the echo plugin (counted), or the fake plugin."""
    kind = request.param
    if kind == "none":
        yield None
        return
    if kind == "echo":
        plugin = start_plugin(proxied, "fuzz-echo")
        try:
            counter = HookCounter(plugin)
            yield counter
        finally:
            (proxied.hook_dir / "fuzz-echo.json").unlink(missing_ok=True)
            assert 0 == plugin.stop()
        return
    socket = str(proxied.hook_dir.parent / "fuzz-fake.sock")
    log = open(proxied.hook_dir.parent / "fuzz-fake.log", "wb")  # noqa: SIM115 - closed at teardown
    process = subprocess.Popen(
        [
            *(
                sys.executable,
                "-m",
                "krproxy.fakes.plugin",
                "--socket",
                socket,
                "--hook-dir",
                str(proxied.hook_dir),
            ),
            *("--name", "fuzz-fake", "--add-annotation", "krproxy-fuzz=seen"),
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        cwd=REPO,
    )
    try:
        wait_registered(proxied, "fuzz-fake", limit=30)
        yield None
    finally:
        code = sigterm(process, 10, lambda: "fake plugin ignored SIGTERM")
        log.close()
    assert 0 == code


@pytest.fixture(scope="module")
def sides(containerd: Containerd, proxied: Proxy) -> Iterator[tuple[Side, Side]]:
    with Cri.connect(containerd.socket) as direct, Cri.connect(proxied.socket) as via:
        yield (
            Side(direct, containerd.busybox, "d", cgroup_parent=containerd.cgroup_parent),
            Side(via, containerd.busybox, "k", cgroup_parent=containerd.cgroup_parent),
        )


@pytest.mark.parametrize("way", ["none", "echo", "fake_plugin"], indirect=True)
def test_proxy_answers_as_containerd_direct(sides: tuple[Side, Side], way: HookCounter | None) -> None:
    """Each step's status code and resulting state are the same straight to containerd and through
    krproxy; with the echo hook server, each call the runtime accepted at a Pre hook point reached it.
    All sequences run; the failure lists each kind of difference found, with the first sequence showing it."""
    found: list[tuple[list[Step], Difference]] = []

    @seed(6)
    @settings(
        max_examples=examples(10), deadline=None, phases=(Phase.explicit, Phase.generate), database=None
    )
    @given(sequence=differential.sequences(mutations=MUTATIONS, spellings=SPELLINGS))
    @example(sequence=[Step("run", spelling="slashless")])
    @example(sequence=[*START, Step("remove_pod", Ref("pod", 0, "unknown"), mutation="invalid_utf8")])
    @example(
        sequence=[*START, Step("start", Ref("ctr", 0, "prefix")), Step("update", Ref("ctr", 0, "prefix"))]
    )
    @example(
        sequence=[
            *START,
            Step("status", Ref("ctr", 0, "full"), mutation="huge"),
            Step("start", Ref("ctr", 0, "full")),
        ]
    )
    def explore(sequence: list[Step]) -> None:
        if way is not None:
            way.reset()
        differences = differential.run(sequence, sides, uuid.uuid4().hex[:10], hook_check=way, known=KNOWN)
        found.extend((sequence, d) for d in differential.unexplained(differences, KNOWN))

    explore()
    assert not found, differential.summary(found, ("containerd", "krproxy"))


def test_every_known_difference_is_documented() -> None:
    """docs/testing.md says what :data:`KNOWN` holds: each accepted difference by id and reason, or none."""
    docs = DOCS.read_text()
    missing = differential.undocumented("test_containerd_proxy_fuzz.py", KNOWN, docs)
    assert not missing, missing
    rows = [line for line in docs.splitlines() if any(line.startswith(f"  | `{k.id}` |") for k in KNOWN)]
    assert len(rows) == len(KNOWN), rows
    for row in rows:  # each names the tests that hold krproxy's side: they must exist
        for path, name in re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", row):
            text = (REPO / path).read_text()
            assert name == "" or f"def {name}(" in text, (
                f"{path}::{name} named in docs/testing.md: no such test"
            )
