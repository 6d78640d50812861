"""The launcher's index: strings whose absence from ``config.json`` proves no hook can match.

The fast launcher (:mod:`krproxy.ocihooks.wrapper`) must decide a ``runc create`` without Python
when it can: starting Python costs more than runc itself. It cannot evaluate regular expressions,
but ``grep -F`` can look for fixed strings. So for every hook file in force the wrapper derives
*needles*: literal strings such that, if the hook's ``when`` holds for a spec, at least one of
its needles occurs in that spec's ``config.json`` text. If no needle of any hook occurs, no hook
matches, and runc is exec'ed at once. If one occurs, the launcher runs the wrapper, which decides
properly — a needle is a necessary condition, never a sufficient one.

Where a needle comes from (the conditions are ANDed, so any one of them may stand for the hook):

- ``annotations``: every (key, value) pair must be matched by one annotation, so the literal every
  match of the key pattern (or of the value pattern) contains is a needle; the longest one is used;
- ``commands``: one of the patterns must match ``process.args[0]``, so each pattern needs its own
  literal, and the set of them is the hook's needles;
- ``always: true`` and ``hasBindMounts: true`` give no needle (every spec has the string
  ``"bind"``): such a hook gets the empty needle, which ``grep -F`` finds in every file, so every
  create runs the wrapper;
- a hook that can never match (``always: false``, ``hasBindMounts: false``) needs no needle.

Needles hold only characters that no JSON encoder escapes (letters, digits and ``._-:@+=,~``), so
a string in the spec shows them verbatim in the file: containerd writes ``config.json`` with Go's
``encoding/json``, which escapes only ``"``, ``\\``, control characters, ``<``, ``>``, ``&`` and
U+2028/U+2029.

**Freshness.** The index is valid for the hook files it was computed from. Its first line names
the hook directories that existed; the launcher compares it with the directories it sees, and asks
``find -L DIRS -maxdepth 1 -cnewer INDEX`` whether any directory or file in them changed since.
That sees only the final targets of symlinks, so the second line names the directories holding
a symlink on the way to a hook directory or a hook file (:func:`deciding_dirs`): repointing one
replaces an entry there, and ``find -L DIRS -maxdepth 0 -cnewer INDEX`` sees the change.
The index's mtime is set to one second *before* the wrapper started reading the directories, so a
change made while (or just before) the index was computed makes it stale — the file system's
ctime comes from a coarse clock that may lag the one :func:`time.time_ns` reads by a few
milliseconds. A stale or missing index sends the create to the wrapper, which writes a new one.
"""

from __future__ import annotations

import contextlib
import os
import re
import string
from collections.abc import Iterable, Sequence

from krproxy.ocihooks.model import HookFile, is_hook_file

__all__ = [
    "HEADER",
    "NEEDLE_CHARS",
    "WATCH",
    "deciding_dirs",
    "existing_dirs",
    "header",
    "hook_needles",
    "index_lines",
    "required_literal",
    "write_index",
]

#: The first line's prefix; the launcher compares the whole first line with ``HEADER + dirs``.
HEADER = "# krproxy-oci-index 2 dirs="

#: The second line's prefix, before ``:DIR`` for each deciding directory (:func:`deciding_dirs`).
WATCH = "# watch="

#: More symlinks than this on one path: a loop (Linux gives up after 40 too).
_MAX_SYMLINKS = 40

#: Characters a needle may hold: none of them is ever escaped in JSON text.
NEEDLE_CHARS = frozenset(string.ascii_letters + string.digits + "._-:@+=,~")

#: How far the index's mtime is set back before the moment the directories were first read.
BACKDATE_NS = 1_000_000_000

#: Flags under which a pattern's literal characters are not what they match verbatim.
_UNSAFE_FLAGS = re.IGNORECASE | re.VERBOSE

#: Escapes longer than a backslash and one character: hex, Unicode, named, octal, group references.
_LONG_ESCAPES = frozenset("xuUN0123456789")

#: Characters with a meaning of their own in a pattern.
_META = frozenset(".^$*+?{}[]()|\\")

#: A ``{m,n}`` repeat as ``re`` reads one (``{}``, ``{x}``, ``{1,`` are literal text, to be parsed on).
_REPEAT = re.compile(r"\{(?!\})[0-9]*(?:,[0-9]*)?\}")


def required_literal(pattern: re.Pattern[str]) -> str:
    """The longest run of :data:`NEEDLE_CHARS` that every string ``pattern`` finds must contain.

    Only what is certain counts: literal characters outside groups and classes, not followed by a
    quantifier that allows zero. Alternation at the top level, an escape with a letter or digit
    (``\\d``, ``\\x41``...), case-insensitive or verbose mode: nothing is certain, and the empty
    string is returned.
    """
    if pattern.flags & _UNSAFE_FLAGS:
        return ""
    text = pattern.pattern
    runs: list[str] = []
    run = ""
    depth = 0  # inside a group: nothing there is certain
    i = 0
    while i < len(text):
        char = text[i]
        i += 1
        if char == "\\":
            escaped = text[i] if i < len(text) else ""
            i += 1
            if escaped.isalnum():
                # \d, \b, \A...: not a literal. \x41, \u00e9, \N{...}, \012, \1 go on: skip the
                # letters and digits that may belong to them.
                if escaped == "N" and text.startswith("{", i):
                    close = text.find("}", i)
                    i = len(text) if close < 0 else close + 1
                elif escaped in _LONG_ESCAPES:
                    while i < len(text) and text[i].isalnum():
                        i += 1
                escaped = ""
            if depth:
                continue
            if escaped and escaped in NEEDLE_CHARS:
                run += escaped
                continue
        elif char == "[":
            i = _class_end(text, i - 1)
        elif char == "(" and text.startswith("?#", i):
            i = _comment_end(text, i + 2)  # a comment is nothing: the run goes on, a repeat after
            continue  # it applies to the atom before it
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif depth:
            continue
        elif char == "|":
            return ""
        elif char in "*?" or (char == "{" and _REPEAT.match(text, i - 1)):
            run = run[:-1]  # the atom before may occur zero times (a group's or class's run is closed)
            if char == "{":
                i = text.index("}", i) + 1  # the repeat's own "}"
        elif char not in _META and char in NEEDLE_CHARS:
            run += char
            continue
        # Anything else (".", "^", "$", "+", a class, a group, a character JSON may escape) ends the
        # run; "+" keeps the atom before it, which occurs at least once.
        if not depth or char == "(":
            runs.append(run)
            run = ""
    runs.append(run)
    return max(runs, key=len)


def _comment_end(text: str, i: int) -> int:
    """The index after the ``)`` that ends a ``(?#`` comment whose text starts at ``i``."""
    while i < len(text) and text[i] != ")":
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _class_end(text: str, start: int) -> int:
    """The index after the ``]`` that closes the class opened at ``start``."""
    i = start + 1
    if i < len(text) and text[i] == "^":
        i += 1
    if i < len(text) and text[i] == "]":  # a leading "]" is a member, not the end
        i += 1
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i + 1


def hook_needles(hook: HookFile) -> list[str] | None:
    """The hook's needles (see the module docstring); None when the hook can never match.

    ``[""]`` means "no string can rule it out": every create must run the wrapper.
    """
    when = hook.when
    if when.always is False or when.has_bind_mounts is False:
        return None
    options: list[list[str]] = []
    for key, value in when.annotations:
        options.append([max(required_literal(key), required_literal(value), key=len)])
    if when.commands:
        options.append([required_literal(command) for command in when.commands])
    usable = [needles for needles in options if all(needles)]
    if not usable:
        return [""]
    return max(usable, key=lambda needles: min(len(n) for n in needles))


def deciding_dirs(directories: Iterable[str]) -> str | None:
    """The directories whose entries decide which files the hook paths lead to, as ``:DIR`` each.

    The real directory holding each symlink met on the way to a directory of ``directories`` or to
    a ``*.json`` in one, through symlink targets too: a symlink is repointed by replacing it, which
    changes that directory. None when one cannot be written in the index (a ``:`` or a newline in
    its name) or the symlinks loop.
    """
    found: set[str] = set()
    try:
        for directory in directories:
            _symlink_dirs(directory, found)
            for name in _json_names(directory):
                _symlink_dirs(os.path.join(directory, name), found)
    except RecursionError:
        return None
    if any(":" in d or "\n" in d for d in found):
        return None
    return "".join(f":{d}" for d in sorted(found))


def _json_names(directory: str) -> list[str]:
    try:
        return [name for name in os.listdir(directory) if is_hook_file(name)]
    except OSError:
        return []


def _symlink_dirs(path: str, found: set[str], hops: int = 0) -> None:
    """Add to ``found`` the real directory holding each symlink on the way to ``path``."""
    if hops > _MAX_SYMLINKS:
        raise RecursionError(f"too many symlinks at {path}")
    current = os.sep
    for part in os.path.join(os.getcwd(), path).split(os.sep):
        if part in ("", "."):
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        following = os.path.join(current, part)
        if os.path.islink(following):
            found.add(current)
            _symlink_dirs(os.path.join(current, os.readlink(following)), found, hops + 1)
            following = os.path.realpath(following)
        current = following


def existing_dirs(directories: Iterable[str]) -> str:
    """The directories that exist, as the launcher writes them: ``:DIR`` for each, in order."""
    return "".join(f":{d}" for d in directories if os.path.isdir(d))


def header(dirs: str) -> str:
    return HEADER + dirs


def index_lines(dirs: str, hooks: Sequence[HookFile], watch: str | None = "") -> list[str]:
    """The index's lines: the header, the deciding directories ``watch``, then each distinct needle once.

    ``watch`` None (the directories could not be named) adds the empty needle: every create then
    runs the wrapper. The first two lines are patterns ``grep -F`` looks for too; they cannot hide
    a match, only cause one.
    """
    lines = [header(dirs), WATCH + (watch or "")]
    if watch is None:
        lines.append("")
    for hook in hooks:
        for needle in hook_needles(hook) or ():
            if needle not in lines:
                lines.append(needle)
    return lines


def write_index(path: str, dirs: str, hooks: Sequence[HookFile], read_started_ns: int) -> None:
    """Write the index for ``hooks`` (read from ``dirs`` starting at ``read_started_ns``) atomically.

    The parent directory is created (mode 0700) if needed. The mtime is set to
    ``read_started_ns`` minus :data:`BACKDATE_NS`, before the file is renamed into place. The
    deciding directories are found now, after the reading: one changed since (a symlink repointed)
    is newer than the index, whichever way it resolved.
    """
    watch = deciding_dirs(dirs.split(":")[1:])
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in index_lines(dirs, hooks, watch)))
        stamp = read_started_ns - BACKDATE_NS
        os.utime(temporary, ns=(stamp, stamp))
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
