"""The commands and code blocks of README.md and docs/*.md are run or checked, so the docs stay true.

A small collector of our own (no Sybil: the blocks are few and of known kinds) reads every fenced
block and every inline code span that is a command, and each kind is checked as far as it can
be without root or a node:

- ``sh`` blocks and ``$ ``-prompted lines: each command (continuations joined, ``&&`` split) is
  known to :data:`COMMANDS`, or the test fails. ``krproxy ...`` is parsed by krproxy's own
  argument parser (subcommands, flags and their values); ``python -m X`` and ``python FILE``
  are asked for ``--help``, which must name every flag the command and its trailing comment
  use; ``nox -s NAME`` names a session of noxfile.py; ``cp`` copies files that exist.
  ``systemctl`` and ``kill`` need a node (systemd as root, the example's own jobs), and the
  deploy units are checked by tests/unit/test_admin_deploy.py: they are only recognised. The
  install blocks (README's "Try it" and "Install", operations.md's "Installing on a node") are
  also run as written, by tests/e2e/test_docs_install.py.
- A ``$ krproxy trace show`` of a trace under tests/data runs, and its output is the block's
  (``...`` stands for lines, or within a line for text, left out).
- ``python`` blocks run, a document's blocks in order in one namespace.
- ``json`` blocks parse; a registration file (``remote-endpoint``) and an OCI hook file
  (``hook``) parse with krproxy's own loaders. ``toml`` blocks parse; ``yaml`` blocks load as a
  node policy (the SDK's loader).
- Inline spans such as `` `krproxy trace show|replay|serve` `` or `` `python -m krproxy.fakes.containerd
  --socket PATH` ``: the command exists and ``--help`` names its flags.

Blocks without a language and without a prompt are diagrams and sample output: not run.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import io
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator

import attrs
import pytest

from krproxy import cli
from krproxy.hooks.registration import parse_registration
from krproxy.hookserver import NodePolicy
from krproxy.ocihooks.model import parse_hook_file

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@attrs.frozen
class Block:
    doc: str
    line: int
    lang: str
    text: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


def fenced_blocks(path: pathlib.Path) -> list[Block]:
    text = path.read_text()
    return [
        Block(path.name, text[: m.start()].count("\n") + 1, m.group(1), m.group(2))
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
    ]


def prose(path: pathlib.Path) -> str:
    """The document without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


BLOCKS = [b for path in DOCS for b in fenced_blocks(path)]


@attrs.frozen
class Command:
    where: str
    argv: tuple[str, ...]
    comment: str = ""


def shell_commands(where: str, text: str) -> list[Command]:
    """The commands of a shell block: continuations joined, comments kept apart (a comment line
    joins the comment of the command above it), ``&&`` split, a trailing ``&`` dropped."""
    commands = []
    for logical in re.sub(r"\\\n", " ", text).splitlines():
        code, _, comment = logical.partition(" #")
        if logical.lstrip().startswith("#"):
            # a comment line goes on the comment of the command above it (more flags of it)
            if commands:
                commands[-1] = attrs.evolve(commands[-1], comment=commands[-1].comment + " " + logical)
            continue
        tokens = shlex.split(code)
        while tokens:
            cut = tokens.index("&&") if "&&" in tokens else len(tokens)
            argv = [t for t in tokens[:cut] if t != "&"]
            if argv:
                commands.append(Command(where, tuple(argv), comment))
            tokens = tokens[cut + 1 :]
    return commands


def prompted(block: Block) -> Iterator[tuple[Command, list[str]]]:
    """``$ `` lines of a block, each with the output lines that follow it."""
    lines = block.text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("$ "):
            out = []
            for rest in lines[i + 1 :]:
                if rest.startswith("$ "):
                    break
                out.append(rest)
            yield Command(str(block), tuple(shlex.split(line[2:]))), out


def inline_commands(path: pathlib.Path) -> list[Command]:
    """Inline code spans that are commands: ``krproxy SUB...``, ``python -m X ...``,
    ``python FILE ...``, ``nox ...``; ``a|b`` in a subcommand position makes one command each."""
    found = []
    pattern = r"`((?:krproxy|nox|python3? -m [\w.]+|python3? \S+\.py)(?: [^`]*)?)`"
    for m in re.finditer(pattern, prose(path)):
        words = m.group(1).split()
        alternatives = next((i for i, w in enumerate(words) if "|" in w and not w.startswith("-")), None)
        if alternatives is None:
            found.append(Command(path.name, tuple(words)))
        else:
            found += [
                Command(path.name, (*words[:alternatives], w, *words[alternatives + 1 :]))
                for w in words[alternatives].split("|")
            ]
    return found


# --- what each program is checked with --------------------------------------------------------


def _krproxy_help(subcommand: tuple[str, ...]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.build_parser().parse_args([*subcommand, "--help"])
    return out.getvalue()


def _subcommand(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The subcommand words of ``krproxy ARGS`` (``trace show``, ``hooks serve``, ``serve``)."""
    words: list[str] = []
    parser = cli.build_parser()
    for word in argv[1:]:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or word not in actions[0].choices:
            break
        words.append(word)
        parser = actions[0].choices[word]
    return tuple(words)


def check_krproxy(command: Command, *, parse: bool) -> None:
    """Parsed by krproxy's parser (``...`` in a block stands for flags left out), or, for inline
    spans with placeholders, each flag named by the subcommand's help."""
    sub = _subcommand(command.argv)
    if not sub and len(command.argv) > 1 and command.argv[1].startswith("-"):
        sub = ("serve",)  # koord-runtime-proxy style, flags only (cli.main)
    placeholder = len(command.argv) == 2 and command.argv[1].rstrip(".").isupper()
    assert sub or placeholder or command.argv == ("krproxy",), (
        f"{command.where}: {shlex.join(command.argv)}: no such subcommand"
    )
    if parse:
        err = io.StringIO()
        args = [a for a in command.argv[1:] if a != "..."]
        with contextlib.redirect_stderr(err):
            try:
                cli.build_parser().parse_args(args)
            except SystemExit:
                pytest.fail(f"{command.where}: {shlex.join(command.argv)}: {err.getvalue()}")
    help_text = _krproxy_help(sub) if sub else ""
    missing = [f for f in FLAG.findall(" ".join(command.argv) + command.comment) if f not in help_text]
    assert [] == missing, (
        f"{command.where}: {shlex.join(command.argv)}: krproxy {' '.join(sub)} has no such flags"
    )


@functools.cache
def _help(argv: tuple[str, ...]) -> str:
    done = subprocess.run(
        [sys.executable, *argv, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert 0 == done.returncode, f"{shlex.join(argv)} --help: {done.stderr}"
    return done.stdout


def check_python(command: Command) -> None:
    """``python -m MODULE ...`` or ``python FILE ...``: the program's ``--help`` names every flag."""
    argv = command.argv[1:]
    if argv[:3] == ("-m", "pip", "install"):
        return check_pip(command)
    program = argv[:2] if argv[0] == "-m" else argv[:1]
    missing = [f for f in FLAG.findall(" ".join(argv) + command.comment) if f not in _help(program)]
    assert [] == missing, f"{command.where}: {shlex.join(command.argv)}: no such flags"
    return None


def check_pip(command: Command) -> None:
    """``pip install krproxy`` or ``pip install -e .`` is what tests/unit/test_packaging.py
    builds; here the package named is ours (the checkout, or its wheel), or nox and uv, which run the
    tests. tests/e2e/test_docs_install.py runs README's and operations.md's installs."""
    named = command.argv[-1]
    ours = named in {"krproxy", ".", "nox", "uv"} or re.fullmatch(r"(dist/)?krproxy-\*\.whl", named)
    assert ours, f"{command.where}: installs {named}"


@functools.cache
def nox_sessions() -> frozenset[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for deco in node.decorator_list:
                call = deco if isinstance(deco, ast.Call) else None
                target = call.func if call else deco
                if isinstance(target, ast.Attribute) and target.attr == "session":
                    named = [k.value for k in (call.keywords if call else []) if k.arg == "name"]
                    names.add(named[0].value if named and isinstance(named[0], ast.Constant) else node.name)
    return frozenset(names)


def check_nox(command: Command) -> None:
    argv = list(command.argv[1:])
    if "--" in argv:
        argv = argv[: argv.index("--")]
    sessions = [argv[i + 1] for i, a in enumerate(argv) if a == "-s"]
    unknown = [s for s in sessions if s not in nox_sessions()]
    assert [] == unknown, f"{command.where}: {shlex.join(command.argv)}: no such nox session"


def check_cp(command: Command) -> None:
    missing = [s for s in command.argv[1:-1] if not (ROOT / s).exists()]
    assert [] == missing, f"{command.where}: {shlex.join(command.argv)}: no such files in the repository"


def needs_a_node(command: Command) -> None:
    """Recognised, not run: systemd or containerd's ctr as root, apt-get, or the example's own
    background jobs."""


def check_ln(command: Command) -> None:
    """``ln -sf VENV/bin/krproxy LINK``: the link is where deploy/krproxy.service runs krproxy from."""
    source, link = command.argv[-2:]
    service = (ROOT / "deploy" / "krproxy.service").read_text()
    assert source.endswith("/bin/krproxy"), f"{command.where}: links {source}, not a venv's krproxy"
    assert f"ExecStart={link} " in service, f"{command.where}: deploy/krproxy.service does not run {link}"


def check_in_venv(command: Command) -> None:
    """``DIR/bin/pip ...`` or ``DIR/bin/krproxy ...``: a venv's pip or krproxy, checked as those."""
    program = os.path.basename(command.argv[0])
    COMMANDS[program](attrs.evolve(command, argv=(program, *command.argv[1:])))


COMMANDS = {
    "krproxy": lambda c: check_krproxy(c, parse=True),
    "python": check_python,
    "python3": check_python,
    "pip": check_pip,
    "nox": check_nox,
    "cp": check_cp,
    "systemctl": needs_a_node,
    "kill": needs_a_node,
    "ctr": needs_a_node,
    "apt-get": needs_a_node,
    "pipx": check_pip,
    "ln": check_ln,
}


def _all_commands() -> list[Command]:
    found = []
    for block in BLOCKS:
        if block.lang == "sh":
            found += shell_commands(str(block), block.text)
        found += [command for command, _ in prompted(block)]
    return found


@pytest.mark.parametrize(
    "command", _all_commands(), ids=lambda c: f"{c.where} {c.argv[0]} {' '.join(c.argv[1:2])}"
)
def test_a_command_of_the_docs_is_right(command: Command) -> None:
    """Each command of a shell block or after a ``$`` prompt is one we check, and passes its check."""
    if command.argv[0].endswith(("/bin/pip", "/bin/krproxy")):
        return check_in_venv(command)
    assert command.argv[0] in COMMANDS, (
        f"{command.where}: how to check {command.argv[0]!r}? Add it to COMMANDS"
    )
    return COMMANDS[command.argv[0]](command)


@pytest.mark.parametrize(
    "command", [c for p in DOCS for c in inline_commands(p)], ids=lambda c: f"{c.where} {' '.join(c.argv)}"
)
def test_a_command_named_in_the_prose_exists(command: Command) -> None:
    """An inline ``krproxy ...``, ``python ...`` or ``nox ...`` names a real command and real flags."""
    if command.argv[0] == "krproxy":
        check_krproxy(command, parse=False)
    elif command.argv[0] == "nox":
        check_nox(command)
    else:
        check_python(command)


def _trace_shows() -> list[tuple[Command, list[str]]]:
    return [
        (command, out)
        for block in BLOCKS
        for command, out in prompted(block)
        if command.argv[:3] == ("krproxy", "trace", "show")
    ]


@pytest.mark.parametrize("command, expected", _trace_shows(), ids=lambda x: str(getattr(x, "where", "")))
def test_a_trace_show_prints_what_the_docs_show(command: Command, expected: list[str]) -> None:
    """``krproxy trace show`` of a trace file in the repository prints the lines shown, in order
    (``...`` in the block: lines left out)."""
    out = io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out):
        assert 0 == cli.main(list(command.argv[1:]))
    printed = [p.rstrip() for p in out.getvalue().splitlines()]
    at = 0
    for line in expected:
        if line.strip() == "...":
            continue
        # ``...`` inside a line: text left out (a long message, a JSON object)
        wanted = re.compile(".*".join(re.escape(part) for part in line.rstrip().split("...")))
        found = next((i for i in range(at, len(printed)) if wanted.fullmatch(printed[i])), None)
        assert found is not None, f"{command.where}: not printed (in this order): {line!r}"
        at = found + 1


def _by_lang(lang: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang == lang]


@pytest.mark.parametrize("doc", sorted({b.doc for b in _by_lang("python")}))
def test_the_python_blocks_of_a_document_run(doc: str) -> None:
    """A document's python blocks run in order, in one namespace (later ones use earlier names)."""
    namespace: dict[str, object] = {"__name__": "docs_example"}
    for block in (b for b in _by_lang("python") if b.doc == doc):
        exec(compile(block.text, str(block), "exec"), namespace)


@pytest.mark.parametrize("block", _by_lang("json"), ids=str)
def test_a_json_block_parses(block: Block) -> None:
    """A JSON block parses; a registration or OCI hook file as krproxy would load it."""
    text = block.text if block.text.lstrip().startswith("{") else "{" + block.text + "}"
    document = json.loads(text)
    if "remote-endpoint" in document:
        parse_registration("example.json", block.text.encode())
    if "hook" in document:
        parse_hook_file("example.json", block.text.encode())


@pytest.mark.parametrize("block", _by_lang("toml"), ids=str)
def test_a_toml_block_parses(block: Block) -> None:
    tomllib.loads(block.text)


@pytest.mark.parametrize("block", _by_lang("yaml"), ids=str)
def test_a_yaml_block_is_a_node_policy(block: Block) -> None:
    NodePolicy.from_text(block.text)


def test_every_block_is_checked_or_shown() -> None:
    """A block has a language this test checks, or none (a diagram or sample output, prompted
    commands in it checked above); a new language needs a check here."""
    known = {"", "sh", "text", "python", "json", "toml", "yaml"}
    assert [] == [f"{b} ```{b.lang}" for b in BLOCKS if b.lang not in known]


def test_the_collector_reads_commands() -> None:
    """The collector itself: continuations, comments, ``&&``, ``&`` and alternatives."""
    text = "# first\na --x 1 \\\n  --y 2 &  # --z\n   # --v\nb && c --w\n"
    assert [
        Command("t", ("a", "--x", "1", "--y", "2"), " --z    # --v"),
        Command("t", ("b",)),
        Command("t", ("c", "--w")),
    ] == shell_commands("t", text)
    with pytest.raises(AssertionError, match="no such flags"):
        check_krproxy(Command("t", ("krproxy", "status", "--no-such-flag")), parse=False)
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments"):
        check_krproxy(Command("t", ("krproxy", "serve", "--no-such-flag")), parse=True)
