"""The node policy file: parsing, validation, the live watcher and the rule module."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib

import pytest

from krproxy.hookserver import NodePolicy, PolicyError, PolicyWatcher, QoSClass, Rules
from krproxy.hookserver._policy import (
    SCHEMA,
    CPUQoS,
    CPUSuppress,
    Key,
    ResctrlQoS,
    annotated_example,
    schema_markdown,
)
from krproxy.hookserver.testing import logged_events

ROOT = pathlib.Path(__file__).resolve().parents[2]

YAML = """
resourceQOSStrategy:
  lsrClass: {cpuQOS: {groupIdentity: 2}}
  lsClass:
    cpuQOS: {groupIdentity: 2}
    resctrlQOS: {catRangeStartPercent: 0, catRangeEndPercent: 100, mbaPercent: 100}
  beClass:
    cpuQOS: {enable: true, groupIdentity: -1}
    resctrlQOS: {catRangeEndPercent: 30, mbaPercent: 50}
resourceUsedThresholdWithBE:
  cpuSuppressThresholdPercent: 60
  cpuSuppressPolicy: cpuset
"""


class TestParse:
    def test_yaml(self) -> None:
        """NodeSLO-shaped YAML becomes per-class strategies and the suppress settings."""
        policy = NodePolicy.from_text(YAML)
        be = policy.strategy(QoSClass.BE)
        assert be is not None
        assert CPUQoS(-1) == be.cpu_qos
        assert ResctrlQoS(0, 30, 50) == be.resctrl_qos
        assert CPUSuppress(60, "cpuset", 2000) == policy.cpu_suppress

    def test_json_is_the_same(self) -> None:
        """JSON is accepted and means the same."""
        import yaml

        assert NodePolicy.from_text(YAML) == NodePolicy.from_text(json.dumps(yaml.safe_load(YAML)))

    def test_lse_uses_lsr_and_system_nothing(self) -> None:
        """LSE pods get the lsrClass strategy; SYSTEM pods none."""
        policy = NodePolicy.from_text(YAML)
        assert policy.strategy(QoSClass.LSR) == policy.strategy(QoSClass.LSE)
        assert policy.strategy(QoSClass.SYSTEM) is None

    def test_disabled_section_is_absent(self) -> None:
        """``enable: false`` switches a section off."""
        policy = NodePolicy.from_text("resourceUsedThresholdWithBE: {enable: false}\n")
        assert policy.cpu_suppress is None

    @pytest.mark.parametrize(
        "text",
        [
            "[1, 2]",
            "resourceQOSStrategy: {beClass: {cpuQOS: {groupIdentity: 7}}}",
            "resourceQOSStrategy: {beClass: {resctrlQOS: {catRangeStartPercent: 50, catRangeEndPercent: 40}}}",
            "resourceUsedThresholdWithBE: {cpuSuppressPolicy: magic}",
            "resourceUsedThresholdWithBE: {cpuSuppressThresholdPercent: '65'}",
            "{unclosed",
        ],
    )
    def test_invalid(self, text: str) -> None:
        """Wrong shapes, ranges and syntax are PolicyErrors."""
        with pytest.raises(PolicyError):
            NodePolicy.from_text(text)


class TestUnknownKeys:
    @pytest.mark.parametrize(
        ("text", "message"),
        [
            (
                "resourceQOSStrategy: {beClass: {cpuQOS: {groupIdentiy: -1}}}",
                "unknown key 'resourceQOSStrategy.beClass.cpuQOS.groupIdentiy' (did you mean 'groupIdentity'?)",
            ),
            (
                "resourceQOSStrategy: {beclass: {}}",
                "unknown key 'resourceQOSStrategy.beclass' (did you mean 'beClass'?)",
            ),
            (
                "resourceUsedThresholdWithBE: {cpuSuppresPolicy: cpuset}",
                "(did you mean 'cpuSuppressPolicy'?)",
            ),
            ("resourceQOSStrategy: {lsClass: {enabled: false}}", "(did you mean 'enable'?)"),
            (
                "memoryQOS: {}",
                "unknown key 'memoryQOS' (known keys: resourceQOSStrategy, resourceUsedThresholdWithBE)",
            ),
        ],
    )
    def test_unknown_key_is_refused_with_the_nearest_known_one(self, text: str, message: str) -> None:
        """A key the schema does not know is an error naming it, and the nearest known key if any."""
        with pytest.raises(PolicyError) as err:
            NodePolicy.from_text(text)
        assert message in str(err.value)

    @pytest.mark.parametrize(
        ("text", "key"),
        [
            ("resourceQOSStrategy: {systemClass: {}}", "resourceQOSStrategy.systemClass"),
            ("resourceQOSStrategy: {policies: {cpuPolicy: coreSched}}", "resourceQOSStrategy.policies"),
            (
                "resourceQOSStrategy: {beClass: {memoryQOS: {enable: true}}}",
                "resourceQOSStrategy.beClass.memoryQOS",
            ),
            (
                "resourceQOSStrategy: {lsClass: {cpuQOS: {schedIdle: 1}}}",
                "resourceQOSStrategy.lsClass.cpuQOS.schedIdle",
            ),
            (
                "resourceUsedThresholdWithBE: {cpuSuppressMinPercent: 10}",
                "resourceUsedThresholdWithBE.cpuSuppressMinPercent",
            ),
            (
                "resourceUsedThresholdWithBE: {memoryEvictThresholdPercent: 70}",
                "resourceUsedThresholdWithBE.memoryEvictThresholdPercent",
            ),
            ("cpuBurstStrategy: {policy: auto}", "cpuBurstStrategy"),
        ],
    )
    def test_koordinator_keys_not_implemented_are_named_so(self, text: str, key: str) -> None:
        """A real NodeSLO key this hook server does not implement is refused as such, not "corrected"
        into a different key (systemClass is not a misspelt lsClass, cpuSuppressMinPercent not a
        misspelt cpuSuppressThresholdPercent)."""
        with pytest.raises(PolicyError) as err:
            NodePolicy.from_text(text)
        message = str(err.value)
        assert f"key {key!r} is a Koordinator NodeSLO key this hook server does not implement" in message
        assert "did you mean" not in message

    def test_a_whole_nodeslo_object_says_to_give_its_spec(self) -> None:
        """A NodeSLO object as kubectl prints it is refused with how to fix it: the spec's contents."""
        text = "apiVersion: slo.koordinator.sh/v1alpha1\nkind: NodeSLO\nmetadata: {name: n}\nspec: {}\n"
        with pytest.raises(PolicyError, match=r"whole NodeSLO object.*what is under its 'spec:'"):
            NodePolicy.from_text(text)

    def test_null_enable_is_absent(self) -> None:
        """`enable:` with no value (YAML null) is the default, as for every other key (and for a
        Koordinator *bool), not an error."""
        assert NodePolicy.from_text(
            "resourceQOSStrategy: {beClass: {cpuQOS: {enable: null, groupIdentity: -1}}}"
        ) == NodePolicy.from_text("resourceQOSStrategy: {beClass: {cpuQOS: {groupIdentity: -1}}}")

    def test_every_unknown_key_is_named(self) -> None:
        """Several unknown keys in one section are all named."""
        with pytest.raises(PolicyError, match=r"'a'.*; unknown key 'b'"):
            NodePolicy.from_text("{a: 1, b: 2}")

    def test_unknown_key_keeps_the_last_good_policy(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A misspelt key is refused like a bad value: the last good policy stays, and the log says so."""
        path = tmp_path / "policy.yaml"
        path.write_text(YAML)
        seen: list[NodePolicy] = []
        watcher = PolicyWatcher(str(path), seen.append)
        assert watcher.poll()
        path.write_text(YAML.replace("groupIdentity: -1", "groupIdentiy: -1"))
        os.utime(path, ns=(1, 1))
        with caplog.at_level(logging.ERROR):
            assert not watcher.poll()
        assert NodePolicy.from_text(YAML) == watcher.current
        assert [NodePolicy.from_text(YAML)] == seen
        [invalid] = logged_events(caplog.records, "policy_invalid")
        assert "groupIdentiy" in invalid["error"] and "did you mean 'groupIdentity'" in invalid["error"]
        assert invalid["kept_last_good"] is True


class TestSchemaDoc:
    def _generated_part(self) -> str:
        spec = importlib.util.spec_from_file_location(
            "gen_policy_doc", ROOT / "scripts" / "gen_policy_doc.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        documented: str = module.documented((ROOT / "docs" / "plugin-authoring.md").read_text())
        return documented

    def test_doc_is_generated_from_the_loaders_schema(self) -> None:
        """docs/plugin-authoring.md shows exactly what the loader's schema says (regenerate with
        ``python scripts/gen_policy_doc.py`` after changing SCHEMA)."""
        assert schema_markdown() == self._generated_part()

    def test_annotated_example_is_a_valid_policy_with_every_key(self) -> None:
        """The documented example loads, and it sets every key of the schema."""
        policy = NodePolicy.from_text(annotated_example())
        assert {QoSClass.LSR, QoSClass.LS, QoSClass.BE} == set(policy.classes)
        assert policy.cpu_suppress is not None

        def names(section: Key) -> set[str]:
            out = {section.name}
            for key in section.keys:
                out |= names(key)
            return out

        keys_in_example = {
            line.split(":")[0].strip()
            for line in annotated_example().splitlines()
            if ":" in line and not line.lstrip().startswith("#")
        }
        assert names(SCHEMA) - {""} == keys_in_example

    def test_every_key_has_meaning_and_default_in_the_table(self) -> None:
        """Each leaf key has a row with its meaning and default."""
        table = [line for line in schema_markdown().splitlines() if line.startswith("| `")]
        for row in table:
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert cells[1] and cells[4], row


class TestWatcher:
    def test_change_bad_file_and_recovery(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A change is taken; a bad file keeps the last good policy (logged); a fix is taken again."""
        path = tmp_path / "policy.yaml"
        seen: list[NodePolicy] = []
        watcher = PolicyWatcher(str(path), seen.append)
        assert not watcher.poll()  # missing: nothing yet
        path.write_text(YAML)
        assert watcher.poll()
        assert not watcher.poll()  # unchanged
        path.write_text("resourceQOSStrategy: [oops")
        with caplog.at_level(logging.ERROR):
            assert not watcher.poll()
        assert "policy_invalid" in caplog.text
        assert NodePolicy.from_text(YAML) == watcher.current
        path.write_text("resourceUsedThresholdWithBE: {cpuSuppressThresholdPercent: 50}\n")
        os.utime(path, ns=(1, 1))  # a different stamp even within one mtime tick
        assert watcher.poll()
        assert [NodePolicy.from_text(YAML), watcher.current] == seen

    @pytest.mark.parametrize("text", ["", "\n", "# nothing yet\n"])
    def test_an_empty_file_is_not_a_policy(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, text: str
    ) -> None:
        """A file caught empty (a writer that truncates, then writes) is refused, keeping the last
        good policy: taken, it would switch every feature off (and release BE) for a second.
        A policy with nothing in force is written `{}`."""
        path = tmp_path / "policy.yaml"
        path.write_text(YAML)
        watcher = PolicyWatcher(str(path), lambda p: None)
        assert watcher.poll()
        path.write_text(text)
        os.utime(path, ns=(1, 1))
        with caplog.at_level(logging.ERROR):
            assert not watcher.poll()
        assert NodePolicy.from_text(YAML) == watcher.current
        [invalid] = logged_events(caplog.records, "policy_invalid")
        assert "empty" in invalid["error"] and "{}" in invalid["error"]
        assert NodePolicy() == NodePolicy.from_text("{}")

    def test_a_missing_file_is_logged_at_start_and_when_gone(
        self, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A policy file missing at the first look is logged once (``policy_missing``, nothing to keep), and
        again, once, when it disappears later (the last good policy kept). Before, a file missing from the
        start logged nothing: ``--policy`` with a typo ran with no policy, silently."""
        path = tmp_path / "policy.yaml"
        watcher = PolicyWatcher(str(path), lambda p: None)
        with caplog.at_level(logging.WARNING):
            assert not watcher.poll()
            assert not watcher.poll()
        [missing] = logged_events(caplog.records, "policy_missing")
        assert {"path": str(path), "kept_last_good": False} == {
            k: missing[k] for k in ("path", "kept_last_good")
        }
        path.write_text(YAML)
        assert watcher.poll()
        caplog.clear()
        path.unlink()
        with caplog.at_level(logging.WARNING):
            assert not watcher.poll()
            assert not watcher.poll()
        [missing] = logged_events(caplog.records, "policy_missing")
        assert missing["kept_last_good"] is True
        assert NodePolicy.from_text(YAML) == watcher.current

    def test_rename_over_is_noticed(self, tmp_path: pathlib.Path) -> None:
        """Replacing the file by rename (new inode, as ConfigMap updates do) is a change."""
        path = tmp_path / "policy.yaml"
        path.write_text(YAML)
        watcher = PolicyWatcher(str(path), lambda p: None)
        watcher.poll()
        new = tmp_path / "new.yaml"
        new.write_text(YAML.replace("60", "70"))
        os.replace(new, path)
        assert watcher.poll()
        assert watcher.current is not None and watcher.current.cpu_suppress == CPUSuppress(70, "cpuset", 2000)


class TestRules:
    def test_callbacks_run_only_when_a_rule_changed(self) -> None:
        """Parse functions say whether their view changed; callbacks run only then."""
        rules = Rules()
        calls: list[str] = []
        state: dict[str, object] = {}

        def parse(policy: NodePolicy) -> bool:
            changed = state.get("p") != policy.cpu_suppress
            state["p"] = policy.cpu_suppress
            return changed

        rules.register("suppress", "", parse)
        rules.register("unsupported", "", lambda p: True, system_supported=lambda: False)
        rules.on_update(lambda: calls.append("reapply"))
        assert ("suppress",) == rules.update(NodePolicy.from_text(YAML))
        assert () == rules.update(NodePolicy.from_text(YAML))
        assert ["reapply"] == calls

    def test_failing_rule_is_logged_and_others_go_on(self, caplog: pytest.LogCaptureFixture) -> None:
        """A raising parse function does not stop the other rules."""
        rules = Rules()

        def broken(policy: NodePolicy) -> bool:
            raise RuntimeError("boom")

        rules.register("a", "", broken)
        rules.register("b", "", lambda p: True)
        assert ("b",) == rules.update(NodePolicy())
        assert "rule_parse_failed" in caplog.text
        with pytest.raises(ValueError, match="already registered"):
            rules.register("a", "", broken)
