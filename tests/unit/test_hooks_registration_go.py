"""Registration files read as koord-runtime-proxy reads them (krproxy.hooks.registration against
tests/gojson, Go's encoding/json into the reference's RuntimeHookConfig).

koordlet and other hook servers write these files for koord-runtime-proxy; krproxy must register
what it registers from the same bytes. A file krproxy read otherwise went around a hook: a
``Failure-Policy: Fail`` that Go reads as the field, skipped by krproxy as an unknown key, made a
required hook server optional, and a ``runtime-hooKs`` list (Kelvin sign) registered it for nothing.
Where krproxy is deliberately stricter it says so: an unknown policy string is Fail (Go's Ignore), a
relative endpoint refuses the file."""

from __future__ import annotations

from typing import Any

import pytest

from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import FailurePolicy, RegistrationError, parse_registration
from tests.unit.gojson_support import go_reads, gojson  # noqa: F401 - the fixture

KNOWN = {point.value for point in HookPoint}

E = '"remote-endpoint":"/run/p.sock"'
HOOKS = '"runtime-hooks":["PreCreateContainer"]'

#: Odd spellings of a file Go reads one way: (name, bytes).
CASES = [
    ("plain", f'{{{E},"failure-policy":"Fail",{HOOKS}}}'.encode()),
    ("key in capitals", f'{{{E},"Failure-Policy":"Fail",{HOOKS}}}'.encode()),
    ("key all capitals", f'{{"REMOTE-ENDPOINT":"/run/p.sock","FAILURE-POLICY":"Fail",{HOOKS}}}'.encode()),
    ("kelvin sign", f'{{{E},"failure-policy":"Fail","runtime-hoo\u212as":["PreStartContainer"]}}'.encode()),
    ("long s", f'{{{E},"failure-policy":"Fail","runtime-hook\u017f":["PreStartContainer"]}}'.encode()),
    ("twice, last Ignore", f'{{{E},"failure-policy":"Fail","Failure-Policy":"Ignore",{HOOKS}}}'.encode()),
    ("twice, last Fail", f'{{{E},"failure-policy":"Ignore","FAILURE-policy":"Fail",{HOOKS}}}'.encode()),
    ("exact twice", f'{{{E},"failure-policy":"Fail","failure-policy":"Ignore",{HOOKS}}}'.encode()),
    ("null after Fail", f'{{{E},"failure-policy":"Fail","failure-policy":null,{HOOKS}}}'.encode()),
    ("empty after Fail", f'{{{E},"failure-policy":"Fail","failure-policy":"",{HOOKS}}}'.encode()),
    ("null endpoint after", f'{{{E},"remote-endpoint":null,"failure-policy":"Fail",{HOOKS}}}'.encode()),
    ("hooks then null", f'{{{E},"failure-policy":"Fail",{HOOKS},"runtime-hooks":null}}'.encode()),
    (
        "hooks twice",
        f'{{{E},"failure-policy":"Fail",{HOOKS},"Runtime-Hooks":["PreStartContainer"]}}'.encode(),
    ),
    ("wrong type first", f'{{{E},"failure-policy":5,"failure-policy":"Fail",{HOOKS}}}'.encode()),
    ("wrong type later", f'{{{E},"failure-policy":"Fail","failure-policy":true,{HOOKS}}}'.encode()),
    ("hooks of wrong type first", f'{{{E},"failure-policy":"Fail","runtime-hooks":"x",{HOOKS}}}'.encode()),
    ("invalid UTF-8 elsewhere", f'{{{E},"failure-policy":"Fail",{HOOKS},"note":"\xff"}}'.encode("latin-1")),
    ("byte order mark", b"\xef\xbb\xbf" + f'{{{E},"failure-policy":"Fail",{HOOKS}}}'.encode()),
    ("UTF-16", f'{{{E},"failure-policy":"Fail",{HOOKS}}}'.encode("utf-16")),
    ("NaN elsewhere", f'{{{E},"failure-policy":"Fail",{HOOKS},"note":NaN}}'.encode()),
    ("escaped key", f'{{{E},"failure\\u002dpolicy":"Fail",{HOOKS}}}'.encode()),
    ("trailing data", f'{{{E},"failure-policy":"Fail",{HOOKS}}} {{}}'.encode()),
    ("policy typo", f'{{{E},"failure-policy":"fail",{HOOKS}}}'.encode()),
    (
        "unknown hook",
        f'{{{E},"failure-policy":"Fail","runtime-hooks":["PreStopContainer","PreStartContainer"]}}'.encode(),
    ),
    ("null hook", f'{{{E},"failure-policy":"Fail","runtime-hooks":[null,"PreStartContainer"]}}'.encode()),
    ("no endpoint", f'{{"failure-policy":"Fail",{HOOKS}}}'.encode()),
    ("tcp endpoint", f'{{"remote-endpoint":"tcp://127.0.0.1:9",{HOOKS},"failure-policy":"Fail"}}'.encode()),
    ("relative endpoint", f'{{"remote-endpoint":"run/p.sock","failure-policy":"Fail",{HOOKS}}}'.encode()),
    ("unix scheme", f'{{"remote-endpoint":"unix:///run/p.sock","failure-policy":"Fail",{HOOKS}}}'.encode()),
]


@pytest.fixture(scope="module")
def go_read(gojson: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:  # noqa: F811
    """What Go made of each case, by name."""
    reads = go_reads(gojson, tmp_path_factory.mktemp("registrations"), "registration", [c for _, c in CASES])
    return {name: read for (name, _), read in zip(CASES, reads, strict=True)}


def _as_krproxy_reads(content: bytes) -> dict[str, Any]:
    """krproxy's reading in Go's terms: the three fields, or an error."""
    try:
        registration = parse_registration("hookserver.d/p.json", content)
    except RegistrationError as exc:
        return {"error": exc.problem}
    return {
        "remote-endpoint": registration.endpoint,
        "fail": registration.failure_policy is FailurePolicy.FAIL,
        "runtime-hooks": [point.value for point in registration.hooks],
    }


def _as_go_reads(read: dict[str, Any]) -> dict[str, Any]:
    """Go's reading as krproxy states it: the endpoint without its ``unix://``, the hooks krproxy knows.
    koord-runtime-proxy fails closed on "Fail" only; krproxy on any string but "Ignore" and "" (a typo
    of "Fail" must not make a plugin optional: the one difference, the stricter one)."""
    if "error" in read:
        return {"error": read["error"]}
    config = read["value"]
    return {
        "remote-endpoint": config["remote-endpoint"].removeprefix("unix://"),
        "fail": config["failure-policy"] not in ("", "Ignore"),
        "runtime-hooks": [name for name in config["runtime-hooks"] or [] if name in KNOWN],
    }


@pytest.mark.parametrize("name", [name for name, _ in CASES])
def test_read_as_go_reads(name: str, go_read: dict[str, dict[str, Any]]) -> None:
    """krproxy registers the endpoint, failure policy and hooks Go reads from the same bytes, and refuses
    the files Go refuses."""
    content = dict(CASES)[name]
    ours, go = _as_krproxy_reads(content), _as_go_reads(go_read[name])
    if "error" in go or "error" in ours:
        assert ("error" in ours, "error" in go) == (True, True), (ours, go)
    else:
        assert ours == go


def test_other_spellings_are_warned() -> None:
    """A key spelt otherwise than the reference, or given twice, is read as Go reads it, with a warning
    that says how to write it."""
    content = f'{{{E},"failure-policy":"Ignore","Failure-Policy":"Fail",{HOOKS}}}'.encode()
    registration = parse_registration("hookserver.d/p.json", content)
    assert registration.failure_policy is FailurePolicy.FAIL
    assert registration.warnings == (
        'failure-policy is written "failure-policy", "Failure-Policy" (the last counts, as '
        'koord-runtime-proxy reads it): write it once, as "failure-policy"',
    )
