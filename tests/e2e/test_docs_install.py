"""The install commands of README.md and docs/operations.md, run as written on this machine.

The commands are the docs' own shell blocks, read from their sections (README's "Try it" and
"Install", operations.md's "Installing on a node"), so the docs and this test cannot drift; each
block runs whole with ``sh -e``, in a copy of the checkout (its files as git lists them), with a home
directory of the test's own and the PATH a shell on a Debian machine has (``pipx`` added where it is
installed beside the tests, as the test extra has it). pip's cache is the user's, so a run downloads
only what is new. Each block must exit 0, and what it installed must run.

The node install runs as root in a mount namespace of its own where /opt and /usr/local/bin are
overlays whose writes go to the test's directories: the doc's commands run unchanged, and the real
/opt and /usr/local/bin are not written. Its ``apt-get install -y python3-venv`` is real, as on a
node (a no-op where the package is installed).

Not a containerd test: scripts/e2e-matrix runs this file once, as its own row (a few minutes: six
venvs, each filled by pip).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import krproxy
from krproxy.demo import NEXT_STEPS
from tests.e2e.support import REPO

README = REPO / "README.md"
OPERATIONS = REPO / "docs" / "operations.md"
#: What a login shell on Debian has, so the docs' ``python3`` is the system's (not the tests' venv).
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: A block's run: pip installs from the index, on a busy machine.
BLOCK_TIMEOUT = 900
VERSION_LINE = f"krproxy {krproxy.__version__}"


def sh_blocks(path: Path, heading: str) -> list[str]:
    """The ``sh`` blocks of the section ``heading`` (a ``## `` heading) of ``path``, in order."""
    text = path.read_text()
    found = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert found, f"{path.name}: no section '## {heading}'"
    blocks = re.findall(r"^```sh\n(.*?)^```", found.group(1), re.S | re.M)
    assert blocks, f"{path.name}, '## {heading}': no sh block"
    return blocks


def checkout_copy(dest: Path) -> Path:
    """The checkout's files (tracked and new, as ``git ls-files`` lists them; links as links) copied to
    ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        source, target = REPO / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # krproxy/fakes is one: the wheel's krproxy.fakes is fakes/
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    return dest


def user_pip_cache() -> str:
    done = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def environment(home: Path, tools: Path) -> dict[str, str]:
    """The user's environment with ``home`` as HOME, the system PATH (``tools`` first), no venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(HOME=str(home), PATH=f"{tools}:{SYSTEM_PATH}")
    env.pop("PIPX_HOME", None)
    env.pop("PIPX_BIN_DIR", None)
    cache = user_pip_cache()
    if cache:
        env["PIP_CACHE_DIR"] = cache
    return env


def run_block(block: str, cwd: Path, env: dict[str, str], wrap: list[str] | None = None) -> str:
    """``sh -e -c BLOCK`` in ``cwd`` (inside ``wrap``); its output, after asserting exit 0."""
    done = subprocess.run(
        [*(wrap or []), "sh", "-e", "-c", block],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=BLOCK_TIMEOUT,
    )
    assert 0 == done.returncode, f"exit {done.returncode} of:\n{block}\n--- output:\n{done.stdout[-6000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A directory for the test's homes and checkouts, and one with ``pipx`` where the tests have it."""
    if not shutil.which("python3", path=SYSTEM_PATH):
        pytest.skip("no python3 on the system PATH to install with")
    probe = subprocess.run(
        ["python3", "-c", "import ensurepip"], env={"PATH": SYSTEM_PATH}, capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip("python3 -m venv cannot install pip here: apt-get install python3-venv (README says so)")
    base = tmp_path_factory.mktemp("install")
    tools = base / "tools"
    tools.mkdir()
    pipx = shutil.which("pipx", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if pipx:
        (tools / "pipx").symlink_to(pipx)
    return base, tools


def test_readme_try_it_and_install_run(machine: tuple[Path, Path]) -> None:
    """README's demo block, then its install block (venv, pipx, wheel) in the checkout, then its target
    block where the wheel was copied: each exits 0 and what it installed runs."""
    base, tools = machine
    if not (tools / "pipx").exists():
        pytest.skip("no pipx beside the tests (the test extra installs it) for README's `pipx install .`")
    home = base / "home"
    home.mkdir()
    checkout = checkout_copy(base / "checkout")
    env = environment(home, tools)

    (demo,) = sh_blocks(README, "Try it")
    said = run_block(demo, checkout, env)
    assert "krproxy demo" in demo and NEXT_STEPS.splitlines()[0] in said, said[-3000:]

    here, target = sh_blocks(README, "Install")
    run_block(here, checkout, env)
    pipx_krproxy = home / ".local" / "bin" / "krproxy"
    assert VERSION_LINE == subprocess.check_output([pipx_krproxy, "version"], text=True).strip()
    (wheel,) = (checkout / "dist").glob("krproxy-*.whl")

    elsewhere = base / "target"
    (elsewhere / "home").mkdir(parents=True)
    shutil.copy2(wheel, elsewhere)
    said = run_block(target, elsewhere, environment(elsewhere / "home", tools))
    assert VERSION_LINE == said.strip().splitlines()[-1]
    assert (elsewhere / "home" / "krproxy-venv" / "bin" / "krproxy").exists()


def test_operations_node_install_runs(machine: tuple[Path, Path]) -> None:
    """operations.md's node install, as root, with /opt and /usr/local/bin overlaid: it exits 0, the link
    it made runs the /opt/krproxy venv's krproxy, and the real /opt and /usr/local/bin are untouched."""
    if os.geteuid() != 0:
        pytest.skip("the node install runs as root (apt-get, /opt, /usr/local/bin)")
    if not shutil.which("unshare"):
        pytest.skip("no unshare (util-linux) for a mount namespace of the test's own")
    base, tools = machine
    home = base / "root-home"
    home.mkdir()
    checkout = checkout_copy(base / "node-checkout")
    before = {path: os.path.lexists(path) for path in ("/opt/krproxy", "/usr/local/bin/krproxy")}
    mounts = []
    for directory in ("/opt", "/usr/local/bin"):
        name = directory.strip("/").replace("/", "-")
        upper, work = base / f"{name}-upper", base / f"{name}-work"
        upper.mkdir()
        work.mkdir()
        options = f"lowerdir={directory},upperdir={upper},workdir={work}"
        mounts.append(f"mount -t overlay overlay -o {options} {directory}")
    wrap = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-e",
        "-c",
        " && ".join(mounts) + ' && exec "$@"',
        "sh",
    ]

    (block,) = sh_blocks(OPERATIONS, "Installing on a node")
    said = run_block(block, checkout, environment(home, tools), wrap)

    assert VERSION_LINE == said.strip().splitlines()[-1]
    link = base / "usr-local-bin-upper" / "krproxy"
    assert "/opt/krproxy/bin/krproxy" == os.readlink(link)
    assert (base / "opt-upper" / "krproxy" / "bin" / "krproxy").exists()
    assert before == {path: os.path.lexists(path) for path in before}
