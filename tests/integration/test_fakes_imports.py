"""The fakes run without grpclib, trio-asyncio, h2 or an asyncio loop (issue 24: trio-asyncio cannot be
imported on Python 3.14, and the whole test suite stood on the fakes).

A fresh interpreter serves the fake containerd and the fake plugin, calls each once through
krproxy's own client, imports the other fakes, and prints what it had loaded; a lazy import inside
a handler counts as much as one at the top of a module.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.integration.support import STARTUP_LIMIT

#: What the fakes must not load: none of it is a runtime dependency of krproxy any more.
NOT_IN_FAKES = {"grpclib", "trio_asyncio", "h2", "<asyncio loop policy>"}

_SERVE_AND_CALL = textwrap.dedent(
    """
    import json, os, sys, tempfile
    import trio
    import krproxy.fakes.dockerd.__main__, krproxy.fakes.nri, krproxy.fakes.containerd.__main__, krproxy.fakes.plugin.__main__
    from krproxy.fakes.containerd import run_fake_containerd
    from krproxy.fakes.plugin import run_fake_plugin
    from krproxy import rpc
    from krproxy.hooks.points import HookPoint

    async def main(tmp):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_fake_containerd, os.path.join(tmp, "c.sock"))
            await nursery.start(run_fake_plugin, os.path.join(tmp, "p.sock"))
            async with rpc.Channel(os.path.join(tmp, "c.sock")) as channel:
                assert await channel.unary("/runtime.v1.RuntimeService/Version", b"")
            async with rpc.Channel(os.path.join(tmp, "p.sock")) as channel:
                await channel.unary(HookPoint.PRE_CREATE_CONTAINER.rpc_path, b"")
            nursery.cancel_scope.cancel()

    with tempfile.TemporaryDirectory(prefix="kp-", dir="/tmp") as tmp:
        trio.run(main, tmp)
    events = sys.modules.get("asyncio.events")
    policy = getattr(events, "_event_loop_policy", None) if events is not None else None
    print(json.dumps(sorted(sys.modules) + (["<asyncio loop policy>"] if policy is not None else [])))
    """
)


def test_the_fakes_load_no_grpclib_trio_asyncio_or_h2() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SERVE_AND_CALL],
        capture_output=True,
        text=True,
        timeout=STARTUP_LIMIT,
        check=False,
    )
    assert 0 == done.returncode, done.stderr
    loaded = set(json.loads(done.stdout))
    assert {
        "krproxy.fakes.containerd.server",
        "krproxy.fakes.plugin.server",
        "krproxy.rpc",
    } <= loaded  # it ran
    assert set() == NOT_IN_FAKES & loaded
