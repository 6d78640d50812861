"""The admin endpoint of a real daemon, over loopback (127.0.0.1, port 0): metrics, health, readiness, status.

Every HTTP exchange is bounded by ``trio.fail_after``; the client always reads to EOF (the server
answers ``Connection: close``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.daemon import Daemon
from krproxy.fakes.containerd import FakeContainerd, RuntimeState, run_fake_containerd
from tests.conftest import CriClient
from tests.integration.support import LIVENESS_LIMIT, start_proxy, wait_until

LOOPBACK = "127.0.0.1:0"


async def http(address: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw request bytes to ``HOST:PORT``; the status, headers and body of the answer."""
    host, _, port = address.rpartition(":")
    with trio.fail_after(LIVENESS_LIMIT):
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(request)
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    return int(status_line.split(" ")[1]), headers, body


async def get(daemon: Daemon, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    assert daemon.admin_view is not None
    address = daemon.admin_view.address
    return await http(address, f"{method} {path} HTTP/1.1\r\nHost: {address}\r\n\r\n".encode())


async def status(daemon: Daemon) -> dict[str, Any]:
    code, _, body = await get(daemon, "/status")
    assert 200 == code
    document: dict[str, Any] = json.loads(body)
    return document


@pytest.fixture
async def containerd_proxy(
    nursery: trio.Nursery, sockdir: str, fake_containerd: tuple[FakeContainerd, str]
) -> Daemon:
    """The proxy in front of the fake containerd, with the admin endpoint on loopback, store recovered."""
    _, path = fake_containerd
    daemon = await start_proxy(nursery, sockdir, runtime_endpoint=path, metrics_address=LOOPBACK)
    await wait_until(lambda: daemon.hooks.recovered)
    return daemon


class TestMetrics:
    async def test_counters_show_calls_made(
        self, containerd_proxy: Daemon, sockdir: str, cri_client: Callable[[str], CriClient]
    ) -> None:
        """After three Version calls and one failing call, /metrics counts them by method and code."""
        client = cri_client(os.path.join(sockdir, "proxy.sock"))
        for _ in range(3):
            await client.call(client.runtime.Version, api_pb2.VersionRequest())
        with pytest.raises(Exception, match=r"NOT_FOUND|not found"):
            await client.call(
                client.runtime.ContainerStatus, api_pb2.ContainerStatusRequest(container_id="nope")
            )

        code, headers, body = await get(containerd_proxy, "/metrics")

        text = body.decode()
        assert 200 == code
        assert headers["content-type"].startswith("text/plain")
        assert 'krproxy_calls_total{code="OK",method="Version"} 3.0' in text
        assert 'krproxy_calls_total{code="NOT_FOUND",method="ContainerStatus"} 1.0' in text
        assert 'krproxy_call_seconds_count{method="Version"} 3.0' in text
        assert 'krproxy_backend_seconds_count{method="Version"} 3.0' in text
        runtime = containerd_proxy.config.runtime_endpoint
        assert f'krproxy_backend_up{{endpoint="{runtime}",role="runtime"}} 1.0' in text
        assert "krproxy_ready 1.0" in text
        assert "krproxy_store_recovered 1.0" in text
        assert "krproxy_recording 0.0" in text
        assert 'krproxy_build_info{version="' in text

    async def test_openmetrics_on_request(self, containerd_proxy: Daemon) -> None:
        """A scraper asking for OpenMetrics gets it, terminated by # EOF."""
        assert containerd_proxy.admin_view is not None
        address = containerd_proxy.admin_view.address
        request = (
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text; version=1.0.0\r\n\r\n"
        )

        code, headers, body = await http(address, request)

        assert (200, True, True) == (
            code,
            headers["content-type"].startswith("application/openmetrics-text"),
            body.endswith(b"# EOF\n"),
        )


class TestEndpoints:
    async def test_healthz_and_readyz(self, containerd_proxy: Daemon) -> None:
        """A recovered, listening proxy is alive and ready."""
        assert [(200, b"ok\n"), (200, b"ready\n")] == [
            (code, body)
            for code, _, body in [
                await get(containerd_proxy, "/healthz"),
                await get(containerd_proxy, "/readyz"),
            ]
        ]

    async def test_status_document(self, containerd_proxy: Daemon, sockdir: str) -> None:
        """/status reports version, sockets, backend, store, plugins and readiness as JSON."""
        document = await status(containerd_proxy)

        assert {
            "ready": True,
            "reasons": [],
            "listening": True,
            "draining": False,
            "listen": os.path.join(sockdir, "proxy.sock"),
            "in_flight": 0,
            "plugins": [],
            "registration_errors": {},
            "store": {"recovered": True, "pods": 0, "containers": 0},
            "hook_dir": os.path.join(sockdir, "hooks"),
            "recording": False,
        } == {
            k: document[k]
            for k in (
                "ready",
                "reasons",
                "listening",
                "draining",
                "listen",
                "in_flight",
                "plugins",
                "registration_errors",
                "store",
                "hook_dir",
                "recording",
            )
        }
        assert os.getpid() == document["pid"]
        assert [containerd_proxy.config.runtime_endpoint] == [b["endpoint"] for b in document["backends"]]

    async def test_status_lists_plugins_and_registration_errors(
        self, containerd_proxy: Daemon, sockdir: str
    ) -> None:
        """Loaded plugins come with hooks, policy, timeout and order; bad files with their error."""
        hook_dir = trio.Path(sockdir, "hooks")
        await (hook_dir / "koordlet.json").write_text(
            json.dumps(
                {
                    "remote-endpoint": "unix:///run/koordlet.sock",
                    "failure-policy": "Fail",
                    "runtime-hooks": ["PreRunPodSandbox", "PreCreateContainer"],
                    "timeout": "500ms",
                    "order": 3,
                }
            )
        )
        await (hook_dir / "broken.json").write_text("{")
        registry = containerd_proxy.hooks.dispatcher
        await wait_until(lambda: len(registry.registry.plugins) + len(registry.registry.errors) == 2)

        document = await status(containerd_proxy)

        assert [
            {
                "name": "koordlet",
                "file": "koordlet.json",
                "endpoint": "/run/koordlet.sock",
                "hooks": ["PreRunPodSandbox", "PreCreateContainer"],
                "failure_policy": "Fail",
                "timeout": 0.5,
                "order": 3,
                "warnings": [],
            }
        ] == document["plugins"]
        assert ["broken.json"] == list(document["registration_errors"])

    @pytest.mark.parametrize(
        ("request_bytes", "code"),
        [
            (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404),
            (b"GET /nowhere HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 requires Host (h11)
            (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405),
            (b"GET /metrics HTTP/2.0\r\nHost: x\r\n\r\n", 505),
            (b"GET metrics HTTP/1.1\r\nHost: x\r\n\r\n", 400),
            (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),
            (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
        ],
    )
    async def test_bad_requests_are_answered_not_fatal(
        self, containerd_proxy: Daemon, request_bytes: bytes, code: int
    ) -> None:
        """Unknown paths, other methods, other versions and garbage get a 4xx/5xx; the endpoint keeps serving."""
        assert containerd_proxy.admin_view is not None
        address = containerd_proxy.admin_view.address

        answer, _, _ = await http(address, request_bytes)

        assert (code, 200) == (answer, (await get(containerd_proxy, "/healthz"))[0])

    async def test_head_has_no_body(self, containerd_proxy: Daemon) -> None:
        """HEAD answers the headers of GET (its Content-Length included) without the body."""
        code, headers, body = await get(containerd_proxy, "/healthz", method="HEAD")
        assert (200, "3", b"") == (code, headers["content-length"], body)

    async def test_client_that_hangs_up_early(self, containerd_proxy: Daemon) -> None:
        """A client that closes before finishing its request leaves the endpoint serving."""
        assert containerd_proxy.admin_view is not None
        host, _, port = containerd_proxy.admin_view.address.rpartition(":")
        for _ in range(5):
            stream = await trio.open_tcp_stream(host, int(port))
            await stream.send_all(b"GET /met")
            await stream.aclose()
        assert 200 == (await get(containerd_proxy, "/healthz"))[0]


class TestReadiness:
    async def test_readyz_flips_after_recovery(self, nursery: trio.Nursery, sockdir: str) -> None:
        """While the runtime is down the store cannot recover: 503 naming the reason; once it is up, 200."""
        runtime = os.path.join(sockdir, "containerd.sock")
        daemon = await start_proxy(nursery, sockdir, runtime_endpoint=runtime, metrics_address=LOOPBACK)

        before_code, _, before = await get(daemon, "/readyz")
        not_ready = await status(daemon)
        await nursery.start(run_fake_containerd, runtime, FakeContainerd(RuntimeState()))
        await wait_until(lambda: daemon.hooks.recovered)
        after_code, _, _ = await get(daemon, "/readyz")

        assert 503 == before_code
        assert b"the store is not recovered from the runtime yet" in before
        assert (False, False) == (not_ready["ready"], not_ready["store"]["recovered"])
        assert 200 == after_code

    async def test_backend_down_is_reported(
        self, nursery: trio.Nursery, sockdir: str, cri_client: Callable[[str], CriClient]
    ) -> None:
        """Calls that cannot reach the runtime (store recovery's, kubelet's) turn its state to down, with the
        error, in /status and /metrics."""
        runtime = os.path.join(sockdir, "gone.sock")
        daemon = await start_proxy(nursery, sockdir, runtime_endpoint=runtime, metrics_address=LOOPBACK)
        client = cri_client(os.path.join(sockdir, "proxy.sock"))
        with pytest.raises(Exception, match=r"UNAVAILABLE|unavailable"):
            await client.call(client.runtime.Version, api_pb2.VersionRequest())

        after = await status(daemon)
        _, _, metrics = await get(daemon, "/metrics")

        [backend] = after["backends"]
        assert ("down", True) == (backend["state"], bool(backend["last_error"]))
        assert f'krproxy_backend_up{{endpoint="{runtime}",role="runtime"}} 0.0' in metrics.decode()

    async def test_recovery_reaching_the_runtime_reports_it_up(
        self, containerd_proxy: Daemon, sockdir: str
    ) -> None:
        """Store recovery's calls that reach the runtime turn its state to up, as failing ones turn it
        down: a proxy that has just rebuilt its store from the runtime said "unknown (no call
        forwarded yet)", and after an outage at start "down" until kubelet's next call."""
        [backend] = (await status(containerd_proxy))["backends"]
        _, _, metrics = await get(containerd_proxy, "/metrics")

        assert ("up", "") == (backend["state"], backend["last_error"])
        runtime = containerd_proxy.config.runtime_endpoint
        assert f'krproxy_backend_up{{endpoint="{runtime}",role="runtime"}} 1.0' in metrics.decode()

    async def test_readyz_fails_while_draining(self, nursery: trio.Nursery, sockdir: str) -> None:
        """Once shutdown starts, /readyz says so (the endpoint lives until the drain is over)."""
        daemon = await start_proxy(nursery, sockdir, metrics_address=LOOPBACK)
        daemon.relay.transport.draining = True  # what _drain() sets first

        code, _, body = await get(daemon, "/readyz")

        assert (503, True) == (code, b"shutting down" in body)
        daemon.relay.transport.draining = False


class TestConfig:
    @pytest.mark.parametrize("address", ["0.0.0.0:9722", "10.1.2.3:9722", ":9722", "node1:9722"])
    def test_remote_address_needs_the_flag(self, address: str) -> None:
        """A non-loopback metrics address is refused unless remote access is allowed explicitly."""
        from krproxy.config import ProxyConfig

        with pytest.raises(ValueError, match="--metrics-allow-remote"):
            ProxyConfig(metrics_address=address)
        assert address == ProxyConfig(metrics_address=address, metrics_allow_remote=True).metrics_address
