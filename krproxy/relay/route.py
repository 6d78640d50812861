"""Where calls go: :class:`Route` holds the connection to one upstream socket."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from krproxy import log
from krproxy.relay.connection import RETIRED, STOPPED, Endpoint
from krproxy.unixsock import not_a_socket

if TYPE_CHECKING:
    from krproxy.relay.transport import Transport

__all__ = ["Route", "connect_unix"]

LOGGER = logging.getLogger("krproxy.relay")


class Route:
    """Where one kind of call goes: a runtime socket, a plugin's, a server's; on a transport.

    Holds one upstream connection at a time, opened on first use and again after it was
    lost, so a restarted runtime is picked up by the next call. ``on_state(reachable, error)``
    is told when the runtime answers after being unreachable, and when it cannot be reached.
    """

    def __init__(
        self,
        transport: Transport,
        describe: str,
        connect: Callable[[], socket.socket],
        *,
        on_state: Callable[[bool, str], None] | None = None,
    ) -> None:
        self.transport = transport
        self.describe = describe
        self.connect = connect
        self.on_state = on_state
        self.reachable: bool | None = None
        self.ep: Endpoint | None = None

    def endpoint(self) -> Endpoint:
        """The connection new calls go on; connects first if there is none. Raises OSError."""
        ep = self.ep
        if ep is None or ep.closed or ep.retiring:
            try:
                sock = self.connect()
            except OSError as err:
                self._unreachable(str(err) or type(err).__name__)
                raise
            ep = self.ep = self.transport.open_upstream(sock, self)
        return ep

    def drop(self, ep: Endpoint) -> None:
        if self.ep is ep:
            self.ep = None

    def lost(self, ep: Endpoint, reason: str) -> None:
        self.drop(ep)
        if reason in (RETIRED, STOPPED):
            return
        running = len(ep.halves) + len(ep.waiting)
        if running:
            self._unreachable(reason, calls=running)
        else:  # an idle connection ended: nothing was lost, the next call reconnects
            log.event(LOGGER, "backend_disconnected", backend=self.describe, reason=reason)

    def mark_reachable(self) -> None:
        if self.reachable is not True:
            self.reachable = True
            if self.on_state is not None:
                self.on_state(True, "")

    def _unreachable(self, error: str, calls: int = 0) -> None:
        # A warning once per event: the backend going down, or a connection breaking under calls.
        # While it stays down, each further failed connect (every call, every recovery retry) is
        # a debug line, not a warning per kubelet call.
        news = self.reachable is not False or calls > 0
        self.reachable = False
        if self.on_state is not None:
            self.on_state(False, error)
        log.event(
            LOGGER,
            "backend_unavailable",
            level=logging.WARNING if news else logging.DEBUG,
            backend=self.describe,
            error=error,
            calls=calls,
        )


def connect_unix(path: str) -> Callable[[], socket.socket]:
    """A connect function for :class:`Route`: a non-blocking connection to the socket at ``path``."""

    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
        except BlockingIOError:
            sock.close()  # a unix socket refuses at once when its backlog is full
            raise ConnectionRefusedError(f"{path}: listen backlog full") from None
        except ConnectionRefusedError as err:
            sock.close()
            kind = not_a_socket(path)  # connect() says "Connection refused" for a directory too
            if kind is None:
                raise
            raise ConnectionRefusedError(err.errno, f"not a socket but {kind}", path) from None
        except BaseException:
            sock.close()
            raise
        return sock

    return connect
