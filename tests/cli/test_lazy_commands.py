"""`bsr` builds a command only when it runs or its help is asked (bsr_cli/cli/lazy.py), from one table in
bsr_cli/cli/app.py, and converts plain option values without pydantic (bsr_cli/cli/coercion.py). What must hold:
the table names every command as it is (module, kind, the summary `bsr --help` lists), every command's help works,
completion offers every command, and a value converts to what typer's own conversion gives, or fails as it fails.

Everything here runs without an engine, through the real entry point or the real parser."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.cli.lazy import CommandEntry


def _tree() -> dict[tuple[str, ...], Any]:
    """Every command and group by its words (the root as ()), each built."""
    from bsr_cli.cli.app import build_command

    found: dict[tuple[str, ...], Any] = {}

    def walk(cmd: Any, path: tuple[str, ...]) -> None:
        found[path] = cmd
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, (*path, name))

    walk(build_command(), ())
    return found


# -- the table and the commands ----------------------------------------------------------------------------------


def table_problems(entries: list[CommandEntry] | tuple[CommandEntry, ...]) -> list[str]:
    """What is wrong between the table and the commands it names: an entry that cannot be built (its module or
    attribute is not there), a group listed as a command or the other way round, or a summary that is not the first
    paragraph of the command's own help (what `bsr --help` would list once the command is built)."""
    from typer.core import TyperGroup

    from bsr_cli.cli.app import _build_entry

    problems = []
    for entry in entries:
        try:
            cmd = _build_entry(entry)
        except (ImportError, AttributeError, TypeError) as e:
            problems.append(f"{entry.name}: cannot be built from {entry.module_path}.{entry.attr}: {e}")
            continue
        if isinstance(cmd, TyperGroup) != entry.group:
            problems.append(f"{entry.name}: listed as a {'group' if entry.group else 'command'}, it is not one")
        first_paragraph = " ".join((cmd.help or "").split("\n\n")[0].split())
        if cmd.short_help or first_paragraph != entry.summary:
            problems.append(f"{entry.name}: its summary should read {first_paragraph!r}")
    return problems


def test_the_table_names_every_command_as_it_is() -> None:
    from bsr_cli.cli.app import COMMANDS

    assert len(COMMANDS) >= 20 and len({e.name for e in COMMANDS}) == len(COMMANDS)
    assert table_problems(COMMANDS) == []
    # The check can fail: an entry pointing at nothing, a stale summary, a group listed as a command.
    probe = next(e for e in COMMANDS if e.name == "probe")
    faults = next(e for e in COMMANDS if e.name == "faults")
    broken = [
        dataclasses.replace(probe, attr="no_such_function"),
        dataclasses.replace(probe, module="no_such_module"),
        dataclasses.replace(probe, summary="Probe the store."),
        dataclasses.replace(faults, group=False),
    ]
    assert [p.split(":")[0] for p in table_problems(broken)] == ["probe", "probe", "probe", "faults"]


@pytest.mark.parametrize("width", [60, 80, 110, 200])
def test_bsr_help_lists_the_commands_as_the_built_commands_would(width: int) -> None:
    """`bsr --help` lists every command from the table, building none, exactly as it lists them once every
    command is built (the summaries cut at the same place at every width)."""
    from bsr_cli.cli.app import COMMANDS, build_command

    def help_text(root: Any) -> str:
        with root.make_context("bsr", [], resilient_parsing=True, terminal_width=width) as ctx:
            return str(root.get_help(ctx))

    lazy = build_command()
    listed = help_text(lazy)
    assert not [n for n in lazy.commands if lazy.commands.is_built(n)]  # nothing was built to list them
    built = build_command()
    for name in built.commands:
        built.commands[name]
    assert help_text(built) == listed
    commands = listed.split("Commands:")[1]
    assert [line.split()[0] for line in commands.splitlines() if line.strip()] == [e.name for e in COMMANDS]


@pytest.mark.timeout(180)
def test_every_command_help_prints_its_options(bsr) -> None:
    """Each command's and group's `--help`, the way a user asks it, exits 0 and shows its usage and every option
    (and, for a group, every subcommand)."""
    tree = _tree()
    assert len(tree) >= 50
    for path, cmd in tree.items():
        r = bsr(*path, "--help")
        assert r.code == 0, (path, r.err)
        assert r.out.startswith(f"Usage: {' '.join(('bsr', *path))} "), (path, r.out[:200])
        for param in cmd.params:
            if param.param_type_name == "option" and not param.hidden:
                assert param.opts[-1] in r.out, (path, param.opts)
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            assert sub.hidden or f"  {name} " in r.out, (path, name)


def test_a_command_runs_with_only_its_own_module_built(bsr) -> None:
    """Running one command builds that command alone (the parser asked for nothing else)."""
    from bsr_cli.cli import app

    built: list[str] = []
    build = app._build_entry

    def recording(entry: CommandEntry) -> Any:
        built.append(entry.name)
        return build(entry)

    app._build_entry = recording
    try:
        assert bsr("plan", "--tokens", "4096", "--json").code == 0
        assert bsr("--help").code == 0
        assert bsr("registration", "show", "demo", "--json").code == 0
    finally:
        app._build_entry = build
    assert built == ["plan", "registration"]


# -- completion ----------------------------------------------------------------------------------------------------


def _complete(words: str, shell: str, cache: Path) -> list[str]:
    env = dict(
        os.environ,
        XDG_CACHE_HOME=str(cache),
        _BSR_COMPLETE=f"complete_{shell}",
        COMP_WORDS=words,
        COMP_CWORD=str(len(words.split()) - (0 if words.endswith(" ") else 1)),
        _TYPER_COMPLETE_ARGS=words,  # zsh's
    )
    r = subprocess.run([sys.executable, "-m", "bsr_cli"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.timeout(180)
def test_completion_offers_every_command(tmp_path: Path) -> None:
    """TAB after `bsr ` offers every command of the table, on the full path (which writes the fast path's index),
    then on the fast path from that index, and zsh's; a group offers its subcommands."""
    from bsr_cli.cli.app import COMMANDS

    names = [e.name for e in COMMANDS]
    engine_subs = list(_tree()[("engine",)].commands)
    for path in ("full", "fast"):
        assert _complete("bsr ", "bash", tmp_path) == names, path
        assert _complete("bsr engine ", "bash", tmp_path) == engine_subs, path
    assert (tmp_path / "bsr" / "completion-index.json").exists()
    zsh = " ".join(_complete("bsr ", "zsh", tmp_path / "zsh"))  # `"name":"help"` pairs for zsh's _arguments
    assert re.findall(r'"([a-z-]+)":"', zsh) == names, zsh[:300]


def test_the_completion_index_holds_every_command() -> None:
    """The fast path's index is built from the whole tree: every command and group, and each group's subcommands."""
    from bsr_cli.cli.app import COMMANDS, build_command
    from bsr_cli.cli.fastcomplete import build_index

    idx = build_index(build_command())
    assert list(idx.commands[""].subcommands) == [e.name for e in COMMANDS]
    tree = _tree()
    assert set(idx.commands) == {" ".join(p) for p in tree}
    assert "--store" in idx.commands["probe"].options and "--W" in idx.commands["engine up"].options


# -- plain values convert as typer converts them --------------------------------------------------------------------

PLAIN = ["0", "7", "-3", "131072", "1.5", "-2.25", "notes.txt", "/tmp", "x/y.json", "demo"]
UNUSUAL = ["", " 7", "+5", "007", "-0", "1_000", "1e3", "inf", "nan", "abc", "./x", "a//b", "d/", "0x10", "٣"]


def _values(existing: Path) -> list[Any]:
    return [*PLAIN, *UNUSUAL, str(existing), 5, 2.0, True, Path("p"), ["1", "2"], ("a", "-4"), ("1", "x")]


def _outcome(runtime: Any, value: Any, param: Any, ctx: Any) -> tuple[str, Any]:
    try:
        return ("value", runtime.coerce(value, param=param, ctx=ctx))
    except Exception as e:  # noqa: BLE001 - compared: the same error, worded the same
        return (type(e).__name__, str(getattr(e, "message", e)))


def _multi(param: Any) -> bool:
    return bool(param.multiple or param.nargs == -1)


@pytest.mark.timeout(180)
def test_plain_values_convert_as_typers_own_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """For every option and argument of every command, and values plain and unusual (a number, a path, a list, a
    spelling typer's adapter reads its own way, one it refuses), the conversion gives what typer's own gives: the
    same value of the same type, or the same error with the same message. And a plain value takes no adapter."""
    import typer
    from typer._coercion import build_runtime_param

    from bsr_cli.cli.coercion import PLAIN_TYPES, install_plain_values

    existing = tmp_path / "tokens.json"
    existing.write_text("[1]")
    monkeypatch.chdir(tmp_path)
    checked, took_adapter, plain_params = 0, [], 0
    for path, cmd in _tree().items():
        ctx = typer.Context(cmd, info_name=path[-1] if path else "bsr")
        for param in cmd.params:
            descriptor = getattr(param, "type_descriptor", None)
            if descriptor is None or descriptor.file_annotation is not None:
                continue
            param._runtime_param = None
            install_plain_values(param)
            ours, theirs = param._runtime_param, build_runtime_param(descriptor)
            for value in _values(existing):
                if isinstance(value, list | tuple) and not _multi(param):
                    continue
                a, b = _outcome(ours, value, param, ctx), _outcome(theirs, value, param, ctx)
                assert repr(a) == repr(b) and type(a[1]) is type(b[1]), (
                    path,
                    param.name,
                    descriptor.annotation,
                    value,
                    a,
                    b,
                )
                checked += 1
            item = descriptor.annotation.__args__[0] if descriptor.is_list else descriptor.annotation
            if item in PLAIN_TYPES and descriptor.choices is None:
                plain_params += 1
                low = descriptor.parameter_info.min
                value = "7" if low is None or low <= 7 else repr(low)  # within the option's range
                fresh = type(ours)(param)
                fresh.coerce([value] if _multi(param) else value, param=param, ctx=ctx)
                if fresh._typer_own is not None:
                    took_adapter.append((path, param.name))
    assert checked > 5000 and plain_params > 200
    assert took_adapter == [], took_adapter
