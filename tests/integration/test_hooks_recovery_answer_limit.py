"""Store recovery reads list answers up to kubelet's receive limit (16 MiB, a message): one over it is
refused before it is read, with a recovery_retry error that says so, and recovery tries again; one of
exactly the limit is read. Reading a 16 MiB answer of tiny fields in Python held the event loop for
seconds, and a kubelet connecting meanwhile timed out its handshake (UNAVAILABLE for every call)."""

from __future__ import annotations

import logging
import os

import pytest
import trio
from cri_api.v1 import api_pb2 as pb

from krproxy import rpc
from krproxy.hooks import listing
from krproxy.hooks.recovery import MAX_ANSWER
from krproxy.hookserver.testing import logged_events
from tests.integration.support import start_proxy, start_scripted_backend, wait_until

LIST_CONTAINERS = "/runtime.v1.RuntimeService/ListContainers"


def _spy_on_lists(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the list answers recovery reads, in order."""
    sizes: list[int] = []
    read_list = listing.read_list

    def spy(data: bytes, *args: str) -> listing.Listed:
        sizes.append(len(data))
        return read_list(data, *args)

    monkeypatch.setattr(listing, "read_list", spy)
    return sizes


async def test_a_list_over_16_mib_is_refused_unread(
    nursery: trio.Nursery, sockdir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A ListContainers answer one byte over the limit (not protobuf either): recovery_retry names the
    method and the limit, the answer never reaches the list reader, and the next attempt calls again."""
    backend, _ = await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))

    async def huge(stream: rpc.Stream, messages: list[bytes]) -> None:
        await stream.send_message(b"x" * (MAX_ANSWER + 1))

    backend.behaviours[LIST_CONTAINERS] = huge
    sizes = _spy_on_lists(monkeypatch)
    caplog.set_level(logging.INFO, logger="krproxy.recovery")
    proxy = await start_proxy(nursery, sockdir)
    await wait_until(lambda: backend.started.count(LIST_CONTAINERS) >= 2)  # retried
    [retry, *_] = logged_events(caplog.records, "recovery_retry")
    assert retry["error"] == (
        f"AnswerTooLarge: the runtime's answer to {LIST_CONTAINERS} is over {MAX_ANSWER} bytes, kubelet's limit"
        " (kubelet cannot read it either): remove exited containers and pods, or shorten their labels and"
        " annotations"
    )
    assert sizes and max(sizes) <= MAX_ANSWER  # only ListPodSandbox's answers were read
    assert not proxy.hooks.recovered


async def test_a_list_of_exactly_16_mib_is_recovered(
    nursery: trio.Nursery, sockdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ListContainers answer of exactly the limit (one container with a large label), as kubelet
    accepts it: recovery reads it and finishes."""
    container = pb.Container(
        id="c1", pod_sandbox_id="p1", metadata=pb.ContainerMetadata(name="c"), state=pb.CONTAINER_RUNNING
    )
    container.labels["big"] = ""
    answer = pb.ListContainersResponse(containers=[container])
    while (short := MAX_ANSWER - answer.ByteSize()) != 0:
        answer.containers[0].labels["big"] += "x" * short if short > 0 else ""
        if short < 0:
            answer.containers[0].labels["big"] = answer.containers[0].labels["big"][:short]
    body = answer.SerializeToString()
    assert MAX_ANSWER == len(body)
    backend, _ = await start_scripted_backend(nursery, os.path.join(sockdir, "backend.sock"))

    async def exact(stream: rpc.Stream, messages: list[bytes]) -> None:
        await stream.send_message(body)

    backend.behaviours[LIST_CONTAINERS] = exact
    sizes = _spy_on_lists(monkeypatch)
    proxy = await start_proxy(nursery, sockdir)
    await wait_until(lambda: proxy.hooks.recovered)
    assert MAX_ANSWER in sizes
    assert 1 == backend.started.count(LIST_CONTAINERS)
