"""ttrpc's 4 MiB message limit between the fake NRI runtime and ``krproxy nri``, both directions.

containerd's ttrpc (``messageLengthMax = 4 << 20``) refuses to send a longer message, with
RESOURCE_EXHAUSTED "message length N exceed maximum message size of 4194304", and a receiver
skips one and answers that stream so: the one call fails, the connection goes on. krproxy's
ttrpc core does both (tests/unit/test_nri_ttrpc.py: an oversized request skipped and answered,
an oversized answer sent as that status); this test holds the session's side over the
multiplexed NRI socket: a call too large to send fails alone.
"""

from __future__ import annotations

import pytest
import trio

from krproxy.fakes.nri import NriError
from krproxy.fakes.plugin import Changes
from krproxy.hooks.points import HookPoint
from krproxy.nri._ttrpc import MESSAGE_LENGTH_MAX
from tests.integration.nri_support import LIMIT, Node, container, pod, start_node

TOO_LONG = f"exceed maximum message size of {MESSAGE_LENGTH_MAX}"


@pytest.fixture
async def node(nursery: trio.Nursery, short_tmp: object) -> Node:
    return await start_node(nursery, short_tmp)


async def test_event_over_the_limit_fails_that_call_only(node: Node) -> None:
    """A container whose CreateContainer event is over 4 MiB (a 5 MiB annotation): the runtime's
    call fails RESOURCE_EXHAUSTED, unsent, as Go's ttrpc client fails it; krproxy stays
    connected and the next container is created with its hook run."""
    fake = await node.hook_server("h", [HookPoint.PRE_CREATE_CONTAINER], changes=Changes(cpu_shares=7))
    with trio.fail_after(LIMIT):
        await node.start_krproxy()
        await node.runtime.run_pod(pod())
        huge = container("huge")
        huge.annotations["x-huge"] = "a" * (5 << 20)
        with pytest.raises(NriError, match="RESOURCE_EXHAUSTED") as failed:
            await node.runtime.create_container(huge)
        created = await node.runtime.create_container(container("next"))
    assert TOO_LONG in str(failed.value)
    assert 7 == created.linux.resources.cpu.shares.value  # type: ignore[union-attr]
    assert 1 == len(node.runtime.plugins) and 1 == len(fake.requests(HookPoint.PRE_CREATE_CONTAINER))
