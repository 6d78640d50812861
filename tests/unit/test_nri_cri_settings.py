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
    ],
    ids=["1.x", "2.x", "off", "another plugin's table", "unset"],
)
def test_restricts_oom_score_adj(tmp_path: Path, text: str, restricts: bool) -> None:
    """The setting in containerd 1.x's CRI plugin or 2.x's CRI runtime plugin, nowhere else."""
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
