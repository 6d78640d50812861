"""Your first hook plugin: give every container of a pod a ``POD_NAME`` variable and
mark BE pods' cgroups SCHED_IDLE.

Run it next to krproxy (or koord-runtime-proxy)::

    python examples/first_plugin.py --socket /run/krproxy-plugins/first-plugin.sock --hook-dir /etc/runtime/hookserver.d

It writes ``/etc/runtime/hookserver.d/first-plugin.json`` so the proxy starts calling it, and
removes that file when stopped (Ctrl-C, SIGTERM or SIGHUP).
"""

from __future__ import annotations

import argparse
import signal

import trio

from krproxy import log
from krproxy.hookserver import ContainerContext, HookServer, PodContext, QoSClass, ServeOptions, Stage, serve

app = HookServer()


@app.hook(Stage.PRE_CREATE_CONTAINER, name="pod-name-env", description="POD_NAME for every container")
def pod_name_env(ctx: ContainerContext) -> None:
    ctx.response.add_envs["POD_NAME"] = ctx.request.pod.meta.name


@app.hook(Stage.PRE_RUN_POD_SANDBOX, name="be-idle", description="BE pods run SCHED_IDLE")
def be_idle(ctx: PodContext) -> None:
    if ctx.request.qos_class is QoSClass.BE:
        ctx.response.resources.cpu_idle = 1


async def _main(options: ServeOptions) -> None:
    # Ctrl-C (SIGINT), SIGTERM and SIGHUP cancel serve(), which removes the registration file
    # before its socket closes. The signals are caught before serving starts.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, app, options)
            async for _ in signals:
                nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", default="/run/krproxy-plugins/first-plugin.sock")
    parser.add_argument("--hook-dir", default="/etc/runtime/hookserver.d")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every hook call's decisions")
    args = parser.parse_args()
    # The SDK's log format (logfmt on stderr), as `krproxy hooks serve` does: without it the
    # SDK's events (deferred or failed cgroup writes...) would go nowhere.
    log.configure("debug" if args.verbose else "info")
    trio.run(_main, ServeOptions(socket=args.socket, hook_dir=args.hook_dir, name="first-plugin"))
