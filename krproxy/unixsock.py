"""Unix socket files: binding one safely, and naming one as an endpoint.

Used by the daemon (its CRI or Docker socket) and by the grpclib servers (through
:mod:`krproxy._grpc`); imports nothing but the standard library and :mod:`krproxy.log`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat

from krproxy import log

__all__ = ["SocketInUseError", "bind_unix_socket", "strip_unix_scheme", "unlink_if_ours"]

LOGGER = logging.getLogger("krproxy.grpc")


class SocketInUseError(OSError):
    """Another process is accepting connections on the socket path we were asked to bind."""


def strip_unix_scheme(endpoint: str) -> str:
    """``unix:///run/x.sock`` and ``/run/x.sock`` both name the socket file ``/run/x.sock``."""
    return endpoint.removeprefix("unix://")


def bind_unix_socket(path: str, *, mode: int = 0o660, gid: int | None = None) -> socket.socket:
    """Bind and listen on a unix socket at ``path``, with ``mode`` (and group ``gid``).

    A socket file nobody listens on (left by a crash) is replaced. A socket somebody
    listens on raises :class:`SocketInUseError`: taking it over silently would cut off the
    other process. Any other kind of file at ``path`` is an error too.
    """
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(errno.EEXIST, "exists and is not a socket", path)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            log.event(LOGGER, "stale_socket_removed", path=path)
            os.unlink(path)
        else:
            raise SocketInUseError(errno.EADDRINUSE, "another process is listening on", path)
        finally:
            probe.close()
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        # Set permissions before listen(): nobody can connect in between.
        os.chmod(path, mode)
        if gid is not None:
            os.chown(path, -1, gid)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def unlink_if_ours(path: str, inode: int) -> None:
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass
