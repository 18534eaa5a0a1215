"""One real vLLM (CPU build) with LMCache, running a list of scenarios; prints one JSON result line.

Run by tests/vllm (one process per configuration, so vLLM's start-up is paid once for several scenarios):
``python tests/vllm/driver.py CONFIG.json``. The config names the model directory, the connector ("stock":
vLLM's built-in LMCacheConnectorV1, "bsr": vllm_bsr's BSRConnector), the TP size, the LMCache config file and the
scenarios. What happened inside vLLM's scheduler and workers comes back through bsr's event file
($BSR_VLLM_EVENTS, JSON lines written by the connectors); the result line carries every request's output tokens,
vLLM's cached-token count, and the events each scenario produced.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

RESULT_PREFIX = "BSR-DRIVER-RESULT "
SCENARIO_PREFIX = "BSR-DRIVER-SCENARIO "
READY_PREFIX = "BSR-DRIVER-READY"


def make_model(path: Path, *, arch: str = "llama", layers: int = 2, vocab: int = 1024) -> None:
    """A tiny model of architecture ``arch`` (llama or qwen2) made locally (no hub): weights at initializer_range
    0.2, so wrong KV changes the output."""
    if (path / "config.json").exists():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = {
        "vocab_size": vocab,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(0)
    if arch == "qwen2":  # biased q/k/v projections, head_dim = hidden / heads
        model: Any = Qwen2ForCausalLM(Qwen2Config(**shape, max_position_embeddings=4096))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, head_dim=32, max_position_embeddings=2048))
    model.to(torch.float32).save_pretrained(path)


def prompt(n: int, seed: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 1000 + 7 for i in range(n)]


def read_events(path: Path, start: int) -> tuple[list[dict[str, Any]], int]:
    if not path.exists():
        return [], start
    data = path.read_bytes()
    out = [json.loads(line) for line in data[start:].decode().splitlines() if line.strip()]
    return out, len(data)


def corrupt_files(root: Path) -> int:
    """Flip bytes in every stored object under ``root`` (LMCache's disk tier): nothing in LMCache checks them."""
    n = 0
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.stat().st_size > 64:
            data = bytearray(f.read_bytes())
            for i in range(64, len(data), 97):
                data[i] ^= 0x5A
            f.write_bytes(bytes(data))
            n += 1
    return n


def _mooncake_client(metadata: str, master: str) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", metadata, 0, 16 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"Mooncake client setup failed: {rc}")
    return store


def mooncake_remove(admin: str, metadata: str, master: str, world: int, worker: int) -> dict[str, Any]:
    """Remove one object of TP rank ``worker`` from the Mooncake store (the first of its keys in sorted order),
    through a client of the real master: a hole on one rank only."""
    import urllib.request

    with urllib.request.urlopen(admin + "/get_all_keys", timeout=10) as r:
        keys = sorted(k for k in r.read().decode().split() if f"@{world}@{worker}@" in k and "#" not in k)
    if not keys:
        return {"removed": None, "candidates": 0}
    store = _mooncake_client(metadata, master)
    rc = store.remove(keys[0], True)
    with urllib.request.urlopen(admin + "/get_all_keys", timeout=10) as r:
        left = set(r.read().decode().split())
    return {"removed": keys[0], "candidates": len(keys), "rc": rc, "gone": keys[0] not in left}


def mooncake_corrupt(admin: str, metadata: str, master: str, world: int, worker: int) -> dict[str, Any]:
    """Flip bytes of one stored object of TP rank ``worker`` in the Mooncake store (the first of its LMCache keys in
    sorted order; never a checksum sidecar): read it through a client of the real master, flip every 97th byte from
    byte 64, and write it back in place (``upsert``). A real corruption of the stored object."""
    import urllib.request

    with urllib.request.urlopen(admin + "/get_all_keys", timeout=10) as r:
        listed = r.read().decode().split()
    keys = sorted(k for k in listed if f"@{world}@{worker}@" in k and "#" not in k)
    if not keys:
        return {"corrupted": None, "candidates": 0}
    store = _mooncake_client(metadata, master)
    data = bytearray(store.get(keys[0]))
    before = bytes(data)
    for i in range(64, len(data), 97):
        data[i] ^= 0x5A
    rc = store.upsert(keys[0], bytes(data))
    after = store.get(keys[0])
    return {
        "corrupted": keys[0],
        "candidates": len(keys),
        "bytes": len(data),
        "rc": rc,
        "changed": after != before and len(after) == len(before),
        "sidecars": sum(1 for k in listed if k.endswith("#bsr-crc32c")),
    }


def prompt_key(model: str, tokens: int, seed: int, chunk: int, chunk_size: int = 128) -> str:
    """The LMCache key vLLM's worker 0 (TP 1, fp32, PYTHONHASHSEED=0) stores chunk ``chunk`` of a prompt under, as
    bsr computes it (``bsr probe --store`` does the same)."""
    from bsr_cli.core.lmcache_keys import lmcache_chunk_hashes, lmcache_key, vllm_seeded_start

    hashes = lmcache_chunk_hashes(prompt(tokens, seed), chunk_size, vllm_seeded_start("0"))
    return lmcache_key(model, 1, 0, hashes[chunk], "float")


def mooncake_copy(metadata: str, master: str, src: str, dst: str) -> dict[str, Any]:
    """Write ``src``'s object and its checksum sidecar under ``dst``'s key, byte for byte, through a client of the
    real master (what a copy between deployments, a writer with the wrong key or a key collision leaves)."""
    store = _mooncake_client(metadata, master)
    held = store.batch_is_exist([src, dst, src + "#bsr-crc32c", dst + "#bsr-crc32c"])
    data, side = store.get(src), store.get(src + "#bsr-crc32c")
    before = store.get(dst)
    rcs = [store.upsert(dst, data), store.upsert(dst + "#bsr-crc32c", side)]
    return {"copied": dst, "from": src, "held": held, "rcs": rcs, "changed": store.get(dst) != before}


def mooncake_grow(metadata: str, master: str, key: str, extra: int) -> dict[str, Any]:
    """Append ``extra`` zero bytes to the stored object of ``key`` (its sidecar untouched)."""
    store = _mooncake_client(metadata, master)
    data = store.get(key)
    rc = store.upsert(key, data + bytes(extra))
    return {"grown": key, "bytes": len(data), "rc": rc, "now": len(store.get(key))}


def run_action(act: dict[str, Any]) -> dict[str, Any]:
    """One step between requests: a bsr command (real CLI, real HTTP), a corrupted disk tier, a killed process."""
    import signal
    import subprocess

    if "cli" in act:
        try:
            p = subprocess.run(
                [sys.executable, "-m", "bsr_cli", *act["cli"]],
                capture_output=True,
                text=True,
                timeout=float(act.get("timeout_s", 60)),
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            return {"cli": act["cli"], "rc": None, "timed_out": True, "stdout": out[-4000:], "stderr": ""}
        return {"cli": act["cli"], "rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr[-2000:]}
    if "sh" in act:  # a shell script, as a user types it (tests/vllm/test_runbook.py: the runbook's blocks)
        p = subprocess.run(
            ["bash", "-c", act["sh"]],
            cwd=act.get("cwd"),
            env={**os.environ, **act.get("env", {})},
            capture_output=True,
            text=True,
            timeout=float(act.get("timeout_s", 300)),
            check=False,
        )
        return {"sh": act["sh"], "rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr[-4000:]}
    if "corrupt_dir" in act:
        return {"corrupted_files": corrupt_files(Path(act["corrupt_dir"]))}
    if "mooncake_corrupt" in act:
        return mooncake_corrupt(**act["mooncake_corrupt"])
    if "mooncake_remove" in act:
        return mooncake_remove(**act["mooncake_remove"])
    if "mooncake_copy" in act:
        return mooncake_copy(**act["mooncake_copy"])
    if "mooncake_grow" in act:
        return mooncake_grow(**act["mooncake_grow"])
    if "kill_pid" in act:
        pid = int(act["kill_pid"])
        os.kill(pid, signal.SIGKILL)
        return {"killed": pid}
    if "sleep_s" in act:
        time.sleep(float(act["sleep_s"]))
        return {"slept": act["sleep_s"]}
    raise ValueError(f"unknown action {act}")


def main(config_path: str) -> int:
    cfg = json.loads(Path(config_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    events_path = Path(os.environ["BSR_VLLM_EVENTS"])
    ktc: dict[str, Any] = {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
    if cfg["connector"] == "bsr":
        ktc |= {
            "kv_connector": "BSRConnector",
            "kv_connector_module_path": "vllm_bsr.connector",
            "kv_connector_extra_config": cfg.get("extra", {}),
        }
    t0 = time.monotonic()
    llm = LLM(
        model=cfg["model"],
        skip_tokenizer_init=True,
        max_model_len=int(cfg.get("max_model_len", 2048)),
        enable_prefix_caching=False,  # every reuse must come through the connector
        kv_transfer_config=ktc,
        enforce_eager=True,
        tensor_parallel_size=int(cfg.get("tp", 1)),
        dtype="float32",
        max_num_seqs=4,
        block_size=int(cfg.get("block_size", 64)),
        seed=0,
    )
    startup_s = time.monotonic() - t0
    print(f"{READY_PREFIX} {startup_s:.1f} s", flush=True)  # the runner's start-up deadline ends here
    sp = SamplingParams(max_tokens=int(cfg.get("max_tokens", 8)), temperature=0.0, detokenize=False)
    pos = 0
    results: list[dict[str, Any]] = []
    for sc in cfg["scenarios"]:
        print(SCENARIO_PREFIX + sc["name"], flush=True)  # names the scenario in a failure's report
        actions = [run_action(a) for a in sc.get("before", [])]
        res: dict[str, Any] = {"name": sc["name"], "actions": actions}
        if int(sc.get("tokens", 0)):
            t = time.monotonic()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt(int(sc["tokens"]), int(sc["seed"])))], sp)[0]
            res |= {
                "output": list(out.outputs[0].token_ids),
                "num_cached_tokens": out.num_cached_tokens,
                "wall_s": round(time.monotonic() - t, 3),
            }
        time.sleep(float(sc.get("settle_s", 0.2)))  # workers append their events right after the step
        res["events"], pos = read_events(events_path, pos)
        res["after"] = [run_action(a) for a in sc.get("after", [])]
        results.append(res)
    print(RESULT_PREFIX + json.dumps({"startup_s": round(startup_s, 1), "results": results}), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--make-model":
        make_model(Path(sys.argv[2]), arch=sys.argv[3] if len(sys.argv) > 3 else "llama")
        sys.exit(0)
    sys.exit(main(sys.argv[1]))
