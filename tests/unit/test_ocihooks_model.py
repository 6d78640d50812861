"""Hook files (schema 1.0.0): parsing, ``when`` matching, directory precedence and order, state JSON."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from krproxy.ocihooks.model import (
    Container,
    HookCommand,
    HookFile,
    InvalidHookFile,
    effective,
    parse_hook_file,
    select,
    state_document,
)


def hook_json(**changes: Any) -> bytes:
    doc: dict[str, Any] = {
        "version": "1.0.0",
        "hook": {"path": "/usr/bin/hook"},
        "when": {"always": True},
        "stages": ["prestart"],
    }
    doc.update(changes)
    return json.dumps(doc).encode()


def parsed(when: dict[str, Any], name: str = "a.json", stages: tuple[str, ...] = ("prestart",)) -> HookFile:
    return parse_hook_file(name, hook_json(when=when, stages=list(stages)))


PLAIN = Container(annotations={}, command="/bin/sh", has_bind_mounts=False)


class TestParse:
    def test_full_file(self) -> None:
        """Every field of a 1.0.0 file lands in the HookFile; stages come out in lifecycle order."""
        content = hook_json(
            hook={"path": "/usr/bin/h", "args": ["h", "x"], "env": ["A=1"], "timeout": 5},
            stages=["poststop", "prestart"],
        )
        hook = parse_hook_file("h.json", content, "/etc/h.json")
        assert HookCommand("/usr/bin/h", ("h", "x"), ("A=1",), 5) == hook.command
        assert ("prestart", "poststop") == hook.stages
        assert "/etc/h.json" == hook.source

    def test_argv_defaults_to_path(self) -> None:
        """Without args the hook's argv is just its path (runtime-spec execv semantics)."""
        assert ["/usr/bin/hook"] == parse_hook_file("a.json", hook_json()).command.argv

    @pytest.mark.parametrize(
        ("changes", "message"),
        [
            ({"version": "0.1.0"}, "version must be '1.0.0'"),
            ({"hook": {"args": ["x"]}}, "hook.path"),
            ({"hook": {"path": "relative/hook"}}, "must be absolute"),
            ({"hook": {"path": "/h", "timeout": 0}}, "positive integer"),
            ({"hook": {"path": "/h", "timeout": True}}, "positive integer"),
            ({"hook": {"path": "/h", "env": ["NOEQUALS"]}}, "NAME=VALUE"),
            ({"hook": {"path": "/h", "args": "x"}}, "hook.args must be a list"),
            ({"when": {}}, "at least one of"),
            ({"when": {"always": "yes"}}, "true or false"),
            ({"when": {"commands": ["("]}}, "not a valid regular expression"),
            ({"when": {"annotations": {"a": "["}}}, "not a valid regular expression"),
            ({"when": {"annotations": ["a"]}}, "key pattern -> value pattern"),
            ({"stages": []}, "at least one stage"),
            ({"stages": ["prestrat"]}, "unknown stage 'prestrat'"),
        ],
    )
    def test_invalid(self, changes: dict[str, Any], message: str) -> None:
        """Each schema violation is refused with a message naming it."""
        with pytest.raises(InvalidHookFile, match=message.replace("(", r"\(").replace("[", r"\[")):
            parse_hook_file("a.json", hook_json(**changes))

    @pytest.mark.parametrize("content", [b"{", b"[]", b"\xff"])
    def test_not_an_object(self, content: bytes) -> None:
        """Bytes that are not a JSON object are refused."""
        with pytest.raises(InvalidHookFile):
            parse_hook_file("a.json", content)

    @given(st.binary(max_size=200))
    def test_never_crashes(self, content: bytes) -> None:
        """Any bytes either parse or raise InvalidHookFile, nothing else."""
        with contextlib.suppress(InvalidHookFile):
            parse_hook_file("a.json", content)


class TestWhen:
    def test_always(self) -> None:
        """always: true matches every container; always: false none."""
        assert (True, False) == (
            parsed({"always": True}).applies("prestart", PLAIN),
            parsed({"always": False}).applies("prestart", PLAIN),
        )

    def test_annotations_need_key_and_value_of_one_annotation(self) -> None:
        """A pattern pair holds only if one annotation matches both key and value."""
        hook = parsed({"annotations": {"^gpu$": "^yes$"}})
        assert hook.when.matches(PLAIN._replace(annotations={"gpu": "yes"}))
        assert not hook.when.matches(PLAIN._replace(annotations={"gpu": "no", "other": "yes"}))

    def test_annotation_pairs_are_anded(self) -> None:
        """Every pattern pair must be matched."""
        hook = parsed({"annotations": {"^a$": "1", "^b$": "2"}})
        assert hook.when.matches(PLAIN._replace(annotations={"a": "1", "b": "2"}))
        assert not hook.when.matches(PLAIN._replace(annotations={"a": "1"}))

    def test_patterns_are_searched_not_anchored(self) -> None:
        """Like Go's MatchString, a pattern may match anywhere in the string."""
        assert parsed({"commands": ["sh"]}).when.matches(PLAIN)

    def test_commands_any_of(self) -> None:
        """commands holds when any pattern matches process.args[0]."""
        hook = parsed({"commands": ["^/init$", "/sh$"]})
        assert hook.when.matches(PLAIN)
        assert not hook.when.matches(PLAIN._replace(command="/bin/bash"))

    def test_unknown_command_never_matches(self) -> None:
        """When the command is unknown a commands condition cannot hold."""
        assert not parsed({"commands": [".*"]}).when.matches(PLAIN._replace(command=None))

    def test_has_bind_mounts(self) -> None:
        """hasBindMounts: true needs bind mounts; hasBindMounts: false never holds."""
        mounted = PLAIN._replace(has_bind_mounts=True)
        assert parsed({"hasBindMounts": True}).when.matches(mounted)
        assert not parsed({"hasBindMounts": True}).when.matches(PLAIN)
        assert not parsed({"hasBindMounts": False}).when.matches(PLAIN)

    def test_conditions_are_anded(self) -> None:
        """With several conditions set, all must hold."""
        hook = parsed({"always": True, "commands": ["sh"], "hasBindMounts": True})
        assert not hook.when.matches(PLAIN)
        assert hook.when.matches(PLAIN._replace(has_bind_mounts=True))

    def test_stage_must_be_listed(self) -> None:
        """A matching hook applies only at the stages it lists."""
        hook = parsed({"always": True}, stages=("poststop",))
        assert (False, True) == (hook.applies("prestart", PLAIN), hook.applies("poststop", PLAIN))


class TestPrecedence:
    def test_later_directory_masks_same_name(self) -> None:
        """The same file name in a later directory replaces the earlier one."""
        early = parse_hook_file("01-x.json", hook_json(hook={"path": "/early"}))
        late = parse_hook_file("01-x.json", hook_json(hook={"path": "/late"}))
        assert ["/late"] == [h.command.path for h in effective([{"01-x.json": early}, {"01-x.json": late}])]

    def test_invalid_later_file_masks_too(self) -> None:
        """An invalid file still masks the same-named earlier file: neither runs."""
        early = parse_hook_file("01-x.json", hook_json())
        assert [] == effective([{"01-x.json": early}, {"01-x.json": "not valid JSON"}])

    def test_order_is_lowercased_name(self) -> None:
        """Files run in order of their lower-cased names, whatever directory they come from."""
        names = ["b.json", "A.json", "01-z.json"]
        layers = [{n: parse_hook_file(n, hook_json())} for n in names]
        assert ["01-z.json", "A.json", "b.json"] == [h.name for h in effective(layers)]

    def test_select_keeps_order(self) -> None:
        """select returns the matching hooks of a stage in run order."""
        hooks = effective([{n: parsed({"always": True}, n)} for n in ("b.json", "a.json")])
        assert ["a.json", "b.json"] == [h.name for h in select(hooks, "prestart", PLAIN)]


class TestState:
    def test_known_fields_only(self) -> None:
        """The state has ociVersion, id, status, annotations; pid and bundle only when known."""
        assert {
            "ociVersion": "1.0.2",
            "id": "c1",
            "status": "creating",
            "annotations": {"a": "b"},
        } == json.loads(state_document("c1", "creating", {"a": "b"}))
        with_pid = json.loads(state_document("c1", "running", {}, pid=42, bundle="/b"))
        assert (42, "/b") == (with_pid["pid"], with_pid["bundle"])
