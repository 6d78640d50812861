"""What a runtime's NRI version applies of a container adjustment: one reading for the SDK's NRI stub and
``krproxy nri`` alike. Pure and synchronous.

A plugin learns the runtime's NRI at Configure (:meth:`RuntimeNri.configured`): NRI 0.12 says its version;
0.8 to 0.11 say none but send the registration and request timeouts; 0.6.1 (containerd 1.7) sends
neither. An adjustment field newer than the runtime's NRI is dropped unseen (protobuf skips fields it
does not know), and no NRI release passes an env var's removal (``-NAME``) on to the runtime: its
adaptation (``pkg/adaptation`` adjustEnv, 0.6.1 to 0.12 as read; measured on containerd 1.7.24 and 2.1.9)
takes the variable out of what the plugins before set and of what the plugins after see, never out of
the runtime's own env (the pod spec's, the image's). Nor does any apply a plugin's memory swap limit: its
spec generator (``pkg/runtime-tools/generate``, 0.6.1 to 0.12 as read) sets the swap limit to the memory
limit whenever an adjustment sets one, and reads no swap (measured on containerd 1.7.24 and 2.1.9:
``memory.memsw.limit_in_bytes`` is the limit). :meth:`RuntimeNri.not_applied` names each such part of an
adjustment, so that a plugin says it instead of believing it applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from krproxy.nri.records import is_message

__all__ = ["ENV_REMOVAL", "FIELDS_SINCE", "SWAP_IGNORED", "RuntimeNri"]

#: Adjustment fields by the NRI version that brought them (the schema's notes), as dotted paths of
#: ``ContainerAdjustment``: a runtime older than that drops them.
FIELDS_SINCE: Mapping[str, tuple[str, ...]] = {
    "0.8": ("CDI_devices", "linux.oom_score_adj"),
    "0.12": (
        "args",
        "linux.io_priority",
        "linux.seccomp_policy",
        "linux.namespaces",
        "linux.sysctl",
        "linux.net_devices",
        "linux.scheduler",
        "linux.rdt",
        "linux.memory_policy",
    ),
}
#: Why an env var's removal is listed: it reaches the runtime with no NRI version.
ENV_REMOVAL = (
    "NRI passes no env var's removal on to the runtime: it removes only what an NRI plugin before this one "
    "set, and the runtime's own variable stays"
)

#: Why a swap limit is listed: no NRI version applies it.
SWAP_IGNORED = (
    "NRI sets the memory swap limit to the memory limit (when the adjustment sets one) and applies no "
    "plugin's swap"
)


@attrs.frozen
class RuntimeNri:
    """The runtime's NRI as Configure told it.

    Attributes:
        version: Configure's ``NRI_version`` (NRI 0.12 and later; "" before).
        has_0_8: whether the runtime's NRI is 0.8 or later (its Configure carries timeouts; 0.6.1's does not).
    """

    version: str = ""
    has_0_8: bool = True

    @classmethod
    def configured(cls, request: Any) -> RuntimeNri:
        """From a ``ConfigureRequest`` (betterproto2 or upb: the same field names)."""
        version = request.NRI_version
        return cls(version, bool(version) or request.request_timeout > 0 or request.registration_timeout > 0)

    @property
    def has_0_12(self) -> bool:
        return bool(self.version)

    def describe(self) -> str:
        """The version as logs say it: ``v0.12.2``, ``0.8 to 0.11`` or ``before 0.8``."""
        return self.version or ("0.8 to 0.11" if self.has_0_8 else "before 0.8")

    def lacking(self) -> list[str]:
        """The versions of :data:`FIELDS_SINCE` the runtime is older than, oldest first."""
        return [since for since, have in (("0.8", self.has_0_8), ("0.12", self.has_0_12)) if not have]

    def dropped(self, adjust: Any) -> list[str]:
        """The fields ``adjust`` (a ``ContainerAdjustment``) sets that this runtime's NRI does not know."""
        return [field for since in self.lacking() for field in FIELDS_SINCE[since] if _is_set(adjust, field)]

    def not_applied(self, adjust: Any) -> list[tuple[str, str]]:
        """What of ``adjust`` the runtime will not apply, each with why: the fields it does not know
        (``linux.oom_score_adj``), env vars removed (``env[NAME] removed``) and a swap limit
        (``linux.resources.memory.swap``) unless it is the memory limit set with it, which NRI gives."""
        out = []
        dropped = self.dropped(adjust)
        if dropped:
            reason = f"the runtime's NRI ({self.describe()}) is older than {self.lacking()[-1]}: it drops these fields"
            out += [(field, reason) for field in dropped]
        out += [(f"env[{kv.key[1:]}] removed", ENV_REMOVAL) for kv in adjust.env if kv.key.startswith("-")]
        resources = adjust.linux.resources if adjust.linux is not None else None
        memory = resources.memory if resources is not None else None
        if memory is not None and memory.swap is not None:
            limit = memory.limit.value if memory.limit is not None else 0
            if memory.swap.value != limit or not limit:
                out.append(("linux.resources.memory.swap", SWAP_IGNORED))
        return out


def _is_set(message: Any, path: str) -> bool:
    """Whether the dotted field *path* of a betterproto2 message is set (a sub-message, or non-empty)."""
    value = message
    for name in path.split("."):
        if value is None:
            return False
        value = getattr(value, name)
    return is_message(value) or bool(value)
