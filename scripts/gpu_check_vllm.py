"""vLLM (CUDA build) + LMCache 0.5.6 + BSRConnector on one GPU, with hit-token assertions (scripts/gpu_check.py).

A 2-layer Llama with random weights is made locally (no downloads); vLLM runs with prefix caching off, so every
reused token must come through the connector. The first request computes and stores its prompt through LMCache's
local disk; the second loads it: vLLM's own count of cached tokens for it (prefix cache off: only external tokens)
must cover every full 256-token chunk, the first request's must be 0, and the two generations must agree.

``--imports-only`` (the CPU dry run) checks that vLLM, LMCache and the connector import, and stops: LMCache under a
CPU vLLM stores and loads nothing. Prints one JSON line with the facts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CHUNK = 256
PROMPT_TOKENS = 8 * CHUNK + 100  # 8 full chunks and a tail LMCache never stores


def main(argv: list[str]) -> int:
    wd = Path(argv[0])
    wd.mkdir(parents=True, exist_ok=True)
    import lmcache
    import vllm
    import vllm_bsr.connector  # noqa: F401 - the connector must import where vLLM does

    facts: dict[str, object] = {"vllm": vllm.__version__, "lmcache": getattr(lmcache, "__version__", "?")}
    if "--imports-only" in argv:
        print(json.dumps(facts | {"imports_only": True}))
        return 0

    (wd / "disk").mkdir(exist_ok=True)
    cfg = wd / "lmcache.yaml"
    cfg.write_text(
        f'chunk_size: {CHUNK}\nlocal_cpu: false\nmax_local_cpu_size: 1.0\nlocal_disk: "file://{wd}/disk/"\n'
        "max_local_disk_size: 2.0\n"
    )
    os.environ["LMCACHE_CONFIG_FILE"] = str(cfg)
    model = wd / "tiny-llama"
    if not (model / "config.json").exists():
        from vllm_bsr.gpu_smoke import make_model  # plugins/ is on PYTHONPATH (gpu_check.py)

        make_model(model)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        max_model_len=4096,
        gpu_memory_utilization=0.2,
        enable_prefix_caching=False,
        enforce_eager=True,
        kv_transfer_config={
            "kv_connector": "BSRConnector",
            "kv_connector_module_path": "vllm_bsr.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"bsr_window_chunks": 2},
        },
    )
    prompt = TokensPrompt(prompt_token_ids=[(i * 7919) % 31999 + 1 for i in range(PROMPT_TOKENS)])
    sp = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    first = llm.generate([prompt], sp)[0]
    second = llm.generate([prompt], sp)[0]
    full = PROMPT_TOKENS // CHUNK * CHUNK
    facts |= {
        "prompt_tokens": PROMPT_TOKENS,
        "first_cached_tokens": first.num_cached_tokens,
        "second_cached_tokens": second.num_cached_tokens,
        "equal": list(first.outputs[0].token_ids) == list(second.outputs[0].token_ids),
    }
    print(json.dumps(facts), flush=True)
    ok = not first.num_cached_tokens and (second.num_cached_tokens or 0) >= full and facts["equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
