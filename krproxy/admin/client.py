"""``krproxy status``: a daemon's ``/status`` document, fetched and printed (blocking, no trio)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Mapping
from typing import Any

from krproxy.config import DEFAULT_METRICS_ADDRESS as DEFAULT_STATUS_ADDRESS
from krproxy.config import parse_address


class Unreachable(Exception):
    """No daemon answered at the address, or its answer was not a status document."""


def fetch_status(address: str, timeout: float = 5.0) -> dict[str, Any]:
    """GET ``/status`` from a daemon's admin endpoint (blocking; for the CLI).

    Raises:
        Unreachable: connection failed or timed out, or the answer was not a JSON object.
    """
    try:
        host, port = parse_address(address)
    except ValueError as err:
        raise Unreachable(str(err)) from None
    host = {"": "127.0.0.1"}.get(host, host)
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/status")
        answer = connection.getresponse()
        body = answer.read()
        if answer.status != 200:
            raise Unreachable(f"{address}/status answered {answer.status} {answer.reason}")
        document = json.loads(body)
    except OSError as err:
        raise Unreachable(
            f"no krproxy status at {address}: {err}; is krproxy serve (or nri) running with "
            f"--metrics-address={address}? The status endpoint is off without that flag"
        ) from None
    except (http.client.HTTPException, ValueError) as err:
        raise Unreachable(f"no krproxy status at {address}: {err}") from None
    finally:
        connection.close()
    if not isinstance(document, dict):
        raise Unreachable(f"{address}/status did not answer a JSON object")
    return document


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{days}d"] if days else []
    if days or hours:
        parts.append(f"{hours}h")
    if days or hours or minutes:
        parts.append(f"{minutes}m")
    return "".join([*parts, f"{secs}s"])


def render_status(status: Mapping[str, Any]) -> str:
    """A readable report of a ``/status`` document (missing keys are shown as ``?``)."""

    def get(key: str, default: Any = "?") -> Any:
        return status.get(key, default)

    ready = get("ready", False)
    lines = [
        f"krproxy {get('version')} (pid {get('pid')}), up {_duration(float(get('uptime_seconds', 0)))}",
        "ready: yes" if ready else "ready: NO — " + "; ".join(get("reasons", []) or ["unknown"]),
    ]
    nri = get("nri", None)
    if isinstance(nri, Mapping):  # krproxy nri: no proxy socket, a plugin of the runtime's NRI
        registered = f"registered as {nri.get('plugin', '?')}" if nri.get("registered") else "not registered"
        protocol = ", ".join(
            part
            for part in (
                f"NRI {nri['nri_version']}" if nri.get("nri_version") else "",
                f"events via {nri['event_calls']}" if nri.get("event_calls") else "",
            )
            if part
        )
        lines.append(
            f"nri: {nri.get('socket', '?')} — {registered}, runtime {nri.get('runtime') or '?'}"
            + (f" ({protocol})" if protocol else "")
            + f", request timeout {nri.get('request_timeout', '?')}s, events {nri.get('events', '?')}"
        )
        if nri.get("runtime_validator"):
            lines.append(f"containerd's validator: krproxy nri is {nri['runtime_validator']}")
    else:
        lines.append(
            f"listen: {get('listen')} ({'accepting calls' if get('listening', False) else 'not accepting calls'}"
            + (", shutting down" if get("draining", False) else "")
            + f"), {get('in_flight', 0)} in flight"
        )
    for backend in get("backends", []):
        line = f"backend {backend.get('role', '?')}: {backend.get('endpoint', '?')} — {backend.get('state', '?')}"
        if backend.get("last_error"):
            line += f" ({backend['last_error']})"
        elif backend.get("state") == "unknown":
            line += " (no call forwarded yet)"
        lines.append(line)
    store = get("store", {})
    lines.append(
        f"store: {store.get('pods', '?')} pods, {store.get('containers', '?')} containers, "
        + ("recovered" if store.get("recovered") else "NOT recovered")
    )
    if get("recording", False):
        lines.append("recording: on")
    plugins = get("plugins", [])
    lines.append(f"plugins ({get('hook_dir')}): {len(plugins) or 'none'}")
    for p in plugins:
        hooks = ", ".join(p.get("hooks", [])) or "no hooks"
        lines.append(
            f"  {p.get('name')}: {p.get('endpoint')} policy={p.get('failure_policy')} "
            f"timeout={p.get('timeout')}s order={p.get('order')} hooks: {hooks}"
        )
        lines.extend(f"    warning: {w}" for w in p.get("warnings", []))
    for server in get("required_servers", []):
        state = server.get("state", "?")
        detail = f" ({server['detail']})" if server.get("detail") else ""
        origin = "" if server.get("declared", True) else ", from pod annotations"
        lines.append(
            f"required hook server {server.get('name')}: {state.replace('_', ' ')}{detail}{origin}; "
            f"hooks: {', '.join(server.get('hooks', [])) or '?'}"
        )
    errors = get("registration_errors", {})
    if errors:
        lines.append(f"registration errors: {len(errors)}")
        lines.extend(f"  {error}" for error in errors.values())
    return "\n".join(lines) + "\n"


def add_status_subcommand(subparsers: Any) -> None:
    """Add ``krproxy status`` to the CLI's subparsers."""
    import argparse

    p: argparse.ArgumentParser = subparsers.add_parser(
        "status",
        help="report a running daemon's readiness, backend and plugins",
        description="Ask a running `krproxy serve` or `krproxy nri` (started with --metrics-address) for /status and print it. "
        "Exit status: 0 ready, 1 running but not ready, 2 unreachable.",
    )
    p.add_argument(
        "--metrics-address",
        default=DEFAULT_STATUS_ADDRESS,
        metavar="HOST:PORT",
        help="the daemon's --metrics-address; default: %(default)s",
    )
    p.add_argument("--json", action="store_true", help="print the /status JSON document as it came")
    p.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="give up after; default: %(default)s"
    )
    p.set_defaults(func=status_main)


def status_main(args: Any) -> int:
    """``krproxy status``: 0 ready, 1 not ready, 2 unreachable."""
    import sys

    try:
        status = fetch_status(args.metrics_address, args.timeout)
    except Unreachable as err:
        print(f"krproxy status: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print(render_status(status), end="")
    return 0 if status.get("ready") is True else 1
