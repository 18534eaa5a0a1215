from __future__ import annotations

import pytest

from bsr_cli.core.hf_config import registration_from_hf_config
from bsr_cli.core.registration import Registration, diff_registrations
from bsr_cli.errors import InvalidInput
from bsr_cli.loaders import builtin_registration

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
}
GEMMA_LIKE = {
    "hidden_size": 2048,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}


def _minimal(**over):
    d = {
        "model": "m",
        "tp_size": 1,
        "groups": [{"name": "g", "block_size": 16}],
        "tensors": [{"name": "t0", "dtype": "bf16", "shape": [2, 8, 128], "group": "g"}],
    }
    d.update(over)
    return d


def test_llama_gqa_split_over_tp() -> None:
    reg = registration_from_hf_config(LLAMA_8B, tp=2)
    assert len(reg.tensors) == 32
    # 2 (K,V) × 4 heads per rank × 128 dim × 2 bytes × 256 tokens × 32 layers
    assert reg.bytes_per_chunk == 2 * 4 * 128 * 2 * 256 * 32
    assert reg.group_names == ("full_attention",)


def test_kv_heads_fewer_than_ranks_are_replicated() -> None:
    reg = registration_from_hf_config(LLAMA_8B | {"num_key_value_heads": 1}, tp=4)
    assert reg.tensors[0].shape == (2, 1, 128)


def test_deepseek_mla_latent_and_mtp() -> None:
    off = registration_from_hf_config(DEEPSEEK_V3, tp=2, dtype="fp8")
    on = registration_from_hf_config(DEEPSEEK_V3, tp=2, dtype="fp8", include_mtp=True)
    assert off.tensors[0].shape == (576,)
    assert off.bytes_per_chunk == 576 * 256 * 61  # latent is not split by TP
    assert len(on.tensors) == 62
    d = diff_registrations(off, on)
    assert len(d.added) == 1 and d.bytes_per_chunk[1] - d.bytes_per_chunk[0] == 576 * 256


def test_layer_types_become_groups() -> None:
    reg = registration_from_hf_config(GEMMA_LIKE)
    assert reg.group_names == ("sliding_attention", "full_attention")
    assert len(reg.tensors_of("full_attention")) == 2


def test_identity_is_stable_and_sensitive() -> None:
    a = Registration.from_dict(_minimal())
    assert a.identity == Registration.from_dict(_minimal()).identity
    assert a.identity != Registration.from_dict(_minimal(chunk_size=128)).identity
    # dtype spellings are canonical
    alias = _minimal(tensors=[{"name": "t0", "dtype": "bfloat16", "shape": [2, 8, 128], "group": "g"}])
    assert a.identity == Registration.from_dict(alias).identity


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"tensors": []}, "no tensors"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 100}, "not a multiple"),
        ({"tensors": [{"name": "t", "dtype": "int4", "shape": [1], "group": "g"}]}, "unknown dtype"),
        ({"tensors": [{"name": "t", "dtype": "bf16", "shape": [1], "group": "nope"}]}, "unknown group"),
        ({"tensors": [{"name": "t", "dtype": "bf16", "shape": [1 << 30, 1 << 20], "group": "g"}]}, "absurd"),
        ({"tensors": [{"name": "t", "dtype": "bf16", "group": "g"}]}, "needs 'shape'"),
        ({"tp_size": -2}, "tp_size"),
    ],
)
def test_bad_registrations(override, message) -> None:
    with pytest.raises(InvalidInput, match=message):
        Registration.from_dict(_minimal(**override))


def test_builtin_paper_diff() -> None:
    d = diff_registrations(builtin_registration("paper-mtp-off"), builtin_registration("paper-mtp-on"))
    assert len(d.added) == 3 and not d.removed and not d.changed
