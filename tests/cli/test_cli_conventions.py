"""What holds across every command: one spelling per flag (old spellings accepted, shown nowhere), one error format
(the parser's own errors included), `--json` accepted everywhere, and names that do not say "demo" outside the demo.

Everything here runs without an engine (the isolated state directory has none), through the real entry point."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bsr_cli.errors import ExitCode

REPO = Path(__file__).resolve().parents[2]


def _commands() -> list[tuple[str, ...]]:
    """Every command a user can run: the leaves of the command tree and the groups that run on their own."""
    from bsr_cli.cli.app import build_command

    found: list[tuple[str, ...]] = []

    def walk(cmd, path: tuple[str, ...]) -> None:
        subs = getattr(cmd, "commands", None)
        if not subs or getattr(cmd, "invoke_without_command", False):
            found.append(path)
        for name, sub in (subs or {}).items():
            walk(sub, (*path, name))

    walk(build_command(), ())
    return [p for p in found if p]


# -- one spelling per flag -------------------------------------------------------------------------------------------

OLD_SPELLINGS = re.compile(r"(?<![\w-])(-W|--window-size|--tp|--out)(?![\w-])")


@pytest.mark.timeout(120)
def test_help_and_examples_show_one_spelling_per_flag(bsr) -> None:
    """Help (options and examples) names each flag once: `--W`, `--world-size`, `--output`; `-n` only where it
    counts results (`--limit`, `--requests`), never as `--tokens`."""
    for path in _commands():
        r = bsr(*path, "--help")
        assert r.code == 0, path
        assert not OLD_SPELLINGS.search(r.out), (path, OLD_SPELLINGS.findall(r.out))
        for line in r.out.splitlines():
            if re.search(r"(?<![\w-])-n(?![\w-])", line):
                assert "--limit" in line or "--requests" in line or line.strip().startswith("bsr "), (path, line)
            if line.strip().startswith("bsr "):  # an example: `-n` there is events' or bench trace's count
                assert " -n " not in line or line.split()[1] in {"events", "bench"}, (path, line)


def test_a_short_flag_means_one_thing_across_commands() -> None:
    """`-o` is `--output` wherever it appears, `-r` `--registration`, ...; `-n` is a count of results."""
    from bsr_cli.cli.app import build_command

    meaning: dict[str, set[str]] = {}

    def walk(cmd) -> None:
        for p in getattr(cmd, "params", []):
            if p.param_type_name != "option":
                continue
            longs = [o for o in p.opts if o.startswith("--")]
            for short in (o for o in p.opts if not o.startswith("--")):
                meaning.setdefault(short, set()).update(longs[:1])
        for sub in (getattr(cmd, "commands", None) or {}).values():
            walk(sub)

    walk(build_command())
    counts = {"--limit", "--requests"}  # how many results / requests to take: `head -n`'s sense
    for short, longs in meaning.items():
        if short == "-n":
            assert longs <= counts, longs
        else:
            assert len(longs) == 1, (short, longs)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (("plan", "--window-size", "16", "--tokens", "8192"), ("plan", "--W", "16", "--tokens", "8192")),
        (("plan", "-W", "16", "-n", "8192"), ("plan", "--W", "16", "--tokens", "8192")),
        (("rws", "-r", "demo", "-n", "4096"), ("rws", "-r", "demo", "--tokens", "4096")),
        (
            ("rws", "--hf-config", "examples/config.json", "--tp", "2"),
            ("rws", "--hf-config", "examples/config.json", "--world-size", "2"),
        ),
    ],
)
def test_old_spellings_are_still_accepted(bsr, monkeypatch: pytest.MonkeyPatch, old, new) -> None:
    monkeypatch.chdir(REPO)
    a, b = bsr(*old, "--json"), bsr(*new, "--json")
    assert a.code == b.code == 0, (a.err, b.err)
    assert a.json() == b.json()


@pytest.mark.timeout(120)
def test_tab_offers_only_the_canonical_spellings(tmp_path: Path) -> None:
    """Both completion paths (the full one, then the fast one from its index) offer `--W` and `--world-size`, not
    the old spellings."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), _BSR_COMPLETE="complete_bash")

    def complete(words: str) -> list[str]:
        e = dict(env, COMP_WORDS=words, COMP_CWORD=str(len(words.split()) - 1))
        r = subprocess.run([sys.executable, "-m", "bsr_cli"], env=e, capture_output=True, text=True, timeout=60)
        return r.stdout.split()

    for _ in ("full", "fast"):
        offered = complete("bsr plan --")
        assert "--W" in offered and "--world-size" in offered, offered
        assert not {"--window-size", "--tp", "-W", "-n"} & set(offered), offered
        assert complete("bsr bench sweep --ou") == ["--output"]


def test_events_n_is_the_limit(bsr) -> None:
    help_text = bsr("events", "--help").out
    assert re.search(r"-n, --limit", help_text)


def test_documented_commands_use_the_canonical_spellings() -> None:
    """The README, docs/ and the help's examples teach the spelling help shows (old ones are going away)."""
    from bsr_cli.cli.examples import EXAMPLES
    from tests.test_docs_commands import doc_command_lines

    lines = [c for _, c in doc_command_lines()] + [c for cmds in EXAMPLES.values() for c in cmds]
    for cmd in lines:
        assert not OLD_SPELLINGS.search(cmd), cmd
        words = cmd.split()
        assert "-n" not in words or words[1] in {"events", "bench"}, cmd


# -- one error format --------------------------------------------------------------------------------------------


PARSER_ERRORS = [
    (("plan", "--no-such-flag"), "bsr plan", "No such option: --no-such-flag"),
    (("plan", "--W", "many"), "bsr plan", "Invalid value for '--W'"),
    (("no-such-command",), "bsr", "No such command 'no-such-command'"),
    (("events", "-n"), "bsr events", "Option '-n' requires an argument"),
    (("--engine", "x", "engine", "up", "--W"), "bsr engine up", "Option '--W' requires an argument"),
    (("registration", "show"), "bsr registration show", "Missing argument 'REGISTRATION'"),
]


@pytest.mark.parametrize(("argv", "command", "message"), PARSER_ERRORS)
def test_parser_errors_speak_bsrs_one_format(bsr, argv, command, message) -> None:
    """The parser's own errors read like every other error: one `bsr: error:` line, a hint, exit 2."""
    r = bsr(*argv)
    assert r.code == ExitCode.INVALID_INPUT
    lines = r.err.splitlines()
    assert len(lines) == 2, r.err
    assert lines[0].startswith(f"bsr: error: {message}"), lines[0]
    assert lines[1] == f"bsr: hint: see `{command} --help`"
    assert r.out == ""


@pytest.mark.parametrize(("argv", "command", "message"), PARSER_ERRORS)
def test_parser_errors_under_json_are_a_json_object(bsr, argv, command, message) -> None:
    r = bsr("--json", *argv)
    assert r.code == ExitCode.INVALID_INPUT
    doc = r.json()
    assert doc == {
        "error": "usage",
        "message": r.err.splitlines()[0].removeprefix("bsr: error: "),
        "hint": f"see `{command} --help`",
        "exit_code": 2,
    }


def test_a_bare_group_shows_its_help_and_under_json_says_so_in_json(bsr) -> None:
    """`bsr engine` is a question ("what can I type here?"): its help, on stderr, exit 2; with --json also the
    error object, so a script reading stdout is never left with nothing."""
    r = bsr("engine")
    assert r.code == ExitCode.INVALID_INPUT and "Commands:" in r.err and r.out == ""
    r = bsr("--json", "engine")
    assert r.code == ExitCode.INVALID_INPUT and "Commands:" in r.err
    assert r.json() == {
        "error": "usage",
        "message": "`bsr engine` needs a command",
        "hint": "see `bsr engine --help`",
        "exit_code": 2,
    }


# -- --json on every command -------------------------------------------------------------------------------------

# Arguments that let a command run, or be refused, without an engine and in well under a second. The benchmarks
# that start their own services are given a value they refuse before starting anything.
RUN_CHEAPLY: dict[tuple[str, ...], tuple[str, ...]] = {
    ("rws",): ("-r", "demo"),
    ("plan",): ("--tokens", "4096"),
    ("probe",): ("--synthetic", "4096"),
    ("submit",): ("--synthetic", "4096"),
    ("restore",): ("--synthetic", "4096"),
    ("explain",): ("--synthetic", "4096"),
    ("scrub",): ("--tier", "fs", "--synthetic", "4096"),
    ("inject-fault",): ("--rank", "0", "--kind", "remote-unavailable"),
    ("faults", "inject"): ("--rank", "0", "--kind", "remote-unavailable"),
    ("drill",): ("--yes",),
    ("abort",): ("req-00001",),
    ("describe",): ("req-00001",),
    ("bundle",): ("--synthetic", "4096", "-o", "{tmp}/incident.tar.gz"),
    ("registration", "show"): ("demo",),
    ("registration", "diff"): ("demo", "paper-mtp-off"),
    ("engine", "up"): ("--W", "0", "--budget", "1"),
    ("markers", "clear"): ("--all", "--yes"),
    ("settings", "set"): ("--W", "2"),
    ("pool",): ("--once",),
    ("bench", "ladder"): ("--rungs", "lots"),
    ("bench", "peer"): ("--below-rung", "lots"),
    ("bench", "cpu-bound"): ("--budgets", "lots"),
    ("bench", "trace"): ("{tmp}/no-trace.jsonl",),
    ("bench", "validate"): ("{tmp}/no-bundle.json",),
    ("bench", "show"): ("{tmp}/no-bundle.json",),
    ("bench", "plot"): ("--output", "{tmp}"),
}
# Commands that need nothing running: they answer, exit 0.
ANSWER_OFFLINE = {
    ("rws",),
    ("plan",),
    ("registration", "show"),
    ("registration", "diff"),
    ("config", "show"),
    ("engine", "down"),
    ("bench", "schema"),
}


@pytest.mark.timeout(180)
def test_every_command_honours_json(bsr, tmp_path: Path) -> None:
    """`--json` on every command (the README's promise): stdout is JSON, the result or the error object that says
    why (with the exit code it exits with), never plain text and never the parser refusing `--json` itself."""
    commands = _commands()
    assert len(commands) >= 40 and set(ANSWER_OFFLINE) | set(RUN_CHEAPLY) <= set(commands)
    for path in commands:
        args = [a.replace("{tmp}", str(tmp_path)) for a in RUN_CHEAPLY.get(path, ())]
        r = bsr(*path, *args, "--json")
        where = f"bsr {' '.join(path)} {' '.join(args)} --json: exit {r.code}\n{r.err}\n{r.out[:300]}"
        assert r.out.strip(), where
        docs = _json_documents(r.out)
        assert docs is not None, where
        if path in ANSWER_OFFLINE:
            assert r.code == 0, where
        if r.code != 0:  # exactly one document: the error object (carrying the result that came with it, if any)
            assert len(docs) == 1, where
            (doc,) = docs
            assert isinstance(doc, dict) and doc.get("exit_code") == r.code, where
            assert doc["error"] != "usage", where  # the parser accepted the command line, --json included
            assert doc["message"] and doc["hint"], where  # every error says what to do next
            assert r.err.startswith("bsr: error: ") and "\nbsr: hint: " in r.err, where


def test_an_error_that_comes_with_a_result_is_one_json_object_carrying_it(bsr, tmp_path: Path) -> None:
    """A command whose result stands beside its error (an engine that is not running, a fleet with an engine down, a
    bundle that fails the schema) prints one JSON document under --json: the error object, with the result under
    ``report``; the text mode still draws the result, then the error line and its hint."""
    engines = tmp_path / "engines.txt"
    engines.write_text("http://127.0.0.1:9\n")
    bundle = tmp_path / "br-x.json"
    bundle.write_text(json.dumps({"schema": "bsr.bench/1"}))
    cases = [
        (("engine", "status"), ExitCode.ENGINE_UNREACHABLE, "running"),
        (("status", "--engines-from", str(engines), "--timeout", "2"), ExitCode.ENGINE_UNREACHABLE, "engines"),
        (("bench", "validate", str(bundle)), ExitCode.INVALID_INPUT, str(bundle)),
    ]
    for args, code, key in cases:
        r = bsr(*args, "--json")
        assert r.code == code, (args, r.err)
        doc = json.loads(r.out)  # one document: json.loads refuses a second
        assert doc["exit_code"] == code and doc["message"] and doc["hint"], (args, doc)
        assert isinstance(doc["report"], dict) and key in doc["report"], (args, doc)
        text = bsr(*args)
        assert text.code == code and text.err.startswith("bsr: error: "), (args, text.err)


# Real error paths, one per layer that raises them, run as a user meets them: each ends with a hint line.
ERROR_PATHS: list[tuple[tuple[str, ...], ExitCode]] = [
    (("rws", "-r", "{tmp}/bad-registration.json"), ExitCode.INVALID_INPUT),  # a malformed registration
    (("registration", "show", "{tmp}/no-such.yaml"), ExitCode.INVALID_INPUT),
    (("plan", "--tokens", "5", "--probe", "{tmp}/p.json"), ExitCode.INVALID_INPUT),
    (("plan", "--W", "32", "--bandwidth", "1GB/s"), ExitCode.INVALID_INPUT),
    (("plan", "--trace", "{tmp}/no-trace.jsonl", "--bandwidth", "1GB/s"), ExitCode.INVALID_INPUT),
    (("plan", "--probe", "{tmp}/bad-registration.json"), ExitCode.INVALID_INPUT),  # not a probe result
    (("rws", "-r", "demo", "--l1", "lots"), ExitCode.INVALID_INPUT),
    (("status", "--engines-from", "{tmp}/no-engines.txt"), ExitCode.INVALID_INPUT),  # a missing file
    (("status", "--engines-from", "dns://engines.lab"), ExitCode.INVALID_INPUT),
    (("events", "--since", "yesterday"), ExitCode.INVALID_INPUT),
    (("events", "--since", "1h", "--until", "2h"), ExitCode.INVALID_INPUT),
    (("probe", "--synthetic", "0"), ExitCode.ENGINE_UNREACHABLE),  # no engine runs in the isolated state dir
    (("probe", "--store", "mooncake://127.0.0.1:9", "--tokens-file", "{tmp}/t.json"), ExitCode.INVALID_INPUT),
    (("abort", "req-00001"), ExitCode.ENGINE_UNREACHABLE),
    (("top", "--record", "a.gz", "--replay", "b.gz"), ExitCode.INVALID_INPUT),
    (("describe", "req-00001", "--record", "{tmp}/no-recording.gz"), ExitCode.INVALID_INPUT),
    (("bench", "show", "{tmp}/no-bundle.json"), ExitCode.INVALID_INPUT),
    (("--engine", "nowhere", "status"), ExitCode.INVALID_INPUT),
    (("--config", "{tmp}/no-config.toml", "status"), ExitCode.INVALID_INPUT),
]


@pytest.mark.parametrize(("argv", "code"), ERROR_PATHS, ids=[" ".join(a) for a, _ in ERROR_PATHS])
def test_real_error_paths_end_with_a_hint(bsr, tmp_path: Path, argv: tuple[str, ...], code: ExitCode) -> None:
    (tmp_path / "bad-registration.json").write_text(json.dumps({"tensors": 5}))
    (tmp_path / "p.json").write_text("{}")
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    r = bsr(*args)
    assert r.code == code, (args, r.err)
    error, hint = r.err.strip().splitlines()[-2:]
    assert error.startswith("bsr: error: ") and hint.startswith("bsr: hint: ") and len(hint) > 20, r.err
    assert str(tmp_path) not in error.split(str(tmp_path), 1)[-1], "the error names a path once"
    j = bsr(*args, "--json")
    assert j.code == code and json.loads(j.out)["hint"] == hint.removeprefix("bsr: hint: ")


def test_every_error_bsr_raises_carries_a_hint() -> None:
    """Every construction of a bsr error in bsr_cli names its hint (`hint=`): the user is told what to do next, not
    only what went wrong. (The error boundary adds a generic hint to an error from elsewhere, e.g. a host's.)"""
    import ast

    import bsr_cli
    from bsr_cli import errors

    classes = {name for name, obj in vars(errors).items() if isinstance(obj, type) and issubclass(obj, Exception)}
    classes |= {"WindowRefused", "UnsupportedOp"}  # RankUnresponsive writes its own hint
    root = Path(bsr_cli.__file__).parent
    missing = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in classes and not any(k.arg in ("hint", None) for k in node.keywords):
                missing.append(f"{path.relative_to(root.parent)}:{node.lineno} {name}")
    assert len(classes) >= 20 and not missing, missing


def _json_documents(out: str) -> list[object] | None:
    """One JSON document, or JSON lines (`events --json`); None when any of it is not JSON."""
    try:
        return [json.loads(out)]
    except json.JSONDecodeError:
        pass
    try:
        return [json.loads(line) for line in out.splitlines() if line.strip()]
    except json.JSONDecodeError:
        return None


# -- names --------------------------------------------------------------------------------------------------------


def test_the_engines_default_model_is_not_called_demo(bsr) -> None:
    """`bsr engine up` without `-r` serves the built-in `demo` registration; what it reports (status, metrics, the
    store's keys) is the engine's model name, which is not the demo's."""
    from bsr_cli import loaders

    reg = loaders.load_registration("demo")
    assert reg.model == "bsr-engine"
    assert bsr("registration", "show", "demo", "--json").json()["model"] == "bsr-engine"
