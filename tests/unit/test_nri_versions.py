"""krproxy.nri.versions: what a runtime's NRI version applies of an adjustment, read from its Configure."""

from __future__ import annotations

import pytest

from krproxy.nri.versions import ENV_REMOVAL, SWAP_IGNORED, RuntimeNri
from krproxy.proto.nri.pkg.api import v1alpha1 as api

#: Every kind of field the table knows, and an env var set and one removed.
ADJUSTMENT = api.ContainerAdjustment(
    args=["sleep", "1"],
    env=[api.KeyValue(key="ADDED", value="1"), api.KeyValue(key="-MODE")],
    CDI_devices=[api.CdiDevice(name="vendor.com/gpu=0")],
    linux=api.LinuxContainerAdjustment(oom_score_adj=api.OptionalInt(value=100)),
)


class TestConfigured:
    @pytest.mark.parametrize(
        ("request_", "expected"),
        [
            (api.ConfigureRequest(NRI_version="v0.12.2", request_timeout=2000), RuntimeNri("v0.12.2", True)),
            (api.ConfigureRequest(request_timeout=2000, registration_timeout=5000), RuntimeNri("", True)),
            (api.ConfigureRequest(), RuntimeNri("", False)),
        ],
        ids=["0.12", "0.8", "0.6.1"],
    )
    def test_version_from_configure(self, request_: api.ConfigureRequest, expected: RuntimeNri) -> None:
        """0.12 says its version; 0.8 to 0.11 send timeouts; 0.6.1 neither."""
        assert expected == RuntimeNri.configured(request_)

    def test_describe(self) -> None:
        assert ["v0.12.2", "0.8 to 0.11", "before 0.8"] == [
            RuntimeNri("v0.12.2").describe(),
            RuntimeNri("", True).describe(),
            RuntimeNri("", False).describe(),
        ]


class TestNotApplied:
    def test_on_0_12_only_the_env_removal(self) -> None:
        """A 0.12 runtime knows every field; the env var's removal still does not reach it."""
        assert [("env[MODE] removed", ENV_REMOVAL)] == RuntimeNri("v0.12.2").not_applied(ADJUSTMENT)

    def test_on_0_8_the_0_12_fields_too(self) -> None:
        got = RuntimeNri("", True).not_applied(ADJUSTMENT)
        assert ["args", "env[MODE] removed"] == [field for field, _ in got]
        assert "the runtime's NRI (0.8 to 0.11) is older than 0.12: it drops these fields" == got[0][1]

    def test_on_0_6_the_0_8_fields_too(self) -> None:
        got = RuntimeNri("", False).not_applied(ADJUSTMENT)
        assert ["CDI_devices", "linux.oom_score_adj", "args", "env[MODE] removed"] == [f for f, _ in got]
        assert "older than 0.12" in got[0][1]

    def test_an_env_var_set_is_applied(self) -> None:
        adjust = api.ContainerAdjustment(env=[api.KeyValue(key="ADDED", value="1")])
        assert [] == RuntimeNri("", False).not_applied(adjust)

    @pytest.mark.parametrize(
        ("limit", "swap", "said"),
        [(None, 1 << 30, True), (1 << 29, 1 << 30, True), (1 << 30, 1 << 30, False)],
        ids=["swap alone", "swap above the limit", "swap equal to the limit"],
    )
    def test_a_swap_limit(self, limit: int | None, swap: int, said: bool) -> None:
        """No NRI version applies a plugin's swap: it sets the swap limit to the memory limit. A swap equal
        to the limit set with it is what NRI gives, and is not listed."""
        memory = api.LinuxMemory(
            limit=api.OptionalInt64(value=limit) if limit is not None else None,
            swap=api.OptionalInt64(value=swap),
        )
        adjust = api.ContainerAdjustment(
            linux=api.LinuxContainerAdjustment(resources=api.LinuxResources(memory=memory))
        )
        expected = [("linux.resources.memory.swap", SWAP_IGNORED)] if said else []
        assert expected == RuntimeNri("v0.12.2").not_applied(adjust)
