"""krproxy.nri.cri_settings: containerd's CRI settings an NRI adjustment goes around, read from its
configuration as krproxy.nri.validator reads it (imports merged over the main file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from krproxy.nri.cri_settings import restricts_oom_score_adj
from krproxy.nri.validator import ConfigError


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("text", "restricts"),
    [
        ('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  restrict_oom_score_adj = true\n', True),
        ("version = 3\n[plugins.'io.containerd.cri.v1.runtime']\n  restrict_oom_score_adj = true\n", True),
        ('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  restrict_oom_score_adj = false\n', False),
        ("version = 3\n[plugins.'io.containerd.cri.v1.images']\n  restrict_oom_score_adj = true\n", False),
        ("version = 3\n", False),
        ('version = 3\n[plugins."io.containerd.grpc.v1.cri"]\n  restrict_oom_score_adj = true\n', False),
        ('[plugins."io.containerd.grpc.v1.cri"]\n  restrict_oom_score_adj = true\n', False),
        (
            'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  restrict_oom_score_adj = true\n'
            "[plugins.'io.containerd.cri.v1.runtime']\n  restrict_oom_score_adj = false\n",
            False,
        ),
    ],
    ids=[
        "1.x",
        "2.x",
        "off",
        "another plugin's table",
        "unset",
        "1.x key in v3",
        "unversioned",
        "2.x key first",
    ],
)
def test_restricts_oom_score_adj(tmp_path: Path, text: str, restricts: bool) -> None:
    """The setting in 2.x's CRI runtime plugin, else in 1.x's CRI plugin of a version 2 file (what
    containerd 2.1.9 migrates: tests/e2e/test_cri_settings_containerd.py), nowhere else."""
    assert restricts is restricts_oom_score_adj(write(tmp_path / "config.toml", text))


def test_an_import_overrides_the_main_file(tmp_path: Path) -> None:
    """An imported file's value wins over the main file's, key by key, as containerd merges them."""
    write(
        tmp_path / "off.toml", "[plugins.'io.containerd.cri.v1.runtime']\n  restrict_oom_score_adj = false\n"
    )
    main = write(
        tmp_path / "config.toml",
        "version = 3\nimports = ['off.toml']\n"
        "[plugins.'io.containerd.cri.v1.runtime']\n  restrict_oom_score_adj = true\n",
    )
    assert not restricts_oom_score_adj(main)


def test_an_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read containerd's configuration"):
        restricts_oom_score_adj(str(tmp_path / "missing.toml"))


def test_a_version_2_import_brings_the_1_x_key(tmp_path: Path) -> None:
    """A version 3 main file importing a version 2 file whose 1.x CRI plugin sets it: containerd 2.1.9
    migrates the import's value."""
    write(
        tmp_path / "old.toml",
        'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  restrict_oom_score_adj = true\n',
    )
    assert restricts_oom_score_adj(write(tmp_path / "config.toml", "version = 3\nimports = ['old.toml']\n"))
