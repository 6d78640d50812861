"""Which method a call is, through the proxy: raw HTTP/2 requests with every ``:path`` spelling.

The scripted backend answers any path (as grpc-go before 1.79.3 routes a slash-less one to its
method), so a call it records is a call krproxy let through: a slash-less path must never reach
it, whatever the flags; other spellings reach it unless required hook servers are configured and
the method is not listed with ``--forward-unhooked-method``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import trio

from krproxy.grpcstatus import Status
from krproxy.hooks.required import Requirements, parse_required_server
from krproxy.hookserver.testing import logged_events
from krproxy.routing import CRI_VERSION
from tests.integration.h2_client import H2Answer, framed, grpc_request, request
from tests.integration.support import ScriptedBackend, start_proxy

SERVICE = "runtime.v1.RuntimeService"
#: The workload verbs a slash-less path would run on containerd 1.6/1.7, unhooked.
WORKLOAD_VERBS = ["RunPodSandbox", "CreateContainer", "StartContainer", "RestorePod"]
#: Spellings every grpc-go answers UNIMPLEMENTED (no registered service or method has that name).
OTHER_SPELLINGS = [
    f"//{SERVICE}/RunPodSandbox",
    f"/{SERVICE}/RunPodSandbox/",
    f"/{SERVICE}/RunPodSandbox?x=1",
    f"/{SERVICE}/RunPod%53andbox",
    f"/{SERVICE}/runpodsandbox",
    f"/{SERVICE.upper()}/RunPodSandbox",
    "/runtime.v1alpha2.RuntimeService/RunPodSandbox",
]
REQUIRED = Requirements((parse_required_server("koordlet"),), startup_grace=0.0)


async def call(sockdir: str, path: str) -> H2Answer:
    with trio.fail_after(30):
        return await request(os.path.join(sockdir, "proxy.sock"), grpc_request(path), framed(b""))


def reached(backend: ScriptedBackend, path: str) -> bool:
    return path in backend.started


async def proxy(nursery: trio.Nursery, sockdir: str, **config: Any) -> None:
    daemon = await start_proxy(nursery, sockdir, **config)
    with trio.fail_after(30):
        while not daemon.hooks.recovered:  # noqa: ASYNC110 - the store is recovered from the backend
            await trio.sleep(0.01)


@pytest.mark.parametrize("required", [False, True], ids=["plain", "required"])
@pytest.mark.parametrize("verb", WORKLOAD_VERBS)
async def test_slashless_path_refused_as_grpc_go(
    scripted_backend: ScriptedBackend, nursery: trio.Nursery, sockdir: str, verb: str, required: bool
) -> None:
    """``runtime.v1.RuntimeService/<verb>`` gets grpc-go 1.79.3's answer from krproxy and never reaches
    the runtime, with or without required hook servers."""
    await proxy(nursery, sockdir, **({"requirements": REQUIRED} if required else {}))
    path = f"{SERVICE}/{verb}"

    answer = await call(sockdir, path)

    assert Status.UNIMPLEMENTED == answer.grpc_status, answer
    assert f'malformed method name: "{path}"' == answer.grpc_message
    assert not reached(scripted_backend, path), scripted_backend.started
    control = await call(sockdir, f"/{SERVICE}/Version")  # the connection's peer is fine
    assert Status.OK == control.grpc_status, control
    assert reached(scripted_backend, f"/{SERVICE}/Version")


async def test_slashless_message_quotes_path_as_go(
    scripted_backend: ScriptedBackend, nursery: trio.Nursery, sockdir: str
) -> None:
    """A quote in the path is escaped in the message as Go's %q escapes it."""
    await proxy(nursery, sockdir)
    answer = await call(sockdir, 'svc"x/M')
    assert Status.UNIMPLEMENTED == answer.grpc_status, answer
    assert 'malformed method name: "svc\\"x/M"' == answer.grpc_message
    assert [] == [p for p in scripted_backend.started if "svc" in p]


@pytest.mark.parametrize("path", OTHER_SPELLINGS)
async def test_other_spellings_forwarded_without_required(
    scripted_backend: ScriptedBackend, nursery: trio.Nursery, sockdir: str, path: str
) -> None:
    """Without required hook servers, spellings the runtime does not route go to it as they came."""
    await proxy(nursery, sockdir)
    answer = await call(sockdir, path)
    assert Status.OK == answer.grpc_status, answer  # the scripted backend's echo
    assert reached(scripted_backend, path), scripted_backend.started


@pytest.mark.parametrize("path", [*OTHER_SPELLINGS, f"/{SERVICE}/FutureVerb", "/grpc.health.v1.Health/Check"])
async def test_unknown_methods_refused_under_required(
    scripted_backend: ScriptedBackend, nursery: trio.Nursery, sockdir: str, path: str
) -> None:
    """With a required hook server configured, a method our protos lack is UNIMPLEMENTED from krproxy
    and nothing reaches the runtime (the required server need not even be missing)."""
    await proxy(nursery, sockdir, requirements=REQUIRED)
    answer = await call(sockdir, path)
    assert Status.UNIMPLEMENTED == answer.grpc_status, answer
    assert answer.grpc_message.startswith(f"unknown method {path}: krproxy does not know it")
    assert not reached(scripted_backend, path), scripted_backend.started


async def test_forward_unhooked_method_lets_it_through(
    scripted_backend: ScriptedBackend, nursery: trio.Nursery, sockdir: str
) -> None:
    """``--forward-unhooked-method FutureVerb`` forwards that method unhooked under required servers;
    another unknown one stays refused, and so does the slash-less spelling of the listed one."""
    await proxy(nursery, sockdir, requirements=REQUIRED, forward_unhooked_methods=("FutureVerb",))

    listed = await call(sockdir, f"/{SERVICE}/FutureVerb")
    other = await call(sockdir, f"/{SERVICE}/OtherVerb")
    slashless = await call(sockdir, f"{SERVICE}/FutureVerb")

    assert Status.OK == listed.grpc_status, listed
    assert reached(scripted_backend, f"/{SERVICE}/FutureVerb")
    assert Status.UNIMPLEMENTED == other.grpc_status
    assert Status.UNIMPLEMENTED == slashless.grpc_status
    assert [f"/{SERVICE}/FutureVerb"] == [p for p in scripted_backend.started if "Verb" in p]


async def test_known_unhooked_methods_forwarded_under_required(
    scripted_backend: ScriptedBackend, nursery: trio.Nursery, sockdir: str
) -> None:
    """Methods our protos know go on under required servers as before (CheckpointPod, Version)."""
    await proxy(nursery, sockdir, requirements=REQUIRED)
    for method in ("Version", "CheckpointPod", "ListContainers"):
        answer = await call(sockdir, f"/{SERVICE}/{method}")
        assert Status.OK == answer.grpc_status, (method, answer)
        assert reached(scripted_backend, f"/{SERVICE}/{method}")


@pytest.mark.parametrize("required", [False, True], ids=["plain", "required"])
async def test_unknown_method_against_fake_containerd(
    fake_containerd: Any, nursery: trio.Nursery, sockdir: str, required: bool
) -> None:
    """An unknown RuntimeService method reaches the fake containerd (which answers UNIMPLEMENTED itself)
    without required servers, and is refused by krproxy, never sent, with them."""
    fake, backend = fake_containerd
    await proxy(
        nursery, sockdir, runtime_endpoint=backend, **({"requirements": REQUIRED} if required else {})
    )
    path = f"/{SERVICE}/FutureVerb"

    answer = await call(sockdir, path)

    assert Status.UNIMPLEMENTED == answer.grpc_status, answer
    from_krproxy = answer.grpc_message.startswith(f"unknown method {path}: krproxy")
    assert required == from_krproxy, answer.grpc_message
    assert (not required) == bool(fake.headers("FutureVerb")), fake.headers("FutureVerb")


@pytest.mark.parametrize("required", [False, True], ids=["plain", "required"])
async def test_start_up_log_names_the_cri_version(
    scripted_backend: ScriptedBackend,
    nursery: trio.Nursery,
    sockdir: str,
    caplog: pytest.LogCaptureFixture,
    required: bool,
) -> None:
    """``event=methods`` names the CRI krproxy knows and what becomes of methods it does not know."""
    caplog.set_level(logging.INFO, logger="krproxy.daemon")
    extra: dict[str, Any] = {"requirements": REQUIRED} if required else {}
    await proxy(nursery, sockdir, forward_unhooked_methods=("FutureVerb",), **extra)
    [logged] = logged_events(caplog.records, "methods")
    assert CRI_VERSION == logged["cri"] and "cri-api" in CRI_VERSION
    assert ("refused" if required else "forwarded") == logged["unknown"]
    assert f"/{SERVICE}/FutureVerb" == logged["forward_unhooked"]
