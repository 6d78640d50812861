"""The table ``nox -s bench`` prints: medians, p99s, proxy/direct, each target met or missed."""

from __future__ import annotations

from typing import Any

from krproxy.bench._support import _check
from krproxy.bench.anchor import report_go_anchor
from krproxy.bench.hookanchor import report_hook_anchor
from krproxy.bench.micro import report_header_flood
from krproxy.bench.nri import report_nri
from krproxy.bench.wrapper import report_runc_wrapper, report_runc_wrapper_containerd


def report(results: dict[str, Any]) -> str:
    lines = [
        "case                              direct med/p99 ms   proxy med/p99 ms   ratio   added ms   target"
    ]

    def row(name: str, d: dict[str, float], p: dict[str, float], target: str) -> None:
        added = p["median_ms"] - d["median_ms"]
        lines.append(
            f"{name:<33} {d['median_ms']:7.3f}/{d['p99_ms']:7.3f}   {p['median_ms']:7.3f}/{p['p99_ms']:7.3f}"
            f"   {p['median_ms'] / d['median_ms']:5.2f}   {added:8.3f}   {target}"
        )

    for method in ("Version", "ContainerStatus"):
        r = results[f"small_{method}"]
        ok = (
            r["proxy"]["median_ms"] - r["direct"]["median_ms"] <= 0.5
            and r["proxy"]["p99_ms"] - r["direct"]["p99_ms"] <= 2
        )
        row(f"small {method}", r["direct"], r["proxy"], f"added <=0.5 ms, p99 added <=2 ms: {_check(ok)}")
    r = results["large_ListContainers"]
    row(
        "large ListContainers (1000)",
        r["direct"],
        r["proxy"],
        f"ratio <=2.0: {_check(r['proxy']['median_ms'] / r['direct']['median_ms'] <= 2.0)}",
    )
    h = results["hooked_CreateContainer"]
    row("CreateContainer, no plugin", h["direct"], h["proxy_no_plugin"], "")
    row(
        "CreateContainer, 1 plugin",
        h["direct"],
        h["proxy_1_plugin"],
        f"added <=2 ms: {_check(h['proxy_1_plugin']['median_ms'] - h['direct']['median_ms'] <= 2)}",
    )
    row(
        "CreateContainer, 3 plugins",
        h["direct"],
        h["proxy_3_plugins"],
        f"added <=4 ms: {_check(h['proxy_3_plugins']['median_ms'] - h['direct']['median_ms'] <= 4)}",
    )
    if "proxy_1_plugin_recording" in h:
        rec, one = h["proxy_1_plugin_recording"]["median_ms"], h["proxy_1_plugin"]["median_ms"]
        row(
            "CreateContainer, 1 plugin, rec",
            h["direct"],
            h["proxy_1_plugin_recording"],
            f"recording cost {100 * (rec / one - 1):+.1f}% (<=10%): {_check(rec <= one * 1.10)}",
        )
    else:
        lines.append("CreateContainer with --record      not measured: recording is not built yet")
    if "sdk_CreateContainer" in results:
        from krproxy.bench.sdk import report_sdk_create  # here: see proxy.run

        lines += report_sdk_create(results["sdk_CreateContainer"])
    real = results.get("real_containerd", {"skipped": "not run"})
    if "skipped" in real:
        lines.append(f"real containerd                   not measured: {real['skipped']}")
    else:
        for method in ("Version", "ContainerStatus"):
            r = real[method]
            ok = r["proxy"]["median_ms"] - r["direct"]["median_ms"] <= 0.5
            row(f"real containerd {method}", r["direct"], r["proxy"], f"added <=0.5 ms: {_check(ok)}")
        r = real["ListContainers"]
        ratio_ok = r["proxy"]["median_ms"] / r["direct"]["median_ms"] <= 2.0
        row(
            f"real ListContainers ({real['containers']})",
            r["direct"],
            r["proxy"],
            f"ratio <=2.0: {_check(ratio_ok)}",
        )
    lines += report_runc_wrapper(results.get("runc_wrapper", {"skipped": "not run"}))
    lines += report_runc_wrapper_containerd(results.get("runc_wrapper_containerd", {"skipped": "not run"}))
    lines += report_nri(results.get("nri", {"skipped": "not run"}))
    lines += report_go_anchor(results.get("go_anchor", {"skipped": "not run"}))
    lines += report_hook_anchor(results.get("hook_anchor", {"skipped": "not run"}))
    for label, sc in (("", results.get("stuck_client")), ("real ", real.get("stuck_client"))):
        if sc is not None:
            ok = sc["stuck"]["median_ms"] <= 2 * sc["before"]["median_ms"] + 0.5
            lines.append(
                f"{label}Version, a client stuck    ({sc['streams']} unread streams, {sc['unread_mb']:.0f} MB unread)"
                f" {sc['before']['median_ms']:.3f}/{sc['before']['p99_ms']:.3f} ms before,"
                f" {sc['stuck']['median_ms']:.3f}/{sc['stuck']['p99_ms']:.3f} ms stuck   usual latency: {_check(ok)}"
            )
    lines += report_header_flood(results.get("header_flood", {}))
    t = results["throughput_32_callers"]
    lines.append(
        f"throughput, 32 callers            direct {t['direct']:8.0f}/s   proxy {t['proxy']:8.0f}/s"
        f"   target >=2000/s: {_check(t['proxy'] >= 2000)}"
    )
    rc = results["recovery"]
    lines.append(
        f"recovery {rc['pods']} pods/{rc['containers']} containers   {rc['seconds']:.2f} s, RSS {rc['rss_mb']:.0f} MB"
        f"   targets <=2 s, <=100 MB: {_check(rc['seconds'] <= 2)}, {_check(rc['rss_mb'] <= 100)}"
    )
    lk = results["leak_check"]
    lines.append(
        f"leak check, {lk['calls']} calls          RSS {lk['before']['rss_mb']:.1f} -> {lk['after']['rss_mb']:.1f} MB"
        f" (warm-up from {lk['start']['rss_mb']:.1f}), fds {lk['before']['fds']} -> {lk['after']['fds']},"
        f" errors {lk['errors'] or 'none'}"
    )
    return "\n".join(lines)


#: What the wrapper may add to a runc call that no hook concerns (issue 19).
