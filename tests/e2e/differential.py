"""Differential runs for the e2e tests: one CRI call sequence sent to two runtimes in lockstep, compared
step by step on the status code and on the resulting state (the run's pods and containers and their
states).

A sequence is made of :class:`Step` values that name objects symbolically (:class:`Ref`: the n-th pod or
container this sequence created, in a *form*: full id, 12-character prefix, empty, unknown, other case,
an ambiguous prefix), so that each side resolves them against its own ids. Each :class:`Side` is a CRI
socket with a name tag (two sides may share one containerd: their objects' names differ by the tag,
and states are compared with the tag taken out). :func:`run` plays a sequence on both sides and returns
every :class:`Difference`; the tests hold them to their lists of known differences (docs/testing.md).

Steps may carry a wire *mutation* of the request (:data:`MUTATIONS`) and a *spelling* of its
``:path`` (:data:`SPELLINGS`): the proxy fuzzer's (``test_containerd_proxy_fuzz.py``).

Blocking code (grpcio), as every e2e helper.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import attrs
import grpc
from cri_api.v1 import api_pb2 as pb
from hypothesis import strategies as st

from krproxy.protowire import DecodeError, fields, varint
from tests.e2e.support import LOOP, Cri

SERVICE = "runtime.v1.RuntimeService"

#: How long two sides' states may take to agree after a step. containerd 2.x answers StopPodSandbox
#: before its CRI store marks the pod NOTREADY (its sandbox exit monitor does that a moment later): a
#: ListPodSandbox straight after the OK said READY for 3 of 80 pods on 2.1.9, 0 of 40 on 1.6.20 and
#: 1.7.24, which wait for the exit before answering (CI's run of stop 42 failed on one). A state that
#: still differs after this long is a difference.
SETTLE = 10.0
#: Verbs acting on a container (``Ref.kind`` "ctr") and on a pod ("pod"); "run" and "create" make them.
CONTAINER_VERBS = ("start", "stop", "remove", "status", "exec", "update", "list")
POD_VERBS = ("stop_pod", "remove_pod", "pod_status", "list_pods", "update_pod")
#: How a step names its object (see :class:`Ref`).
FORMS = ("full", "full", "full", "prefix", "prefix", "empty", "unknown", "upper", "ambiguous")
#: Wire mutations of a request (:func:`mutate`), and ``:path`` spellings (:func:`spell`).
MUTATIONS = ("none", "wrong_wire_type", "duplicate", "truncate", "invalid_utf8", "huge")
SPELLINGS = ("canonical", "slashless", "double_slash", "trailing_slash", "query", "lower_case")
#: A huge string: a 1 MiB id (containerd echoes it in its error message).
HUGE = 1 << 20


@attrs.frozen
class Ref:
    """The ``index``-th (modulo) pod or container (``kind``) the sequence created, named in ``form``:
    ``full`` id, ``prefix`` (12 characters), ``empty``, ``unknown`` (64 zeros), ``upper`` (the id in upper
    case), ``ambiguous`` (a prefix of it that another live id shares; the step is skipped where there is none)."""

    kind: str
    index: int
    form: str


@attrs.frozen
class Step:
    verb: str
    ref: Ref | None = None
    #: Which name a "run" or "create" uses (equal slots: the same name, which containerd reserves).
    slot: int = 0
    mutation: str = "none"
    spelling: str = "canonical"

    def describe(self) -> str:
        ref = f" {self.ref.kind}[{self.ref.index}]/{self.ref.form}" if self.ref else ""
        slot = f" slot={self.slot}" if self.verb in ("run", "create") else ""
        extra = "".join(f" {x}" for x in (self.mutation, self.spelling) if x not in ("none", "canonical"))
        return f"{self.verb}{ref}{slot}{extra}"


@attrs.frozen
class Outcome:
    """What one side answered to a step (a status code name, "SKIPPED"), and its state afterwards."""

    code: str
    message: str
    state: tuple[tuple[str, ...], ...]


@attrs.frozen
class Difference:
    index: int
    step: Step
    what: str  # "code", "state" or "hook"
    first: Outcome
    second: Outcome

    def describe(self, names: tuple[str, str]) -> str:
        a, b = self.first, self.second
        return (
            f"step {self.index} {self.step.describe()}: {self.what} differs\n"
            f"    {names[0]}: {a.code} {a.message[:160]!r}\n      state {a.state}\n"
            f"    {names[1]}: {b.code} {b.message[:160]!r}\n      state {b.state}"
        )


@attrs.define
class Side:
    """One runtime under test: a CRI client, the image its containers run, a tag its objects' names carry."""

    cri: Cri
    image: str
    tag: str
    cgroup_parent: str = ""
    run: str = ""
    pods: list[str] = attrs.field(factory=list)
    pod_configs: list[pb.PodSandboxConfig] = attrs.field(factory=list)
    ctrs: list[str] = attrs.field(factory=list)

    def start(self, run: str) -> None:
        self.run, self.pods, self.pod_configs, self.ctrs = run, [], [], []

    @property
    def label(self) -> str:
        return f"{self.tag}-{self.run}"

    def pod_config(self, slot: int) -> pb.PodSandboxConfig:
        uid = f"{self.run}{slot:04d}"
        parent = f"/{self.cgroup_parent}/pod-{uid}-{self.tag}" if self.cgroup_parent else ""
        return pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=f"{self.label}-p{slot}", uid=uid, namespace="krproxy-diff"),
            labels={"krproxy-diff": self.label},
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=parent,
                security_context=pb.LinuxSandboxSecurityContext(
                    namespace_options=pb.NamespaceOption(network=pb.NODE)
                ),
            ),
        )

    def resolve(self, ref: Ref) -> str | None:
        """The id ``ref`` names on this side (None: an ambiguous prefix this side cannot form)."""
        ids = self.pods if ref.kind == "pod" else self.ctrs
        if ref.form == "empty":
            return ""
        if ref.form == "unknown" or not ids:
            return "0" * 64
        target = ids[ref.index % len(ids)]
        if ref.form == "full":
            return target
        if ref.form == "prefix":
            return target[:12]
        if ref.form == "upper":
            return target.upper()
        return shared_prefix(target, self.live_ids(ref.kind))

    def live_ids(self, kind: str) -> list[str]:
        """Every id of ``kind`` the runtime holds (all of them: ambiguity is the whole store's)."""
        if kind == "pod":
            return [
                p.id for p in self.cri.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items
            ]
        return [
            c.id for c in self.cri.runtime.ListContainers(pb.ListContainersRequest(), timeout=30).containers
        ]

    def state(self) -> tuple[tuple[str, ...], ...]:
        """This run's pods (name, state) and containers (pod name, name, state), the tag taken out, sorted."""
        selector = {"krproxy-diff": self.label}
        rt = self.cri.runtime
        pods = rt.ListPodSandbox(
            pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(label_selector=selector)), timeout=30
        ).items
        names = {p.id: p.metadata.name.removeprefix(self.label) for p in pods}
        ctrs = rt.ListContainers(
            pb.ListContainersRequest(filter=pb.ContainerFilter(label_selector=selector)), timeout=30
        ).containers
        rows = [("pod", names[p.id], pb.PodSandboxState.Name(p.state)) for p in pods]
        rows += [
            ("ctr", names.get(c.pod_sandbox_id, "?"), c.metadata.name, pb.ContainerState.Name(c.state))
            for c in ctrs
        ]
        return tuple(sorted(rows))

    def clean(self) -> None:
        """Remove this run's pods (their containers go with them)."""
        selector = {"krproxy-diff": self.label}
        rt = self.cri.runtime
        request = pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(label_selector=selector))
        for pod in rt.ListPodSandbox(request, timeout=30).items:
            with contextlib.suppress(grpc.RpcError):
                rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod.id), timeout=60)
            with contextlib.suppress(grpc.RpcError):
                rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id), timeout=60)


def settled(sides: Sequence[Side], limit: float = SETTLE) -> list[tuple[tuple[str, ...], ...]]:
    """Each side's state, read again (every 0.1 s, up to ``limit`` seconds) while the sides disagree:
    a runtime that finishes a transition just after answering (:data:`SETTLE`) is not a difference."""
    deadline = time.monotonic() + limit
    while True:
        states = [side.state() for side in sides]
        if all(state == states[0] for state in states) or time.monotonic() >= deadline:
            return states
        time.sleep(0.1)


def shared_prefix(target: str, live: Sequence[str]) -> str | None:
    """The longest prefix of ``target`` that another live id shares (None if no other id begins as it)."""
    best = 0
    for other in live:
        if other == target:
            continue
        n = 0
        while n < min(len(other), len(target)) and other[n] == target[n]:
            n += 1
        best = max(best, n)
    return target[:best] if best else None


def request(side: Side, step: Step) -> tuple[str, bytes] | None:
    """The method and the encoded request of ``step`` on ``side`` (None: skipped there)."""
    ident = side.resolve(step.ref) if step.ref is not None else ""
    if ident is None:
        return None
    verb = step.verb
    if verb == "run":
        config = side.pod_config(step.slot)
        return "RunPodSandbox", pb.RunPodSandboxRequest(config=config).SerializeToString()
    if verb == "create":
        pods = side.pod_configs
        assert step.ref is not None
        sandbox = pods[step.ref.index % len(pods)] if pods else side.pod_config(0)
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=f"c{step.slot}"),
            image=pb.ImageSpec(image=side.image),
            command=LOOP,
            labels={"krproxy-diff": side.label},
        )
        message = pb.CreateContainerRequest(pod_sandbox_id=ident, config=config, sandbox_config=sandbox)
        return "CreateContainer", message.SerializeToString()
    table: dict[str, tuple[str, Callable[[str], object]]] = {
        "start": ("StartContainer", lambda i: pb.StartContainerRequest(container_id=i)),
        "stop": ("StopContainer", lambda i: pb.StopContainerRequest(container_id=i, timeout=2)),
        "remove": ("RemoveContainer", lambda i: pb.RemoveContainerRequest(container_id=i)),
        "status": ("ContainerStatus", lambda i: pb.ContainerStatusRequest(container_id=i)),
        "exec": ("ExecSync", lambda i: pb.ExecSyncRequest(container_id=i, cmd=["true"], timeout=10)),
        "update": (
            "UpdateContainerResources",
            lambda i: pb.UpdateContainerResourcesRequest(
                container_id=i, linux=pb.LinuxContainerResources(cpu_shares=256)
            ),
        ),
        "list": ("ListContainers", lambda i: pb.ListContainersRequest(filter=pb.ContainerFilter(id=i))),
        "stop_pod": ("StopPodSandbox", lambda i: pb.StopPodSandboxRequest(pod_sandbox_id=i)),
        "remove_pod": ("RemovePodSandbox", lambda i: pb.RemovePodSandboxRequest(pod_sandbox_id=i)),
        "pod_status": ("PodSandboxStatus", lambda i: pb.PodSandboxStatusRequest(pod_sandbox_id=i)),
        "list_pods": ("ListPodSandbox", lambda i: pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(id=i))),
        "update_pod": (
            "UpdatePodSandboxResources",
            lambda i: pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=i),
        ),
    }
    method, build = table[verb]
    return method, build(ident).SerializeToString()  # type: ignore[attr-defined]


def mutate(data: bytes, mutation: str) -> bytes:
    """``data`` (an encoded request) with ``mutation`` applied to its field 1 (the id of an id-carrying
    request, the config of RunPodSandbox): sent as a varint (``wrong_wire_type``), twice (``duplicate``),
    with its last byte cut (``truncate``), its value's last byte 0xff (``invalid_utf8``), or 1 MiB long
    (``huge``). A request without field 1 gets it."""
    if mutation == "none":
        return data
    if mutation == "truncate":
        return data[:-1]
    try:
        parsed = list(fields(data))
    except DecodeError:
        return data
    first = next((value for number, wire, value in parsed if number == 1 and wire == 2), b"")
    assert isinstance(first, bytes)
    rest = b"".join(_field(n, v) for n, w, v in parsed if n != 1 and w == 2 and isinstance(v, bytes))
    rest += b"".join(varint(n << 3) + varint(v) for n, w, v in parsed if w == 0 and isinstance(v, int))
    if mutation == "wrong_wire_type":
        return varint(1 << 3) + varint(1) + rest
    if mutation == "duplicate":
        return _field(1, first) + rest + _field(1, first)
    if mutation == "invalid_utf8":
        return _field(1, (first[:-1] or b"a") + b"\xff") + rest
    if mutation == "huge":
        return _field(1, (first or b"a") * (HUGE // max(1, len(first)) + 1)) + rest
    raise ValueError(f"unknown mutation {mutation!r}")


def _field(number: int, value: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(value)) + value


def spell(method: str, spelling: str) -> str:
    """The ``:path`` of ``method`` spelled as ``spelling`` says."""
    canonical = f"/{SERVICE}/{method}"
    return {
        "canonical": canonical,
        "slashless": canonical[1:],
        "double_slash": "/" + canonical,
        "trailing_slash": canonical + "/",
        "query": canonical + "?x=1",
        "lower_case": canonical.lower(),
    }[spelling]


def play(side: Side, step: Step) -> tuple[str, str, bytes]:
    """Send ``step`` on ``side``: ``(code name, message, reply)``; records the ids "run" and "create" made."""
    built = request(side, step)
    if built is None:
        return "SKIPPED", "", b""
    method, data = built
    call = side.cri.channel.unary_unary(
        spell(method, step.spelling), request_serializer=None, response_deserializer=None
    )
    try:
        reply: bytes = call(mutate(data, step.mutation), timeout=120)
    except grpc.RpcError as err:
        return err.code().name, err.details() or "", b""
    if method == "RunPodSandbox" and step.mutation == "none":
        side.pods.append(pb.RunPodSandboxResponse.FromString(reply).pod_sandbox_id)
        side.pod_configs.append(side.pod_config(step.slot))
    elif method == "CreateContainer" and step.mutation == "none":
        side.ctrs.append(pb.CreateContainerResponse.FromString(reply).container_id)
    return "OK", "", reply


def run(
    steps: Sequence[Step],
    sides: tuple[Side, Side],
    run_id: str,
    *,
    hook_check: Callable[[Step, str], str | None] | None = None,
    known: Sequence[Known] = (),
) -> list[Difference]:
    """Play ``steps`` on both sides in lockstep; every step whose code or resulting state differs.

    ``hook_check(step, code of the second side)`` may name a difference of its own (the proxy fuzzer's:
    a call the runtime accepted that no hook saw). A step one side skips is skipped on both. A difference
    one of ``known`` accepts ends the sequence when it left the sides apart (one side accepted the call,
    or their states differ): what followed would compare two different sets of objects. Both sides'
    objects of the run are removed at the end.
    """
    for side in sides:
        side.start(run_id)
    differences: list[Difference] = []
    try:
        for index, step in enumerate(steps):
            if any(request(side, step) is None for side in sides):
                continue
            answers = [play(side, step) for side in sides]
            outcomes = [
                Outcome(code, message, state)
                for (code, message, _), state in zip(answers, settled(sides), strict=True)
            ]
            first, second = outcomes
            found = None
            if first.code != second.code:
                found = Difference(index, step, "code", first, second)
            elif first.state != second.state:
                found = Difference(index, step, "state", first, second)
            if found is not None:
                differences.append(found)
                apart = "OK" in (first.code, second.code) or first.state != second.state
                if apart and not unexplained([found], known):
                    break
            if hook_check is not None:
                missed = hook_check(step, second.code)
                if missed is not None:
                    differences.append(Difference(index, step, f"hook: {missed}", first, second))
    finally:
        for side in sides:
            side.clean()
    return differences


# --------------------------------------------------------------------------- generated sequences


def _ref(kind: str) -> st.SearchStrategy[Ref]:
    return st.builds(Ref, st.just(kind), st.integers(0, 5), st.sampled_from(FORMS))


def steps(
    *, mutations: Sequence[str] = ("none",), spellings: Sequence[str] = ("canonical",)
) -> st.SearchStrategy[Step]:
    """Any step; with ``mutations``/``spellings`` beyond the defaults, some carry one (one in four)."""
    odd_mutation = st.sampled_from(mutations) if len(mutations) > 1 else st.just("none")
    odd_spelling = st.sampled_from(spellings) if len(spellings) > 1 else st.just("canonical")
    mutation = st.one_of(st.just("none"), st.just("none"), st.just("none"), odd_mutation)
    spelling = st.one_of(st.just("canonical"), st.just("canonical"), st.just("canonical"), odd_spelling)
    return st.one_of(
        st.builds(Step, st.just("run"), st.none(), st.integers(0, 3), mutation, spelling),
        st.builds(Step, st.just("create"), _ref("pod"), st.integers(0, 2), mutation, spelling),
        st.builds(Step, st.sampled_from(CONTAINER_VERBS), _ref("ctr"), st.just(0), mutation, spelling),
        st.builds(Step, st.sampled_from(POD_VERBS), _ref("pod"), st.just(0), mutation, spelling),
    )


#: How every generated sequence begins: a pod and a container in it, so most steps reach an object.
START = (Step("run", None, 0), Step("create", Ref("pod", 0, "full"), 0))


def sequences(max_size: int = 10, **kinds: Sequence[str]) -> st.SearchStrategy[list[Step]]:
    """:data:`START`, then up to ``max_size`` steps."""
    return st.lists(steps(**kinds), min_size=1, max_size=max_size).map(lambda rest: [*START, *rest])


@attrs.frozen
class Known:
    """A difference a differential test accepts: its id, which differences it covers, and why (the
    reason docs/testing.md gives, beside the test that holds it)."""

    id: str
    matches: Callable[[Difference], bool]
    reason: str


def unexplained(differences: Sequence[Difference], known: Sequence[Known]) -> list[Difference]:
    """The differences none of ``known`` accepts."""
    return [d for d in differences if not any(k.matches(d) for k in known)]


def undocumented(test_file: str, known: Sequence[Known], docs: str) -> list[str]:
    """What docs/testing.md (``docs``) lacks about the accepted differences ``known`` of
    ``test_file``: its bullet in "Differential tests" must say "Accepted differences: none" when there
    are none, and name each one's id and reason otherwise."""
    section = docs.partition("## Differential tests")[2].partition("\n## ")[0]
    bullet = next((b for b in section.split("\n- ") if f"`tests/e2e/{test_file}`" in b), None)
    if bullet is None:
        return [f"no bullet for tests/e2e/{test_file}"]
    if not known:
        return (
            []
            if "Accepted differences: none" in bullet
            else ["the bullet lists differences the test has not"]
        )
    return [k.id for k in known if k.id not in section or k.reason not in section]


def kind(difference: Difference) -> str:
    """What a difference is, without the run's particulars: the step's verb, id form, mutation and
    spelling, what differs, and the two codes."""
    step = difference.step
    form = step.ref.form if step.ref else "-"
    codes = f"{difference.first.code} vs {difference.second.code}"
    return f"{step.verb} id={form} mutation={step.mutation} path={step.spelling}: {difference.what} ({codes})"


def summary(found: Sequence[tuple[Sequence[Step], Difference]], names: tuple[str, str]) -> str:
    """Every kind of difference found (:func:`kind`), how often, and the first sequence that showed it."""
    kinds: dict[str, list[tuple[Sequence[Step], Difference]]] = {}
    for sequence, difference in found:
        kinds.setdefault(kind(difference), []).append((sequence, difference))
    lines = [f"{len(found)} differences of {len(kinds)} kinds ({names[0]} vs {names[1]}):"]
    for name, seen in sorted(kinds.items()):
        sequence, first = seen[0]
        lines.append(f"- {name}: {len(seen)}x; first in: " + "; ".join(s.describe() for s in sequence))
        lines.append("  " + first.describe(names).replace("\n", "\n  "))
    return "\n".join(lines)
