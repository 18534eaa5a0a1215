"""BSRConnector inside real vLLM (CPU build) over LMCache's disk tier, and bsr's commands against its workers.

One vLLM start-up runs every scenario in order (module-scoped): store, windowed load, bsr's operator commands over
the worker admin API, an injected window failure (fail closed -> vLLM recomputes), the force-local marker steering
the next request for that prompt and then a longer prompt sharing the failed prefix, a healed load, and the
negative control (corrupted stored KV changes the output).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from driver import prompt
from vllmstage import CHUNK, chunk_prefix, events_of, lmcache_yaml, vllm_ports

N = 5 * CHUNK + 60  # 5 full chunks + a tail
W = 2  # windows: [0, 2), [2, 4), [4, 5) chunks
SEED = 2
TOKEN = "vllm-stage-token"


def cli(url: str, *args: str) -> dict[str, Any]:
    return {"cli": ["--engine", url, "--token", TOKEN, *args]}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, model_dir: Any, plugin_site: Any) -> dict[str, Any]:
    from vllmstage import Driver

    d = Driver(tmp_path_factory.mktemp("bsr-disk"), model_dir, plugin_site)
    port = vllm_ports()
    url = f"http://127.0.0.1:{port}"
    toks = d.root / "prompt.json"
    toks.write_text(json.dumps(prompt(N, SEED)))
    p = {"tokens": N, "seed": SEED}
    res = d.run(
        {
            "connector": "bsr",
            "extra": {
                "bsr_window_chunks": W,
                "bsr_admin_port": port,
                "bsr_admin_token": TOKEN,
                "bsr_admin_faults": True,
            },
            "scenarios": [
                {"name": "store", **p},
                {"name": "load", **p},
                {
                    "name": "ops",
                    "before": [
                        cli(url, "--json", "status"),
                        cli(url, "--json", "probe", "--tokens-file", str(toks)),
                        cli(url, "--json", "pool", "--once"),
                        cli(url, "--json", "faults", "list"),
                        cli(url, "markers", "clear", "--all", "--yes"),
                        cli(url, "bench", "failures", "-n", str(N), "--no-plots", "-o", str(d.root / "bench")),
                        {**cli(url, "top", "--interval", "0.5"), "timeout_s": 6},
                    ],
                },
                {
                    "name": "fault",
                    "before": [cli(url, "--json", "inject-fault", "--kind", "restore-fault", "--window", "2")],
                    "after": [cli(url, "--json", "faults", "list")],
                    **p,
                },
                {"name": "marker", **p},
                # A longer prompt starting with the same prefix, stored whole (one more chunk than the prefix).
                {"name": "store-longer", "tokens": N + CHUNK, "seed": SEED},
                {
                    "name": "fault-again",
                    "before": [cli(url, "--json", "inject-fault", "--kind", "restore-fault", "--window", "2")],
                    **p,
                },
                # The longer prompt again, after a load of the shorter prefix failed.
                {"name": "marker-longer", "tokens": N + CHUNK, "seed": SEED},
                {"name": "healed", **p},
                {"name": "corrupt", "before": [{"corrupt_dir": str(d.disk)}], **p},
            ],
        },
        lmcache=lmcache_yaml(d.root / "lmcache.yaml", d.disk),
    )
    res["admin_url"] = url
    return res


def one_load(r: dict[str, Any]) -> dict[str, Any]:
    loads = events_of(r, "bsr_load")
    assert len(loads) == 1, r["events"]
    return loads[0]


@pytest.mark.timeout(300)
def test_windowed_probe_only_load_is_bit_identical_to_recompute(run: dict[str, Any]) -> None:
    store, load = run["by_name"]["store"], run["by_name"]["load"]
    assert store["num_cached_tokens"] == 0 and not events_of(store, "bsr_load")
    assert sum(e["tokens"] for e in events_of(store, "lmcache_cpu_store")) == chunk_prefix(N)
    # The scheduler's count came from bsr's probe-only lookup...
    (lk,) = events_of(load, "bsr_lookup")
    assert lk["probed"] == lk["external"] == chunk_prefix(N) and not lk["force_local"]
    # ...and the worker loaded it in windows of W chunks, every one complete.
    ev = one_load(load)
    assert ev["ok"] and ev["loaded"] == chunk_prefix(N)
    assert ev["windows"] == [[0, 2 * CHUNK], [2 * CHUNK, 4 * CHUNK], [4 * CHUNK, 5 * CHUNK]]
    assert ev["windows_run"] == 3
    assert ev["probe_served"] >= 1 and ev["lmcache_lookups"] == 0  # LMCache's pinning lookup never used
    assert sum(e["tokens"] for e in events_of(load, "lmcache_cpu_load")) == chunk_prefix(N)
    assert load["num_cached_tokens"] == chunk_prefix(N)
    assert load["output"] == store["output"]


@pytest.mark.timeout(300)
def test_injected_window_failure_recomputes_and_commits_nothing(run: dict[str, Any]) -> None:
    store, fault = run["by_name"]["store"], run["by_name"]["fault"]
    inject = fault["actions"][0]
    assert inject["rc"] == 0, inject
    assert json.loads(inject["stdout"])["kind"] == "restore-fault"
    ev = one_load(fault)
    # Window 2 (index 1) failed: the load stopped there and reported every block of the request.
    assert not ev["ok"] and ev["failed_window"] == 1 and ev["windows_run"] == 2 and ev["loaded"] == 0
    assert "injected restore-fault" in ev["reason"]
    # vLLM recomputed from scratch: identical output.
    assert fault["output"] == store["output"]
    assert [e["req"] for e in events_of(fault, "bsr_marker_set")] == [ev["req"]]
    # The fault fired once and is gone.
    listed = fault["after"][0]
    assert listed["rc"] == 0 and json.loads(listed["stdout"])["faults"] == []


@pytest.mark.timeout(300)
def test_marker_steers_the_next_request_for_the_prompt_then_clears(run: dict[str, Any]) -> None:
    store, marker, healed = (run["by_name"][n] for n in ("store", "marker", "healed"))
    (lk,) = events_of(marker, "bsr_lookup")
    assert lk["force_local"] and lk["external"] == 0 and lk["probed"] == chunk_prefix(N)
    assert not events_of(marker, "bsr_load") and marker["num_cached_tokens"] == 0
    assert len(events_of(marker, "bsr_marker_cleared")) == 1
    assert marker["output"] == store["output"]
    # Cleared: the next request loads again, in windows.
    ev = one_load(healed)
    assert ev["ok"] and ev["windows_run"] == 3 and healed["output"] == store["output"]


@pytest.mark.timeout(300)
def test_marker_stands_for_the_failed_prefix_not_only_its_prompt(run: dict[str, Any]) -> None:
    again, longer = run["by_name"]["fault-again"], run["by_name"]["marker-longer"]
    ev = one_load(again)
    assert not ev["ok"] and ev["failed_window"] == 1
    (marked,) = events_of(again, "bsr_marker_set")
    # Another prompt, longer, starting with the failed prefix and probed past it (its own last chunk is stored
    # too): sent to local compute without a load, and its admission clears the marker (the healed load above then
    # runs in windows).
    (lk,) = events_of(longer, "bsr_lookup")
    assert lk["force_local"] and lk["external"] == 0 and lk["probed"] == chunk_prefix(N + CHUNK) > chunk_prefix(N)
    assert not events_of(longer, "bsr_load") and longer["num_cached_tokens"] == 0
    assert len(events_of(longer, "bsr_marker_cleared")) == 1 and marked["prefix"]


@pytest.mark.timeout(300)
def test_negative_control_corrupted_kv_changes_the_output(run: dict[str, Any]) -> None:
    """Proves the comparisons above can fail: the same load path with corrupted stored KV generates differently."""
    store, corrupt = run["by_name"]["store"], run["by_name"]["corrupt"]
    assert corrupt["actions"][0]["corrupted_files"] >= 5
    ev = one_load(corrupt)
    assert ev["ok"] and ev["loaded"] == chunk_prefix(N)
    assert corrupt["output"] != store["output"]


@pytest.mark.timeout(300)
def test_bsr_commands_against_a_vllm_worker(run: dict[str, Any]) -> None:
    status, probe, pool, faults, markers, bench, top = run["by_name"]["ops"]["actions"]
    assert status["rc"] == 0, status
    st = json.loads(status["stdout"])
    assert "vllm-lmcache tp-rank 0" in json.dumps(st)
    assert probe["rc"] == 0, probe
    # Every full chunk is on the disk tier of this worker; the tail is not a chunk.
    assert "fs" in probe["stdout"]
    assert pool["rc"] == 0, pool
    assert faults["rc"] == 0 and json.loads(faults["stdout"])["enabled"] is True
    # What a worker cannot serve is refused in one line, with a non-zero exit code and no stack trace: markers
    # live in vLLM's scheduler; moving KV outside vLLM (the failure bench submits and restores) is not allowed.
    for refused in (markers, bench):
        assert refused["rc"] == 7 and "not served from a vLLM worker" in refused["stderr"], refused
        assert "Traceback" not in refused["stderr"]
    # `top` is a live terminal UI: without a terminal it says so in one line and points to `pool`.
    assert top["rc"] == 2 and "interactive terminal" in top["stderr"] and "pool --once" in top["stderr"], top
