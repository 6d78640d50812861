"""``krproxy nri``'s configuration: names and indexes NRI would refuse are refused before connecting."""

from __future__ import annotations

import pytest

from krproxy.nri.plugin import NriConfig


@pytest.mark.parametrize("index", ["00", "50", "99"])
def test_two_ascii_digits(index: str) -> None:
    assert index == NriConfig(plugin_index=index).plugin_index


@pytest.mark.parametrize(
    "index", ["", "7", "100", "5a", " 5", "\u0661\u0662", "\u00b2\u00b3", "\uff11\uff12"]
)
def test_other_indexes_refused(index: str) -> None:
    """NRI takes exactly two bytes 0-9 (``api.CheckPluginIndex``); Python's isdigit() alone lets Unicode
    digits through, which the runtime then refuses at every registration, retried forever."""
    with pytest.raises(ValueError, match=r"two digits, 00\.\.99"):
        NriConfig(plugin_index=index)


@pytest.mark.parametrize("name", ["", "a/b"])
def test_bad_names_refused(name: str) -> None:
    with pytest.raises(ValueError, match="NRI plugin name"):
        NriConfig(plugin_name=name)
