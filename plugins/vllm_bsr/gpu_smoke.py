"""GPU smoke test of BSRConnector inside a real vLLM (prepared; NOT run on this CPU-only machine).

Creates a tiny Llama with random weights from a local config (no downloads), runs vLLM with the connector and a
local-disk LMCache, stores a prompt, then serves it again from LMCache and checks the generations agree. Driven by
gpu_smoke.sh, which sets the environment (LMCACHE_CONFIG_FILE, PYTHONPATH, PYTHONHASHSEED).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


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
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def main(workdir: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    wd = Path(workdir)
    model = wd / "tiny-llama"
    if not (model / "config.json").exists():
        make_model(model)
    ktc = {
        "kv_connector": "BSRConnector",
        "kv_connector_module_path": "vllm_bsr.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"bsr_window_chunks": 2},
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
    prompt = TokensPrompt(prompt_token_ids=[(i * 7919) % 31999 + 1 for i in range(2048 + 100)])
    sp = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    first = llm.generate([prompt], sp)[0].outputs[0].token_ids
    second = llm.generate([prompt], sp)[0].outputs[0].token_ids
    print(json.dumps({"first": list(first), "second": list(second), "equal": list(first) == list(second)}))
    return 0 if list(first) == list(second) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
