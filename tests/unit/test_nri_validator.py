"""containerd's NRI default validator configuration: does it require krproxy nri's own registration?

The merge rules are what ``containerd -c main.toml config dump`` of containerd 2.3.4 shows: imported
files (globs, relative to the file naming them, their own imports after them, each once) override the
main file and each other in order, key by key inside tables; a list is replaced whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from krproxy.nri.validator import ConfigError, Verdict, check_containerd_config

VALIDATOR = "[plugins.'io.containerd.nri.v1.nri'.default_validator]\n"


def requiring(plugin: str) -> str:
    """The validator's table, enabled and requiring ``plugin``."""
    return VALIDATOR + f"enable = true\nrequired_plugins = ['{plugin}']\n"


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def check(path: str) -> tuple[Verdict, str]:
    result = check_containerd_config(path, "krproxy", "50")
    return result.verdict, result.reason


@pytest.mark.parametrize(
    ("text", "verdict", "reason"),
    [
        (requiring("krproxy"), Verdict.REQUIRED, "lists 'krproxy'"),
        (requiring("50-krproxy"), Verdict.REQUIRED, "'50-krproxy'"),
        # containerd 1.7's version 2 spelling, double quotes: the same table.
        (
            'version = 2\n[plugins."io.containerd.nri.v1.nri".default_validator]\n'
            'enable = true\nrequired_plugins = ["krproxy"]\n',
            Verdict.REQUIRED,
            "lists 'krproxy'",
        ),
        (VALIDATOR + "enable = false\nrequired_plugins = ['krproxy']\n", Verdict.NOT_REQUIRED, "enable"),
        (VALIDATOR + "required_plugins = ['krproxy']\n", Verdict.NOT_REQUIRED, "enable is not true"),
        (requiring("10-krproxy"), Verdict.NOT_REQUIRED, "neither"),
        (VALIDATOR + "enable = true\n", Verdict.NOT_REQUIRED, "names neither"),
        (
            "version = 3\n[plugins.'io.containerd.nri.v1.nri']\ndisable = false\n",
            Verdict.NOT_REQUIRED,
            "no [",
        ),
        ("version = 3\n", Verdict.NOT_REQUIRED, "no [plugins.'io.containerd.nri.v1.nri'.default_validator]"),
        ("[plugins.'io.containerd.nri.v1.nri']\ndisable = true\n", Verdict.NRI_DISABLED, "disable = true"),
    ],
)
def test_verdicts(tmp_path: Path, text: str, verdict: Verdict, reason: str) -> None:
    got = check(write(tmp_path / "config.toml", text))
    assert verdict is got[0]
    assert reason in got[1]


def test_imports_override_the_main_file_in_order_key_by_key(tmp_path: Path) -> None:
    main = write(
        tmp_path / "config.toml",
        "version = 3\nimports = ['conf.d/*.toml']\n" + requiring("x"),
    )
    write(tmp_path / "conf.d" / "10.toml", VALIDATOR + "required_plugins = ['krproxy']\n")
    assert Verdict.REQUIRED is check(main)[0]  # the main file's enable, the import's list

    write(tmp_path / "conf.d" / "20.toml", VALIDATOR + "required_plugins = ['other']\n")
    assert Verdict.NOT_REQUIRED is check(main)[0]  # the later file's list replaces the earlier one

    write(tmp_path / "conf.d" / "30.toml", VALIDATOR + "required_plugins = ['krproxy']\nenable = false\n")
    result = check_containerd_config(main, "krproxy", "50")
    assert Verdict.NOT_REQUIRED is result.verdict
    assert 4 == len(result.files)


def test_the_tolerate_annotation_is_reported(tmp_path: Path) -> None:
    text = (
        VALIDATOR
        + "enable = true\nrequired_plugins = ['krproxy']\ntolerate_missing_plugins_annotation = 't'\n"
    )
    result = check_containerd_config(write(tmp_path / "c.toml", text), "krproxy", "50")
    assert (True, "t") == (result.required, result.tolerate_annotation)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (None, "cannot read containerd's configuration"),
        ("[plugins\n", "is not valid TOML"),
        ("imports = 'x.toml'\n", "imports must be a list"),
        ("imports = ['missing.toml']\n", "missing.toml: No such file"),
    ],
)
def test_bad_files_are_errors_naming_the_file(tmp_path: Path, text: str | None, problem: str) -> None:
    path = str(tmp_path / "config.toml") if text is None else write(tmp_path / "config.toml", text)
    with pytest.raises(ConfigError, match=problem):
        check_containerd_config(path, "krproxy", "50")


def test_cli_refuses_an_unreadable_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from krproxy import cli

    code = cli.main(["nri", f"--containerd-config={tmp_path}/nope.toml", f"--hook-dir={tmp_path}"])

    assert 2 == code
    assert f"cannot read containerd's configuration {tmp_path}/nope.toml" in capsys.readouterr().err


def test_imports_of_imported_files_are_read_after_them(tmp_path: Path) -> None:
    """containerd reads an imported file's own imports too (relative to that file), queued after the
    files already waiting (LoadConfigWithPlugins' pending list; `config dump` of 2.3.4 shows them)."""
    main = write(tmp_path / "config.toml", "version = 3\nimports = ['conf.d/*.toml', 'last.toml']\n")
    write(tmp_path / "conf.d" / "10.toml", "version = 3\nimports = ['../sub/nri.toml']\n")
    write(tmp_path / "sub" / "nri.toml", requiring("krproxy"))
    write(tmp_path / "last.toml", VALIDATOR + "required_plugins = ['other']\n")
    result = check_containerd_config(main, "krproxy", "50")
    # main, then its imports (10.toml, last.toml), then 10.toml's: sub/nri.toml's list is merged last.
    assert Verdict.REQUIRED is result.verdict
    assert [main, f"{tmp_path}/conf.d/10.toml", f"{tmp_path}/last.toml", f"{tmp_path}/sub/nri.toml"] == [
        str(Path(f).resolve()) if f != main else f for f in result.files
    ]


def test_a_file_imported_again_is_read_once(tmp_path: Path) -> None:
    """containerd skips a file already loaded (circular or repeated imports): its first place counts."""
    main = write(tmp_path / "config.toml", "version = 3\nimports = ['a.toml', 'b.toml', 'a.toml']\n")
    write(
        tmp_path / "a.toml",
        VALIDATOR + "enable = true\nrequired_plugins = ['krproxy']\nimports = ['b.toml']\n",
    )
    write(tmp_path / "b.toml", VALIDATOR + "required_plugins = ['other']\nimports = ['a.toml']\n")
    result = check_containerd_config(main, "krproxy", "50")
    assert Verdict.NOT_REQUIRED is result.verdict  # b.toml, read after a.toml, names other
    assert 3 == len(result.files)


def test_globs_as_go_s_filepath_glob(tmp_path: Path) -> None:
    """containerd globs an import only when it has a '*' (a '[' is then a file name's), and Go's glob
    matches names starting with a dot."""
    main = write(tmp_path / "config.toml", "version = 3\nimports = ['conf.d/*.toml', 'x[1].toml']\n")
    write(tmp_path / "conf.d" / ".hidden.toml", requiring("krproxy"))
    write(tmp_path / "x[1].toml", VALIDATOR + "tolerate_missing_plugins_annotation = 't'\n")
    write(tmp_path / "x1.toml", VALIDATOR + "enable = false\n")
    result = check_containerd_config(main, "krproxy", "50")
    assert (Verdict.REQUIRED, "t") == (result.verdict, result.tolerate_annotation)


def test_nri_in_disabled_plugins_is_nri_disabled(tmp_path: Path) -> None:
    """``disabled_plugins`` lists of all files add up (containerd appends them); NRI in it means no NRI."""
    main = write(
        tmp_path / "config.toml",
        "version = 3\nimports = ['d.toml']\ndisabled_plugins = ['io.containerd.nri.v1.nri']\n"
        + requiring("krproxy"),
    )
    write(tmp_path / "d.toml", "version = 3\ndisabled_plugins = ['io.containerd.snapshotter.v1.zfs']\n")
    assert (Verdict.NRI_DISABLED, "disabled_plugins lists 'io.containerd.nri.v1.nri'") == check(main)


def test_glob_matches_in_go_s_order(tmp_path: Path) -> None:
    """Go's filepath.Glob sorts each directory's names (d/a before d/a-b), not whole paths as strings
    ('-' sorts before '/'): the later file's list wins as under containerd."""
    main = write(
        tmp_path / "config.toml", "version = 3\nimports = ['d/*/x.toml']\n" + VALIDATOR + "enable = true\n"
    )
    write(tmp_path / "d" / "a" / "x.toml", VALIDATOR + "required_plugins = ['krproxy']\n")
    write(tmp_path / "d" / "a-b" / "x.toml", VALIDATOR + "required_plugins = ['other']\n")
    assert Verdict.NOT_REQUIRED is check(main)[0]
