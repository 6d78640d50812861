"""Unix socket files: binding one safely, and naming one as an endpoint.

Used by the daemon (its CRI or Docker socket) and by :class:`krproxy.rpc.Server` (the SDK's hook
server, ``trace serve``, the fakes); imports nothing but the standard library and :mod:`krproxy.log`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import sys

from krproxy import log

__all__ = ["SocketInUseError", "bind_unix_socket", "strip_unix_scheme", "unlink_if_ours", "unreachable"]

LOGGER = logging.getLogger("krproxy.grpc")
_IN_USE = "another process is listening on this socket"
#: ``sizeof(sockaddr_un.sun_path)`` on Linux, the terminating NUL included.
_SUN_PATH_SIZE = 108


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
            raise SocketInUseError(errno.EADDRINUSE, _IN_USE, path)
        finally:
            probe.close()
    if (
        len(os.fsencode(path)) >= _SUN_PATH_SIZE
    ):  # checked first: linking the bound socket there would not catch it
        raise OSError(
            errno.ENAMETOOLONG, f"too long for a unix socket (at most {_SUN_PATH_SIZE - 1} bytes)", path
        )
    created = _make_parents(path)
    # Bound under a temporary name and linked into place once listening, so the file at
    # ``path`` is never a socket that refuses connections: a client that polls for the file
    # (kubelet, a test) and then connects does not race our listen(). The temporary name is
    # no longer than ``path``, so any path that fits a unix socket address works.
    temporary = _temporary_name(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.bind(temporary)
        except OSError as err:
            if err.filename is None:  # bind's own errors name no path ("AF_UNIX path too long")
                raise OSError(err.errno, err.strerror or str(err), path) from None
            raise
        try:
            os.chmod(temporary, mode)  # before listen(): nobody can connect in between
            if gid is not None:
                os.chown(temporary, -1, gid)
            sock.listen(128)
            if temporary != path:
                try:  # a link, not a rename: it fails if another process took the path meanwhile
                    os.link(temporary, path)
                except FileExistsError:
                    raise SocketInUseError(errno.EADDRINUSE, _IN_USE, path) from None
                finally:
                    os.unlink(temporary)
        except BaseException:
            if temporary != path:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
            raise
    except BaseException:
        sock.close()
        for directory in reversed(created):  # leave nothing behind that we made
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise
    return sock


def _temporary_name(path: str) -> str:
    """A name beside ``path`` for binding before the rename: ``.<pid>`` in the same directory,
    or ``path`` itself when that would be longer (a name too short to hold the pid)."""
    temporary = os.path.join(os.path.dirname(path), f".{os.getpid()}")
    return temporary if len(temporary) <= len(path) else path


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


def unreachable(path: str, timeout: float = 5.0) -> str | None:
    """Why nothing accepts a connection on the unix socket ``path`` (the error's words, or what
    ``path`` is when it is no socket), or None when something does. The probe connection is closed at
    once, before any byte is sent."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(path)
        except OSError as err:
            kind = not_a_socket(path)
            return f"not a socket but {kind}" if kind else err.strerror or str(err)
    return None


def not_a_socket(path: str) -> str | None:
    """What ``path`` is when it exists and is no socket ("a directory"), else None."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISSOCK(mode):
        return None
    return (
        "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "a special file"
    )


def unlink_if_ours(path: str, inode: int) -> None:
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


def print_socket_errors(errors: list[BaseException], prefix: str) -> None:
    """Print each OS error of a command that could not serve on its ``--socket`` as one line on stderr,
    ``PREFIX: ERROR``, with what to do about a socket another process listens on."""
    for error in errors:
        hint = (
            "; stop that process first, or choose another --socket"
            if isinstance(error, SocketInUseError)
            else ""
        )
        print(f"{prefix}: {error}{hint}", file=sys.stderr)
