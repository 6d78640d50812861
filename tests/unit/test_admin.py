"""The admin endpoint's pure parts: HTTP request heads, responses, addresses, the status report."""

from __future__ import annotations

from typing import Any

import pytest

from krproxy.admin.client import render_status
from krproxy.admin.server import (
    MAX_HEAD,
    BadRequest,
    Request,
    Response,
    connection,
    parse_head,
    receive,
)
from krproxy.config import is_loopback, parse_address


class TestParseHead:
    def test_complete_head(self) -> None:
        """Request line and headers are parsed; names lower-cased, values stripped; the body is ignored."""
        data = b"GET /metrics?x=1 HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept:  text/plain \r\n\r\nbody"
        expected = Request(
            "GET", "/metrics?x=1", "HTTP/1.1", (("host", "127.0.0.1"), ("accept", "text/plain"))
        )
        assert expected == parse_head(data)

    def test_path_and_header_lookup(self) -> None:
        """The path drops the query; header lookup is case-insensitive and None when absent."""
        request = parse_head(b"HEAD /status?v HTTP/1.0\r\nX-A: 1\r\n\r\n")
        assert request is not None
        assert ("/status", "1", None) == (request.path, request.header("x-a"), request.header("accept"))

    @pytest.mark.parametrize("data", [b"", b"GET / HTTP/1.1\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n\r"])
    def test_incomplete_needs_more(self, data: bytes) -> None:
        """Until the blank line arrives, more data is needed."""
        assert None is parse_head(data)

    def test_a_head_in_pieces(self) -> None:
        """A head arriving a few bytes at a time is parsed once complete (the server's read loop)."""
        conn = connection()
        data = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        seen = [receive(conn, data[i : i + 5]) for i in range(0, len(data), 5)]
        assert [None] * (len(seen) - 1) == seen[:-1]
        assert seen[-1] is not None and "/healthz" == seen[-1].path

    @pytest.mark.parametrize(
        ("data", "status"),
        [
            (b"GET /\r\n\r\n", 400),
            (b"GET  / HTTP/1.1\r\n\r\n", 400),
            (b"G(T / HTTP/1.1\r\n\r\n", 400),
            (b"GET /a b HTTP/1.1\r\n\r\n", 400),
            (b"GET / FTP/1.1\r\n\r\n", 400),
            (b"GET / HTTP/2\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nno colon\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\n: empty\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 without Host
            (b"GET /" + b"a" * MAX_HEAD + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
            (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505),
            (b"GET metrics HTTP/1.1\r\nHost: x\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_HEAD, 431),
        ],
    )
    def test_malformed(self, data: bytes, status: int) -> None:
        """Malformed heads are refused with the status h11 says to answer."""
        with pytest.raises(BadRequest) as info:
            parse_head(data)
        assert status == info.value.status


class TestResponse:
    def _sent(self, response: Response, method: str = "GET") -> bytes:
        conn = connection()
        assert receive(conn, f"{method} / HTTP/1.1\r\nHost: x\r\n\r\n".encode()) is not None
        return response.send(conn, head_only=method == "HEAD")

    def test_send(self) -> None:
        """A response carries its length, content type, Connection: close and extra headers."""
        sent = self._sent(Response(405, b"no\n", headers=(("Allow", "GET, HEAD"),)))
        assert (
            b"HTTP/1.1 405 Method Not Allowed\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Content-Length: 3\r\nConnection: close\r\nCache-Control: no-store\r\nAllow: GET, HEAD\r\n\r\nno\n"
        ) == sent

    def test_head_only_keeps_the_length(self) -> None:
        """For HEAD the body is left out but Content-Length still gives its size."""
        sent = self._sent(Response(200, b"ready\n"), "HEAD")
        assert (True, True) == (sent.endswith(b"\r\n\r\n"), b"Content-Length: 6\r\n" in sent)

    def test_an_error_answer_after_a_bad_head(self) -> None:
        """After h11 refused the head, the 4xx answer can still be sent on the same connection."""
        conn = connection()
        with pytest.raises(BadRequest) as info:
            receive(conn, b"GET / HTTP/1.1\r\nno colon\r\n\r\n")
        sent = Response(info.value.status, b"bad\n").send(conn)
        assert sent.startswith(b"HTTP/1.1 400 Bad Request\r\n") and sent.endswith(b"\r\n\r\nbad\n")


class TestAddress:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("127.0.0.1:9722", ("127.0.0.1", 9722)),
            ("localhost:0", ("localhost", 0)),
            ("[::1]:80", ("::1", 80)),
            (":9722", ("", 9722)),
        ],
    )
    def test_parse(self, text: str, expected: tuple[str, int]) -> None:
        """HOST:PORT, with IPv6 in brackets and an empty host allowed."""
        assert expected == parse_address(text)

    @pytest.mark.parametrize("text", ["9722", "::1:80", "host:http", "host:70000", "host:"])
    def test_parse_errors(self, text: str) -> None:
        """Missing or bad ports and bare IPv6 addresses are errors."""
        with pytest.raises(ValueError):
            parse_address(text)

    @pytest.mark.parametrize(
        ("host", "expected"),
        [
            ("127.0.0.1", True),
            ("127.1.2.3", True),
            ("::1", True),
            ("localhost", True),
            ("", False),
            ("0.0.0.0", False),
            ("10.0.0.1", False),
            ("node1", False),
        ],
    )
    def test_loopback(self, host: str, expected: bool) -> None:
        """Only loopback addresses and 'localhost' count as loopback."""
        assert expected == is_loopback(host)


STATUS: dict[str, Any] = {
    "version": "0.1.0",
    "pid": 42,
    "ready": False,
    "reasons": ["the store is not recovered from the runtime yet"],
    "listening": True,
    "draining": False,
    "listen": "/run/p.sock",
    "uptime_seconds": 3723.5,
    "in_flight": 2,
    "recording": True,
    "backends": [
        {"role": "runtime", "endpoint": "/run/c.sock", "state": "down", "last_error": "[Errno 2] gone"}
    ],
    "store": {"recovered": False, "pods": 0, "containers": 0},
    "hook_dir": "/etc/runtime/hookserver.d",
    "plugins": [
        {
            "name": "koordlet",
            "file": "koordlet.json",
            "endpoint": "/run/k.sock",
            "hooks": ["PreRunPodSandbox", "PreCreateContainer"],
            "failure_policy": "Ignore",
            "timeout": 2.0,
            "order": 0,
            "warnings": ["w1"],
        }
    ],
    "registration_errors": {"bad.json": "bad.json: not valid JSON"},
}


class TestRenderStatus:
    def test_full_report(self) -> None:
        """Every part of the status document appears, one line per fact."""
        assert (
            "krproxy 0.1.0 (pid 42), up 1h2m3s\n"
            "ready: NO — the store is not recovered from the runtime yet\n"
            "listen: /run/p.sock (accepting calls), 2 in flight\n"
            "backend runtime: /run/c.sock — down ([Errno 2] gone)\n"
            "store: 0 pods, 0 containers, NOT recovered\n"
            "recording: on\n"
            "plugins (/etc/runtime/hookserver.d): 1\n"
            "  koordlet: /run/k.sock policy=Ignore timeout=2.0s order=0 hooks: PreRunPodSandbox, PreCreateContainer\n"
            "    warning: w1\n"
            "registration errors: 1\n"
            "  bad.json: not valid JSON\n"
        ) == render_status(STATUS)

    def test_ready_and_quiet(self) -> None:
        """A ready daemon without plugins or errors gives a short report."""
        status = {
            **STATUS,
            "ready": True,
            "reasons": [],
            "plugins": [],
            "registration_errors": {},
            "recording": False,
        }
        text = render_status(status)
        assert ("ready: yes", "plugins (/etc/runtime/hookserver.d): none") == (
            text.splitlines()[1],
            text.splitlines()[-1],
        )

    def test_missing_keys_do_not_crash(self) -> None:
        """A document from another version with keys missing still renders."""
        assert render_status({}).startswith("krproxy ? (pid ?), up 0s\nready: NO — unknown\n")
