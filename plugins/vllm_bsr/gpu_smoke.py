"""Smoke test of BSRConnector inside a real vLLM on a GPU host (the CPU build is covered by tests/vllm).

Creates a tiny Llama with random weights from a local config (no downloads), runs vLLM with the connector and a
local-disk LMCache, stores a prompt, then serves it again from LMCache. Passes only when the second request's
prefix was really loaded: the connector's events ($BSR_VLLM_EVENTS) show one complete windowed load of the
prompt's chunk-aligned prefix in the expected number of windows, vLLM reports that many cached tokens, LMCache's
pinning lookup was never used, and both generations agree. Driven by gpu_smoke.sh, which sets the environment
(LMCACHE_CONFIG_FILE, BSR_VLLM_EVENTS, PYTHONPATH, PYTHONHASHSEED).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CHUNK = 256  # gpu_smoke.sh's LMCache chunk_size
W = 2
PROMPT = 2048 + 100  # 8 full chunks + a tail: windows of 2 chunks -> 4 windows


def make_model(path: Path) -> None:
    """A 2-layer Llama with random weights and a tiny tokenizer-free setup (token ids go in directly)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,  # weights that react to wrong KV
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(workdir: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    wd = Path(workdir)
    model = wd / "tiny-llama"
    if not (model / "config.json").exists():
        make_model(model)
    ev_path = Path(os.environ["BSR_VLLM_EVENTS"])
    ktc = {
        "kv_connector": "BSRConnector",
        "kv_connector_module_path": "vllm_bsr.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"bsr_window_chunks": W},
    }
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        max_model_len=4096,
        gpu_memory_utilization=0.3,
        enable_prefix_caching=False,  # every reuse must come through the connector
        kv_transfer_config=ktc,
        enforce_eager=True,
    )
    prompt = TokensPrompt(prompt_token_ids=[(i * 7919) % 31999 + 1 for i in range(PROMPT)])
    sp = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    first = llm.generate([prompt], sp)[0]
    n_before = len(events(ev_path))
    second = llm.generate([prompt], sp)[0]
    loads = [e for e in events(ev_path)[n_before:] if e["event"] == "bsr_load"]
    prefix = PROMPT // CHUNK * CHUNK
    want_windows = -(-prefix // (W * CHUNK))
    checks = {
        "outputs_equal": list(first.outputs[0].token_ids) == list(second.outputs[0].token_ids),
        "one_load": len(loads) == 1,
        "loaded_prefix": bool(loads) and loads[0]["ok"] and loads[0]["loaded"] == prefix,
        "windows": bool(loads) and loads[0]["windows_run"] == want_windows,
        "no_pinning_lookup": bool(loads) and loads[0]["lmcache_lookups"] == 0,
        "vllm_cached_tokens": second.num_cached_tokens == prefix,
    }
    print(json.dumps({"checks": checks, "loads": loads, "cached_tokens": second.num_cached_tokens}))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
