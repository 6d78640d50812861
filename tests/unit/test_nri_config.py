"""``krproxy nri``'s configuration: names and indexes NRI would refuse are refused before connecting."""

from __future__ import annotations

import pytest

from krproxy import cli
from krproxy.nri._events import event_names, mask_of
from krproxy.nri.plugin import NriConfig
from krproxy.proto.nri.pkg.api import v1alpha1 as api


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


@pytest.mark.parametrize(
    ("socket", "reason"),
    [
        ("tcp://127.0.0.1:5000", "only unix sockets are supported, not 'tcp://127.0.0.1:5000'"),
        ("var/run/nri/nri.sock", "a socket path must be absolute"),
        ("/" + "n" * 120, "longer than a unix socket path can be"),
    ],
    ids=["tcp", "relative", "too-long"],
)
def test_a_bad_nri_socket_is_refused_naming_the_flag(
    socket: str, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`krproxy nri --nri-socket` is checked as the proxy's endpoints are: exit 2 with one line naming the
    flag (``tcp://…`` was taken for a file's path, and retried as one forever)."""
    assert 2 == cli.main(["nri", "--nri-socket", socket])
    err = capsys.readouterr().err
    assert err.startswith("krproxy nri: error: --nri-socket: ") and reason in err, err


@pytest.mark.parametrize(
    ("mask", "names"),
    [
        (0, "none"),
        (
            mask_of({api.Event.RUN_POD_SANDBOX, api.Event.CREATE_CONTAINER}),
            "RUN_POD_SANDBOX,CREATE_CONTAINER",
        ),
        (mask_of({api.Event.REMOVE_POD_SANDBOX}), "REMOVE_POD_SANDBOX"),
        (1 << 30, "bit30"),
    ],
)
def test_event_masks_are_logged_by_name(mask: int, names: str) -> None:
    """The event masks NRI mode logs and reports (``nri_configured events=…``) are NRI's event names in
    event order, not ``0x9``; a bit no event of NRI 0.12 has is named by its number."""
    assert names == event_names(mask)
