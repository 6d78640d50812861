"""Docker backend mode: krproxy as an HTTP/1.1 proxy between kubelet's dockershim and dockerd.

Layers, pure first:

* :mod:`krproxy.docker.routes` — which requests carry hook points;
* :mod:`krproxy.docker.convert` — Docker JSON ⇄ the hook records (:mod:`krproxy.hooks.model`);
* :mod:`krproxy.docker.hooks` — the hook chains around one intercepted request;
* :mod:`krproxy.docker.recovery` / :mod:`krproxy.docker.client` — rebuilding the store from dockerd;
* :mod:`krproxy.docker.server` — the proxy itself (h11 on trio streams) and the daemon's task tree.

See docs/docker-mode.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from krproxy._lazy import reexport

if TYPE_CHECKING:
    from krproxy.docker.server import DockerDaemon as DockerDaemon
    from krproxy.docker.server import DockerProxy as DockerProxy
    from krproxy.docker.server import serve as serve

# The proxy runs on trio; the pure modules below it (routes, convert) are imported through this
# package without it (tests/integration/test_layers.py).
__all__ = ["DockerDaemon", "DockerProxy", "serve"]
__getattr__ = reexport(__name__, dict.fromkeys(__all__, "server"))
