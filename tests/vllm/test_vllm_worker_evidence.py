"""What bsr shows against a vLLM worker's admin API is what the BSR connector and vLLM's scheduler really hold.

Inside real vLLM (CPU build), once per model architecture (the tiny Llama the other scenarios use, and a tiny
Qwen2 with max_model_len 4,096): a prompt is stored, then `bsr explain`/`status`/`pool` run against the worker; a
fault is armed with `bsr inject-fault --window 2` and the next load fails there; then `bsr markers list`, `status`,
`explain` and `events` must show the force-local marker vLLM's scheduler holds and the failed load as the connector
saw it (advertised, loaded 0, recomputed), the connector's W and vLLM's limits, and one window numbering (G2 in
text, index 1 in JSON and events); the next request for the prompt is forced local and the marker is gone.
"""

from __future__ import annotations

import json
import shlex
import sys
from typing import Any

import pytest
from driver import prompt
from vllmstage import CHUNK, Driver, chunk_prefix, events_of, lmcache_yaml, vllm_ports

from bsr_cli.core.keys import prompt_hash

N = 5 * CHUNK + 60  # 5 full chunks + a tail LMCache never stores
W = 2  # windows G1 [0, 2), G2 [2, 4), G3 [4, 5) chunks
SEED = 3
TOKEN = "vllm-evidence-token"
MAX_MODEL_LEN = {"llama": 2048, "qwen2": 4096}
# What a vLLM worker's admin API serves (and so what `bsr explain` may suggest there).
SERVED = ("bsr status", "bsr markers list", "bsr probe ", "bsr faults clear", "bsr events")


def cli(url: str, *args: str) -> dict[str, Any]:
    return {"cli": ["--engine", url, "--token", TOKEN, *args]}


def describe_failed_load(url: str, *flags: str) -> dict[str, Any]:
    """`bsr describe` of the worker's last failed load, its request id read from `bsr events` (as an operator would)."""
    py = shlex.quote(sys.executable)
    bsr = f"{py} -m bsr_cli --engine {url} --token {TOKEN}"
    last = "import json,sys; print([json.loads(x) for x in sys.stdin if x.strip()][-1]['request'])"
    find = f"{bsr} --json events -n 500 --kind restore_failed_closed | {py} -c {shlex.quote(last)}"
    return {"sh": f'req=$({find}) && {bsr} {" ".join(flags)} describe "$req"'}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def run(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    model_dir: Any,
    qwen2_model_dir: Any,
    plugin_site: Any,
) -> dict[str, Any]:
    arch = request.param
    d = Driver(
        tmp_path_factory.mktemp(f"evidence-{arch}"), qwen2_model_dir if arch == "qwen2" else model_dir, plugin_site
    )
    url = f"http://127.0.0.1:{vllm_ports()}"
    toks = d.root / "prompt.json"
    toks.write_text(json.dumps(prompt(N, SEED)))
    tf = ("--tokens-file", str(toks))
    p = {"tokens": N, "seed": SEED}
    after_failure = [
        cli(url, "markers", "list"),
        cli(url, "--json", "markers", "list"),
        cli(url, "status"),
        cli(url, "--json", "status"),
        cli(url, "explain", *tf),
        cli(url, "--json", "explain", *tf),
        cli(url, "--json", "events", "-n", "500"),
        describe_failed_load(url),
        describe_failed_load(url, "--json"),
    ]
    res = d.run(
        {
            "connector": "bsr",
            "max_model_len": MAX_MODEL_LEN[arch],
            "extra": {
                "bsr_window_chunks": W,
                "bsr_admin_port": int(url.rsplit(":", 1)[1]),
                "bsr_admin_token": TOKEN,
                "bsr_admin_faults": True,
            },
            "scenarios": [
                {"name": "store", **p},
                {
                    "name": "stored",
                    "before": [
                        cli(url, "explain", *tf),
                        cli(url, "--json", "explain", *tf),
                        cli(url, "status"),
                        cli(url, "--json", "status"),
                        cli(url, "--json", "pool", "--once"),
                    ],
                },
                {
                    "name": "fault",
                    "before": [cli(url, "inject-fault", "--kind", "restore-fault", "--window", "2")],
                    **p,
                },
                {"name": "failed", "before": after_failure},
                {
                    "name": "marker",
                    "after": [cli(url, "--json", "markers", "list"), cli(url, "--json", "status"), cli(url, "status")],
                    **p,
                },
            ],
        },
        lmcache=lmcache_yaml(d.root / "lmcache.yaml", d.disk),
    )
    res["arch"] = arch
    return res


def ok(action: dict[str, Any]) -> str:
    assert action["rc"] == 0, action
    assert "Traceback" not in action["stderr"], action
    return str(action["stdout"])


def as_json(action: dict[str, Any]) -> Any:
    return json.loads(ok(action))


def failed_load(run: dict[str, Any]) -> dict[str, Any]:
    (ev,) = events_of(run["by_name"]["fault"], "bsr_load")
    assert not ev["ok"], ev
    return ev


PREFIX = chunk_prefix(N)
PREFIX_HASH = prompt_hash(prompt(N, SEED)[:PREFIX])


@pytest.mark.timeout(400)
def test_status_and_pool_show_the_connectors_w_budget_and_vllms_limits(run: dict[str, Any]) -> None:
    text, st, pool = (run["by_name"]["stored"]["actions"][i] for i in (2, 3, 4))
    info = as_json(st)["info"]
    assert info["W"] == W and info["serves_restores"] is False
    # The connector loads one window at a time: its budget is RWS(W) and it is not zero.
    assert info["rws_bytes"] and info["budget_bytes"] == info["rws_bytes"] > 0
    assert info["max_tokens"] == info["worker"]["max_model_len"] == MAX_MODEL_LEN[run["arch"]]
    assert info["worker"]["window_chunks"] == W and info["worker"]["scheduler_published"] is True
    shown = ok(text)
    assert f"W={W} " in shown and "RWS —" not in shown and "budget B 0 B" not in shown, shown
    assert f"max prompt {MAX_MODEL_LEN[run['arch']]:,} tokens" in shown and "max prompt 131,072" not in shown, shown
    view = as_json(pool)
    assert view["info"]["w"] == W and view["info"]["budget_bytes"] == info["budget_bytes"]
    assert all(g["budget_bytes"] == info["budget_bytes"] for g in view["gauges"])


@pytest.mark.timeout(400)
def test_explain_reasons_from_full_chunks_and_suggests_only_what_the_worker_serves(run: dict[str, Any]) -> None:
    text, js = (run["by_name"]["stored"]["actions"][i] for i in (0, 1))
    d = as_json(js)
    # Every full chunk is stored: restorable. The 60-token tail LMCache never stores is no "partial" prefix, and
    # no store is blamed for evicting it.
    assert d["verdict"] == "restorable" and d["chunks"] == PREFIX // CHUNK, d
    assert any("do not fill a chunk" in e for e in d["findings"][0]["evidence"]), d
    shown = ok(text)
    assert "evicting tails" not in shown and "partial" not in shown, shown
    for f in d["findings"]:
        assert f["next"].startswith(SERVED), f
    assert d["next"] == "bsr status"


@pytest.mark.timeout(400)
def test_after_a_failed_window_markers_status_and_explain_show_the_marker_and_the_failed_load(
    run: dict[str, Any],
) -> None:
    ev = failed_load(run)
    req = ev["req"]
    mlist, mjson, stext, sjson, etext, ejson, _events = run["by_name"]["failed"]["actions"][:7]
    # The marker vLLM's scheduler holds, under the prefix's prompt hash, with the failed load's window and reason.
    (m,) = as_json(mjson)["markers"]
    assert m["request"] == req and m["prompt"] == PREFIX_HASH and m["prefix_tokens"] == PREFIX, m
    assert m["failed_window"] == 1 and "window G2" in m["reason"], m
    assert PREFIX_HASH in ok(mlist) and "no force-local markers" not in ok(mlist)
    snap = as_json(sjson)
    assert [x["request"] for x in snap["markers"]] == [req]
    (load,) = [r for r in snap["recent"] if r["request"] == req]
    # What really happened: nothing loaded, the prefix recomputed; vLLM itself still counts it as cached.
    assert run["by_name"]["fault"]["num_cached_tokens"] == PREFIX
    assert load["outcome"] == "failed_closed" and load["advertised_tokens"] == PREFIX
    assert load["loaded_tokens"] == 0 and load["recomputed_tokens"] == PREFIX and load["failed_window"] == 1
    shown = ok(stext)
    assert f"force-local marker prompt {PREFIX_HASH}" in shown and "no force-local markers" not in shown, shown
    assert f"failed closed at window G2 of 3 (W={W}): advertised {PREFIX:,} tokens, loaded 0, recomputed" in shown
    # explain: the marker is the verdict, the failed load is its last restore, the next step is served there.
    d = as_json(ejson)
    assert d["verdict"] == "force-local-marker" and d["next"] == "bsr markers list", d
    last = d["last_restore"]
    assert last["request"] == req and last["outcome"] == "failed_closed"
    assert [f["window"] for f in last["failures"]] == [1]
    shown = ok(etext)
    assert "failed rank 0 window G2" in shown and "bsr markers clear" not in shown, shown


@pytest.mark.timeout(400)
def test_the_marker_has_one_id_and_describe_names_the_failed_window(run: dict[str, Any]) -> None:
    """After the worker's failed load: `markers list`, `status`, `explain` (of the whole prompt), the events and
    `describe` of the failed request all name the marker by the one id vLLM's scheduler keys it by (the prefix's
    prompt hash, never the whole prompt's), and describe says which window failed, its chunks, the stage and why."""
    ev = failed_load(run)
    req = ev["req"]
    mlist, mjson, stext, sjson, _etext, ejson, events, dtext, djson = run["by_name"]["failed"]["actions"]
    whole = prompt_hash(prompt(N, SEED))
    assert whole != PREFIX_HASH  # the negative control: the id explain used to show
    assert [m["prompt"] for m in as_json(mjson)["markers"]] == [PREFIX_HASH]
    assert [m["prompt"] for m in as_json(sjson)["markers"]] == [PREFIX_HASH]
    assert f"prompt {PREFIX_HASH}" in ok(mlist) and f"force-local marker prompt {PREFIX_HASH}" in ok(stext)
    d = as_json(ejson)
    assert d["marker"] == PREFIX_HASH and d["prompt"] == whole, d
    shown = [e for f in d["findings"] for e in f["evidence"] if e.startswith("marker:")]
    assert shown and all(e.startswith(f"marker: prompt {PREFIX_HASH} ") for e in shown), shown
    assert f"first {PREFIX:,} tokens" in shown[0] and whole not in json.dumps(d["findings"]), shown
    lines = [json.loads(x) for x in ok(events).splitlines() if x.strip()]
    (marked,) = [e for e in lines if e["type"] == "marker_set" and e["request"] == req]
    (started,) = [e for e in lines if e["type"] == "restore_started" and e["request"] == req]
    assert marked["prompt"] == started["prompt"] == PREFIX_HASH
    t = as_json(djson)
    assert t["request"] == req and t["prompt"] == PREFIX_HASH and t["marker"]["prompt"] == PREFIX_HASH, t
    (f,) = t["failures"]
    # G2 of W=2 is chunks [2, 4); the injected restore-fault fails the install: the rank's stage, no tier.
    assert (f["label"], f["chunks"], f["stage"], f["kind"], f["tier"]) == ("G2", [2, 4], "install", "rank", None), f
    assert "injected restore-fault" in f["reason"]
    text = ok(dtext)
    assert "failed at window G2 (chunks 2-3) (stage install" in text and f"marker prompt {PREFIX_HASH}" in text, text


@pytest.mark.timeout(400)
def test_one_window_numbering_in_cli_log_and_events(run: dict[str, Any]) -> None:
    armed = ok(run["by_name"]["fault"]["actions"][0])
    assert "window G2" in armed, armed
    ev = failed_load(run)
    # The log and every text: G2; events: the 0-based index 1 (with the label the CLI and the log use).
    assert f"load of {ev['req']} failed closed at window G2 of 3" in run["log"]
    assert "in window G2" in ev["reason"], ev
    assert ev["failed_window"] == 1 and ev["failed_window_label"] == "G2", ev
    # `bsr events --json` prints JSON lines, one event a line (for log shippers).
    events = [json.loads(line) for line in ok(run["by_name"]["failed"]["actions"][6]).splitlines() if line.strip()]
    (fired,) = [e for e in events if e["type"] == "fault_fired"]
    (closed,) = [e for e in events if e["type"] == "restore_failed_closed" and e["request"] == ev["req"]]
    assert fired["window"] == 1 and [f["window"] for f in closed["failures"]] == [1]
    released = [e for e in events if e["type"] == "window_released" and e["request"] == ev["req"]]
    assert [e["window"] for e in released] == [0]  # G1 completed before G2 failed


@pytest.mark.timeout(400)
def test_the_marker_forces_the_next_request_local_and_the_worker_then_shows_it_gone(run: dict[str, Any]) -> None:
    marker = run["by_name"]["marker"]
    (lk,) = events_of(marker, "bsr_lookup")
    assert lk["force_local"] and lk["external"] == 0
    mjson, sjson, stext = marker["after"]
    assert as_json(mjson)["markers"] == []
    forced = as_json(sjson)["scheduler"]["forced_local"]
    assert [f["request"] for f in forced] == [lk["req"]] and forced[0]["marker"] == PREFIX_HASH
    shown = ok(stext)
    assert f"admission {lk['req']}: forced local by the marker on prompt {PREFIX_HASH}" in shown, shown
    assert "no force-local markers" in shown
