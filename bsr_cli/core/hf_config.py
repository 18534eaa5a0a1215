"""Derive a registration from a Hugging Face ``config.json`` (already parsed into a dict).

Covers the families operators run behind vLLM + LMCache:

* GQA/MHA (Llama, Mistral, Qwen2/3, ...): one tensor per layer holding K and V, per-token shape
  ``(2, kv_heads_per_rank, head_dim)``. KV heads are split across TP ranks; when there are fewer KV heads than
  ranks each rank keeps one replica (what vLLM does).
* MLA (DeepSeek-V2/V3): one latent tensor per layer, shape ``(kv_lora_rank + qk_rope_head_dim,)``, replicated on
  every rank (the latent is not sharded by TP).
* Separate layer groups: ``layer_types`` (e.g. ``sliding_attention`` / ``full_attention``) or Qwen2's
  ``use_sliding_window`` + ``max_window_layers`` put layers in one KV group per kind, as vLLM's hybrid allocator does.
* Extra layers: ``include_mtp`` adds ``num_nextn_predict_layers`` MTP layers (DeepSeek) with the same layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bsr_cli.core.registration import DEFAULT_CHUNK_SIZE, KVGroup, Registration, TensorSpec
from bsr_cli.core.units import canonical_dtype
from bsr_cli.errors import InvalidInput


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise InvalidInput(f"config.json has no {key!r}", hint="is this a decoder model's config.json?")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInput(
            f"config.json: {key} must be a positive integer, got {value!r}",
            hint="is this a decoder model's config.json?",
        )
    return value


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    # Multimodal configs nest the language model's settings.
    inner = cfg.get("text_config")
    return inner if isinstance(inner, Mapping) else cfg


def registration_from_hf_config(
    config: Mapping[str, Any],
    *,
    tp: int = 1,
    dtype: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    block_size: int | None = None,
    include_mtp: bool = False,
    model: str | None = None,
    source: str = "",
) -> Registration:
    if not isinstance(config, Mapping):
        raise InvalidInput("config.json must hold an object", hint="give the model's config.json (a JSON object)")
    cfg = _text_config(config)
    if tp <= 0:
        raise InvalidInput(f"--tp must be positive, got {tp}", hint="e.g. --world-size 2")
    kv_dtype = canonical_dtype(dtype or str(cfg.get("torch_dtype") or config.get("torch_dtype") or "bf16"))
    name = model or str(config.get("_name_or_path") or (config.get("architectures") or ["model"])[0])
    layers = _int(cfg, "num_hidden_layers")
    is_mla = cfg.get("kv_lora_rank") is not None

    if is_mla:
        width = _int(cfg, "kv_lora_rank") + _int(cfg, "qk_rope_head_dim")
        shape: tuple[int, ...] = (width,)
        default_block = 64  # vLLM's MLA backends page in 64-token blocks
    else:
        heads = _int(cfg, "num_attention_heads")
        kv_heads = _int(cfg, "num_key_value_heads", heads)
        head_dim = cfg.get("head_dim") or _int(cfg, "hidden_size") // heads
        if kv_heads % tp and tp % kv_heads:
            raise InvalidInput(
                f"{kv_heads} KV heads cannot be split over tp={tp}",
                hint=f"give a --world-size that divides the {kv_heads} KV heads (or that they divide)",
            )
        shape = (2, max(1, kv_heads // tp), int(head_dim))
        default_block = 16

    kinds = _layer_kinds(cfg, layers)
    extra_layers = int(cfg.get("num_nextn_predict_layers") or 0) if include_mtp else 0
    if include_mtp and not extra_layers:
        raise InvalidInput(
            "config.json declares no MTP layers (num_nextn_predict_layers)",
            hint="drop --mtp: this model has no multi-token-prediction layers",
        )

    bs = block_size or default_block
    group_names = list(dict.fromkeys(kinds))
    tensors = [
        TensorSpec(name=f"model.layers.{i}.self_attn.attn", dtype=kv_dtype, shape=shape, group=kinds[i])
        for i in range(layers)
    ]
    tensors += [
        TensorSpec(name=f"model.layers.{layers + j}.mtp.attn", dtype=kv_dtype, shape=shape, group=group_names[-1])
        for j in range(extra_layers)
    ]
    return Registration(
        model=name,
        tp_size=tp,
        chunk_size=chunk_size,
        groups=tuple(KVGroup(g, bs) for g in group_names),
        tensors=tuple(tensors),
        source=source,
    )


def _layer_kinds(cfg: Mapping[str, Any], layers: int) -> list[str]:
    """The KV group of every layer: one group per attention kind."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        if len(types) != layers:
            raise InvalidInput(
                f"config.json: layer_types has {len(types)} entries for {layers} layers",
                hint="the config.json is inconsistent: check layer_types against num_hidden_layers",
            )
        return [str(t) for t in types]
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        # Qwen2: layers from max_window_layers on use sliding-window attention.
        cut = int(cfg.get("max_window_layers") or 0)
        return ["full_attention" if i < cut else "sliding_attention" for i in range(layers)]
    return ["full_attention"] * layers
