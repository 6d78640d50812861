"""Which containerd the fake imitates: the rules that differ between containerd 1.6, 1.7, 2.1 and 2.3.

Every rule here was measured against the real runtime (1.6.20 bookworm, 1.7.24 trixie, 2.1.9 sid on this
project's machines; 2.3.4 outside them, see ``shared/notes/real-containerd.md``) and is held by a test in
``tests/unit/test_fake_containerd_versions.py``; ``tests/e2e/test_containerd_fake_differential.py`` runs the
same call sequences against the fake and the real runtime of each version the machine has.

- **Routing** (grpc-go's ``handleStream``, :func:`route`): a ``:path`` without its leading slash is routed
  to the method by the grpc-go of 1.6 and 1.7 (before 1.79.3, CVE-2026-33186) and refused by 2.x's as a
  malformed method name; ``//svc/M``, ``/svc/M/``, a query, percent-encoding and other case name an
  unknown service or method on every version. A name without any ``/`` is malformed everywhere; the
  grpc-go of 1.6 says so with RESOURCE_EXHAUSTED, later ones with UNIMPLEMENTED.
- **Ids** (containerd's truncindex): a unique prefix names the object, an empty id or an ambiguous prefix
  is UNKNOWN (1.6's message capitalises "Prefix").
- **Stop of an unknown id**: NOT_FOUND on 1.6, OK on 1.7 and later (CRI's idempotent stop).
- **A name already reserved** (RunPodSandbox, CreateContainer): UNKNOWN on 1.6 and 1.7,
  FAILED_PRECONDITION on 2.x.
- **CreateContainer in a stopped pod**: NOT_FOUND "no running task found" on 1.6 and 1.7; 2.x creates it.
- **UpdatePodSandboxResources**: unknown to the CRI server of 1.6 to 2.1 (grpc-go's UNIMPLEMENTED
  "unknown method ..."), answered by 2.3.
"""

from __future__ import annotations

import attrs

from krproxy.fakes.containerd.records import Code
from krproxy.fakes.strict import GrpcGo
from krproxy.grpcstatus import GRPCError, Status


@attrs.frozen
class Imitation:
    """How one containerd version answers where versions differ (see the module docstring).

    Attributes:
        version: the version's short name ("1.6", "1.7", "2.1", "2.3").
        runtime_version: what ``Version`` reports as ``runtime_version``.
        grpc_go: how its grpc-go refuses a request's headers (:class:`krproxy.fakes.strict.GrpcGo`).
        routes_slashless: its grpc-go routes a ``:path`` without the leading slash.
        malformed_status: the status of grpc-go's "malformed method name".
        empty_prefix: truncindex's words for an empty id.
        stop_unknown_ok: StopPodSandbox / StopContainer of an unknown id answer OK (else NOT_FOUND).
        name_conflict: the status of a RunPodSandbox / CreateContainer whose name is reserved.
        create_in_stopped_pod: CreateContainer in a NOTREADY pod creates the container (else NOT_FOUND).
        pod_resize: its CRI server has UpdatePodSandboxResources.
    """

    version: str
    runtime_version: str
    grpc_go: GrpcGo
    routes_slashless: bool
    malformed_status: Status
    empty_prefix: str
    stop_unknown_ok: bool
    name_conflict: Code
    create_in_stopped_pod: bool
    pod_resize: bool


_V1_6 = Imitation(
    version="1.6",
    runtime_version="v1.6.20-fake",
    grpc_go=GrpcGo.V1_6,
    routes_slashless=True,
    malformed_status=Status.RESOURCE_EXHAUSTED,
    empty_prefix="Prefix can't be empty",
    stop_unknown_ok=False,
    name_conflict=Code.UNKNOWN,
    create_in_stopped_pod=False,
    pod_resize=False,
)
_V1_7 = attrs.evolve(
    _V1_6,
    version="1.7",
    runtime_version="v1.7.24-fake",
    grpc_go=GrpcGo.V2,
    malformed_status=Status.UNIMPLEMENTED,
    empty_prefix="prefix can't be empty",
    stop_unknown_ok=True,
)
_V2_1 = attrs.evolve(
    _V1_7,
    version="2.1",
    runtime_version="v2.1.9-fake",
    routes_slashless=False,
    name_conflict=Code.FAILED_PRECONDITION,
    create_in_stopped_pod=True,
)
_V2_3 = attrs.evolve(_V2_1, version="2.3", runtime_version="v2.3.4-fake", pod_resize=True)

#: Every version the fake imitates, by its short name.
IMITATIONS: dict[str, Imitation] = {i.version: i for i in (_V1_6, _V1_7, _V2_1, _V2_3)}
#: What a fake imitates unless told otherwise: containerd 1.6, Debian bookworm's (the e2e matrix's first row).
DEFAULT_VERSION = "1.6"
#: Other names the version is known by (the e2e matrix calls sid's 2.1 "2.x").
_ALIASES = {"2.x": "2.1", "2": "2.1"}


def imitation(version: str | Imitation) -> Imitation:
    """The :class:`Imitation` of ``version`` ("1.6", "1.7", "2.1" or "2.x", "2.3"; an Imitation is kept)."""
    if isinstance(version, Imitation):
        return version
    name = _ALIASES.get(version, version)
    found = IMITATIONS.get(name)
    if found is None:
        raise ValueError(f"no imitation of containerd {version!r}; choose from {', '.join(IMITATIONS)}")
    return found


def route(path: str, methods: dict[str, frozenset[str]], imitated: Imitation) -> tuple[str, str]:
    """``(service, method)`` for a request's ``:path`` as the imitated version's grpc-go routes it, or
    :class:`~krproxy.grpcstatus.GRPCError` with grpc-go's answer. ``methods`` holds each service's methods."""
    name = path
    if name.startswith("/"):
        name = name[1:]
    elif not name or not imitated.routes_slashless:
        raise GRPCError(imitated.malformed_status, f"malformed method name: {_go_quote(path)}")
    service, slash, method = name.rpartition("/")
    if not slash:
        raise GRPCError(imitated.malformed_status, f"malformed method name: {_go_quote(path)}")
    known = methods.get(service)
    if known is None:
        raise GRPCError(Status.UNIMPLEMENTED, f"unknown service {service}")
    if method not in known:
        raise GRPCError(Status.UNIMPLEMENTED, f"unknown method {method} for service {service}")
    return service, method


def _go_quote(text: str) -> str:
    """``text`` as Go's ``%q`` writes a printable string (quotes and backslashes escaped)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


__all__ = ["DEFAULT_VERSION", "IMITATIONS", "Imitation", "imitation", "route"]
