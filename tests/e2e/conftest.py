"""Fixtures for end-to-end tests: a private real containerd, the ``krproxy serve`` daemon in front of it.

Where the machine cannot run containerd (not root, no apt-get, install failed) every e2e test
is skipped with the reason. Whatever a fixture starts it stops, by PID, at teardown.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.support import Containerd, Cri, Plugin, Proxy, run_script, serving_proxy, start_plugin

HERE = Path(__file__).parent
#: Which containerd this pytest run uses: 1.6 (the machine's own package, the default), 1.7 or 2.x
#: (Debian trixie's / sid's, fetched by ``containerd-sandbox fetch``). ``nox -s e2e`` runs each.
CONTAINERD_VERSION = os.environ.get("KRPROXY_E2E_CONTAINERD", "1.6")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


@pytest.fixture(scope="session")
def containerd() -> Iterator[Containerd]:
    """A real containerd (CRI plugin on) in its own namespaces, with local busybox and pause images."""
    if os.geteuid() != 0:
        pytest.skip(f"e2e needs root to run containerd (running as uid {os.geteuid()})")
    if not shutil.which("apt-get"):
        pytest.skip("e2e needs apt-get to install containerd and runc (not a Debian-like machine)")
    installed = run_script("install")
    if installed.returncode != 0:
        pytest.skip(
            f"containerd-sandbox install failed (exit {installed.returncode}):\n{_tail(installed.stderr)}"
        )
    fetched = run_script("fetch", "--version", CONTAINERD_VERSION)
    if fetched.returncode != 0:
        pytest.skip(f"containerd {CONTAINERD_VERSION} cannot be had here: {_tail(fetched.stderr, 1)}")
    bin_dir = fetched.stdout.strip().splitlines()[-1]
    root = Path(tempfile.mkdtemp(prefix="kpe2e-", dir="/tmp"))
    # A cgroup parent of our own, so parallel runs never clean up each other's cgroups.
    sandbox = Containerd(
        root / "containerd", cgroup_parent=f"krproxy-e2e-{uuid.uuid4().hex[:6]}", bin_dir=bin_dir
    )
    try:
        sandbox.start()
        yield sandbox
    finally:
        sandbox.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def node_image(containerd: Containerd, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The DaemonSets' image (both manifests name the same), built from this checkout once per run and
    imported into the sandbox's containerd; its name (tests/e2e/daemonset.py)."""
    from tests.e2e import daemonset

    name = daemonset.Manifest(HERE.parents[1] / "deploy" / "daemonset.yaml").image
    nri = daemonset.Manifest(HERE.parents[1] / "deploy" / "daemonset-nri.yaml").image
    assert nri == name, f"the DaemonSets name two images: {name}, {nri}"
    return daemonset.import_image(containerd, tmp_path_factory.mktemp("image") / "krproxy-image.tar", name)


@pytest.fixture
def proxy(containerd: Containerd, short_tmp: Path) -> Iterator[Proxy]:
    """``krproxy serve`` in front of containerd (socket, log and hook dir in ``short_tmp``).

    At teardown it must exit 0 on SIGTERM and have removed its socket.
    """
    with serving_proxy(short_tmp, containerd.socket) as daemon:
        yield daemon
    assert not os.path.exists(daemon.socket)


@pytest.fixture
def direct(containerd: Containerd) -> Iterator[Cri]:
    """A grpcio CRI client talking to containerd directly."""
    with Cri.connect(containerd.socket) as cri:
        yield cri


@pytest.fixture
def via_proxy(proxy: Proxy) -> Iterator[Cri]:
    """A grpcio CRI client talking to containerd through the proxy."""
    with Cri.connect(proxy.socket) as cri:
        yield cri


@pytest.fixture
def plugins(proxy: Proxy) -> Iterator[Callable[..., Plugin]]:
    """``plugins(name, **config)`` starts a scripted hook plugin registered with ``proxy``.

    Every plugin started is stopped by PID at teardown (before the proxy) and must exit 0.
    """
    started: list[Plugin] = []

    def start(name: str, **config: Any) -> Plugin:
        plugin = start_plugin(proxy, name, **config)
        started.append(plugin)
        return plugin

    yield start
    codes = {plugin.name: plugin.stop() for plugin in started}
    assert all(code == 0 for code in codes.values()), f"plugin exit codes: {codes}"
