"""NRI mode: krproxy as a plugin of the runtime's Node Resource Interface (containerd ≥ 1.7).

NRI plugins connect to the runtime's socket (``/var/run/nri/nri.sock`` by default) and are called at pod
and container lifecycle events; they may adjust a container at creation and update resources later,
with no proxy in kubelet's path. NRI speaks ttrpc over a multiplexed socket, which krproxy implements
itself: :mod:`krproxy.nri._ttrpc` (ttrpc, no I/O), :mod:`krproxy.nri._mux` (NRI's multiplexer, no I/O)
and :mod:`krproxy.nri._session` (both on trio). The messages are NRI's ``nri.pkg.api.v1alpha1``
(:mod:`krproxy.proto.nri.pkg.api.v1alpha1`, from our ``protos/nri_v1alpha1.proto``).
"""

from __future__ import annotations

#: NRI's service names, as ttrpc carries them in each request.
PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
#: Where containerd listens for external plugins unless configured otherwise.
DEFAULT_SOCKET = "/var/run/nri/nri.sock"

#: The NRI version krproxy speaks, sent in RegisterPlugin (NRI 0.12's version exchange).
NRI_VERSION = "v0.12.2"

__all__ = ["DEFAULT_SOCKET", "NRI_VERSION", "PLUGIN_SERVICE", "RUNTIME_SERVICE", "check_index", "check_name"]


def check_index(index: str) -> str:
    if len(index) != 2 or not (index.isascii() and index.isdigit()):  # NRI: two bytes, each 0-9
        raise ValueError(f"NRI plugin index must be two digits, 00..99 (got {index!r})")
    return index


def check_name(name: str) -> str:
    if not name or "/" in name:
        raise ValueError(f"NRI plugin name must be non-empty, without '/' (got {name!r})")
    return name
