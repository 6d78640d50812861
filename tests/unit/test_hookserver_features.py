"""Which policy features are active on a node, and why not: one log line and a gauge each."""

from __future__ import annotations

import logging
import pathlib

import pytest

from krproxy.hookserver import HookServer, NodePolicy
from krproxy.hookserver.policies import install_all
from krproxy.hookserver.testing import FakeNode, logged_events

POLICY = NodePolicy.from_text(
    """
resourceQOSStrategy:
  beClass: {cpuQOS: {groupIdentity: -1}, resctrlQOS: {catRangeEndPercent: 30}}
resourceUsedThresholdWithBE: {cpuSuppressThresholdPercent: 65}
"""
)


def _app(tmp_path: pathlib.Path, **node_kw: object) -> tuple[HookServer, FakeNode]:
    node = FakeNode(tmp_path, **node_kw).create()  # type: ignore[arg-type]
    node.add_cgroup("/kubepods")
    proc_stat = tmp_path / "stat"
    proc_stat.write_text("cpu 1 0 1 10 0 0 0 0\ncpu0 1 0 1 10 0 0 0 0\n")
    app = HookServer(executor=node.executor())
    install_all(app, proc_stat=str(proc_stat))
    return app, node


def _statuses(caplog: pytest.LogCaptureFixture) -> dict[str, dict[str, object]]:
    return {e["feature"]: e for e in logged_events(caplog.records, "feature_status")}  # type: ignore[misc]


def _gauge(app: HookServer, feature: str) -> float | None:
    return app.features.registry.get_sample_value("krproxy_hookserver_feature_active", {"feature": feature})


class TestFeatureStatus:
    @pytest.mark.parametrize("version", [1, 2])
    def test_node_without_bvt_or_resctrl(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, version: int
    ) -> None:
        """As on this machine: group identity falls back to cpu.idle (said so), resctrl is off
        because /sys/fs/resctrl is not mounted, and the gauge says the same."""
        app, node = _app(tmp_path, cgroup_version=version, bvt=False, resctrl=False)
        (node.resctrl_root).rmdir()
        with caplog.at_level(logging.INFO):
            app.set_policy(POLICY)
        status = _statuses(caplog)
        gi = status["groupidentity"]
        assert gi["active"] is True and gi["mode"] == "cpu.idle"
        assert "cpu.bvt_warp_ns" in str(gi["reason"]) and "fallback" in str(gi["reason"])
        rdt = status["resctrl"]
        assert rdt["active"] is False and "no resctrl mount" in str(rdt["reason"])
        assert status["cpusuppress"]["active"] is True
        assert (1.0, 0.0, 1.0) == (
            _gauge(app, "groupidentity"),
            _gauge(app, "resctrl"),
            _gauge(app, "cpusuppress"),
        )
        [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert "resctrl" == warning.krproxy_fields["feature"]  # type: ignore[attr-defined]

    def test_no_bvt_no_idle_falls_back_to_shares(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Without cpu.idle either (Linux < 5.15), BE pods get cpu.shares=2, and the log says why."""
        app, _ = _app(tmp_path, cgroup_version=1, bvt=False, idle=False)
        with caplog.at_level(logging.INFO):
            app.set_policy(POLICY)
        gi = _statuses(caplog)["groupidentity"]
        assert "cpu.shares" == gi["mode"] and "cpu.idle" in str(gi["reason"])

    def test_bvt_kernel(self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
        """A kernel with group identity uses cpu.bvt_warp_ns; resctrl without MBA is L3 only."""
        app, _ = _app(tmp_path, cgroup_version=1, mba=False)
        with caplog.at_level(logging.INFO):
            app.set_policy(POLICY)
        status = _statuses(caplog)
        assert "cpu.bvt_warp_ns" == status["groupidentity"]["mode"]
        assert (True, "L3") == (status["resctrl"]["active"], status["resctrl"]["mode"])

    def test_v2_without_cpu_controller(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """On cgroup v2 a missing cpu.max (controller not enabled) switches CPU suppress off, saying so."""
        app, node = _app(tmp_path, cgroup_version=2)
        (node.cgroup_root / "kubepods" / "cpu.max").unlink()
        with caplog.at_level(logging.INFO):
            app.set_policy(POLICY)
        suppress = _statuses(caplog)["cpusuppress"]
        assert suppress["active"] is False
        assert "cpu.max" in str(suppress["reason"]) and "cgroup.subtree_control" in str(suppress["reason"])
        assert 0.0 == _gauge(app, "cpusuppress")

    def test_every_policy_change_reports_again(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Without a policy the policy features are off (not a warning), each naming the key that turns it on;
        each change reports anew."""
        app, _ = _app(tmp_path)
        with caplog.at_level(logging.INFO):
            app.report_features()
            app.set_policy(POLICY)
            app.set_policy(NodePolicy())
        events = logged_events(caplog.records, "feature_status")
        assert 3 * 5 == len(events)
        first = {e["feature"]: e for e in events[:5]}
        assert first["cpusuppress"]["active"] is False
        assert "no resourceUsedThresholdWithBE in the policy" == first["cpusuppress"]["reason"]
        assert (
            "no resourceQOSStrategy.<class>.cpuQOS.groupIdentity in the policy"
            == first["groupidentity"]["reason"]
        )
        assert all(r.levelno == logging.INFO for r in caplog.records[:5])
        assert 0.0 == _gauge(app, "cpusuppress")

    @pytest.mark.parametrize("qos_class", ["lsrClass", "lsClass", "beClass"])
    def test_each_class_configures_and_each_feature_names_its_key(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, qos_class: str
    ) -> None:
        """A cpuQOS of any one class turns group identity on; a policy without resctrlQOS or
        resourceUsedThresholdWithBE leaves those off, each reason naming the key to set, at INFO (not
        wanted, so not a warning)."""
        app, _ = _app(tmp_path)
        with caplog.at_level(logging.INFO):
            app.set_policy(
                NodePolicy.from_text(
                    f"resourceQOSStrategy: {{{qos_class}: {{cpuQOS: {{groupIdentity: 2}}}}}}"
                )
            )
        status = _statuses(caplog)
        assert (True, 1.0) == (status["groupidentity"]["active"], _gauge(app, "groupidentity"))
        assert {
            "resctrl": (False, "no resourceQOSStrategy.<class>.resctrlQOS in the policy"),
            "cpusuppress": (False, "no resourceUsedThresholdWithBE in the policy"),
        } == {name: (status[name]["active"], status[name]["reason"]) for name in ("resctrl", "cpusuppress")}
        assert [] == [r for r in caplog.records if r.levelno >= logging.WARNING]

    def test_textfile(self, tmp_path: pathlib.Path) -> None:
        """The gauge is written for node_exporter's textfile collector when asked."""
        app, _ = _app(tmp_path, resctrl=False)
        app.features.textfile = str(tmp_path / "features.prom")
        app.set_policy(POLICY)
        text = (tmp_path / "features.prom").read_text()
        assert 'krproxy_hookserver_feature_active{feature="resctrl"} 0.0' in text
        assert 'krproxy_hookserver_feature_active{feature="groupidentity"} 1.0' in text
