"""krproxy-runc-wrapper: runc command lines, spec facts, hook injection, configuration, exec."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from krproxy.ocihooks import wrapper
from krproxy.ocihooks.model import Container

SPEC: dict[str, Any] = {
    "ociVersion": "1.0.2",
    "process": {"args": ["/bin/sh", "-c", "true"]},
    "annotations": {"io.kubernetes.cri.container-type": "container", "gpu": "yes"},
    "mounts": [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/etc/hosts", "type": "bind", "source": "/x/hosts", "options": ["rbind"]},
    ],
    "hooks": {"prestart": [{"path": "/already/there"}]},
}


def write_hook(directory: Path, name: str, path: str, when: dict[str, Any], stages: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    doc = {"version": "1.0.0", "hook": {"path": path}, "when": when, "stages": stages}
    (directory / name).write_text(json.dumps(doc))


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    path = tmp_path / "bundle"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(SPEC))
    (path / "config.json").chmod(0o600)
    return path


class TestParseRuncArgs:
    def test_containerd_create(self) -> None:
        """containerd's runc create: global flags, then create with --bundle, --pid-file and the id."""
        args = [
            "--root", "/run/containerd/runc/k8s.io", "--log", "/b/log.json", "--log-format", "json",
            "create", "--bundle", "/b", "--pid-file", "/b/init.pid", "--no-pivot", "abc",
        ]  # fmt: skip
        assert wrapper.Invocation("create", "/b", "abc") == wrapper.parse_runc_args(args)

    def test_equals_forms_and_short_bundle(self) -> None:
        """--root=DIR and -b DIR work too."""
        args = ["--root=/r", "--systemd-cgroup", "create", "-b", "/b", "--console-socket", "/s", "id1"]
        assert wrapper.Invocation("create", "/b", "id1") == wrapper.parse_runc_args(args)

    def test_other_commands(self) -> None:
        """Other subcommands are recognised but not parsed further."""
        assert wrapper.Invocation("delete", None, None) == wrapper.parse_runc_args(
            ["--root", "/r", "delete", "x"]
        )

    def test_bundle_defaults_to_cwd(self) -> None:
        """Without --bundle runc uses the current directory."""
        assert os.getcwd() == wrapper.parse_runc_args(["create", "x"]).bundle


class TestSpecFacts:
    def test_facts(self) -> None:
        """annotations and args[0] come from the spec; runtime-added binds do not count."""
        assert Container(SPEC["annotations"], "/bin/sh", False) == wrapper.container_from_spec(SPEC)

    def test_caller_bind_mount(self) -> None:
        """A bind mount elsewhere counts as requested by the caller."""
        spec = {
            **SPEC,
            "mounts": [{"destination": "/data", "type": "bind", "source": "/srv", "options": ["rbind"]}],
        }
        assert wrapper.container_from_spec(spec).has_bind_mounts


class TestInject:
    def test_matching_hooks_appended(self, tmp_path: Path, bundle: Path) -> None:
        """Matching hooks are appended after the spec's own, per stage; others are left out."""
        hooks = tmp_path / "hooks"
        write_hook(hooks, "10-gpu.json", "/gpu", {"annotations": {"^gpu$": "yes"}}, ["prestart", "poststop"])
        write_hook(hooks, "20-init.json", "/init-only", {"commands": ["^/init$"]}, ["prestart"])
        added = wrapper.inject(str(bundle), [str(hooks)], wrapper.Logger(None), "c1")
        spec = json.loads((bundle / "config.json").read_text())
        assert ["10-gpu.json:prestart", "10-gpu.json:poststop"] == added
        assert [{"path": "/already/there"}, {"path": "/gpu", "env": []}] == spec["hooks"]["prestart"]
        assert [{"path": "/gpu", "env": []}] == spec["hooks"]["poststop"]
        assert 0o600 == (bundle / "config.json").stat().st_mode & 0o777

    def test_env_always_written(self, tmp_path: Path, bundle: Path) -> None:
        """A hook's env goes into the spec as the file gives it, and empty when the file has none (runc would pass its own)."""
        hooks = tmp_path / "hooks"
        hooks.mkdir()
        with_env = {"path": "/h", "env": ["A=1"]}
        doc = {"version": "1.0.0", "hook": with_env, "when": {"always": True}, "stages": ["poststart"]}
        (hooks / "10-env.json").write_text(json.dumps(doc))
        write_hook(hooks, "20-bare.json", "/bare", {"always": True}, ["poststart"])
        wrapper.inject(str(bundle), [str(hooks)], wrapper.Logger(None), "c1")
        spec = json.loads((bundle / "config.json").read_text())
        assert [{"path": "/h", "env": ["A=1"]}, {"path": "/bare", "env": []}] == spec["hooks"]["poststart"]

    def test_nothing_matches_leaves_file_untouched(self, tmp_path: Path, bundle: Path) -> None:
        """With no matching hook config.json is not rewritten."""
        hooks = tmp_path / "hooks"
        write_hook(hooks, "a.json", "/x", {"always": False}, ["prestart"])
        before = (bundle / "config.json").stat().st_mtime_ns, (bundle / "config.json").read_bytes()
        assert [] == wrapper.inject(str(bundle), [str(hooks)], wrapper.Logger(None), "c1")
        assert before == ((bundle / "config.json").stat().st_mtime_ns, (bundle / "config.json").read_bytes())

    def test_precedence_and_invalid_files(self, tmp_path: Path, bundle: Path) -> None:
        """A later directory wins on the same name; an invalid file is logged and skipped."""
        low, high, log = tmp_path / "low", tmp_path / "high", tmp_path / "log"
        write_hook(low, "a.json", "/low", {"always": True}, ["prestart"])
        write_hook(high, "a.json", "/high", {"always": True}, ["prestart"])
        (high / "b.json").write_text("{nope")
        wrapper.inject(str(bundle), [str(low), str(high)], wrapper.Logger(str(log)), "c1")
        spec = json.loads((bundle / "config.json").read_text())
        assert [{"path": "/already/there"}, {"path": "/high", "env": []}] == spec["hooks"]["prestart"]
        assert "event=oci_hook_invalid" in log.read_text() and "b.json" in log.read_text()

    def test_retried_create_adds_once(self, tmp_path: Path, bundle: Path) -> None:
        """Injecting twice does not duplicate hooks."""
        hooks = tmp_path / "hooks"
        write_hook(hooks, "a.json", "/a", {"always": True}, ["poststart"])
        wrapper.inject(str(bundle), [str(hooks)], wrapper.Logger(None), "c1")
        assert [] == wrapper.inject(str(bundle), [str(hooks)], wrapper.Logger(None), "c1")


class TestSettings:
    def test_config_file_next_to_argv0(self, tmp_path: Path) -> None:
        """runc, hooks-dir (repeatable, both syntaxes) and log come from the .conf beside the wrapper."""
        (tmp_path / wrapper.CONFIG_NAME).write_text(
            "# comment\nrunc = /opt/runc\n--hooks-dir /a\nhooks-dir=/b\nlog = /var/log/w.log\n"
        )
        got = wrapper.settings(str(tmp_path / "krproxy-runc-wrapper"), {})
        assert wrapper.Settings("/opt/runc", ("/a", "/b"), "/var/log/w.log") == got

    def test_environment_wins_and_defaults(self, tmp_path: Path) -> None:
        """Environment variables override the file; without either the hooks.d defaults apply."""
        env = {"KRPROXY_RUNC": "/e/runc", "KRPROXY_OCI_HOOKS_DIRS": "/x:/y"}
        assert wrapper.Settings("/e/runc", ("/x", "/y"), None) == wrapper.settings(str(tmp_path / "w"), env)
        assert wrapper.DEFAULT_HOOK_DIRS == wrapper.settings(str(tmp_path / "w"), {}).hook_dirs

    def test_find_runc_skips_itself(self, tmp_path: Path) -> None:
        """On PATH, a runc that is the wrapper itself (symlink) is skipped."""
        me, first, second = tmp_path / "wrapper", tmp_path / "a", tmp_path / "b"
        me.write_text("#!/bin/sh\n")
        me.chmod(0o755)
        first.mkdir()
        second.mkdir()
        (first / "runc").symlink_to(me)
        (second / "runc").write_text("#!/bin/sh\n")
        (second / "runc").chmod(0o755)
        assert str(second / "runc") == wrapper.find_runc(None, str(me), f"{first}:{second}")


class TestExec:
    def run_wrapper(
        self, tmp_path: Path, args: list[str], hooks: Path
    ) -> tuple[subprocess.CompletedProcess[str], list[str]]:
        record = tmp_path / "runc-args"
        runc = tmp_path / "runc"
        runc.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {record}\nexit 7\n")
        runc.chmod(0o755)
        env = {**os.environ, "KRPROXY_RUNC": str(runc), "KRPROXY_OCI_HOOKS_DIRS": str(hooks)}
        done = subprocess.run(
            [sys.executable, "-m", "krproxy.ocihooks.wrapper", *args], env=env, capture_output=True, text=True
        )
        return done, record.read_text().splitlines() if record.exists() else []

    def test_create_injects_then_execs_runc_unchanged(self, tmp_path: Path, bundle: Path) -> None:
        """On create the hooks are in config.json when runc runs, with the arguments unchanged and its exit status."""
        hooks = tmp_path / "hooks"
        write_hook(hooks, "a.json", "/a", {"always": True}, ["createRuntime"])
        args = ["--root", "/r", "create", "--bundle", str(bundle), "id 1"]
        done, got = self.run_wrapper(tmp_path, args, hooks)
        assert (7, args) == (done.returncode, got)
        assert [{"path": "/a", "env": []}] == json.loads((bundle / "config.json").read_text())["hooks"][
            "createRuntime"
        ]

    def test_other_commands_pass_straight_through(self, tmp_path: Path) -> None:
        """Commands other than create/run reach runc as they came."""
        done, got = self.run_wrapper(tmp_path, ["--root", "/r", "state", "abc"], tmp_path / "none")
        assert (7, ["--root", "/r", "state", "abc"]) == (done.returncode, got)


class TestLauncher:
    """The /bin/sh launcher: runc directly unless a hook file could concern the call."""

    def install(
        self, tmp_path: Path, hooks: Path, *, python: str = sys.executable, index: Path | None = None
    ) -> tuple[Path, Path]:
        record = tmp_path / "runc-args"
        runc = tmp_path / "runc"
        runc.write_text(
            f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {record}\nenv | grep '^KRPROXY_RUNC_WRAPPER=' >> {record}\nexit 7\n"
        )
        runc.chmod(0o755)
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / wrapper.CONFIG_NAME).write_text(f"hooks-dir = {hooks}\n")
        launcher = bin_dir / "krproxy-runc-wrapper"
        index = index or tmp_path / "index" / "oci.index"
        wrapper.write_launcher(str(launcher), runc=str(runc), python=python, index=str(index))
        return launcher, record

    def run(self, launcher: Path, args: list[str], record: Path) -> tuple[int, list[str]]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KRPROXY_")}
        cwd = launcher.parent.parent / "cwd"
        cwd.mkdir(exist_ok=True)
        done = subprocess.run(
            [str(launcher), *args], env=env, capture_output=True, text=True, timeout=60, cwd=cwd
        )
        assert "" == done.stderr
        assert [] == os.listdir(cwd)  # no log file (or anything else) where runc is started
        return done.returncode, record.read_text().splitlines() if record.exists() else []

    def test_other_commands_never_start_python(self, tmp_path: Path) -> None:
        """state/start/delete... reach runc unchanged even when the Python named in it does not exist;
        a global option's value that reads like a command is skipped."""
        hooks = tmp_path / "hooks"
        write_hook(hooks, "a.json", "/a", {"always": True}, ["createRuntime"])
        launcher, record = self.install(tmp_path, hooks, python="/nonexistent/python")
        for args in (
            ["--root", "/r", "state", "abc"],
            ["--log", "create", "delete", "x"],
            ["--root=/r", "kill", "x"],
        ):
            assert (7, args) == self.run(launcher, args, record)

    def test_create_without_hook_files_never_starts_python(self, tmp_path: Path, bundle: Path) -> None:
        """With no *.json in the hook directories a create goes straight to runc, config.json untouched."""
        hooks = tmp_path / "hooks"
        hooks.mkdir()
        (hooks / ".hidden.json").write_text("{}")
        (hooks / "notes.txt").write_text("")
        launcher, record = self.install(tmp_path, hooks, python="/nonexistent/python")
        before = (bundle / "config.json").read_text()
        args = ["--root", "/r", "create", "--bundle", str(bundle), "id1"]
        assert (7, args) == self.run(launcher, args, record)
        assert before == (bundle / "config.json").read_text()

    def test_create_with_hooks_runs_the_wrapper_without_site(self, tmp_path: Path, bundle: Path) -> None:
        """With hook files the wrapper (python -I -S) adds the matching hooks, then execs runc with
        the arguments unchanged; the launcher's own variable does not reach runc."""
        hooks = tmp_path / "hooks"
        write_hook(hooks, "a.json", "/a", {"always": True}, ["createRuntime"])
        launcher, record = self.install(tmp_path, hooks)
        args = ["--root", "/r", "create", "--bundle", str(bundle), "id 1"]
        assert (7, args) == self.run(launcher, args, record)
        assert [{"path": "/a", "env": []}] == json.loads((bundle / "config.json").read_text())["hooks"][
            "createRuntime"
        ]

    def test_paths_with_spaces_and_the_log(self, tmp_path: Path, bundle: Path) -> None:
        """runc, hook directory and log paths that need quoting work, and the log is the configured one."""
        hooks = tmp_path / "hook dir"
        write_hook(hooks, "a.json", "/a", {"always": True}, ["createRuntime"])
        launcher, record = self.install(tmp_path, hooks)
        log_file = tmp_path / "log file.log"
        (launcher.parent / wrapper.CONFIG_NAME).write_text(f"hooks-dir = {hooks}\nlog = {log_file}\n")
        wrapper.write_launcher(str(launcher), runc=str(tmp_path / "runc"), index=str(tmp_path / "index"))
        args = ["create", "--bundle", str(bundle), "c2"]
        assert (7, args) == self.run(launcher, args, record)
        assert "event=oci_hooks_injected" in log_file.read_text()

    def current_index(self, tmp_path: Path, hooks: Path, bundle: Path) -> tuple[Path, Path, Path]:
        """A launcher whose index was written by a first create and is current: the index is dated a
        second before the wrapper read the hook files, so they must be older than that."""
        index = tmp_path / "run" / "oci.index"
        launcher, record = self.install(tmp_path, hooks, index=index)
        time.sleep(1.05)
        assert 7 == self.run(launcher, ["create", "--bundle", str(bundle), "first"], record)[0]
        assert index.exists()
        return launcher, record, index

    def test_create_no_hook_can_match_never_starts_python(self, tmp_path: Path, bundle: Path) -> None:
        """With a current index and none of its strings in config.json, a create goes straight to
        runc even though hook files exist; config.json stays as it was."""
        hooks = tmp_path / "hooks"
        write_hook(
            hooks,
            "seccomp.json",
            "/a",
            {"annotations": {r"^io\.containers\.trace-syscall$": ".*"}},
            ["prestart"],
        )
        write_hook(hooks, "gpu.json", "/b", {"commands": [r"nvidia-smi$"]}, ["prestart"])
        launcher, record, index = self.current_index(tmp_path, hooks, bundle)
        assert ["# watch=", "nvidia-smi", "io.containers.trace-syscall"] == index.read_text().splitlines()[1:]
        wrapper.write_launcher(
            str(launcher), runc=str(tmp_path / "runc"), python="/nonexistent/python", index=str(index)
        )
        before = (bundle / "config.json").read_text()
        for args in (
            ["--root", "/r", "create", "--bundle", str(bundle), "id1"],
            ["create", "-b", str(bundle), "--pid-file", "/p", "id2"],
            ["run", f"--bundle={bundle}", "--console-socket", "/s", "id3"],
        ):
            assert (7, args) == self.run(launcher, args, record)
        assert before == (bundle / "config.json").read_text()

    def test_empty_bundle_is_the_current_directory(self, tmp_path: Path, bundle: Path) -> None:
        """``--bundle ""`` means the current directory to runc and the wrapper: the launcher reads
        ./config.json too (it read /config.json), and decides without Python when it can."""
        hooks = tmp_path / "hooks"
        write_hook(hooks, "gpu.json", "/g", {"annotations": {"^gpu-never$": ""}}, ["prestart"])
        launcher, record, index = self.current_index(tmp_path, hooks, bundle)
        wrapper.write_launcher(
            str(launcher), runc=str(tmp_path / "runc"), python="/nonexistent/python", index=str(index)
        )
        args = ["create", "--bundle", "", "id1"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KRPROXY_")}
        done = subprocess.run(
            [str(launcher), *args], env=env, capture_output=True, text=True, timeout=60, cwd=bundle
        )
        assert (7, "", args) == (done.returncode, done.stderr, record.read_text().splitlines())

    def test_hook_dirs_of_colons_alone_are_the_configured_ones(self, tmp_path: Path, bundle: Path) -> None:
        """KRPROXY_OCI_HOOKS_DIRS=":" names no directory: the launcher, like the wrapper, uses the
        configured ones (it looked for /*.json instead)."""
        hooks = tmp_path / "hooks"
        write_hook(hooks, "a.json", "/a", {"always": True}, ["prestart"])
        launcher, record = self.install(tmp_path, hooks)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KRPROXY_")}
        done = subprocess.run(
            [str(launcher), "create", "--bundle", str(bundle), "id1"],
            env={**env, "KRPROXY_OCI_HOOKS_DIRS": ":"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (7, "") == (done.returncode, done.stderr)
        assert ["create", "--bundle", str(bundle), "id1"] == record.read_text().splitlines()
        prestart = json.loads((bundle / "config.json").read_text())["hooks"]["prestart"]
        assert "/a" in [entry["path"] for entry in prestart]

    def test_create_with_a_needle_runs_the_wrapper(self, tmp_path: Path, bundle: Path) -> None:
        """A string of the index in config.json (here the annotation the hook wants) runs the wrapper,
        which decides: the hook is added."""
        hooks = tmp_path / "hooks"
        write_hook(hooks, "gpu.json", "/g", {"annotations": {"^gpu$": "^yes$"}}, ["prestart"])
        write_hook(hooks, "other.json", "/o", {"annotations": {"^other$": ""}}, ["prestart"])
        spec = json.loads((bundle / "config.json").read_text())
        (bundle / "config.json").write_text(json.dumps({**spec, "annotations": {"x": "y"}}))
        launcher, record, _ = self.current_index(tmp_path, hooks, bundle)
        (bundle / "config.json").write_text(json.dumps(spec))  # SPEC has gpu=yes
        assert 7 == self.run(launcher, ["create", "--bundle", str(bundle), "id1"], record)[0]
        prestart = json.loads((bundle / "config.json").read_text())["hooks"]["prestart"]
        assert ["/already/there", "/g"] == [entry["path"] for entry in prestart]

    def test_changed_hook_files_make_the_index_stale(self, tmp_path: Path, bundle: Path) -> None:
        """A hook file changed, added or removed after the index was written, or another set of hook
        directories, sends the next create to the wrapper, which writes the index anew."""
        hooks = tmp_path / "hooks"
        write_hook(hooks, "a.json", "/a", {"annotations": {"^nothing-has-this$": ""}}, ["prestart"])
        launcher, record, index = self.current_index(tmp_path, hooks, bundle)
        args = ["create", "--bundle", str(bundle), "id1"]

        def hooks_added() -> list[str]:
            doc = json.loads((bundle / "config.json").read_text())
            return [e["path"] for e in doc["hooks"].get("prestart", []) if e["path"] != "/already/there"]

        # Changed in place: the file's ctime moves, the directory's does not.
        write_hook(hooks, "a.json", "/a", {"annotations": {"^gpu$": ""}}, ["prestart"])
        assert 7 == self.run(launcher, args, record)[0]
        assert ["/a"] == hooks_added()
        assert "gpu" in index.read_text().splitlines()
        # A second directory appears (with a hook that always applies): the header no longer matches.
        (bundle / "config.json").write_text(json.dumps(SPEC))
        extra = tmp_path / "extra"
        write_hook(extra, "b.json", "/b", {"always": True}, ["prestart"])
        time.sleep(1.05)
        launcher.parent.joinpath(wrapper.CONFIG_NAME).write_text(
            f"hooks-dir = {hooks}\nhooks-dir = {extra}\n"
        )
        wrapper.write_launcher(str(launcher), runc=str(tmp_path / "runc"), index=str(index))
        assert 7 == self.run(launcher, args, record)[0]
        assert ["/a", "/b"] == hooks_added()

    @staticmethod
    def repoint(link: Path, target: Path) -> None:
        """Point the symlink ``link`` at ``target`` atomically (ln -sfn: a new link renamed over)."""
        temporary = link.with_name(link.name + ".new")
        temporary.symlink_to(target)
        temporary.rename(link)

    @pytest.mark.parametrize("what", ["directory", "file"])
    def test_repointed_symlink_makes_the_index_stale(self, tmp_path: Path, bundle: Path, what: str) -> None:
        """A hook directory that is a symlink, or a hook file reached through one, repointed at files
        older than the index (a version switch, a rollback): the create runs the wrapper, which adds
        the hook the new target holds. find -L sees only the final targets, whose ctimes did not move."""
        old, new = tmp_path / "v1", tmp_path / "v2"
        write_hook(old, "a.json", "/old-hook", {"annotations": {"^nothing-has-this$": ""}}, ["prestart"])
        # SPEC has gpu=yes
        write_hook(new, "a.json", "/new-hook", {"annotations": {"^gpu$": "^yes$"}}, ["prestart"])
        current = tmp_path / "current"
        current.symlink_to(old)
        if what == "directory":
            hooks = current
        else:
            hooks = tmp_path / "hooks"
            hooks.mkdir()
            (hooks / "a.json").symlink_to(current / "a.json")
        launcher, record, _ = self.current_index(tmp_path, hooks, bundle)
        assert "/old-hook" not in (bundle / "config.json").read_text()
        self.repoint(current, new)
        assert 7 == self.run(launcher, ["create", "--bundle", str(bundle), "id1"], record)[0]
        assert "/new-hook" in (bundle / "config.json").read_text()

    def test_index_replaced_after_the_check_is_not_read(self, tmp_path: Path, bundle: Path) -> None:
        """The strings grep looks for come from the index the launcher found current, even when a
        slower wrapper (it read the hook files before they changed) replaces the index between the
        check and the grep: here find itself does that, leaving an index without the string."""
        hooks = tmp_path / "hooks"
        write_hook(hooks, "gpu.json", "/gpu-hook", {"annotations": {"^gpu$": "^yes$"}}, ["prestart"])
        spec = json.loads((bundle / "config.json").read_text())
        (bundle / "config.json").write_text(json.dumps({**spec, "annotations": {"x": "y"}}))
        launcher, _, index = self.current_index(tmp_path, hooks, bundle)
        (bundle / "config.json").write_text(json.dumps(spec))  # SPEC has gpu=yes
        stale = tmp_path / "stale-index"
        stale.write_text("\n".join(index.read_text().splitlines()[:2]) + "\n")  # no "gpu"
        shims = tmp_path / "shims"
        shims.mkdir()
        real_find = subprocess.run(["sh", "-c", "command -v find"], capture_output=True, text=True).stdout
        (shims / "find").write_text(
            f'#!/bin/sh\n{real_find.strip()} "$@"\nstatus=$?\n'
            f"cp {stale} {index}.new && touch -d '1 hour ago' {index}.new && mv {index}.new {index}\n"
            "exit $status\n"
        )
        (shims / "find").chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KRPROXY_")}
        env["PATH"] = f"{shims}:{env['PATH']}"
        done = subprocess.run(
            [str(launcher), "create", "--bundle", str(bundle), "id1"],
            env=env,
            capture_output=True,
            timeout=60,
        )
        assert (7, b"") == (done.returncode, done.stderr)
        assert index.read_text() == stale.read_text()  # find did replace it
        assert "/gpu-hook" in (bundle / "config.json").read_text()

    def test_hook_directory_name_is_not_a_pattern(self, tmp_path: Path, bundle: Path) -> None:
        """A hook directory whose name reads like a glob (h[1]) is that directory, not h1."""
        hooks = tmp_path / "h[1]"
        write_hook(hooks, "g.json", "/g", {"annotations": {"^gpu$": "^yes$"}}, ["prestart"])
        (tmp_path / "h1").mkdir()  # no hook files: the glob's match would send the create to runc
        launcher, record = self.install(tmp_path, hooks)
        assert 7 == self.run(launcher, ["create", "--bundle", str(bundle), "id1"], record)[0]
        assert "/g" in (bundle / "config.json").read_text()

    def test_unwritable_index_still_adds_hooks(self, tmp_path: Path, bundle: Path) -> None:
        """An index that cannot be written is logged, and every create keeps running the wrapper."""
        hooks = tmp_path / "hooks"
        write_hook(hooks, "a.json", "/a", {"annotations": {"^gpu$": ""}}, ["prestart"])
        (tmp_path / "file").write_text("")
        launcher, _ = self.install(tmp_path, hooks, index=tmp_path / "file" / "index")
        log_file = tmp_path / "wrapper.log"
        env_log = {"KRPROXY_OCI_LOG": str(log_file)}
        done = subprocess.run(
            [str(launcher), "create", "--bundle", str(bundle), "id1"],
            env={**{k: v for k, v in os.environ.items() if not k.startswith("KRPROXY_")}, **env_log},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (7, "") == (done.returncode, done.stderr)
        assert "/a" in (bundle / "config.json").read_text()
        assert "event=oci_index_unwritable" in log_file.read_text()

    def test_no_runc_no_launcher(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without a runc anywhere the launcher is not written, and the error says how to fix it."""
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        with pytest.raises(FileNotFoundError, match="runc ="):
            wrapper.launcher_script(str(tmp_path / "w"))
