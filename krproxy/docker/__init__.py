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

from krproxy.docker.server import DockerDaemon as DockerDaemon
from krproxy.docker.server import DockerProxy as DockerProxy
from krproxy.docker.server import serve as serve

__all__ = ["DockerDaemon", "DockerProxy", "serve"]
