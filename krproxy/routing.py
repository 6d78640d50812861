"""Which method a call is: one reading of a request's ``:path``, the runtime's.

krproxy decides everything about a call — whether it has hook points, whether required hook
servers hold it — from the method it names. The runtime behind (containerd) decides which method
to run from the same ``:path`` with grpc-go's rules, which differ by version (``server.go``,
``Server.handleStream``):

- grpc-go before 1.79.3 (containerd 1.6.20 and 1.7.24): strips one leading ``/`` *if there is one*,
  splits the rest at its last ``/`` into service and method, and looks both up exactly. So
  ``runtime.v1.RuntimeService/RunPodSandbox`` runs RunPodSandbox (CVE-2026-33186). Every other
  spelling (``//svc/M``, ``/svc/M/``, ``/svc/M?x``, percent-encoding, other case) names no
  registered service or method: UNIMPLEMENTED "unknown service ..." or "unknown method ...".
- grpc-go 1.79.3 and later (containerd 2.1.9): a ``:path`` that does not start with ``/`` is
  refused, UNIMPLEMENTED ``malformed method name: "<path>"`` (the path quoted as Go's ``%q``);
  the rest as before.

So the canonical ``/service/method`` is the only spelling every version routes, the slash-less one
is the only other spelling any version routes to a method, and that is the one krproxy would not
match: :meth:`Routing.refusal` refuses it, whatever the runtime's version, with the answer newer
grpc-go gives; it is never forwarded. Everything else goes on as it came (the runtime answers what
it does not know with UNIMPLEMENTED), except that with required hook servers configured a method
krproxy does not know (one our protos lack: a newer CRI verb, containerd's own API on the same
socket, CRI v1alpha2 on containerd 1.6/1.7) is refused with UNIMPLEMENTED unless the operator lists
it as safe to forward unhooked (``--forward-unhooked-method``): krproxy cannot know whether such a
method creates or changes a workload its hook servers must see. docs/security.md states the rule.

Pure: no event loop, no I/O (the relay asks it on every call it cannot match at once).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from krproxy.grpcstatus import Status, go_quote

__all__ = ["CRI_VERSION", "Refusal", "Routing", "go_quote", "grpc_go_route", "unhooked_path"]

#: The CRI krproxy knows: protos/cri_v1.proto matches cri-api's master of the 1.37 line
#: (KEP-5823's RestorePod and CheckpointPod included); the start-up log names it.
CRI_VERSION = "runtime.v1 of cri-api master (1.37 line)"

#: The service a bare method name given to ``--forward-unhooked-method`` belongs to.
RUNTIME_SERVICE = "runtime.v1.RuntimeService"


@attrs.frozen
class Refusal:
    """The answer krproxy gives a call instead of forwarding it."""

    status: Status
    message: str


def grpc_go_route(path: str, *, strict: bool) -> tuple[str, str] | None:
    """The (service, method) grpc-go looks up for *path*, or None where it answers
    ``malformed method name``: before 1.79.3 (``strict`` False) one leading ``/`` is stripped if
    there is one; from 1.79.3 (``strict``) a path without it is malformed. Either way the rest is
    split at its last ``/``."""
    if path.startswith("/"):
        path = path[1:]
    elif strict:
        return None
    service, slash, method = path.rpartition("/")
    return (service, method) if slash else None


def unhooked_path(name: str) -> str:
    """The method path a ``--forward-unhooked-method`` value names: a full ``/service/method`` as
    given, a bare name (``RestorePod``) as RuntimeService's. Raises ValueError for anything else."""
    if name.startswith("/"):
        route = grpc_go_route(name, strict=True)
        if route is None or not route[0] or not route[1] or "/" in route[0]:
            raise ValueError(f"{name!r} is not a method path /package.Service/Method")
        return name
    if not name or "/" in name or not name.isidentifier():
        raise ValueError(f"{name!r} is neither a method name (RestorePod) nor a path /package.Service/Method")
    return f"/{RUNTIME_SERVICE}/{name}"


@attrs.frozen
class Routing:
    """The rule of which method a call is, and which calls krproxy answers itself (module docstring).

    Attributes:
        known: the method paths of our protos (canonical: ``/runtime.v1.RuntimeService/Version``).
        refuse_unknown: refuse methods not in *known* (required hook servers are configured).
        forward_unhooked: paths forwarded unhooked even so (``--forward-unhooked-method``).
    """

    known: frozenset[str] = frozenset()
    refuse_unknown: bool = False
    forward_unhooked: frozenset[str] = frozenset()

    @classmethod
    def for_cri(cls, *, refuse_unknown: bool = False, forward_unhooked: Iterable[str] = ()) -> Routing:
        """The rule for a CRI front end: *known* is every method of our protos."""
        from krproxy.methods import cri_methods  # the descriptor's table, read once

        allowed = frozenset(unhooked_path(name) for name in forward_unhooked)
        return cls(frozenset(cri_methods()), refuse_unknown, allowed)

    def refusal(self, path: str, raw: bytes | None = None) -> Refusal | None:
        """How krproxy answers a call to *path* itself, or None: the call goes on as *path* names
        it (to its interceptor, or upstream as it came). *raw*: the ``:path`` bytes as received,
        for the message (*path* is their UTF-8 reading, with replacement characters)."""
        if path in self.known:  # the hot path: kubelet's calls are all canonical
            return None
        if not path.startswith("/"):
            # grpc-go < 1.79.3 would route it (CVE-2026-33186) past every interceptor of ours.
            return Refusal(Status.UNIMPLEMENTED, f"malformed method name: {go_quote(raw or path)}")
        if self.refuse_unknown and path not in self.forward_unhooked:
            return Refusal(
                Status.UNIMPLEMENTED,
                f"unknown method {path}: krproxy does not know it, so it cannot run its hooks, and "
                "required hook servers are configured (--forward-unhooked-method lets it through "
                "unhooked)",
            )
        return None
