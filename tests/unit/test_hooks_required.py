"""Required hook servers: the flag, the annotations, the decision (pure), and the guard in virtual time."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest

from krproxy import cli
from krproxy.hooks.points import HookPoint
from krproxy.hooks.required import (
    MAX_ANNOTATED_NAMES,
    MAX_NAME_BYTES,
    AnnotationError,
    RequiredServer,
    Requirements,
    effective_annotation,
    hooked_names,
    needed,
    parse_bool,
    parse_name_list,
    parse_required_server,
    required_names,
)

RUN = HookPoint.PRE_RUN_POD_SANDBOX
CREATE = HookPoint.PRE_CREATE_CONTAINER
KEY = "required-plugins.noderesource.dev"


class TestFlag:
    def test_name_alone_means_every_point(self) -> None:
        assert RequiredServer("koordlet", frozenset(HookPoint)) == parse_required_server("koordlet")

    def test_points(self) -> None:
        server = parse_required_server("koordlet=PreRunPodSandbox, PreUpdatePodSandboxResources")
        assert frozenset({RUN, HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES}) == server.points

    @pytest.mark.parametrize(
        ("text", "problem"),
        [
            ("", "empty name"),
            ("=PreRunPodSandbox", "empty name"),
            ("koordlet=", "empty hook point"),
            ("koordlet=PreRunPodSandbox,,", "empty hook point"),
            ("koordlet=PreRun", "unknown hook point 'PreRun' (known: PreRunPodSandbox,"),
            ("koordlet.json", "without .json"),
            ("/etc/runtime/hookserver.d/koordlet", "without directory"),
        ],
    )
    def test_bad_values(self, text: str, problem: str) -> None:
        with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(".", r"\.")):
            parse_required_server(text)

    def test_cli_names_the_flag(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit):
            cli.main(["serve", "--required-hook-server", "koordlet=PreStart"])
        err = capsys.readouterr().err
        assert "argument --required-hook-server: 'koordlet=PreStart': unknown hook point 'PreStart'" in err

    def test_docker_mode_refuses_required_servers(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Any
    ) -> None:
        """Docker mode has no guard: a required server there would hold nothing, so it is refused at start
        rather than run unguarded while the operator believes pods wait for it."""
        code = cli.main(
            [
                "serve",
                "--backend-runtime-mode=Docker",
                "--required-hook-server",
                "koordlet",
                f"--koord-runtimeproxy-endpoint={tmp_path}/p.sock",
            ]
        )
        err = capsys.readouterr().err
        assert 2 == code
        assert "--required-hook-server is not supported with --backend-runtime-mode=Docker" in err

    def test_repeated_flags_add_up(self) -> None:
        servers = [parse_required_server("a=PreRunPodSandbox"), parse_required_server("a=PreCreateContainer")]
        assert (RequiredServer("a", frozenset({RUN, CREATE})),) == Requirements(tuple(servers)).servers


class TestAnnotations:
    def test_effective_form_container_first_then_pod_then_bare(self) -> None:
        annotations = {KEY: "bare", f"{KEY}/pod": "pod", f"{KEY}/container.app": "app"}
        assert "app" == effective_annotation(annotations, KEY, "app")
        assert "pod" == effective_annotation(annotations, KEY, "sidecar")
        assert "pod" == effective_annotation(annotations, KEY, None)
        assert "bare" == effective_annotation({KEY: "bare"}, KEY, "app")
        assert effective_annotation({f"{KEY}/container.app": "x"}, KEY, None) is None

    def test_container_names_with_dots_match_whole(self) -> None:
        """NRI joins the key and the name as they are: container.my.app is container my.app, not my."""
        annotations = {f"{KEY}/container.my.app": '["gpu"]'}
        assert '["gpu"]' == effective_annotation(annotations, KEY, "my.app")
        assert effective_annotation(annotations, KEY, "my") is None
        assert ("gpu",) == required_names(Requirements(), CREATE, annotations, "my.app")

    @pytest.mark.parametrize(
        ("value", "names"),
        [
            ('["a", "b"]', ("a", "b")),
            ("[ plugin ]", ("plugin",)),  # NRI's own test writes YAML flow lists
            ("['a', \"b\"]", ("a", "b")),
            ("- a\n- b\n", ("a", "b")),
            ("", ()),
            ("[]", ()),
            ("null", ()),
        ],
    )
    def test_name_lists(self, value: str, names: tuple[str, ...]) -> None:
        assert names == parse_name_list(value)

    @pytest.mark.parametrize("value", ["net", '"net"', "[1]", '{"a": 1}', "[a,,b]", "[a", "- a\nb"])
    def test_not_name_lists(self, value: str) -> None:
        assert parse_name_list(value) is None

    def test_bool_spellings_are_go_s(self) -> None:
        assert [True, True, False, None] == [parse_bool(v) for v in ("true", "1", "F", "yes")]


class TestDecision:
    requirements = Requirements(
        (RequiredServer("koordlet", frozenset({RUN})),), tolerate_annotation="tolerate"
    )

    def test_flag_servers_at_their_points_only(self) -> None:
        assert ("koordlet",) == required_names(self.requirements, RUN, {}, None)
        assert () == required_names(self.requirements, CREATE, {}, "app")

    def test_annotations_at_creation_points(self) -> None:
        annotations = {f"{KEY}/pod": '["net"]', f"{KEY}/container.app": '["gpu"]'}
        assert ("koordlet", "net") == required_names(self.requirements, RUN, annotations, None)
        assert ("gpu",) == required_names(self.requirements, CREATE, annotations, "app")
        assert ("net",) == required_names(self.requirements, CREATE, annotations, "sidecar")
        assert () == required_names(self.requirements, HookPoint.PRE_START_CONTAINER, annotations, "app")

    def test_hooked_names_are_named_points_and_annotated_containers(self) -> None:
        """Must be called at the point itself: a flag's named points, a container's annotated names; not
        a bare flag's (wherever its file has it called) nor the pod's names at PreRunPodSandbox."""
        requirements = Requirements(
            (RequiredServer("koordlet", frozenset({RUN})), RequiredServer("everywhere")),
            tolerate_annotation="tolerate",
        )
        annotations = {f"{KEY}/pod": '["net"]', f"{KEY}/container.app": '["gpu"]'}
        assert ("koordlet",) == hooked_names(requirements, RUN, annotations, None)
        assert ("gpu",) == hooked_names(requirements, CREATE, annotations, "app")
        assert ("net",) == hooked_names(requirements, CREATE, annotations, "sidecar")
        assert () == hooked_names(requirements, CREATE, {**annotations, "tolerate": "true"}, "app")
        need = needed(requirements, CREATE, annotations, "app", met=("gpu",))
        assert (("everywhere",), ()) == (need.names, need.hooked)

    def test_no_repeats(self) -> None:
        assert ("koordlet",) == required_names(self.requirements, RUN, {KEY: '["koordlet"]'}, None)

    def test_annotations_off(self) -> None:
        off = attrs.evolve(self.requirements, annotation="")
        assert ("koordlet",) == required_names(off, RUN, {KEY: '["net"]'}, None)

    def test_tolerate_clears_everything_in_its_scope(self) -> None:
        annotations = {KEY: '["net"]', "tolerate/container.app": "true"}
        assert () == required_names(self.requirements, CREATE, annotations, "app")
        assert ("net",) == required_names(self.requirements, CREATE, annotations, "sidecar")
        assert () == required_names(self.requirements, RUN, {"tolerate": "True"}, None)

    def test_tolerate_key_unset_means_no_exemption(self) -> None:
        plain = attrs.evolve(self.requirements, tolerate_annotation="")
        assert ("koordlet",) == required_names(plain, RUN, {"tolerate": "true"}, None)

    @pytest.mark.parametrize(
        ("annotations", "problem"),
        [
            ({KEY: "net"}, "is not a list of hook server names"),
            ({"tolerate": "yes"}, "is not a boolean"),
            # strconv.ParseBool takes no spaces: NRI refuses " true", so it must not exempt here.
            ({"tolerate": " true"}, "is not a boolean"),
            ({"tolerate": "true\n"}, "is not a boolean"),
        ],
    )
    def test_malformed_annotations_refuse(self, annotations: dict[str, str], problem: str) -> None:
        with pytest.raises(AnnotationError, match=problem):
            required_names(self.requirements, RUN, annotations, None)

    def test_an_annotation_lists_at_most_max_annotated_names(self) -> None:
        """A pod listing thousands of names is refused with the bound, not probed and tracked name by name."""
        many = [f"server-{i}" for i in range(MAX_ANNOTATED_NAMES + 1)]
        enough = json.dumps(many[:MAX_ANNOTATED_NAMES] + many[:5])  # repeats count once

        assert MAX_ANNOTATED_NAMES == len(required_names(Requirements(), RUN, {KEY: enough}, None))
        with pytest.raises(AnnotationError, match=f"lists 33 hook servers; at most {MAX_ANNOTATED_NAMES}"):
            required_names(Requirements(), RUN, {KEY: json.dumps(many)}, None)
        with pytest.raises(AnnotationError, match="lists 5000 hook servers"):
            required_names(Requirements(), CREATE, {KEY: json.dumps([f"s{i}" for i in range(5000)])}, "app")

    def test_a_name_no_registration_file_can_have_refuses(self) -> None:
        longest = "n" * MAX_NAME_BYTES
        assert (longest,) == required_names(Requirements(), RUN, {KEY: json.dumps([longest])}, None)
        with pytest.raises(AnnotationError, match="name of 251 bytes"):
            required_names(Requirements(), RUN, {KEY: json.dumps([longest + "n"])}, None)

    def test_a_name_with_a_lone_surrogate_refuses(self) -> None:
        """JSON's escape of half a UTF-16 pair decodes to a str no file name or UTF-8 message can hold: the
        annotation is refused (INVALID_ARGUMENT), not a UnicodeEncodeError out of the call (UNKNOWN)."""
        with pytest.raises(AnnotationError, match="not valid UTF-8"):
            required_names(Requirements(), RUN, {KEY: '["\\ud800"]'}, None)
