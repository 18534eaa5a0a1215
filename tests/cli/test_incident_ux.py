"""What an operator meets at the prompt during an incident: global flags anywhere, JSON for every outcome, output
that survives a pipe, a probe map that shows every tier, settings that name the engine actually used. No engine
runs here (the fast lane): these need only the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bsr_cli.cli.app import hoist_global_options
from bsr_cli.errors import ExitCode

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["status", "--engine", "prod"], ["--engine", "prod", "status"]),
        (["status", "-e", "prod", "--json"], ["-e", "prod", "status", "--json"]),
        (
            ["probe", "--synthetic", "8", "--timeout=3", "--traceback"],
            ["--timeout=3", "--traceback", "probe", "--synthetic", "8"],
        ),
        (["--engine", "a", "status"], ["--engine", "a", "status"]),
        (
            ["faults", "list", "--token", "t", "--state-dir", "/s"],
            ["--token", "t", "--state-dir", "/s", "faults", "list"],
        ),
        (["probe", "--", "--engine", "x"], ["probe", "--", "--engine", "x"]),  # after `--` nothing is an option
        (["status", "--engine"], ["status", "--engine"]),  # a missing value is left for the parser to report
    ],
)
def test_global_options_are_hoisted_from_anywhere(argv: list[str], expected: list[str]) -> None:
    assert hoist_global_options(argv) == expected


def test_global_flags_after_the_subcommand_reach_the_engine_call(bsr) -> None:
    # Nothing listens on port 1: the flag given after the subcommand is the URL the client tried.
    r = bsr("status", "--engine", "http://127.0.0.1:1", "--timeout", "5", "--json")
    assert r.code == ExitCode.ENGINE_UNREACHABLE
    doc = r.report()
    assert doc["error"] == "unreachable" and "127.0.0.1:1" in doc["message"]


def test_subcommand_help_lists_the_global_options(bsr) -> None:
    r = bsr("status", "--help")
    assert r.code == 0
    assert "Global options" in r.out and "--engine" in r.out and "--timeout" in r.out


def test_json_version_is_json(bsr) -> None:
    r = bsr("--json", "--version")
    assert r.code == 0 and "version" in r.json()


def test_usage_errors_under_json_print_a_json_document(bsr) -> None:
    r = bsr("--json", "plan", "--W", "many")
    assert r.code == ExitCode.INVALID_INPUT
    doc = r.json()
    assert doc["error"] == "usage" and "--W" in doc["message"] and doc["exit_code"] == 2


def test_help_shows_no_python_spellings(bsr) -> None:
    for cmd in (["restore"], ["plan"], ["bench", "validate"], ["registration", "diff"], ["registration", "show"]):
        text = bsr(*cmd, "--help").out
        assert "list[" not in text and "{spec}" not in text and "{a}" not in text, (cmd, text)


def test_config_show_names_the_engine_in_use(bsr, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = bsr("config", "show", "--json").json()
    assert doc["engine_url"]["value"] is None and "none running" in doc["engine_url"]["source"]
    text = bsr("config", "show").out
    assert "None" not in text
    monkeypatch.setenv("BSR_ENGINE", "http://10.1.2.3:8470")
    doc = bsr("config", "show", "--json").json()
    assert doc["engine_url"] == {"value": "http://10.1.2.3:8470", "source": "env BSR_ENGINE"}


def test_engine_status_says_not_running_once(bsr, tmp_path: Path) -> None:
    r = bsr("--state-dir", str(tmp_path), "engine", "status")
    assert r.code == ExitCode.ENGINE_UNREACHABLE
    assert (r.out + r.err).count("not running") == 1


def test_bench_plot_without_a_plottable_bundle_is_an_error(bsr, tmp_path: Path) -> None:
    empty = bsr("bench", "plot", "--out", str(tmp_path))
    assert empty.code == ExitCode.INVALID_INPUT and "no bundles" in empty.err
    shutil.copy(REPO / "docs" / "evidence" / "br-fail-75c30e6db28f.json", tmp_path)
    only_failures = bsr("bench", "plot", "--out", str(tmp_path))
    assert only_failures.code == ExitCode.INVALID_INPUT
    assert "failures" in only_failures.err and "nothing to plot" in only_failures.err


def test_piped_output_is_not_hard_wrapped(tmp_path: Path) -> None:
    """A real subprocess whose stdout is a pipe and COLUMNS unset: no table row is cut at a fixed width."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "COLUMNS"}
    env["NO_COLOR"] = "1"
    r = subprocess.run(
        [sys.executable, "-m", "bsr_cli", "rws", "-r", "paper-mtp-off", "--W", "32", "--tokens", "262144"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    last = r.stdout.strip().splitlines()[-1]
    # The summary sentence stays one line, wider than the 120 columns it used to be cut at.
    assert last.startswith("262,144 tokens") and "first ladder rung" in last and len(last) > 120


# -- the probe map ----------------------------------------------------------------------------------------------------


def _strip(cells: str, width: int, tiers: tuple[str, ...] = ("mooncake", "fs")) -> str:
    from bsr_cli.cli.render.ops import strip

    return strip(cells, list(tiers), width).plain


def test_probe_map_shows_chunks_held_by_both_tiers() -> None:
    # masks: 1 = mooncake, 2 = fs, 3 = both, 0 = miss
    assert _strip("3312", 4) == "BBMF"
    assert _strip("3330", 4) == "BBB·"
    # A cell that bins chunks shows what every chunk in it has: a miss anywhere wins.
    assert _strip("33333330", 2) == "B·"
    assert _strip("33113311", 2) == "MM"


def test_probe_legend_names_both_and_the_binning() -> None:
    from bsr_cli.cli.render.ops import legend

    text = legend(["mooncake", "fs"], chunks=512, width=128)
    assert "=mooncake+fs" in text and "1 cell ≈ 4 chunks" in text
    assert "cell" not in legend(["mooncake", "fs"], chunks=64, width=128)


def test_probe_map_follows_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    from bsr_cli.cli.render.ops import STRIP_FIXED_COLUMNS, strip_width

    monkeypatch.setenv("COLUMNS", "100")
    assert strip_width(Console(width=100), None) == 100 - STRIP_FIXED_COLUMNS
    assert strip_width(Console(width=100), 20) == 20


def test_bench_targets_read_as_text_not_python() -> None:
    from bsr_cli.cli.render.bench import _plain

    assert _plain({"remote-unavailable": "pass"}) == "remote-unavailable: pass"
    assert _plain({"8": 1048576, "16": True}) == "8: 1,048,576, 16: yes"
    assert json.dumps(_plain(0.8512)) == '"0.851"'


# -- examples on every command ------------------------------------------------------------------------------------


def _leaf_paths() -> list[str]:
    from bsr_cli.cli.app import build_command

    out: list[str] = []

    def walk(cmd, path: str) -> None:
        subs = getattr(cmd, "commands", None)
        if path and (not subs or getattr(cmd, "invoke_without_command", False)):
            out.append(path)
        for name, sub in (subs or {}).items():
            walk(sub, f"{path} {name}".strip())

    walk(build_command(), "")
    return out


def test_every_command_has_examples_in_its_help(bsr) -> None:
    from bsr_cli.cli.examples import EXAMPLES

    paths = _leaf_paths()
    assert "settings set" in paths and "pool" in paths
    missing = [p for p in paths if p not in EXAMPLES]
    assert not missing, f"commands without examples: {missing}"
    assert not set(EXAMPLES) - set(paths), "examples for commands that do not exist"
    text = bsr("settings", "set", "--help").out
    assert "Examples:\n    bsr settings set --W 16\n" in text  # kept as lines, not rewrapped


def _rest(ctx) -> list[str]:
    # The parser's own context keeps the subcommand words apart from the arguments after them.
    return list(getattr(ctx, "_protected_args", [])) + list(ctx.args)


def test_every_example_parses() -> None:
    """Each example's bsr invocation parses with the real parser: options exist and values convert."""
    import shlex

    from bsr_cli.cli.app import build_command, hoist_global_options
    from bsr_cli.cli.examples import EXAMPLES

    root = build_command()
    for path, lines in EXAMPLES.items():
        for line in lines:
            for part in line.replace("&&", "|").split("|"):
                words = shlex.split(part.split(">")[0])
                if not words or words[0] != "bsr":
                    continue
                args = hoist_global_options(words[1:])
                ctx = root.make_context("bsr", list(args), resilient_parsing=False)
                cmd, rest = root, _rest(ctx)
                while getattr(cmd, "commands", None) and rest and rest[0] in cmd.commands:
                    name, cmd, rest = cmd.resolve_command(ctx, rest)
                    ctx = cmd.make_context(name, list(rest), parent=ctx, resilient_parsing=False)
                    rest = _rest(ctx)
                assert not rest, (path, line, rest)


def _complete(words: str, cword: int, **env: str) -> list[str]:
    import os

    e = dict(os.environ, COMP_WORDS=words, COMP_CWORD=str(cword), _BSR_COMPLETE="complete_bash", **env)
    r = subprocess.run([sys.executable, "-m", "bsr_cli"], env=e, capture_output=True, text=True, timeout=60)
    return r.stdout.split()


def test_completion_offers_values(tmp_path: Path) -> None:
    assert "restore-fault" in _complete("bsr inject-fault --kind ", 3)
    assert _complete("bsr restore --exclude-tier ", 3) == ["mooncake", "fs"]
    assert _complete("bsr rws -r paper", 3) == ["paper-mtp-off", "paper-mtp-on"]
    assert "fp8_e4m3" in _complete("bsr probe --dtype fp8", 3)
    cfg = tmp_path / "config.toml"
    cfg.write_text('[profiles.prod]\nurl = "http://10.0.0.7:8470"\n[profiles.vllm-r0]\nurl = "http://127.0.0.1:8470"\n')
    assert _complete("bsr --engine ", 2, BSR_CONFIG=str(cfg)) == ["prod", "vllm-r0"]


def test_plan_takes_the_registration_flags_rws_takes(bsr, tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "hidden_size": 1024,
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "num_hidden_layers": 2,
                "torch_dtype": "bfloat16",
            }
        )
    )
    args = ["--hf-config", str(cfg), "--world-size", "2", "--chunk-size", "128", "--block-size", "32", "--json"]
    rws = bsr("rws", *args).json()
    plan = bsr("plan", "--tokens", "4096", *args).json()
    assert rws["bytes_per_chunk"] == 2 * 2 * 64 * 2 * 128 * 2
    assert plan["committable_chunks"] == 4096 // 128  # the chunk size reached the plan
    assert (
        bsr("plan", "--tokens", "4096", "--tp", "2", "--hf-config", str(cfg), "--json").json()["committable_chunks"]
        == 4096 // 256
    )


def test_faults_inject_is_inject_fault(bsr) -> None:
    a, b = bsr("faults", "inject", "--help").out, bsr("inject-fault", "--help").out
    assert (
        "--window" in a and a.split("Options:")[1].split("Examples:")[0] == b.split("Options:")[1].split("Examples:")[0]
    )


def test_events_are_paged_until_the_newest() -> None:
    """The engine answers the oldest page first; `bsr events` and `bsr describe` must reach the newest events."""
    from bsr_cli.client import AdminClient
    from bsr_cli.client.admin import EventPage
    from bsr_cli.core.events import WindowFetched

    ring = [WindowFetched(request="req-1", rank=0, window=i, seq=i).to_wire() for i in range(1, 1201)]

    class Engine(AdminClient):  # a fake of the /events contract: after `since`, oldest first, at most 500
        calls = 0

        def __init__(self) -> None:  # no connection: only `events` is answered
            pass

        def events(self, since: int = 0, wait_s: float = 0.0) -> EventPage:
            Engine.calls += 1
            return EventPage.from_wire({"events": [e for e in ring if e["seq"] > since][:500], "last_seq": 1200})

    evs, last = Engine().held_events(0)
    assert last == 1200 and [e.seq for e in evs] == list(range(1, 1201)) and Engine.calls == 3
    assert Engine().held_events(1150)[0][0].seq == 1151


def test_held_events_are_types_and_leave_out_a_kind_this_bsr_does_not_know() -> None:
    """A newer engine may hold kinds this bsr has no type for: read as types they are left out rather than misread;
    exported, they are kept."""
    from bsr_cli.client import AdminClient
    from bsr_cli.client.admin import EventPage
    from bsr_cli.core.events import WindowFetched

    ring = [
        WindowFetched(request="req-1", rank=0, window=0, seq=1).to_wire(),
        {"type": "from_a_newer_engine", "seq": 2, "time": 0.0},
        WindowFetched(request="req-1", rank=1, window=0, seq=3).to_wire(),
    ]

    class Engine(AdminClient):
        def __init__(self) -> None:  # no connection: only `events` is answered
            pass

        def events(self, since: int = 0, wait_s: float = 0.0) -> EventPage:
            return EventPage.from_wire({"events": [e for e in ring if e["seq"] > since], "last_seq": 3})

    evs, last = Engine().held_events(0)
    assert last == 3 and [(type(e), e.seq) for e in evs] == [(WindowFetched, 1), (WindowFetched, 3)]
    # What exports events (`bsr bundle`, `bsr events --since --json`) keeps every one, as the engine sent it.
    wire, last = Engine().held_wire(0)
    assert last == 3 and wire == ring


FAST_CASES = [
    ("bsr inject-fault --kind ", 3),
    ("bsr restore --exclude-tier ", 3),
    ("bsr rws -r paper", 3),
    ("bsr se", 1),
    ("bsr settings s", 2),
    ("bsr pool --", 2),
    ("bsr probe --synthetic 8 --dtype fp8", 5),
    ("bsr --engine prod status --", 4),
]


def test_fast_bash_completion_answers_as_the_full_path_without_the_framework(tmp_path: Path) -> None:
    import os

    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), _BSR_COMPLETE="complete_bash")

    def complete(words: str, cword: int, *flags: str) -> subprocess.CompletedProcess[str]:
        e = dict(env, COMP_WORDS=words, COMP_CWORD=str(cword))
        return subprocess.run(
            [sys.executable, *flags, "-m", "bsr_cli"], env=e, capture_output=True, text=True, timeout=60
        )

    for words, cword in FAST_CASES:
        full = complete(words, cword)  # the first TAB (no index yet, or a stale one) takes the full path
        assert (tmp_path / "cache" / "bsr" / "completion-index.json").exists()
        fast = complete(words, cword, "-X", "importtime")
        assert "typer" not in fast.stderr, f"{words!r}: the fast path imported the framework"
        assert fast.stdout.split() == full.stdout.split(), words
    assert complete("bsr se", 1).stdout.split() == ["settings"]


def test_window_size_old_spellings_still_work(bsr) -> None:
    """`--W` is the paper's notation and the one help shows; `-W` and `--window-size` (older spellings) still work
    for a release and appear nowhere (tests/cli/test_cli_conventions.py)."""
    a = bsr("plan", "--W", "16", "--tokens", "8192", "--json").json()
    b = bsr("plan", "--window-size", "16", "--tokens", "8192", "--json").json()
    assert a == b and a["windows_count"] == 2
    for cmd in (["restore"], ["bench", "sweep"], ["settings", "set"], ["rws"]):
        shown = bsr(*cmd, "--help").out
        assert "--W" in shown and "--window-size" not in shown, cmd


def test_status_shows_a_starved_rank_as_the_hosts_and_a_stopped_one_as_unhealthy() -> None:
    """`bsr status` of an engine whose rank 0 the host starves and whose rank 1 is stopped: rank 0 is up and starved,
    naming the host; rank 1 (the control) is unhealthy."""
    from rich.console import Console

    from bsr_cli.cli.render.ops import status
    from bsr_cli.core.status import EngineStatus, Health, Snapshot

    starved = {"rank": 0, "alive": True, "healthy": True, "state": "starved", "reason": "threads waited 9.0 s to run"}
    stopped = {"rank": 1, "alive": True, "healthy": False, "state": "stopped", "reason": "its process is stopped"}
    info = {"engine": "e", "version": "v", "api": "v1", "W": 4, "registration": {"identity": "r", "groups": ["full"]}}
    snap = Snapshot.from_wire({"time": 1.0, "info": info, "ranks": [starved, stopped], "tiers": {}})
    health = Health.from_wire({"ranks": [starved, stopped], "tiers": {}})
    assert health.starved_ranks == [0] and health.unhealthy_ranks == [1]
    console = Console(record=True, width=160)
    status(console, EngineStatus(url="http://e", health=health, snapshot=snap))
    text = console.export_text()
    assert "up, starved" in text and "rank 0 starved (the host, not the rank): threads waited 9.0 s to run" in text
    assert "rank 1 unhealthy: its process is stopped" in text and "rank 0 unhealthy" not in text
