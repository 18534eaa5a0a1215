"""TAB completion for bash without starting the CLI framework.

Every TAB runs `bsr` once. Importing the CLI framework costs most of a completion (typer pulls in pydantic), so the
first completion writes an index of the command tree (commands, options, which options take a value) to the user's
cache, and later completions answer from that index and the value table (bsr_cli/cli/completion.py) alone. The index
is rewritten whenever the CLI's own files change. zsh and fish, and anything the index cannot answer, take the full
path (the framework's own completion), which gives the same answers.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bsr_cli.core import wire

INDEX_FORMAT = 2
VALUE_GLOBALS = ("--engine", "-e")  # global options whose values are a known set (engine profiles)


def _cli_dir() -> Path:
    return Path(__file__).resolve().parent


def _stamp() -> str:
    """Changes whenever a file that defines commands or options changes (cheap: one stat per file)."""
    from bsr_cli import __version__

    newest = 0
    for root, dirs, files in os.walk(_cli_dir()):  # cli/, commands/ and the command packages below it
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                newest = max(newest, os.stat(os.path.join(root, name)).st_mtime_ns)
    return f"{__version__}:{newest}"


def index_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bsr" / "completion-index.json"


@dataclass(frozen=True)
class CommandNode:
    """One command as the completion needs it: its options (each name -> whether it takes a value, and every name
    of that option) and its subcommands."""

    options: dict[str, tuple[bool, tuple[str, ...]]]
    subcommands: tuple[str, ...]


@dataclass(frozen=True)
class CompletionIndex:
    """The command tree by path (`""` the root, `"engine up"`, ...), stamped with what it was built from."""

    stamp: str
    commands: dict[str, CommandNode]

    @property
    def format(self) -> int:
        return INDEX_FORMAT

    to_wire = wire.writer(order=("format", "stamp", "commands"))

    @classmethod
    def from_wire(cls, d: Mapping[str, wire.JsonValue]) -> CompletionIndex:
        """Strict: a damaged index raises (KeyError, TypeError, IndexError), and the full path answers."""
        return cls(str(d["stamp"]), {str(path): _node(node) for path, node in _object(d["commands"]).items()})


def _node(node: wire.JsonValue) -> CommandNode:
    """One command of the index: its options (name -> [takes a value, [every name]]) and its subcommands."""
    d = _object(node)
    options = {str(name): _option(row) for name, row in _object(d["options"]).items()}
    return CommandNode(options, tuple(str(x) for x in _array(d["subcommands"])))


def _option(row: wire.JsonValue) -> tuple[bool, tuple[str, ...]]:
    cells = _array(row)
    return bool(cells[0]), tuple(str(x) for x in _array(cells[1]))


def _object(value: wire.JsonValue) -> wire.JsonObject:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {type(value).__name__}")
    return value


def _array(value: wire.JsonValue) -> list[wire.JsonValue]:
    if not isinstance(value, list):
        raise TypeError(f"expected an array, got {type(value).__name__}")
    return value


def build_index(root: Any) -> CompletionIndex:
    """The command tree as the completion needs it, from the CLI's root command."""
    commands: dict[str, CommandNode] = {}

    def walk(cmd: Any, path: str) -> None:
        opts: dict[str, tuple[bool, tuple[str, ...]]] = {}
        for p in getattr(cmd, "params", []):
            if getattr(p, "param_type_name", "") == "option" and not getattr(p, "hidden", False):
                names = (*p.opts, *p.secondary_opts)
                for name in names:
                    opts[name] = (not (p.is_flag or p.count), names)
        subs = {n: s for n, s in (getattr(cmd, "commands", None) or {}).items() if not getattr(s, "hidden", False)}
        commands[path] = CommandNode(opts, tuple(subs))
        for name, sub in subs.items():
            walk(sub, f"{path} {name}".strip())

    walk(root, "")
    return CompletionIndex(_stamp(), commands)


def write_index(root: Any) -> None:
    """Called by the full completion path; a cache that cannot be written only costs speed."""
    path = index_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(build_index(root).to_wire()))
        tmp.replace(path)
    except OSError:
        pass


def _load_index() -> CompletionIndex | None:
    try:
        idx = json.loads(index_path().read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(idx, dict) or idx.get("format") != INDEX_FORMAT or idx.get("stamp") != _stamp():
        return None
    try:
        return CompletionIndex.from_wire(idx)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        return None  # a damaged index: the full path answers (and writes a new one)


def candidates(idx: CompletionIndex, args: list[str], incomplete: str) -> list[str] | None:
    """What bash should offer after ``args`` for the word ``incomplete``; None when the index cannot tell."""
    from bsr_cli.cli.completion import VALUES
    from bsr_cli.cli.global_options import GLOBAL_OPTIONS

    commands = idx.commands
    path = ""
    expecting: str | None = None
    for word in args:
        if expecting is not None:
            expecting = None
            continue
        if word == "--":
            return None
        if word.startswith("-"):
            name = word.split("=", 1)[0]
            known = commands[path].options.get(name)
            takes = known[0] if known is not None else GLOBAL_OPTIONS.get(name)
            if takes is None:
                return None  # an option this index does not know: let the full path decide
            if takes and "=" not in word:
                expecting = name
            continue
        subs = commands[path].subcommands
        if word in subs:
            path = f"{path} {word}".strip()
        elif subs:
            return None  # not a command name: the full path reports it
    if expecting is not None:
        known = commands[path].options.get(expecting)
        names = known[1] if known is not None else (expecting,)
        source = next((VALUES[n] for n in names if n in VALUES), None)
        if source is None:
            return None  # a free value (a path, a number): the shell's own default completion
        return [v for v in source() if v.startswith(incomplete)]
    node = commands[path]
    if incomplete.startswith("-"):
        return [o for o in node.options if o.startswith(incomplete)]
    return [s for s in node.subcommands if s.startswith(incomplete)]


def complete_bash() -> bool:
    """Answer a bash completion from the index; False to fall back to the full path."""
    if os.environ.get("_BSR_COMPLETE") != "complete_bash":
        return False
    try:
        words = shlex.split(os.environ.get("COMP_WORDS", ""))
        cword = int(os.environ.get("COMP_CWORD", "0"))
    except ValueError:
        return False
    args, incomplete = words[1:cword], (words[cword] if cword < len(words) else "")
    found: list[str] | None
    if args and args[-1] in VALUE_GLOBALS:
        # The value of a global option, wherever it stands (`bsr top -e <TAB>`), needs no index: the parser's own
        # completion does not know global options after a subcommand and answers nothing, so bash offered file names.
        from bsr_cli.cli.completion import VALUES

        found = [v for v in VALUES[args[-1]]() if v.startswith(incomplete)]
    else:
        idx = _load_index()
        if idx is None:
            return False
        try:
            found = candidates(idx, args, incomplete)
        except (KeyError, TypeError):
            return False
    if found is None:
        return False
    sys.stdout.write("\n".join(found))
    sys.stdout.flush()
    return True
