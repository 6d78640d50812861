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
    other process. Any other kind of file at ``path`` is an error too. Missing parent
    directories are created, and removed again when binding fails; every error (an
    :class:`OSError`) names ``path``.
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
            raise SocketInUseError(errno.EADDRINUSE, "another process is listening on this socket", path)
        finally:
            probe.close()
    created = _make_parents(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.bind(path)
        except OSError as err:
            if err.filename is None:  # bind's own errors name no path ("AF_UNIX path too long")
                raise OSError(err.errno, err.strerror or str(err), path) from None
            raise
        # Set permissions before listen(): nobody can connect in between.
        os.chmod(path, mode)
        if gid is not None:
            os.chown(path, -1, gid)
        sock.listen(128)
    except BaseException:
        sock.close()
        for directory in reversed(created):  # leave nothing behind that we made
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise
    return sock


def _make_parents(path: str) -> list[str]:
    """Create the missing parent directories of ``path``; returns them, outermost first."""
    missing: list[str] = []
    parent = os.path.dirname(path)
    while parent and not os.path.isdir(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    created: list[str] = []
    try:
        for directory in reversed(missing):
            os.mkdir(directory)
            created.append(directory)
    except OSError:
        for directory in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise
    return created


def unlink_if_ours(path: str, inode: int) -> None:
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass
