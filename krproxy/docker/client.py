"""A minimal Docker Engine API client on trio + h11: one request per connection, whole bodies.

Used by store recovery (list, inspect, info) and by tests. Not for streaming or hijacked
endpoints: the proxy relays those itself (:mod:`krproxy.docker.server`).
"""

from __future__ import annotations

import json
from typing import Any

import h11
import trio

from krproxy.docker._http import Headers, Peer, Reply

__all__ = ["DockerError", "get_json", "request"]

#: Largest reply body read: an ``all=1`` container list of a busy node is a few MiB.
MAX_BODY = 64 << 20


class DockerError(Exception):
    """dockerd answered an error status, or something that is not the expected JSON."""


async def request(
    socket_path: str,
    method: str,
    target: str,
    body: bytes = b"",
    *,
    headers: Headers | None = None,
) -> Reply:
    """Send one request to the Docker API at *socket_path* and read the whole reply.

    Raises:
        OSError: the socket cannot be reached.
        h11.RemoteProtocolError: the server broke HTTP/1.1.
        DockerError: the reply body exceeds :data:`MAX_BODY`.
    """
    stream = await trio.open_unix_socket(socket_path)
    async with stream:
        peer = Peer.client(stream)
        sent: Headers = [(b"Host", b"docker"), (b"Content-Length", str(len(body)).encode())]
        await peer.send(h11.Request(method=method, target=target, headers=sent + list(headers or [])))
        if body:
            await peer.send(h11.Data(data=body))
        await peer.send(h11.EndOfMessage())
        response: Any = await peer.next_event()
        while isinstance(response, h11.InformationalResponse):
            response = await peer.next_event()
        if not isinstance(response, h11.Response):
            raise DockerError(f"no response to {method} {target}")
        try:
            content = await peer.read_body(MAX_BODY, f"reply to {method} {target}")
        except h11.RemoteProtocolError as err:
            raise DockerError(str(err)) from None
        if content is None:
            raise DockerError(f"reply to {method} {target} exceeds {MAX_BODY} bytes")
        return Reply(response.status_code, list(response.headers.raw_items()), content, response.reason)


async def get_json(socket_path: str, target: str) -> Any:
    """``GET target`` and decode the JSON answer.

    Raises:
        OSError, h11.RemoteProtocolError: as :func:`request`.
        DockerError: a status other than 200, or a body that is not JSON.
    """
    reply = await request(socket_path, "GET", target)
    if reply.status != 200:
        raise DockerError(f"GET {target}: HTTP {reply.status}: {reply.body[:200]!r}")
    try:
        return json.loads(reply.body)
    except (ValueError, RecursionError) as err:
        raise DockerError(f"GET {target}: not JSON: {err}") from None
