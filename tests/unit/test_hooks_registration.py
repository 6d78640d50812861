"""Registration files and the plugin Registry (krproxy.hooks.registration)."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import (
    DEFAULT_TIMEOUT,
    FailurePolicy,
    PluginRegistration,
    RegistrationError,
    Registry,
    is_registration_file,
    parse_duration,
    parse_registration,
)

FILE = "hookserver.d/koordlet.json"

KOORDLET = (
    b'{"remote-endpoint":"/var/run/koordlet/koordlet.sock","failure-policy":"Ignore",'
    b'"runtime-hooks":["PreRunPodSandbox","PreCreateContainer","PreStartContainer",'
    b'"PreUpdateContainerResources","PostStopPodSandbox","PreRemoveRunPodSandbox"]}'
)


def doc(**keys: object) -> bytes:
    base: dict[str, object] = {"remote-endpoint": "/run/p.sock", "runtime-hooks": ["PreCreateContainer"]}
    base.update({k.replace("_", "-"): v for k, v in keys.items()})
    return json.dumps({k: v for k, v in base.items() if v is not ...}).encode()


class TestParseRegistration:
    def test_koordlet_file(self) -> None:
        """A real koordlet file parses, its NRI-only stage accepted with a warning."""
        expected = PluginRegistration(
            name="koordlet",
            file=FILE,
            endpoint="/var/run/koordlet/koordlet.sock",
            failure_policy=FailurePolicy.IGNORE,
            hooks=(
                HookPoint.PRE_RUN_POD_SANDBOX,
                HookPoint.PRE_CREATE_CONTAINER,
                HookPoint.PRE_START_CONTAINER,
                HookPoint.PRE_UPDATE_CONTAINER_RESOURCES,
                HookPoint.POST_STOP_POD_SANDBOX,
            ),
            timeout=DEFAULT_TIMEOUT,
            order=0,
            warnings=(
                "runtime-hooks: PreRemoveRunPodSandbox is not supported by this proxy and is never called",
            ),
        )

        assert expected == parse_registration(FILE, KOORDLET)

    @pytest.mark.parametrize(
        ("endpoint", "expected"),
        [
            ("/run/p.sock", "/run/p.sock"),
            ("unix:///run/p.sock", "/run/p.sock"),
            ("unix:/run/p.sock", "/run/p.sock"),
        ],
    )
    def test_unix_prefix_optional(self, endpoint: str, expected: str) -> None:
        """unix:// (or unix:) is stripped from the endpoint."""
        assert expected == parse_registration("p.json", doc(remote_endpoint=endpoint)).endpoint

    @pytest.mark.parametrize(
        ("keys", "policy", "timeout", "order"),
        [
            ({}, FailurePolicy.IGNORE, 2.0, 0),
            ({"failure_policy": ""}, FailurePolicy.IGNORE, 2.0, 0),
            ({"failure_policy": None}, FailurePolicy.IGNORE, 2.0, 0),
            ({"failure_policy": "Fail"}, FailurePolicy.FAIL, 2.0, 0),
            ({"timeout": "500ms"}, FailurePolicy.IGNORE, 0.5, 0),
            ({"timeout": "1m30s"}, FailurePolicy.IGNORE, 90.0, 0),
            ({"timeout": 3}, FailurePolicy.IGNORE, 3.0, 0),
            ({"timeout": 0.25}, FailurePolicy.IGNORE, 0.25, 0),
            ({"timeout": "5m"}, FailurePolicy.IGNORE, 300.0, 0),
            ({"order": -3}, FailurePolicy.IGNORE, 2.0, -3),
        ],
    )
    def test_defaults_and_options(
        self, keys: dict[str, object], policy: FailurePolicy, timeout: float, order: int
    ) -> None:
        """Policy defaults to Ignore, timeout to 2 s, order to 0; each can be set."""
        reg = parse_registration("p.json", doc(**keys))

        assert (policy, timeout, order) == (reg.failure_policy, reg.timeout, reg.order)

    @pytest.mark.parametrize(
        ("content", "problem"),
        [
            (
                b"{",
                "not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
            ),
            (
                b"\xff\xfe\xfa",
                "not valid JSON: Expecting value: line 1 column 1 (char 0)",
            ),
            (b"[]", "top level must be a JSON object, not an array"),
            (doc(remote_endpoint=5), "remote-endpoint must be a string, not a number"),
            (doc(failure_policy=True), "failure-policy must be a string, not a boolean"),
            (
                doc(runtime_hooks="PreCreateContainer"),
                "runtime-hooks must be an array of hook names, not a string",
            ),
            (doc(runtime_hooks=[1]), "runtime-hooks must hold hook names (strings), not a number"),
            (doc(timeout="2"), 'timeout "2" is not a number of seconds or a duration like "2s" or "500ms"'),
            (doc(timeout=True), 'timeout true is not a number of seconds or a duration like "2s" or "500ms"'),
            (doc(timeout="0s"), 'timeout "0s" is not in (0s, 5m]'),
            (doc(timeout=-1), "timeout -1 is not in (0s, 5m]"),
            (doc(timeout="10m"), 'timeout "10m" is not in (0s, 5m]'),
            (b'{"remote-endpoint": "/p", "timeout": NaN}', "not valid JSON: NaN is not a JSON value"),
            (doc(order="1"), 'order must be an integer, not "1"'),
            (doc(order=1.5), "order must be an integer, not 1.5"),
        ],
    )
    def test_errors(self, content: bytes, problem: str) -> None:
        """Each malformed file raises RegistrationError naming the file and the problem."""
        with pytest.raises(RegistrationError) as info:
            parse_registration(FILE, content)

        assert (FILE, problem, f"{FILE}: {problem}") == (info.value.file, info.value.problem, str(info.value))

    @pytest.mark.parametrize(
        ("keys", "warnings"),
        [
            ({"runtime_hooks": []}, ("runtime-hooks lists no supported hook: the plugin is never called",)),
            ({"runtime_hooks": ...}, ("runtime-hooks is missing: the plugin is never called",)),
            ({"weight": 3}, ('unknown key "weight" ignored',)),
            (
                {"runtime_hooks": ["PreCreateContainer", "PreFoo", None]},
                (
                    'runtime-hooks: unknown hook "PreFoo" is never called (known: PreRunPodSandbox, '
                    "PostStopPodSandbox, PreCreateContainer, PreStartContainer, PostStartContainer, "
                    "PostStopContainer, PreUpdateContainerResources, PreUpdatePodSandboxResources)",
                    "runtime-hooks: null is no hook name and is ignored",
                ),
            ),
        ],
    )
    def test_warnings(self, keys: dict[str, object], warnings: tuple[str, ...]) -> None:
        """Accepted oddities are reported as warnings."""
        assert warnings == parse_registration("p.json", doc(**keys)).warnings

    @pytest.mark.parametrize("policy", ["fail", "Sometimes", "FAIL"])
    def test_unknown_policy_is_fail(self, policy: str) -> None:
        """A failure-policy that is neither Fail nor Ignore (a typo) is read as Fail, with a warning: a typo
        must not make a Fail plugin optional, nor leave its file unregistered (its hooks never called)."""
        registration = parse_registration("p.json", doc(failure_policy=policy))

        assert FailurePolicy.FAIL == registration.failure_policy
        assert (
            f'failure-policy "{policy}" is not Fail or Ignore: read as Fail (a call fails when this hook server '
            "does; koord-runtime-proxy reads it as Ignore): write Fail or Ignore",
        ) == registration.warnings

    @pytest.mark.parametrize(
        ("endpoint", "unusable"),
        [
            (..., "remote-endpoint is missing"),
            ("", "remote-endpoint is empty"),
            (
                "tcp://10.0.0.1:9000",
                "remote-endpoint 'tcp://10.0.0.1:9000' is not a unix socket (only unix:// is supported)",
            ),
            ("unix://", "remote-endpoint 'unix://' has an empty socket path"),
            ("run/p.sock", "remote-endpoint 'run/p.sock' is not an absolute socket path"),
            ("/run/p\0.sock", "remote-endpoint '/run/p\\x00.sock' contains a NUL character"),
        ],
    )
    def test_unusable_endpoint(self, endpoint: object, unusable: str) -> None:
        """A file without a socket krproxy can dial registers its plugin unusable, with a warning: its
        calls fail as its failure-policy says, as koord-runtime-proxy's fail to dial it."""
        registration = parse_registration("p.json", doc(remote_endpoint=endpoint, failure_policy="Fail"))

        assert (unusable, FailurePolicy.FAIL) == (registration.unusable, registration.failure_policy)
        assert (f"{unusable}: every call to this hook server fails, as its failure-policy says",) == (
            registration.warnings
        )

    def test_unknown_hook_leaves_the_others(self) -> None:
        """An unknown hook name (a newer koordlet's) does not unregister the plugin's known hooks."""
        content = doc(runtime_hooks=["PreStartContainer", "PreStopContainer"])

        assert (HookPoint.PRE_START_CONTAINER,) == parse_registration("p.json", content).hooks

    def test_duplicate_hooks_once(self) -> None:
        """A hook listed twice is registered once, in first position."""
        content = doc(runtime_hooks=["PostStopContainer", "PreStartContainer", "PostStopContainer"])

        hooks = parse_registration("p.json", content).hooks

        assert (HookPoint.POST_STOP_CONTAINER, HookPoint.PRE_START_CONTAINER) == hooks

    @given(st.binary())
    def test_arbitrary_bytes(self, content: bytes) -> None:
        """Arbitrary bytes either parse or raise RegistrationError, nothing else."""
        with contextlib.suppress(RegistrationError):
            parse_registration("x.json", content)

    @given(
        st.dictionaries(
            st.sampled_from(["remote-endpoint", "failure-policy", "runtime-hooks", "timeout", "order", "x"]),
            st.recursive(
                st.none()
                | st.booleans()
                | st.integers()
                | st.floats()
                | st.text(max_size=12)
                | st.sampled_from(["unix:///s", "/s", "Fail", "2s"]),
                lambda children: (
                    st.lists(children, max_size=4)
                    | st.dictionaries(st.text(max_size=4), children, max_size=3)
                ),
                max_leaves=8,
            ),
        )
    )
    def test_arbitrary_json(self, document: dict[str, object]) -> None:
        """Arbitrary JSON objects either parse or raise RegistrationError, nothing else."""
        with contextlib.suppress(RegistrationError):
            parse_registration("x.json", json.dumps(document).encode())


class TestParseDuration:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("2s", 2.0),
            ("500ms", 0.5),
            ("1.5s", 1.5),
            ("1h", 3600.0),
            ("250us", 0.00025),
            ("2", None),
            ("s", None),
            ("", None),
        ],
    )
    def test_parse(self, text: str, expected: float | None) -> None:
        """Go-style durations parse to seconds; anything else is None."""
        assert expected == parse_duration(text)


class TestIsRegistrationFile:
    @pytest.mark.parametrize(
        ("name", "expected"),
        [
            ("koordlet.json", True),
            ("/etc/runtime/hookserver.d/koordlet.json", True),
            (".koordlet.json.swp", False),
            (".koordlet.json", False),
            ("koordlet.json~", False),
            ("koordletjson", False),
            ("koordlet.yaml", False),
        ],
    )
    def test_names(self, name: str, expected: bool) -> None:
        """Only visible *.json names are registration files."""
        assert expected == is_registration_file(name)


class TestRegistry:
    def test_apply_valid(self) -> None:
        """A valid file is registered under its name."""
        registry = Registry().apply(FILE, KOORDLET)

        assert ((FILE,), {}) == (tuple(registry.plugins), dict(registry.errors))

    def test_bad_update_keeps_previous(self) -> None:
        """A malformed new version keeps the previous valid one and records the error."""
        good = Registry().apply(FILE, KOORDLET)

        bad = good.apply(FILE, doc(failure_policy=True))

        assert good.plugins == bad.plugins
        assert f"{FILE}: failure-policy must be a string, not a boolean" == bad.error_for(FILE)

    def test_fix_clears_error(self) -> None:
        """A valid version after a bad one replaces the registration and clears the error."""
        registry = Registry().apply(FILE, b"nope").apply(FILE, doc(failure_policy="Fail"))

        assert (None, FailurePolicy.FAIL) == (registry.error_for(FILE), registry.plugins[FILE].failure_policy)

    def test_bad_first_version(self) -> None:
        """A file that never was valid registers nothing but its error."""
        registry = Registry().apply(FILE, b"[]")

        assert ({}, {FILE: f"{FILE}: top level must be a JSON object, not an array"}) == (
            dict(registry.plugins),
            dict(registry.errors),
        )

    def test_deletion(self) -> None:
        """Deleting a file removes its registration and its error."""
        registry = (
            Registry().apply(FILE, KOORDLET).apply("b.json", b"x").apply(FILE, None).apply("b.json", None)
        )

        assert Registry() == registry

    def test_ignored_names(self) -> None:
        """Hidden and non-JSON files do not change the registry."""
        registry = Registry()

        assert registry is registry.apply(".koordlet.json.swp", KOORDLET)

    def test_ordering(self) -> None:
        """Plugins for a hook are ordered by (order, file name) and filtered by hook."""
        registry = (
            Registry()
            .apply("d/b.json", doc(order=0))
            .apply("d/a.json", doc(order=0))
            .apply("d/z.json", doc(order=-1))
            .apply("d/c.json", doc(order=5))
            .apply("d/other.json", doc(runtime_hooks=["PreRunPodSandbox"]))
        )

        names = [p.name for p in registry.plugins_for(HookPoint.PRE_CREATE_CONTAINER)]

        assert ["z", "a", "b", "c"] == names
        assert ["other"] == [p.name for p in registry.plugins_for(HookPoint.PRE_RUN_POD_SANDBOX)]

    def test_input_unchanged(self) -> None:
        """apply returns a new registry and leaves the old one as it was."""
        empty = Registry()

        empty.apply(FILE, KOORDLET)

        assert Registry() == empty

    def test_record_error_keeps_previous(self) -> None:
        """An error from outside the content (unreadable file) keeps the previous valid version."""
        good = Registry().apply(FILE, KOORDLET)

        registry = good.record_error(FILE, "cannot read: Permission denied")

        assert good.plugins == registry.plugins
        assert f"{FILE}: cannot read: Permission denied" == registry.error_for(FILE)
