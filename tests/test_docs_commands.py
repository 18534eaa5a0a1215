"""Every command the pages and the help tell a user to type, run as written: each `bsr ...` line of a ```sh (or
```bash) block of README.md and docs/*.md, and every `Examples:` line of a command's `--help`
(bsr_cli/cli/examples.py). A comment that opens with `exit N` states the expected exit code (0 otherwise).

* The planning commands and the others that need nothing running are run from a directory laid out like the
  repository (examples/ and docs/evidence/ as shipped, bench-out/ holding bundles as the benchmarks write them).
* The README's incident walkthrough runs step by step against its own engine; every other command that needs a
  live engine runs, as written, against one (`ENGINE_SCRIPT`, in an order that gives each what it reads: the
  prompt it restores, the request it names, the file it archives).
* A line chained or redirected in the shell runs in bash; a line that follows (`-f`) runs until it has printed and
  is then interrupted, exit 130, as an operator's Ctrl-C.
* The alert runbooks' lines (docs/runbooks/*.md) run against the same engine with their placeholders filled as an
  alert fills them: ENGINE the engine's URL, REQ a request it ran.
* Commands that cannot run unattended here are listed in `NOT_RUN` with the reason and the test that exercises
  them; `test_every_documented_command_is_run_or_says_why_not` holds every line to one of these.

The files these lines name (a prompt's token ids, a registration of the user's own, a list of engines) are written
into the working directory first, as a reader would have them."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Documented:
    """One command line as a page or a command's help writes it, with the exit code the page says it ends with."""

    where: str  # README.md, docs/events.md, or `bsr plan --help`
    command: str
    exit_code: int = 0


# Help examples that end non-zero by design (the help cannot carry a comment): why, and the code.
EXAMPLE_EXIT = {
    "bsr abort req-00012": 18,  # the request the help names has long ended: the abort comes too late
}

# Commands not run here: (what the line contains, why it cannot run unattended, where it is exercised instead).
NOT_RUN: tuple[tuple[str, str, str], ...] = (
    ("bsr top", "an interactive terminal UI", "tests/tui (Textual's pilot: live, fleets, --record, --replay)"),
    (
        "-o /etc/prometheus/",
        "writes into the Prometheus server's own configuration directory",
        "tests/cli/test_monitoring_cli.py::test_rules_carry_absolute_runbook_links_under_the_base_given (-o, a base)",
    ),
    (
        "10.0.0.",
        "an engine or a Mooncake store at a deployment's own address",
        "tests/tui/test_fleet.py, tests/cli/test_store_probe.py (a real Mooncake store written as LMCache writes it)",
    ),
    (
        "prom.lab",
        "the reader's Prometheus server",
        "tests/tui/test_fleet_discovery.py::test_fleet_from_prometheus_in_status_and_top",
    ),
    (
        "bsr-engines.lab",
        "the reader's DNS name of a fleet",
        "tests/cli/test_fleet_cli.py::test_engines_from_dns_resolves_a_real_name",
    ),
    ("mooncake://RPC", "a benchmark recipe's placeholders for the store it starts", "tests/cli/test_store_probe.py"),
    (
        "--engine prod-node2",
        "a profile of the reader's own config file",
        "tests/tui/test_fleet.py::test_fleet_profile_lists_engines, tests/cli/test_fleet_cli.py",
    ),
    (
        "--engine prod --json",
        "a profile of the reader's own config file",
        "tests/tui/test_fleet.py::test_fleet_profile_lists_engines, tests/cli/test_fleet_cli.py",
    ),
    ("--engine vllm-", "a profile naming the reader's vLLM worker", "tests/vllm/test_runbook.py (a real vLLM)"),
    ("127.0.0.1:9100", "an engine at a fixed port of the reader's", "tests/cli/test_engine_endpoints.py"),
    (
        "calibration-br-trace-…",
        "a calibration `bsr bench trace` saves, named by its run's id (the page writes it as a placeholder)",
        "tests/cli/test_planning_cli.py::test_plan_trace_from_a_saved_calibration",
    ),
    (
        "conversation_trace.jsonl",
        "the Mooncake trace release (a download, not in the repository)",
        "tests/cli/test_planning_cli.py::test_plan_the_conversation_trace, tests/bench/test_trace_replay.py",
    ),
    (
        "bsr bench sweep",
        "a benchmark of minutes at its documented sizes, on its own engine",
        "tests/bench/test_bench.py::test_sweep_peak_equals_rws_for_every_row (at small sizes)",
    ),
    (
        "bsr bench ladder",
        "one engine start per rung, minutes",
        "tests/bench/test_bench.py::test_ladder_first_passing_rung_is_the_predicted_one",
    ),
    (
        "bsr bench wlaw",
        "a benchmark of minutes on its own engine",
        "tests/bench/test_bench.py::test_wlaw_peak_is_w_times_sum_c_plus_aux",
    ),
    (
        "bsr bench fs-concurrency",
        "a benchmark of minutes on its own engine",
        "tests/bench/test_bench.py::test_fs_concurrency_changes_nothing_in_rws",
    ),
    (
        "bsr bench store",
        "a benchmark of minutes on its own engine",
        "tests/bench/test_bench.py::test_store_measures_the_tier_beside_the_copy_ceiling",
    ),
    (
        "bsr bench peer",
        "needs LMCache's own environment (.venv-lmcache) and runs 9-17 minutes",
        "tests/plugins/test_lmcache_peer.py (./scripts/test-plugins), tests/bench/test_peer.py",
    ),
    (
        "bsr bench trace",
        "replays against its own engine and stock LMCache (.venv-lmcache), minutes",
        "tests/bench/test_trace_replay.py::test_replay_against_the_embedded_engine",
    ),
)
# Run by the offline test: they need no engine (the `bsr bench` lines here read and write bundles only).
OFFLINE = (
    "bsr rws",
    "bsr plan",
    "bsr registration",
    "bsr config show",
    "bsr --engine prod config",
    "bsr bench",
    "bsr monitoring",
)
# Offline lines that read what a live engine wrote first.
READS_THE_ENGINE = ("seen.jsonl",)
# The benchmarks short enough to run as written here (each its own engine or none).
SHORT_BENCHMARKS = (
    "bsr bench failures --embedded",
    "bsr bench cpu-bound --trials 3",
    "bsr bench cpu-bound --tokens 65536 --budgets 1,2,4",
)


def not_run(command: str) -> tuple[str, str] | None:
    """(why, where else) for a command these tests do not run; None when they run it."""
    if command in SHORT_BENCHMARKS:
        return None
    return next(((why, where) for mark, why, where in NOT_RUN if mark in command), None)


def is_offline(command: str) -> bool:
    return command.startswith(OFFLINE) and not any(m in command for m in READS_THE_ENGINE)


def documented() -> list[Documented]:
    """Every command line of the README's and docs/'s shell blocks (continuations joined), then every `--help`
    example."""
    from bsr_cli.cli.examples import EXAMPLES

    out: list[Documented] = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        where = str(page.relative_to(REPO))
        for block in re.findall(r"```(?:sh|bash)\n(.*?)```", page.read_text(), flags=re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                cmd, _, comment = line.strip().partition("  #")
                cmd = re.sub(r"^\.venv/bin/", "", cmd.strip())
                if cmd.startswith("bsr "):
                    m = re.match(r"\s*exit (\d+)\b", comment)
                    out.append(Documented(where, cmd, int(m.group(1)) if m else 0))
    for path, lines in EXAMPLES.items():
        out.extend(Documented(f"bsr {path} --help", line, EXAMPLE_EXIT.get(line, 0)) for line in lines)
    return out


def runbook_lines() -> list[Documented]:
    """Every `bsr` line of the shell blocks of the alert runbooks (docs/runbooks/*.md), placeholders and all."""
    out: list[Documented] = []
    for page in sorted((REPO / "docs" / "runbooks").glob("*.md")):
        for block in re.findall(r"```(?:sh|bash)\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.splitlines():
                cmd = line.strip().partition("  #")[0].strip()
                if cmd.startswith("bsr "):
                    out.append(Documented(str(page.relative_to(REPO)), cmd))
    return out


def doc_command_lines() -> list[tuple[str, str]]:
    """(page, command) for every `bsr` command in a shell block of the README and docs/ (continuations joined)."""
    return [(Path(d.where).name, d.command) for d in documented() if not d.where.startswith("bsr ")]


def sh_block(page: Path, heading: str) -> list[str]:
    """The `bsr ...` lines of the first ```sh block under ``heading``, comments kept for the expected exit code."""
    text = page.read_text()
    part = text.split(f"## {heading}", 1)[1]
    block = part.split("```sh", 1)[1].split("```", 1)[0]
    return [ln.strip() for ln in block.splitlines() if ln.strip().startswith("bsr ")]


def split(line: str) -> tuple[list[str], int]:
    cmd, _, comment = line.partition("  #")
    m = re.match(r"\s*exit (\d+)\b", comment)  # a comment that opens with "exit N" states the outcome
    return shlex.split(cmd), int(m.group(1)) if m else 0


# -- running a line as written ----------------------------------------------------------------------------------------

SHELL = re.compile(r"[|&;<>*?]")  # a pipeline, a chain, a redirection or a glob: the shell reads the line
FOLLOWS = re.compile(r"(?<!\S)(-f|--follow)(?!\S)")


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str


def _shell_env() -> dict[str, str]:
    """The environment of a line run by the shell: `bsr` is this checkout's CLI, started by this interpreter."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "plugins"), env.get("PYTHONPATH", "")]).rstrip(":")
    return env


BSR_FUNCTION = f'bsr() {{ {shlex.quote(sys.executable)} -m bsr_cli "$@"; }}\n'


def run_line(bsr: Callable[..., Any], command: str, cwd: Path) -> Ran:
    """Run one documented line in ``cwd``: in the shell when the shell has to read it, else through the CLI's real
    entry point in this process; a line that follows is interrupted once it has printed (Ctrl-C: exit 130)."""
    if FOLLOWS.search(command):
        return _follow_then_interrupt(command, cwd)
    if SHELL.search(command):
        done = subprocess.run(
            ["bash", "-c", BSR_FUNCTION + command],
            cwd=cwd,
            env=_shell_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        return Ran(done.returncode, done.stdout, done.stderr)
    r = bsr(*shlex.split(command)[1:])
    return Ran(r.code, r.out, r.err)


def _follow_then_interrupt(command: str, cwd: Path) -> Ran:
    argv = [sys.executable, "-m", "bsr_cli", *shlex.split(command)[1:]]
    out, err = cwd / ".follow.out", cwd / ".follow.err"
    with out.open("w") as fo, err.open("w") as fe:
        proc = subprocess.Popen(argv, cwd=cwd, env=_shell_env(), stdout=fo, stderr=fe)
        try:
            deadline = time.monotonic() + 120
            while not out.read_text().strip():  # it has printed what it held: it is following now
                assert proc.poll() is None, f"{command} ended before following: {err.read_text()}"
                assert time.monotonic() < deadline, f"{command} printed nothing within 120 s"
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return Ran(code, out.read_text(), err.read_text())


def _reader_files(cwd: Path, *, engine: bool) -> None:
    """The files the lines name, as a reader has them: the shipped examples and evidence, the bundles the
    benchmarks write (bench-out/), a prompt's token ids, a text prompt, a registration of one's own."""
    from bsr_cli.core.keys import synthetic_tokens
    from bsr_cli.loaders import builtin_registration

    (cwd / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    (cwd / "docs").mkdir()
    (cwd / "docs" / "evidence").symlink_to(REPO / "docs" / "evidence", target_is_directory=True)
    (cwd / "docs" / "img").mkdir()  # where `bench plot --to docs/img` redraws (here: not the repository's)
    (cwd / "bench-out").mkdir()
    for bundle in (REPO / "docs" / "evidence").glob("br-*.json"):
        shutil.copy(bundle, cwd / "bench-out" / bundle.name)
    (cwd / "my-model.yaml").write_text(json.dumps(builtin_registration("demo").to_dict()))  # JSON is YAML
    shutil.copy(REPO / "examples" / "trace.jsonl", cwd / "trace.jsonl")  # a request trace of one's own
    if engine:
        (cwd / "prompt.json").write_text(json.dumps(synthetic_tokens(4096, 3)))
        (cwd / "incident-prompt.txt").write_text("Summarise the incident of last night, step by step.\n")


# -- every line is run, or says why not -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_every_documented_command_is_run_or_says_why_not() -> None:
    """Each line is run by one of the tests below (offline, the README's walkthrough, the engine script, the short
    benchmarks), or named in NOT_RUN with why and where else it runs; an expected exit the page states is the one
    the run checks. A new line on a page fails here until it is one of these."""
    walkthrough = set(sh_block(REPO / "README.md", "An incident, step by step"))
    scripted = {cmd: code for cmd, code in ENGINE_SCRIPT}
    lines = documented()
    assert len(lines) >= 120 and {d.where for d in lines} >= {"README.md", "docs/events.md", "bsr plan --help"}
    unplaced = []
    for d in lines:
        if not_run(d.command) or is_offline(d.command) or d.command in SHORT_BENCHMARKS:
            continue
        in_readme = d.where == "README.md" and any(w.startswith(d.command) for w in walkthrough)
        if in_readme:
            continue
        if d.command not in scripted:
            unplaced.append(f"{d.where}: {d.command}")
        elif d.exit_code and scripted[d.command] != d.exit_code:
            unplaced.append(f"{d.where}: {d.command} says exit {d.exit_code}, the script expects {scripted[d.command]}")
    assert not unplaced, "\n".join(unplaced)
    for mark, why, where in NOT_RUN:
        assert any(mark in d.command for d in lines), f"NOT_RUN names {mark!r}, which no page writes any more"
        assert why and where.startswith("tests/"), mark


@pytest.mark.timeout(60)
def test_every_documented_command_parses() -> None:
    """What the pages and the help tell an operator to type is accepted by the real parser: no renamed or missing
    option, no value of the wrong type (the shell's part of a chained line aside)."""
    from bsr_cli.cli.app import build_command
    from bsr_cli.cli.global_options import hoist_global_options

    root = build_command()
    for d in documented():
        for part in re.split(r"\s*&&\s*", d.command):
            cmd = part.split(" > ", 1)[0]
            words = shlex.split(cmd)
            args = hoist_global_options(words[1:])
            ctx = root.make_context("bsr", list(args), resilient_parsing=False)
            cmd_obj, rest = root, list(getattr(ctx, "_protected_args", [])) + list(ctx.args)
            while getattr(cmd_obj, "commands", None) and rest and rest[0] in cmd_obj.commands:
                name, cmd_obj, rest = cmd_obj.resolve_command(ctx, rest)
                ctx = cmd_obj.make_context(name, list(rest), parent=ctx, resilient_parsing=False)
                rest = list(getattr(ctx, "_protected_args", [])) + list(ctx.args)
            leaf = not getattr(cmd_obj, "commands", None) or getattr(cmd_obj, "invoke_without_command", False)
            assert leaf and not rest, (d.where, d.command, rest)


# -- offline ----------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_readme_planning_commands_run_as_written(bsr, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the repository root, as a reader who cloned it: every file a planning line names is in the repository."""
    monkeypatch.chdir(REPO)
    lines = sh_block(REPO / "README.md", "Planning")
    assert len(lines) >= 5
    named = [w for line in lines for w in split(line)[0] if w.endswith((".json", ".jsonl"))]
    assert named and all((REPO / w).is_file() for w in named), named
    for line in lines:
        words, code = split(line)
        r = bsr(*words[1:])
        assert r.code == code, f"{line}\n{r.err}"
        if "--probe" in words:
            assert "committable prefix" in r.out


@pytest.mark.timeout(300)
def test_offline_commands_run_as_written(bsr, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every line that needs nothing running, in a directory laid out as the reader's: planning, registrations,
    the config, and the bench commands that read, check, redraw and print bundles."""
    _reader_files(tmp_path, engine=False)
    monkeypatch.chdir(tmp_path)
    ran = 0
    for d in documented():
        if not_run(d.command) or not is_offline(d.command) or d.command in SHORT_BENCHMARKS:
            continue
        r = run_line(bsr, d.command, tmp_path)
        assert r.code == d.exit_code, f"{d.where}: {d.command}\nexit {r.code}\n{r.err}"
        ran += 1
    assert ran >= 25
    assert (tmp_path / "bench-schema.json").is_file() and (tmp_path / "plots").is_dir()
    assert any((tmp_path / "docs" / "img").glob("*.png")), "bench plot --to docs/img redrew the plots"


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_short_benchmarks_run_as_written(bsr, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks of about a minute or less, as docs/benchmarks.md writes them (each starts what it needs and
    writes its bundle to bench-out/)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BSR_STATE_DIR", str(tmp_path / "state"))
    lines = list({d.command: d for d in documented() if d.command in SHORT_BENCHMARKS}.values())
    assert {d.command for d in lines} == set(SHORT_BENCHMARKS)
    for d in lines:
        r = run_line(bsr, d.command, tmp_path)
        assert r.code == d.exit_code, f"{d.where}: {d.command}\nexit {r.code}\n{r.err}"
    assert len(list((tmp_path / "bench-out").glob("br-*.json"))) == len(SHORT_BENCHMARKS)


# -- against a live engine -------------------------------------------------------------------------------------------


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_readme_incident_walkthrough_runs_as_written(bsr, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step by step, as the page lists them, with a fresh state directory (the page's own engine)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BSR_STATE_DIR", str(tmp_path / "state"))
    lines = sh_block(REPO / "README.md", "An incident, step by step")
    assert lines[0].startswith("bsr engine up") and lines[-1].startswith("bsr engine down")
    ran: list[str] = []
    try:
        for line in lines:
            words, code = split(line)
            if not_run(line):
                continue
            if words[1:3] == ["engine", "down"]:
                _planning_from_a_saved_probe(bsr, tmp_path)
            r = bsr(*words[1:])
            assert r.code == code, f"{line}\nexit {r.code}\n{r.err}"
            ran.append(line)
        # The page's promise behind the fallback step: served from fs with the canonical hash.
        assert any("submit" in x for x in ran[-4:])
    finally:
        bsr("engine", "down")
    status = bsr("engine", "status")
    assert status.code == 3  # the page's `bsr engine down` left nothing running


def _planning_from_a_saved_probe(bsr, tmp_path: Path) -> None:
    """The Planning section's `--probe` lines, with a probe saved from this engine as the page says, in place of the
    shipped example; the example has the shape the engine saves today."""
    saved = bsr("probe", "--synthetic", "65536", "--seed", "1", "--json")
    assert saved.code == 0, saved.err
    (tmp_path / "probe.json").write_text(saved.out)
    shipped = json.loads((REPO / "examples" / "probe.json").read_text())
    assert set(shipped) == set(saved.json()) and shipped["registration_spec"] == saved.json()["registration_spec"]
    for line in sh_block(REPO / "README.md", "Planning"):
        words, code = split(line)
        if "--probe" in words:
            words[words.index("--probe") + 1] = str(tmp_path / "probe.json")
            r = bsr(*words[1:])
            assert r.code == code, f"{line}\n{r.err}"
            assert "committable prefix" in r.out


# Every documented line that needs a live engine (beyond the README's walkthrough), in the order that gives each
# what it reads, with the exit code it must end with. The first engine is the help's sized one; the second the
# pages' own (`--enable-faults`), on which the prompt is submitted before anything restores it, req-00012 exists
# before the lines that name it, and every fault armed is cleared or used before the next step counts on it.
ENGINE_SCRIPT: tuple[tuple[str, int], ...] = (
    ("bsr engine up --W 16 --budget 32MiB --max-tokens 131072", 0),
    ("bsr engine status", 0),
    ("bsr engine status --json", 0),
    ("bsr engine endpoints", 0),
    ("bsr engine down", 0),
    ("bsr engine up --enable-faults", 0),
    ("bsr submit --synthetic 65536 --seed 1", 0),
    ("bsr probe --synthetic 65536 --seed 1", 0),
    ("bsr probe --synthetic 65536 --seed 1 --json > probe.json && bsr plan --W 16 --probe probe.json", 0),
    ("bsr restore --synthetic 65536 --seed 1 --W 32", 0),
    ("bsr restore --tokens-file prompt.json --dry-run --W 64", 0),
    ("bsr restore --synthetic 65536 --seed 1 --exclude-tier mooncake", 0),
    ("bsr restore --synthetic 65536 --seed 1 --tier fs", 0),
    ("bsr scrub --tier fs --synthetic 65536 --seed 1", 0),
    ("bsr scrub --tier fs --tokens-file prompt.json --json", 0),
    ("bsr scrub --tier fs --all --max-bytes 64GiB", 0),
    ("bsr submit --prompt-file incident-prompt.txt --W 16", 0),
    ("bsr inject-fault --rank 1 --kind restore-fault --window 3", 0),
    ("bsr faults list", 0),
    ("bsr restore --synthetic 65536 --seed 1", 10),  # the fault fails it closed on rank 1
    ("bsr explain --synthetic 65536 --seed 1", 0),
    ("bsr markers list", 0),
    ("bsr markers list --json", 0),
    ("bsr markers clear --prompt 3f2a9c1e0b7d4a65", 0),
    ("bsr markers clear --tier mooncake", 0),
    ("bsr markers clear --all --yes", 0),
    ("bsr inject-fault --kind restore-fault --window 2", 0),
    ("bsr faults inject --rank 1 --kind timeout --window 2", 0),
    ("bsr inject-fault --kind remote-unavailable --count 0", 0),
    ("bsr faults clear", 0),
    ("bsr status", 0),
    ("bsr status --engines-from engines.txt", 0),
    ("bsr explain --tokens-file prompt.json --W 64 --json", 0),
    ("bsr explain --tokens-file prompt.json", 0),
    ("bsr pool --once", 0),
    ("bsr pool --json", 0),
    ("bsr pool reset-peak", 0),
    ("bsr settings show", 0),
    ("bsr drill --yes", 0),
    ("bsr drill --tokens 16384 --W 8 --yes", 0),
    ("bsr explain req-00012", 0),
    ("bsr describe req-00012", 0),
    ("bsr abort req-00012", 18),
    ("bsr events -f --request req-00012", 130),
    ("bsr events", 0),
    ("bsr events -n 20", 0),
    ("bsr events --since 20m --json", 0),
    ("bsr events --since 2h --request req-00042 --kind restore_failed", 0),
    ("bsr events --since 2025-01-01T14:00 --until 30m", 0),
    ("bsr events -n 500 -f", 130),
    ("bsr events --since 1d --json", 0),
    ("bsr events --since 1d --trace seen.jsonl", 0),
    ("bsr plan --trace seen.jsonl -r paper-mtp-off --W 32 --bandwidth 10.31GB/s", 0),
    ("bsr bundle -o incident.tar.gz", 0),
    ("bsr describe req-00012 --record incident.tar.gz", 0),
    ("bsr bundle --synthetic 65536 --seed 1 --max-bytes 4MiB -o ticket-1234.tar.gz", 0),
    ("bsr settings set --W 16", 0),
    ("bsr settings set --budget 64MiB --fs-concurrency 4", 0),
    ("bsr engine down", 0),
)


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_every_engine_command_runs_as_written(bsr, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every documented line that needs a live engine, as written, in order, against engines of its own (a fresh
    state directory, the pages' `bsr engine up`)."""
    _reader_files(tmp_path, engine=True)
    monkeypatch.chdir(tmp_path)
    state = tmp_path / "state"
    monkeypatch.setenv("BSR_STATE_DIR", str(state))
    try:
        for i, (command, code) in enumerate(ENGINE_SCRIPT):
            if i == len(ENGINE_SCRIPT) - 1:  # before the last `bsr engine down`: the runbooks, on this engine
                _run_runbooks(bsr, tmp_path)
            _before(command, bsr, tmp_path)
            r = run_line(bsr, command, tmp_path)
            assert r.code == code, f"{command}\nexit {r.code}\n{r.err}\n{r.out[-2000:]}"
            _after(command, r, tmp_path)
    finally:
        bsr("engine", "down")
    assert bsr("engine", "status").code == 3  # nothing left running


def _run_runbooks(bsr, cwd: Path) -> None:
    """Each runbook line with its placeholders filled as the alert that links the page fills them: ENGINE the
    engine's URL (its token found as docs/fleet.md says, none given), REQ a request the engine ran."""
    url = bsr("engine", "status", "--json").json()["admin_url"]
    lines = runbook_lines()
    assert len(lines) >= 20 and "ENGINE" in lines[0].command
    for d in lines:
        command = re.sub(r"\bREQ\b", "req-00012", re.sub(r"\bENGINE\b", url, d.command))
        assert not re.search(r"\b[A-Z]{2,}\b", command), f"{d.where}: a placeholder left unfilled: {command}"
        r = run_line(bsr, command, cwd)
        assert r.code == 0, f"{d.where}: {command}\nexit {r.code}\n{r.err}\n{r.out[-2000:]}"


def _before(command: str, bsr, cwd: Path) -> None:
    """What a line counts on that the page says in prose: the engines list names the engine, with its token."""
    if command == "bsr status --engines-from engines.txt":
        url = bsr("engine", "status", "--json").json()["admin_url"]
        # No token given: docs/fleet.md says bsr finds the token of an engine of mine on this machine.
        (cwd / "engines.txt").write_text(f"# the lab's engines\n{url}\n")
    elif "req-00012" in command and not (cwd / ".req-00012").exists():
        held = bsr("events", "--request", "req-00012", "--json")
        assert held.code == 0 and held.out.strip(), "the lines that name req-00012 need that many requests first"
        (cwd / ".req-00012").touch()


def _after(command: str, r: Ran, cwd: Path) -> None:
    """What the line promised, beyond its exit code, where a wrong answer could still exit 0."""
    if command == "bsr abort req-00012":
        assert "already" in r.err and "bsr: hint:" in r.err
    elif command == "bsr restore --synthetic 65536 --seed 1 --exclude-tier mooncake":
        assert "from fs" in r.out
    elif command.startswith("bsr events -f"):
        assert "req-00012" in r.out
    elif command == "bsr events --since 1d --trace seen.jsonl":
        assert (cwd / "seen.jsonl").read_text().count("\n") >= 5
    elif command == "bsr status --engines-from engines.txt":
        assert "fleet: 1 engine" in r.out
    elif command.startswith("bsr bundle"):
        assert (cwd / command.split("-o ")[1]).is_file()
