"""The README's commands, run literally as written, in order, against a real embedded engine: what a new user
types from the page must work and exit as the page says (a comment that opens with `exit N` states the expected code).

The files the planning commands read (a Hugging Face `config.json`, a saved `probe.json`, a request trace
`trace.jsonl`) ship in examples/, so those commands run from the repository root with nothing made first; commands
that cannot run unattended are named below with the reason, and nothing else is skipped."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Commands the test does not run, and why (each is exercised elsewhere).
NOT_RUN = {
    "bsr top": "interactive; driven by Textual's pilot in tests/tui",
}


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
        if " ".join(words[:2]) in NOT_RUN:
            continue
        r = bsr(*words[1:])
        assert r.code == code, f"{line}\n{r.err}"
        if "--probe" in words:
            assert "committable prefix" in r.out


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
            if " ".join(words[:2]) in NOT_RUN:
                continue
            if words[1:3] == ["engine", "down"]:
                _planning_from_a_saved_probe(bsr, tmp_path)
                _top_page_snapshot(bsr)
            r = bsr(*words[1:])
            assert r.code == code, f"{line}\nexit {r.code}\n{r.err}"
            ran.append(line)
        # The page's promise behind the fallback step: served from fs with the canonical hash.
        assert any("submit" in x for x in ran[-4:])
    finally:
        bsr("engine", "down")
    status = bsr("engine", "status")
    assert status.code == 3  # the page's `bsr engine down` left nothing running


def _top_page_snapshot(bsr) -> None:
    """docs/top.md's one command that needs no terminal (`bsr pool --once`), as written, against this engine."""
    lines = [c for p, c in doc_command_lines() if p == "top.md" and "--once" in c]
    assert lines
    for cmd in lines:
        r = bsr(*shlex.split(cmd)[1:])
        assert r.code == 0 and "Restore pool per rank" in r.out, (cmd, r.err)


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


def doc_command_lines() -> list[tuple[str, str]]:
    """(page, command) for every `bsr` command in a shell block of the README and docs/ (continuations joined)."""
    out: list[tuple[str, str]] = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = page.read_text()
        for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, flags=re.S):
            joined = re.sub(r"\\\n\s*", " ", block)
            for line in joined.splitlines():
                cmd = line.strip().partition("  #")[0].strip()
                cmd = re.sub(r"^\.venv/bin/", "", cmd)
                if cmd.startswith("bsr "):
                    out.append((page.name, cmd))
    return out


@pytest.mark.timeout(60)
def test_every_documented_command_parses() -> None:
    """What the pages tell an operator to type is accepted by the real parser: no renamed or missing option, no
    value of the wrong type. (Commands that need a cluster, a long benchmark or a terminal run elsewhere; the README's
    flows above run for real.)"""
    from bsr_cli.cli.app import build_command
    from bsr_cli.cli.global_options import hoist_global_options

    root = build_command()
    lines = doc_command_lines()
    assert len(lines) >= 25 and {p for p, _ in lines} >= {"README.md", "top.md", "benchmarks.md", "monitoring.md"}
    for page, cmd in lines:
        words = shlex.split(cmd.replace("…", "x"))
        args = hoist_global_options(words[1:])
        ctx = root.make_context("bsr", list(args), resilient_parsing=False)
        cmd_obj, rest = root, list(getattr(ctx, "_protected_args", [])) + list(ctx.args)
        while getattr(cmd_obj, "commands", None) and rest and rest[0] in cmd_obj.commands:
            name, cmd_obj, rest = cmd_obj.resolve_command(ctx, rest)
            ctx = cmd_obj.make_context(name, list(rest), parent=ctx, resilient_parsing=False)
            rest = list(getattr(ctx, "_protected_args", [])) + list(ctx.args)
        assert not getattr(cmd_obj, "commands", None) or getattr(cmd_obj, "invoke_without_command", False), (
            page,
            cmd,
        )
        assert not rest, (page, cmd, rest)
