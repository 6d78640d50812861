"""The launcher's index: needles that every matching spec contains, and the index file."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from krproxy.ocihooks import index
from krproxy.ocihooks.model import parse_hook_file


def literal(pattern: str) -> str:
    return index.required_literal(re.compile(pattern))


class TestRequiredLiteral:
    @pytest.mark.parametrize(
        ("pattern", "expected"),
        [
            (r"^io\.containers\.trace-syscall$", "io.containers.trace-syscall"),
            (r"nvidia-smi$", "nvidia-smi"),
            (r"/usr/bin/nvidia-smi", "nvidia-smi"),  # "/" may be escaped by some JSON encoders
            (r"^abc?d", "ab"),  # "c" may be absent: runs are "ab" and "d"
            (r"ab*", "a"),
            (r"ab{0,2}cd", "cd"),
            (r"ab+c", "ab"),  # "+" keeps "b" but ends the run
            (r"gpu(-[0-9]+)?-enabled", "-enabled"),
            (r"x(?:abc)y", "x"),  # nothing inside a group counts
            (r"^[a-z]+\.example\.com$", ".example.com"),
            (r"a[]b]cdef", "cdef"),  # "]" first in a class is a member
            (r"\d\dvalue", "value"),
            (r"\x41bcd", ""),  # the hex digits belong to the escape
            (r"\x41bcd-e", "-e"),
            (r"\N{DIGIT ONE}abc", "abc"),
            (r"\12345", ""),
            (r"a|bcdef", ""),  # top-level alternation: nothing is certain
            (r"(a|b)cdef", "cdef"),  # alternation inside a group is fine
            (r"(?i)abcdef", ""),  # case-insensitive: the text may read ABCDEF
            (r"(?x) a b c", ""),  # verbose: spaces and comments are not literal
            (r"", ""),
            (r".*", ""),
            (r"ab\.?cd", "ab"),  # the optional "." splits "ab" from "cd"; the first longest wins
            (r'say"hello"', "hello"),  # '"' is escaped in JSON
            # A "{" that does not start a {m,n} repeat is a literal "{": what follows it is parsed as
            # usual (a class, a group), not skipped up to the next "}".
            (r"x{[}ab]cd", "cd"),  # "ab" is in the class [}ab]: "x{}cd" matches
            (r"x{(ab}cd)?", "x"),  # "cd" is in an optional group: "x{" matches
            (r"a{}bcd", "bcd"),  # "{}" is literal text
            (r"ab{,}cde", "cde"),  # {,} is a repeat (zero or more)
            (r"ab{1,2}+cde", "cde"),  # possessive repeat
            # A comment is nothing: a repeat after it applies to the atom before it.
            (r"abc(?#x)*d", "ab"),  # "c" may be absent: "abd" matches
            (r"ab(?#x\)y)cd", "abcd"),
        ],
    )
    def test_cases(self, pattern: str, expected: str) -> None:
        assert expected == literal(pattern)

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
    @given(st.data())
    def test_every_match_contains_it(self, data: st.DataObject) -> None:
        """For random patterns, every string the pattern finds contains the literal."""
        tokens = st.sampled_from(
            ["a", "b", "c", "-", ".", r"\.", "x", "*", "+", "?", "{2}", "{0,1}", "(", ")", "(?:",
             "[ab]", "[^a]", "^", "$", "|", r"\d", r"\w", r"\x61", "(?=a)", "(?i)", "+?", "*?", '"', "/",
             "{", "}", "{,}", "[}a]", "{1,", "(?#x)", "(?#[)"]
        )  # fmt: skip
        pattern = "".join(data.draw(st.lists(tokens, max_size=10)))
        try:
            compiled = re.compile(pattern)
        except re.error:
            assume(False)
            return
        needle = index.required_literal(compiled)
        text = data.draw(st.from_regex(compiled))
        assert compiled.search(text)
        assert needle in text
        assert set(needle) <= index.NEEDLE_CHARS


def hook(when: dict[str, object], name: str = "h.json") -> object:
    doc = {"version": "1.0.0", "hook": {"path": "/h"}, "when": when, "stages": ["prestart"]}
    return parse_hook_file(name, json.dumps(doc).encode())


class TestHookNeedles:
    def test_annotation_pair_uses_the_longer_of_key_and_value(self) -> None:
        assert ["io.containers.trace-syscall"] == index.hook_needles(
            hook({"annotations": {r"^io\.containers\.trace-syscall$": ".*"}})  # type: ignore[arg-type]
        )
        assert ["gpu-enabled"] == index.hook_needles(hook({"annotations": {".*": "^gpu-enabled$"}}))  # type: ignore[arg-type]

    def test_commands_need_a_literal_each(self) -> None:
        assert ["nvidia-smi", "nvidia-container"] == index.hook_needles(
            hook({"commands": ["nvidia-smi$", "nvidia-container"]})  # type: ignore[arg-type]
        )
        # One command without a literal: the commands say nothing; the annotation still does.
        got = index.hook_needles(hook({"commands": ["nvidia", ".*"], "annotations": {"^gpu$": ""}}))  # type: ignore[arg-type]
        assert ["gpu"] == got

    def test_always_and_bind_mounts_cannot_be_ruled_out(self) -> None:
        assert [""] == index.hook_needles(hook({"always": True}))  # type: ignore[arg-type]
        assert [""] == index.hook_needles(hook({"hasBindMounts": True}))  # type: ignore[arg-type]
        assert [""] == index.hook_needles(hook({"annotations": {".*": ".*"}}))  # type: ignore[arg-type]

    def test_hooks_that_never_match_need_nothing(self) -> None:
        assert index.hook_needles(hook({"always": False})) is None  # type: ignore[arg-type]
        assert index.hook_needles(hook({"hasBindMounts": False, "annotations": {"^a$": ""}})) is None  # type: ignore[arg-type]


class TestIndexFile:
    def test_lines_and_mtime(self, tmp_path: Path) -> None:
        """Header first, each needle once; the mtime is a second before the directories were read."""
        hooks = [
            hook({"annotations": {r"^a\.b$": ""}}, "1.json"),
            hook({"annotations": {r"a\.b": "x"}}, "2.json"),
        ]
        hooks.append(hook({"always": False}, "3.json"))
        path = tmp_path / "sub" / "index"
        started = time.time_ns()
        index.write_index(str(path), ":/d1:/d2", hooks, started)  # type: ignore[arg-type]
        assert ["# krproxy-oci-index 2 dirs=:/d1:/d2", "# watch=", "a.b"] == path.read_text().splitlines()
        assert started - index.BACKDATE_NS == path.stat().st_mtime_ns
        assert 0o700 == (path.parent.stat().st_mode & 0o777)
        assert ["index"] == os.listdir(path.parent)  # no temporary left behind

    def test_deciding_dirs_hold_the_symlinks_on_the_way(self, tmp_path: Path) -> None:
        """The directories holding a symlink on the way to a hook directory or to a hook file (their
        targets' symlinks too); none for plain paths; None (and the empty needle) for a loop."""
        real = tmp_path / "real"
        (real / "hooks").mkdir(parents=True)
        (tmp_path / "links").mkdir()
        (tmp_path / "links" / "to-real").symlink_to("../real")
        (tmp_path / "vendor" / "v1").mkdir(parents=True)
        (tmp_path / "vendor" / "v1" / "a.json").write_text("{}")
        (tmp_path / "vendor" / "current").symlink_to("v1")
        (real / "hooks" / "a.json").symlink_to(tmp_path / "vendor" / "current" / "a.json")
        (real / "hooks" / "plain.json").write_text("{}")
        (real / "hooks" / "other.txt").symlink_to("/nonexistent")  # not a hook file: not followed
        assert "" == index.deciding_dirs([str(tmp_path / "vendor")])
        got = index.deciding_dirs([str(tmp_path / "links" / "to-real" / "hooks")])
        assert f":{tmp_path / 'links'}:{real / 'hooks'}:{tmp_path / 'vendor'}" == got
        (tmp_path / "loop").symlink_to("loop")
        assert index.deciding_dirs([str(tmp_path / "loop")]) is None
        lines = index.index_lines(":/d", [], None)
        assert ["# krproxy-oci-index 2 dirs=:/d", "# watch=", ""] == lines

    def test_existing_dirs(self, tmp_path: Path) -> None:
        (tmp_path / "a").mkdir()
        assert f":{tmp_path / 'a'}" == index.existing_dirs(
            [str(tmp_path / "a"), str(tmp_path / "missing"), ""]
        )


def go_json(doc: object) -> str:
    """JSON as Go's encoding/json writes it (containerd's config.json): UTF-8, with <, >, &, U+2028
    and U+2029 escaped."""
    text = json.dumps(doc, ensure_ascii=False)
    for char in "<>&\u2028\u2029":
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text


PATTERN = st.lists(
    st.sampled_from(
        ["a", "b", "-", ".", r"\.", "x", "*", "+", "?", "{2}", "{0,1}", "(", ")", "(?:", "[ab]", "[^a]", "^",
         "$", "|", r"\d", r"\x61", "(?=a)", "(?i)", "+?", '"', "/", "<", "&", "{", "}", "[}a]", "é", " "]
    ),
    max_size=8,
).map("".join)  # fmt: skip


class TestNeedlesAgainstMatching:
    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def test_a_matching_hook_has_a_needle_in_the_file(self, data: st.DataObject) -> None:
        """Random ``when`` (annotations, commands, always, hasBindMounts) and specs built to match it
        often: whenever the hook matches the spec, one of its needles is in the spec's JSON text."""
        from krproxy.ocihooks.model import InvalidHookFile
        from krproxy.ocihooks.wrapper import container_from_spec

        when: dict[str, object] = {}
        if data.draw(st.booleans()):
            when["annotations"] = data.draw(st.dictionaries(PATTERN, PATTERN, max_size=2))
        if data.draw(st.booleans()):
            when["commands"] = data.draw(st.lists(PATTERN, max_size=2))
        for key in ("always", "hasBindMounts"):
            if data.draw(st.booleans()):
                when[key] = data.draw(st.booleans())
        try:
            parsed = hook(when)
        except InvalidHookFile:
            assume(False)
            return

        def text_for(pattern: re.Pattern[str]) -> str:
            return data.draw(st.one_of(st.from_regex(pattern), st.text(max_size=5)))

        annotations = {text_for(k): text_for(v) for k, v in parsed.when.annotations}  # type: ignore[attr-defined]
        annotations.update(data.draw(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2)))
        commands = parsed.when.commands  # type: ignore[attr-defined]
        args = [text_for(data.draw(st.sampled_from(commands)))] if commands else ["/bin/sh"]
        mounts = [{"destination": "/d", "type": "bind", "source": "/s"}] if data.draw(st.booleans()) else []
        text = go_json({"process": {"args": args}, "annotations": annotations, "mounts": mounts})
        if parsed.when.matches(container_from_spec(json.loads(text))):  # type: ignore[attr-defined]
            needles = index.hook_needles(parsed)  # type: ignore[arg-type]
            assert needles is not None
            assert any(needle in text for needle in needles)
