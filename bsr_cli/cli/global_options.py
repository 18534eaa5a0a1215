"""The options every command takes, wherever they stand on the line, and the argv rewrite that allows it.

Framework-free (the fast TAB completion reads the table without starting the CLI framework).
"""

from __future__ import annotations

# Global options an operator may put anywhere on the line (`bsr status --engine prod`), as kubectl and gh allow.
# (name → takes a value). `--json` is not here: every command accepts it in its own right.
GLOBAL_OPTIONS = {
    "--engine": True,
    "-e": True,
    "--token": True,
    "--state-dir": True,
    "--config": True,
    "--timeout": True,
    "--traceback": False,
}

GLOBAL_HELP = (
    "Global options (accepted anywhere on the line): --engine/-e URL|PROFILE, --token TOKEN, --timeout SECONDS, "
    "--state-dir PATH, --config PATH, --json, --traceback. See `bsr --help`."
)


# Old spellings still accepted for one release, shown nowhere (help, completion, error messages): alias → the
# canonical spelling it stands for. An alias is hidden on an option only where that option also has the canonical
# name, so `-n` stays `--limit` where it counts results (`bsr events -n 20`) and is a hidden `--tokens` elsewhere.
# CHANGELOG.md names each one; remove them in the release after.
HIDDEN_ALIASES = {
    "-W": "--W",
    "--window-size": "--W",
    "--tp": "--world-size",
    "-n": "--tokens",
    "--out": "--output",
}


def hidden_aliases(opts: list[str]) -> list[str]:
    """The names among one option's `opts` that are old spellings of another of its names."""
    return [o for o in opts if HIDDEN_ALIASES.get(o) in opts]


def hoist_global_options(argv: list[str]) -> list[str]:
    """Move global options found after the subcommand to the front, where the parser expects them.

    Stops at `--` (everything after it is an argument). `--engine=URL` forms are kept whole. An option missing its
    value is left in place for the parser to report."""
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            rest.extend(argv[i:])
            break
        name = tok.split("=", 1)[0] if tok.startswith("--") else tok
        takes_value = GLOBAL_OPTIONS.get(name)
        if takes_value is None:
            rest.append(tok)
        elif not takes_value or "=" in tok:
            front.append(tok)
        elif i + 1 < len(argv):
            front.extend(argv[i : i + 2])
            i += 1
        else:
            rest.append(tok)
        i += 1
    return _join_engines(front) + rest


def _join_engines(front: list[str]) -> list[str]:
    """`--engine A --engine B` names a fleet: one `--engine A,B` (the parser would keep only the last)."""
    engines: list[str] = []
    others: list[str] = []
    i = 0
    while i < len(front):
        tok = front[i]
        name = tok.split("=", 1)[0]
        if name in ("--engine", "-e"):
            if "=" in tok and tok.startswith("--"):
                engines.append(tok.split("=", 1)[1])
            elif i + 1 < len(front):
                engines.append(front[i + 1])
                i += 1
        else:
            others.append(tok)
        i += 1
    if len(engines) <= 1:
        return front
    return ["--engine", ",".join(engines), *others]
