"""``krproxy-runc-wrapper``: runc with hooks.d hooks, for a containerd runtime handler.

containerd's runc shim runs the program named by the runtime option ``BinaryName`` for every
runc command. With this wrapper there, ``create`` (and ``run``) first reads the bundle's
``config.json``, evaluates every hook file's ``when`` against it (annotations, ``process.args[0]``,
bind mounts) and appends the matching hooks to the spec's ``hooks`` for their stages; then the
real runc is ``exec``-ed with the arguments unchanged. runc itself then runs the hooks at the
exact points the runtime spec defines (``createRuntime`` after the namespaces exist,
``poststart`` after the process started, ``poststop`` in ``runc delete``), with the true state on
stdin — ``pid`` and ``bundle`` included — and enforces their ``timeout``. A failing
pre-start hook fails ``runc create``, hence StartContainer. This is what CRI-O and podman do:
they, too, put the hooks into the spec and let the runtime run them.

Every other runc command (``state``, ``start``, ``kill``, ``delete``, ``exec``...) is ``exec``-ed
at once, without reading any hook file; ``create`` with no matching hook leaves ``config.json``
untouched. Standard library only, and nothing imported that the fast path does not need.

Configuration (first found wins for ``runc`` and ``log``; ``hooks-dir`` lines accumulate):

- environment: ``KRPROXY_RUNC`` (the real runc), ``KRPROXY_OCI_HOOKS_DIRS`` (colon-separated
  directories, least preferred first), ``KRPROXY_OCI_LOG`` (a file to append log lines to);
- ``krproxy-runc-wrapper.conf`` in the directory the wrapper was invoked from (the directory of
  ``BinaryName`` — not resolved through symlinks), lines ``key = value`` or ``--key value``
  with keys ``runc``, ``hooks-dir`` (repeatable, least preferred first) and ``log``; ``#``
  starts a comment;
- defaults: ``runc`` from ``PATH`` (never the wrapper itself), the hooks.d directories
  :data:`DEFAULT_HOOK_DIRS`, no log.

**The fast launcher** (:func:`launcher_script`; ``krproxy oci-launcher PATH`` writes it): a
``/bin/sh`` script to use as ``BinaryName`` instead of the Python entry point, because a Python
start costs several times what runc itself does. With shell built-ins only it finds the
subcommand and ``exec``s runc directly for every command but ``create``/``run``, and for those
too when no hook directory holds a ``*.json`` file — no Python at all on that path. With hook
files present, a ``create`` still goes straight to runc when the launcher's *index* is current
and ``grep -F`` finds none of its strings in ``config.json``: then no hook can match
(:mod:`krproxy.ocihooks.index` says how the strings are derived and how the launcher tells that
the index is current, with one ``find``). Otherwise it runs this module under ``python -I -S``
(no site processing: the wrapper needs the standard library only, and krproxy's own directory is
put on ``sys.path`` by hand), which also writes the index anew when it was not current. runc,
the hook directories, the log and the index's path are resolved when the launcher is written;
the environment variables above still override the first three at run time.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

CONFIG_NAME = "krproxy-runc-wrapper.conf"

#: The hooks.d directories CRI-O and podman read, least preferred first.
DEFAULT_HOOK_DIRS = ("/usr/share/containers/oci/hooks.d", "/etc/containers/oci/hooks.d")

#: runc's global options that take a value (``--root DIR`` or ``--root=DIR``).
_GLOBAL_WITH_VALUE = frozenset({"--log", "--log-format", "--root", "--criu", "--rootless"})

#: Options of ``create``/``run`` that take a value, besides ``--bundle``.
_CREATE_WITH_VALUE = ("console-socket", "pid-file", "preserve-fds")

#: Mount destinations containerd's CRI plugin adds by itself when the caller did not mount them;
#: they do not count as "bind mounts the caller asked for" (podman likewise ignores its own).
RUNTIME_BIND_MOUNTS = frozenset({"/etc/hostname", "/etc/hosts", "/etc/resolv.conf", "/dev/shm"})

#: Exit status when the wrapper cannot find runc at all (126: found but cannot run, by convention).
EXIT_NO_RUNC = 127


class Settings(NamedTuple):
    runc: str | None
    hook_dirs: tuple[str, ...]
    log: str | None


def read_config(path: str) -> dict[str, list[str]]:
    """``key -> values`` of a config file; an absent file is empty."""
    values: dict[str, list[str]] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return values
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "=" in line:
            key, value = line.split("=", 1)
        else:
            key, _, value = line.partition(" ")
        values.setdefault(key.strip().lstrip("-"), []).append(value.strip())
    return values


def _last(values: list[str] | None) -> str | None:
    return values[-1] if values else None


def settings(argv0: str, environ: dict[str, str] | os._Environ[str]) -> Settings:
    """Where runc, the hook directories and the log are, from the environment and the config file."""
    config = read_config(os.path.join(os.path.dirname(os.path.abspath(argv0)), CONFIG_NAME))
    runc = environ.get("KRPROXY_RUNC") or _last(config.get("runc"))
    env_dirs = [d for d in environ.get("KRPROXY_OCI_HOOKS_DIRS", "").split(":") if d]
    hook_dirs = tuple(env_dirs or config.get("hooks-dir") or DEFAULT_HOOK_DIRS)
    log = environ.get("KRPROXY_OCI_LOG") or _last(config.get("log"))
    return Settings(runc, hook_dirs, log)


def find_runc(configured: str | None, argv0: str, path: str) -> str | None:
    """The real runc: as configured, else the first ``runc`` on ``path`` that is not this wrapper."""
    if configured:
        return configured
    me = os.path.realpath(argv0)
    for directory in path.split(os.pathsep):
        candidate = os.path.join(directory or ".", "runc")
        if os.access(candidate, os.X_OK) and os.path.realpath(candidate) != me:
            return candidate
    return None


class Invocation(NamedTuple):
    """The parts of a runc command line the wrapper cares about."""

    command: str | None
    bundle: str | None
    container_id: str | None


def parse_runc_args(args: Sequence[str]) -> Invocation:
    """Find the subcommand, and for ``create``/``run`` the bundle (default: cwd) and the container id."""
    index = 0
    while index < len(args):
        arg = args[index]
        if not arg.startswith("-"):
            break
        name = "--" + arg.lstrip("-").split("=", 1)[0]
        index += 2 if name in _GLOBAL_WITH_VALUE and "=" not in arg else 1
    if index >= len(args):
        return Invocation(None, None, None)
    command, rest = args[index], list(args[index + 1 :])
    if command not in ("create", "run"):
        return Invocation(command, None, None)
    bundle: str | None = None
    positional: list[str] = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg in ("-b", "--bundle", "-bundle"):
            bundle = rest[i + 1] if i + 1 < len(rest) else None
            i += 2
            continue
        if arg.startswith(("--bundle=", "-bundle=", "-b=")):
            bundle = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            # Options of create/run that take a value; the others are switches.
            if arg.lstrip("-") in _CREATE_WITH_VALUE and "=" not in arg:
                i += 1
        else:
            positional.append(arg)
        i += 1
    return Invocation(command, bundle or os.getcwd(), positional[-1] if positional else None)


def container_from_spec(spec: dict[str, Any]) -> Any:
    """The ``when`` facts of a runtime spec (annotations, ``process.args[0]``, bind mounts)."""
    from krproxy.ocihooks.model import Container

    args = (spec.get("process") or {}).get("args") or []
    mounts = spec.get("mounts") or []
    has_bind_mounts = any(
        isinstance(m, dict)
        and (m.get("type") == "bind" or {"bind", "rbind"} & set(m.get("options") or ()))
        and m.get("destination") not in RUNTIME_BIND_MOUNTS
        for m in mounts
    )
    annotations = spec.get("annotations") or {}
    return Container(
        annotations={str(k): str(v) for k, v in annotations.items()},
        command=args[0] if args and isinstance(args[0], str) else None,
        has_bind_mounts=has_bind_mounts,
    )


class Logger:
    """Appends logfmt-ish lines to a file; does nothing without one. Never raises."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def __call__(self, event: str, **fields: Any) -> None:
        if not self.path:
            return
        import json

        parts = [time.strftime("ts=%Y-%m-%dT%H:%M:%SZ", time.gmtime()), f"event={event}"]
        for key, value in fields.items():
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            quoted = not text or " " in text or '"' in text
            parts.append(f"{key}={json.dumps(text) if quoted else text}")
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(" ".join(parts) + "\n")
        except OSError:
            pass


def load_hooks(directories: Sequence[str], logger: Logger) -> list[Any]:
    """The hook files in force in ``directories`` (least preferred first); invalid ones are logged."""
    from krproxy.ocihooks.model import InvalidHookFile, effective, is_hook_file, parse_hook_file

    layers = []
    for directory in directories:
        layer: dict[str, Any] = {}
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            names = []
        for name in names:
            if not is_hook_file(name):
                continue
            path = os.path.join(directory, name)
            try:
                with open(path, "rb") as f:
                    content = f.read(64 * 1024 + 1)
                layer[name] = parse_hook_file(name, content, path)
            except IsADirectoryError:
                continue
            except (OSError, InvalidHookFile) as err:
                layer[name] = str(err)
                logger("oci_hook_invalid", file=path, error=str(err))
        layers.append(layer)
    return effective(layers)


def inject(
    bundle: str,
    directories: Sequence[str],
    logger: Logger,
    container_id: str | None,
    index: str | None = None,
) -> list[str]:
    """Add the matching hooks to ``bundle/config.json``; return ``"file:stage"`` for each one added.

    With ``index``, also write the launcher's index there for the hook files read (a failure to
    write it is logged: the launcher then keeps running the wrapper for every create).
    """
    import json  # here, not at the top: the commands that pass straight through never need it

    from krproxy.ocihooks.model import STAGES, select

    read_started_ns = time.time_ns()
    hooks = load_hooks(directories, logger)
    if index:
        from krproxy.ocihooks.index import existing_dirs, write_index

        try:
            write_index(index, existing_dirs(directories), hooks, read_started_ns)
        except OSError as err:
            logger("oci_index_unwritable", index=index, error=str(err))
    if not hooks:
        return []
    path = os.path.join(bundle, "config.json")
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    container = container_from_spec(spec)
    added: list[str] = []
    spec_hooks = spec.get("hooks") or {}
    for stage in STAGES:
        entries = list(spec_hooks.get(stage) or [])
        for hook in select(hooks, stage, container):
            entry = hook.command.to_spec()
            if entry not in entries:  # a retried create must not run a hook twice
                entries.append(entry)
                added.append(f"{hook.name}:{stage}")
        if entries:
            spec_hooks[stage] = entries
    if not added:
        return []
    spec["hooks"] = spec_hooks
    mode = os.stat(path).st_mode & 0o7777
    temporary = os.path.join(bundle, ".config.json.krproxy-oci")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    os.replace(temporary, path)
    logger("oci_hooks_injected", id=container_id or "", bundle=bundle, hooks=",".join(added))
    return added


#: The launcher's environment variable naming itself (its directory holds the config file).
LAUNCHER_ENV = "KRPROXY_RUNC_WRAPPER"

#: The launcher's environment variable naming the index to write (set when it was not current).
INDEX_ENV = "KRPROXY_OCI_INDEX_WRITE"

#: Where launchers keep their index by default (a tmpfs: gone at boot, written again when needed).
DEFAULT_INDEX_DIR = "/run/krproxy"

_LAUNCHER = """#!/bin/sh
# krproxy-runc-wrapper fast launcher, written by `krproxy oci-launcher` (krproxy {version}).
# Commands other than create/run go straight to runc. So does a create/run when no hook directory
# holds a *.json file, or when the index is current (no hook directory or file, nor a directory
# holding a symlink on the way to one, changed since the wrapper wrote it) and none of its strings
# occurs in the bundle's config.json: then no hook can match (see krproxy/ocihooks/index.py).
# Otherwise the wrapper runs under Python without site
# processing: it adds the matching OCI hooks to config.json, writes the index anew if it was not
# current, and execs runc.
# Resolved when written: runc {runc}, hook directories {dirs}, log {log}, index {index}.
# KRPROXY_RUNC, KRPROXY_OCI_HOOKS_DIRS and KRPROXY_OCI_LOG override them.
runc=${{KRPROXY_RUNC:-{q_runc}}}
command= skip= bundle=.
for arg do
  if [ -n "$skip" ]; then
    if [ "$skip" = bundle ]; then bundle=$arg; fi
    skip=
  elif [ -z "$command" ]; then
    case "$arg" in
      {global_value_options}) skip=1 ;;
      -*) ;;
      create|run) command=$arg ;;
      *) break ;;
    esac
  else
    case "$arg" in
      -b|-bundle|--bundle) skip=bundle ;;
      -b=*|-bundle=*|--bundle=*) bundle=${{arg#*=}} ;;
      {create_value_options}) skip=1 ;;
    esac
  fi
done
if [ -n "$command" ]; then
  dirs=${{KRPROXY_OCI_HOOKS_DIRS:-{q_dirs}}}
  case "$dirs" in *[!:]*) ;; *) dirs={q_dirs} ;; esac  # no directory named: as if unset (the wrapper)
  bundle=${{bundle:-.}}  # --bundle "": the current directory, as for runc
  log=${{KRPROXY_OCI_LOG:-{q_log}}}
  index={q_index}
  found= existing= relative=
  IFS=:
  set -f
  for dir in $dirs; do
    set +f
    if [ -z "$dir" ]; then continue; fi
    if [ -d "$dir" ]; then existing="$existing:$dir"; fi
    case "$dir" in /*) ;; *) relative=1 ;; esac
    for file in "$dir"/*.json; do
      if [ -e "$file" ]; then found=1; break; fi
    done
  done
  set +f; unset IFS
  if [ -n "$found" ]; then
    current=
    # The index is read through one open descriptor (3): the strings grep looks for are those of
    # the index found current, even if a wrapper replaces the file meanwhile.
    if [ -z "$relative" ] && [ -r "$index" ]; then
      {{
        line= watch=
        IFS= read -r line <&3; IFS= read -r watch <&3
        case "$watch" in "{watch}"*) watch=${{watch#"{watch}"}} ;; *) line= ;; esac
        if [ "$line" = "{header}$existing" ]; then
          set -f; IFS=:
          if changed=$(find -L ${{existing#:}} -maxdepth 1 -cnewer /dev/fd/3 -print -quit 2>/dev/null) \\
              && [ -z "$changed" ] \\
              && {{ [ -z "$watch" ] || changed=$(find -L ${{watch#:}} -maxdepth 0 -cnewer /dev/fd/3 -print -quit 2>/dev/null); }} \\
              && [ -z "$changed" ]; then
            current=1
          fi
          unset IFS; set +f
        fi
        if [ -n "$current" ]; then
          grep -qF -f /dev/fd/3 -- "$bundle/config.json" 2>/dev/null
          if [ $? -eq 1 ]; then exec "$runc" "$@" 3<&-; fi
          index=
        fi
      }} 3< "$index"
    fi
    KRPROXY_RUNC="$runc" KRPROXY_OCI_HOOKS_DIRS="$dirs" KRPROXY_OCI_LOG="$log" {index_env}="$index" \\
      {env_name}="$0" exec {q_python} -I -S {q_wrapper} "$@"
  fi
fi
exec "$runc" "$@"
"""


def default_index(path: str) -> str:
    """Where the launcher written at ``path`` keeps its index: under ``/run/krproxy``, named after ``path``."""
    import hashlib

    digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
    return os.path.join(DEFAULT_INDEX_DIR, f"oci-hooks-{digest}.index")


def launcher_script(
    path: str, *, runc: str | None = None, python: str | None = None, index: str | None = None
) -> str:
    """The fast launcher to install at ``path`` (see the module docstring).

    runc, the hook directories and the log are resolved as the wrapper would for ``path`` (its
    directory's config file, then ``PATH``) unless ``runc`` is given. ``index`` is where the
    launcher keeps its index (default :func:`default_index`).

    Raises:
        FileNotFoundError: no runc to name.
    """
    import shlex

    from krproxy import __version__
    from krproxy.ocihooks.index import HEADER, WATCH

    config = settings(path, {})
    found = find_runc(runc or config.runc, path, os.environ.get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError(f"no runc found for {path} (give one, or set `runc =` in {CONFIG_NAME})")

    def alternatives(names: Sequence[str]) -> str:
        return "|".join(f"{dashes}{name}" for name in sorted(names) for dashes in ("--", "-"))

    dirs = ":".join(config.hook_dirs)
    index = os.path.abspath(index or default_index(path))
    return _LAUNCHER.format(
        version=__version__,
        runc=found,
        dirs=dirs,
        log=config.log or "none",
        index=index,
        q_runc=shlex.quote(found),
        q_dirs=shlex.quote(dirs),
        q_log=shlex.quote(config.log or ""),
        q_index=shlex.quote(index),
        header=HEADER,
        watch=WATCH,
        global_value_options=alternatives([name.lstrip("-") for name in _GLOBAL_WITH_VALUE]),
        create_value_options=alternatives(_CREATE_WITH_VALUE),
        index_env=INDEX_ENV,
        env_name=LAUNCHER_ENV,
        q_python=shlex.quote(python or sys.executable),
        q_wrapper=shlex.quote(os.path.abspath(__file__)),
    )


def write_launcher(
    path: str, *, runc: str | None = None, python: str | None = None, index: str | None = None
) -> str:
    """Write :func:`launcher_script` to ``path`` (mode 0755, atomically); return the text."""
    text = launcher_script(path, runc=runc, python=python, index=index)
    temporary = f"{path}.krproxy-tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o755)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(temporary, 0o755)
    os.replace(temporary, path)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: inject hooks on ``create``/``run``, then become the real runc."""
    argv0 = os.environ.pop(LAUNCHER_ENV, None) or sys.argv[0]
    index = os.environ.pop(INDEX_ENV, None)
    args = list(sys.argv[1:] if argv is None else argv)
    config = settings(argv0, os.environ)
    runc = find_runc(config.runc, argv0, os.environ.get("PATH", os.defpath))
    logger = Logger(config.log)
    if runc is None:
        print(
            f"krproxy-runc-wrapper: cannot find runc (set KRPROXY_RUNC or `runc =` in {CONFIG_NAME})",
            file=sys.stderr,
        )
        return EXIT_NO_RUNC
    invocation = parse_runc_args(args)
    if invocation.command in ("create", "run") and invocation.bundle:
        try:
            inject(invocation.bundle, config.hook_dirs, logger, invocation.container_id, index)
        except Exception as err:
            # Fail closed: a container must not start without the hooks meant for it. (Invalid hook
            # files are not such an error: they are logged and ignored in load_hooks.)
            error = f"{type(err).__name__}: {err}"
            logger("oci_hooks_inject_failed", id=invocation.container_id or "", error=error)
            print(f"krproxy-runc-wrapper: cannot add OCI hooks to the bundle: {error}", file=sys.stderr)
            return 1
    os.execv(runc, [runc, *args])  # replaces this process: never returns


if __name__ == "__main__":
    if sys.flags.no_site and sys.flags.isolated:
        # Run by the fast launcher (python -I -S .../krproxy/ocihooks/wrapper.py): neither this
        # directory nor site-packages is on sys.path; krproxy's parent directory is needed for
        # krproxy.ocihooks.model.
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
