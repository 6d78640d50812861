"""The install commands of README.md and docs/operations.md, run as written: on this machine, and in a
fresh Debian sid root that has only what README tells a user to apt-get install.

The commands are the docs' own shell blocks, read from their sections (README's "Try it" and
"Install", operations.md's "Installing on a node"), so the docs and this test cannot drift; each
block runs whole with ``sh -e``, in a copy of the checkout (its files as git lists them). Each block
must exit 0, and what it installed must run. Each test runs in two places:

- **This machine**: a home directory of the test's own and the PATH a shell on a Debian machine has
  (``pipx`` added where it is installed beside the tests, as the test extra has it); pip's cache is
  the user's, so a run downloads only what is new. README's ``apt-get install`` line runs as written
  where the test is root (a no-op where the packages are installed). The node install runs as root
  in a mount namespace of its own where /opt and /usr/local/bin are overlays whose writes go to the
  test's directories: the doc's commands run unchanged, and the real /opt and /usr/local/bin are
  not written.
- **A fresh Debian sid**: scripts/sid-python's ``docs`` root, a minbase sid plus README's
  ``apt-get install`` line and nothing else (built once by scripts/host-setup, cached under
  /var/cache/krproxy-sid), as the lower layer of an overlay per machine of the test's (``run
  --overlay``): the user's, the wheel's target and the node are each a fresh machine, and the
  cached root is never written. The blocks run there as root (HOME=/root), pip reaching PyPI with
  the host's CA file; the host user's pip cache is bound in, a download cache only.

Not a containerd test: scripts/e2e-matrix runs this file once, as its own row (a few minutes: ten
venvs, each filled by pip).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
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
SID_PYTHON = REPO / "scripts" / "sid-python"
#: What a login shell on Debian has, so the docs' ``python3`` is the system's (not the tests' venv).
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: A block's run: pip installs from the index, on a busy machine.
BLOCK_TIMEOUT = 900
VERSION_LINE = f"krproxy {krproxy.__version__}"
#: What the node install writes, and a user's install in root's home (the sid root's /root).
INSTALLED = ("/opt/krproxy", "/usr/local/bin/krproxy")
ROOT_HOME_INSTALLED = ("/root/krproxy-venv", "/root/.local")


def sh_blocks(path: Path, heading: str) -> list[str]:
    """The ``sh`` blocks of the section ``heading`` (a ``## `` heading) of ``path``, in order."""
    text = path.read_text()
    found = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert found, f"{path.name}: no section '## {heading}'"
    blocks = re.findall(r"^```sh\n(.*?)^```", found.group(1), re.S | re.M)
    assert blocks, f"{path.name}, '## {heading}': no sh block"
    return blocks


def readme_blocks() -> tuple[str, str, str, str]:
    """README's apt-get line and demo ("Try it"), its install block and its target block ("Install")."""
    apt, demo = sh_blocks(README, "Try it")
    here, target = sh_blocks(README, "Install")
    return apt, demo, here, target


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


class HostBox:
    """A user of this machine (HOME of the test's own), or with ``node`` root with /opt and
    /usr/local/bin overlaid in a mount namespace (their writes go to the test's directories)."""

    def __init__(self, base: Path, tools: Path, name: str, node: bool) -> None:
        home = base / f"{name}-home"
        home.mkdir()
        self.home = str(home)
        self.env = environment(home, tools)
        self.wrap: list[str] = []
        self.uppers: dict[str, Path] = {}
        if node:
            mounts = []
            for directory in ("/opt", "/usr/local/bin"):
                stem = f"{name}-{directory.strip('/').replace('/', '-')}"
                upper, work = base / f"{stem}-upper", base / f"{stem}-work"
                upper.mkdir()
                work.mkdir()
                self.uppers[directory] = upper
                options = f"lowerdir={directory},upperdir={upper},workdir={work}"
                mounts.append(f"mount -t overlay overlay -o {options} {directory}")
            script = " && ".join(mounts) + ' && exec "$@"'
            self.wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-e", "-c", script, "sh"]

    def run(self, block: str, cwd: Path) -> str:
        return run_block(block, cwd, self.env, self.wrap)

    def written(self, path: str) -> Path:
        """Where the test sees what the box wrote at ``path``."""
        for directory, upper in self.uppers.items():
            if path.startswith(directory + "/"):
                return upper / path.removeprefix(directory + "/")
        return Path(path)


class SidBox:
    """A fresh machine: the sid ``docs`` root under an overlay of its own (``sid-python run
    --overlay``), ``base`` bound in at its own path; runs as root with HOME=/root."""

    def __init__(self, base: Path, name: str) -> None:
        self.home = "/root"
        self.overlay = base / f"{name}-sid"
        cache = user_pip_cache()
        binds = ["--bind", str(base), *(["--bind", cache] if cache else [])]
        run = [sys.executable, str(SID_PYTHON), "--root", "docs", "run", "--overlay", str(self.overlay)]
        self.wrap = [*run, *binds, "--", *(["env", f"PIP_CACHE_DIR={cache}"] if cache else [])]

    def run(self, block: str, cwd: Path) -> str:
        return run_block(block, cwd, dict(os.environ), self.wrap)

    def written(self, path: str) -> Path:
        return self.overlay / "upper" / path.lstrip("/")


class Place:
    """Where the docs' commands run: this machine, or the fresh sid root (see the module docstring)."""

    def __init__(self, name: str, base: Path, tools: Path, sid_root: Path | None = None) -> None:
        self.name, self.base, self.tools, self.sid_root = name, base, tools, sid_root

    def box(self, name: str, node: bool = False) -> HostBox | SidBox:
        """A fresh user (or ``node``) of this place."""
        if self.sid_root:
            return SidBox(self.base, name)
        return HostBox(self.base, self.tools, name, node)

    @property
    def may_apt(self) -> bool:
        """Whether README's apt-get line runs here (as root: the sid root always is)."""
        return self.sid_root is not None or os.geteuid() == 0

    def installed(self) -> dict[str, bool]:
        """Which of the paths the installs write exist in this place's own (not an overlay's) tree."""
        if self.sid_root:
            return {p: os.path.lexists(f"{self.sid_root}{p}") for p in INSTALLED + ROOT_HOME_INSTALLED}
        return {p: os.path.lexists(p) for p in INSTALLED}


def _sid_docs_root() -> Path:
    """scripts/sid-python's docs root (built now if host-setup has not), or skip with its reason."""
    if os.geteuid() != 0:
        pytest.skip("the fresh sid root needs root (debootstrap, mount, chroot)")
    done = subprocess.run(
        [sys.executable, str(SID_PYTHON), "--root", "docs", "ensure"], capture_output=True, text=True
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0:
        pytest.skip(f"no fresh Debian sid root: {lines[-1] if lines else done.stderr[-500:]}")
    return Path(lines[-1])


@pytest.fixture(scope="module", params=["host", "sid"])
def place(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Place:
    """This machine (with ``pipx`` beside the tests where they have it), then the fresh sid root."""
    base = tmp_path_factory.mktemp(f"install-{request.param}")
    tools = base / "tools"
    tools.mkdir()
    if request.param == "sid":
        return Place("sid", base, tools, _sid_docs_root())
    if not shutil.which("python3", path=SYSTEM_PATH):
        pytest.skip("no python3 on the system PATH to install with")
    probe = subprocess.run(
        ["python3", "-c", "import ensurepip"], env={"PATH": SYSTEM_PATH}, capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip("python3 -m venv cannot install pip here: apt-get install python3-venv (README says so)")
    pipx = shutil.which("pipx", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if pipx:
        (tools / "pipx").symlink_to(pipx)
    return Place("host", base, tools)


def _sid_python() -> object:
    loader = importlib.machinery.SourceFileLoader("sid_python", str(SID_PYTHON))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # its dataclass looks its module up
    try:
        loader.exec_module(module)
    finally:
        del sys.modules[loader.name]
    return module


def test_sid_docs_root_has_readme_packages_only() -> None:
    """The fresh sid root installs exactly the packages of README's apt-get line: what a user of a
    bare Debian is told to install, and nothing the test sessions use."""
    apt = readme_blocks()[0]
    words = apt.split("#")[0].split()
    assert ["apt-get", "install", "-y"] == words[:3], apt
    assert words[3:] == _sid_python().ROOTS["docs"].packages  # type: ignore[attr-defined]


def test_readme_try_it_and_install_run(place: Place) -> None:
    """README's apt-get line and demo block, then its install block (venv, pipx, wheel) in the
    checkout, then its target block on another machine where the wheel was copied: each exits 0 and
    what it installed runs; the place's own tree is not written."""
    apt, demo, here, target = readme_blocks()
    if place.name == "host" and not shutil.which("pipx", path=f"{place.tools}:{SYSTEM_PATH}"):
        pytest.skip("no pipx beside the tests (the test extra installs it) for README's `pipx install .`")
    before = place.installed()
    checkout = checkout_copy(place.base / "checkout")
    user = place.box("user")
    if place.may_apt:
        user.run(apt, checkout)

    said = user.run(demo, checkout)
    assert "krproxy demo" in demo and NEXT_STEPS.splitlines()[0] in said, said[-3000:]

    user.run(here, checkout)
    said = user.run(f"{user.home}/.local/bin/krproxy version", checkout)  # where pipx linked it
    assert VERSION_LINE == said.strip().splitlines()[-1]
    (wheel,) = (checkout / "dist").glob("krproxy-*.whl")

    elsewhere = place.base / "target"
    elsewhere.mkdir()
    shutil.copy2(wheel, elsewhere)
    machine = place.box("target")
    if place.may_apt:
        machine.run(apt, elsewhere)
    said = machine.run(target, elsewhere)
    assert VERSION_LINE == said.strip().splitlines()[-1]
    assert machine.written(f"{machine.home}/krproxy-venv/bin/krproxy").exists()
    assert before == place.installed()


def test_operations_node_install_runs(place: Place) -> None:
    """operations.md's node install, as root on a node (here: /opt and /usr/local/bin overlaid): it
    exits 0, the link it made runs the /opt/krproxy venv's krproxy, and the place's own /opt and
    /usr/local/bin are untouched."""
    if place.name == "host" and os.geteuid() != 0:
        pytest.skip("the node install runs as root (apt-get, /opt, /usr/local/bin)")
    if place.name == "host" and not shutil.which("unshare"):
        pytest.skip("no unshare (util-linux) for a mount namespace of the test's own")
    before = place.installed()
    checkout = checkout_copy(place.base / "node-checkout")
    node = place.box("node", node=True)

    (block,) = sh_blocks(OPERATIONS, "Installing on a node")
    said = node.run(block, checkout)

    assert VERSION_LINE == said.strip().splitlines()[-1]
    assert "/opt/krproxy/bin/krproxy" == os.readlink(node.written("/usr/local/bin/krproxy"))
    assert node.written("/opt/krproxy/bin/krproxy").exists()
    assert before == place.installed()
