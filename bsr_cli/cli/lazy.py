"""Commands loaded when they are used: the root group knows every command by name, module and summary, and imports
a command's module only when that command runs, its help is asked, or something walks the whole tree.

`bsr --help` lists every command from the table (`CommandEntry.summary` is the first paragraph of the command's
help, which is all a list of commands shows); `bsr probe --help` imports the probe's module and nothing of the
other commands. Everything that reads the tree through the parser's own interface (`group.commands`, `get_command`,
`list_commands`: the parser, completion, the completion index, the docs checks) sees the same commands as before;
only the first access to a command builds it. tests/cli/test_lazy_commands.py keeps the table and the commands in
step.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from typer.core import TyperCommand, TyperGroup

__all__ = ["COMMANDS_PACKAGE", "CommandEntry", "LazyCommands", "LazyGroup"]

COMMANDS_PACKAGE = "bsr_cli.cli.commands"


@dataclass(frozen=True)
class CommandEntry:
    """One command (a function) or command group (a `typer.Typer`) of the root: its name on the command line, the
    module under bsr_cli/cli/commands/ that defines it, the attribute there, and its summary for `bsr --help`."""

    name: str
    module: str
    attr: str
    summary: str
    group: bool = False

    @property
    def module_path(self) -> str:
        return f"{COMMANDS_PACKAGE}.{self.module}"

    def target(self) -> Any:
        """The command function or the group's Typer app (imports its module)."""
        return getattr(importlib.import_module(self.module_path), self.attr)


class LazyCommands(MutableMapping[str, Any]):
    """The root's commands by name, in help order: the names are known at once, a command is built on first access.

    Membership and iteration over the names load nothing; reading a command (`[name]`, `get`, `items`, `values`)
    builds it once with `build`."""

    def __init__(self, entries: Sequence[CommandEntry], build: Callable[[CommandEntry], Any]) -> None:
        self._entries = {e.name: e for e in entries}
        self._build = build
        self._built: dict[str, Any] = {}
        self._names = list(self._entries)

    def entry(self, name: str) -> CommandEntry | None:
        return self._entries.get(name)

    def is_built(self, name: str) -> bool:
        return name in self._built

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            entry = self._entries.get(name)
            if entry is None:
                raise KeyError(name)
            self._built[name] = self._build(entry)
        return self._built[name]

    def __setitem__(self, name: str, cmd: Any) -> None:
        if name not in self._entries and name not in self._built:
            self._names.append(name)
        self._built[name] = cmd

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self._names.remove(name)
        self._built.pop(name, None)
        self._entries.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._built

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))

    def __len__(self) -> int:
        return len(self._names)


class LazyGroup(TyperGroup):
    """The root group over `LazyCommands`: its help lists the commands from their summaries, building none."""

    commands: LazyCommands

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)  # the names, in help order (typer's own reads each command)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        """As the parser's own listing (name, then the summary cut to the width), from each command's summary
        where the command is not built yet."""
        from gettext import gettext as _

        rows: list[tuple[str, Any]] = []
        for name in self.list_commands(ctx):
            entry = self.commands.entry(name)
            cmd = self.commands.get(name) if entry is None or self.commands.is_built(name) else _listed(entry)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd))
        if rows:
            limit = formatter.width - 6 - max(len(name) for name, _cmd in rows)
            with formatter.section(_("Commands")):
                formatter.write_dl([(name, cmd.get_short_help_str(limit)) for name, cmd in rows])


def _listed(entry: CommandEntry) -> TyperCommand:
    """A stand-in that lists as the command does (its short help is cut from the same first paragraph)."""
    return TyperCommand(name=entry.name, help=entry.summary)
