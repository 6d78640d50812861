"""krproxy.routing: which method a call is, read as grpc-go reads ``:path``, and what krproxy refuses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from krproxy.grpcstatus import Status
from krproxy.methods import cri_methods
from krproxy.routing import Routing, go_quote, grpc_go_route, unhooked_path

RUN = "/runtime.v1.RuntimeService/RunPodSandbox"
KNOWN = frozenset(cri_methods())


@pytest.mark.parametrize(
    ("path", "old", "new"),
    [
        (RUN, ("runtime.v1.RuntimeService", "RunPodSandbox"), ("runtime.v1.RuntimeService", "RunPodSandbox")),
        (RUN[1:], ("runtime.v1.RuntimeService", "RunPodSandbox"), None),
        (
            "/" + RUN,
            ("/runtime.v1.RuntimeService", "RunPodSandbox"),
            ("/runtime.v1.RuntimeService", "RunPodSandbox"),
        ),
        (
            RUN + "/",
            ("runtime.v1.RuntimeService/RunPodSandbox", ""),
            ("runtime.v1.RuntimeService/RunPodSandbox", ""),
        ),
        (
            RUN + "?x",
            ("runtime.v1.RuntimeService", "RunPodSandbox?x"),
            ("runtime.v1.RuntimeService", "RunPodSandbox?x"),
        ),
        ("/RunPodSandbox", None, None),
        ("//RunPodSandbox", ("", "RunPodSandbox"), ("", "RunPodSandbox")),
        ("RunPodSandbox", None, None),
        ("/", None, None),
    ],
)
def test_grpc_go_route_old_and_new(path: str, old: object, new: object) -> None:
    """(service, method) as grpc-go's handleStream looks them up, before 1.79.3 and from it."""
    assert old == grpc_go_route(path, strict=False)
    assert new == grpc_go_route(path, strict=True)


@given(st.text(max_size=60))
def test_only_canonical_and_slashless_paths_route_to_a_method(path: str) -> None:
    """For any path, old grpc-go routes it to a known method only if it is canonical or the canonical
    path without its slash; krproxy matches the first exactly and refuses the second."""
    routed = grpc_go_route(path, strict=False)
    if routed is None or f"/{routed[0]}/{routed[1]}" not in KNOWN:
        return
    assert path in KNOWN or "/" + path in KNOWN
    refusal = Routing(KNOWN).refusal(path)
    assert (refusal is None) == (path in KNOWN)


def test_canonical_paths_go_on() -> None:
    """Every method of our protos, spelt as kubelet spells it, goes on (to its interceptor or upstream)."""
    routing = Routing.for_cri(refuse_unknown=True)
    assert all(routing.refusal(path) is None for path in KNOWN)
    assert RUN in KNOWN and "/runtime.v1.RuntimeService/RestorePod" in KNOWN


@pytest.mark.parametrize("refuse_unknown", [False, True])
def test_slashless_path_is_refused_as_new_grpc_go(refuse_unknown: bool) -> None:
    """A path without its leading slash gets grpc-go 1.79.3's answer, required servers or not."""
    refusal = Routing.for_cri(refuse_unknown=refuse_unknown).refusal(RUN[1:])
    assert refusal is not None
    assert Status.UNIMPLEMENTED is refusal.status
    assert 'malformed method name: "runtime.v1.RuntimeService/RunPodSandbox"' == refusal.message


def test_slashless_message_quotes_raw_bytes_as_go() -> None:
    """The message quotes the path as received: a byte that is not UTF-8 as \\xNN, as Go's %q."""
    refusal = Routing(KNOWN).refusal("svc/M\ufffd", b"svc/M\xff")
    assert refusal is not None
    assert 'malformed method name: "svc/M\\xff"' == refusal.message


@pytest.mark.parametrize(
    "path",
    [
        "/" + RUN,
        RUN + "/",
        RUN + "?x",
        "/runtime.v1.RuntimeService/RunPod%53andbox",
        "/runtime.v1.RuntimeService/runpodsandbox",
        "/runtime.v1alpha2.RuntimeService/RunPodSandbox",
        "/runtime.v1.RuntimeService/FutureVerb",
    ],
)
def test_unknown_paths_forwarded_unless_required(path: str) -> None:
    """Other spellings and unknown methods go on without required servers; with them, UNIMPLEMENTED."""
    assert Routing.for_cri().refusal(path) is None
    refusal = Routing.for_cri(refuse_unknown=True).refusal(path)
    assert refusal is not None
    assert Status.UNIMPLEMENTED is refusal.status
    assert f"unknown method {path}:" in refusal.message
    assert "--forward-unhooked-method" in refusal.message


def test_forward_unhooked_lets_listed_methods_through() -> None:
    """A method the operator lists goes on under required servers; others stay refused."""
    routing = Routing.for_cri(
        refuse_unknown=True, forward_unhooked=["FutureVerb", "/grpc.health.v1.Health/Check"]
    )
    assert routing.refusal("/runtime.v1.RuntimeService/FutureVerb") is None
    assert routing.refusal("/grpc.health.v1.Health/Check") is None
    assert routing.refusal("/runtime.v1.RuntimeService/OtherVerb") is not None
    assert routing.refusal("runtime.v1.RuntimeService/FutureVerb") is not None  # slash-less: never


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("FutureVerb", "/runtime.v1.RuntimeService/FutureVerb"),
        (
            "/containerd.services.version.v1.Version/Version",
            "/containerd.services.version.v1.Version/Version",
        ),
    ],
)
def test_unhooked_path_reads_names_and_paths(name: str, path: str) -> None:
    assert path == unhooked_path(name)


@pytest.mark.parametrize("name", ["", "a/b", "/svc", "//svc/M", "/svc/M/", "/a/b/c", "Run Pod", "x?"])
def test_unhooked_path_refuses_other_spellings(name: str) -> None:
    with pytest.raises(ValueError, match="method"):
        unhooked_path(name)


@pytest.mark.parametrize(
    ("text", "quoted"),
    [
        ("svc/M", '"svc/M"'),
        ('a"b\\c', '"a\\"b\\\\c"'),
        ("\n\t\x00\x7f", '"\\n\\t\\x00\\x7f"'),
        ("é", '"é"'),
        ("\u00a0\u200b", '"\\u00a0\\u200b"'),
        (b"\xc3", '"\\xc3"'),
        ("\U0001f600", '"\U0001f600"'),
        ("\U000e0001", '"\\U000e0001"'),
    ],
)
def test_go_quote_matches_strconv_quote(text: str | bytes, quoted: str) -> None:
    """Go's strconv.Quote on the same input (values checked against Go's documented escaping)."""
    assert quoted == go_quote(text)
