"""Why a store probe matched nothing, from a key listing alone: the closest group of the model's keys and the flag
that asks for it, a chain start no candidate gives, a model the store never saw. What a real store lists is
tests/cli/test_store_probe.py's; keys real LMCache wrote, tests/plugins/test_lmcache_store_keys.py's."""

from __future__ import annotations

from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.core.lmcache_keys import lmcache_chunk_hashes, lmcache_key, parse_lmcache_key, vllm_seeded_start
from bsr_cli.core.store_diagnosis import changes_as_flags, diagnose, unknown_start_chunks
from bsr_cli.core.store_match import KeyFormat, hash_starts
from bsr_cli.core.store_probe import Diagnosis

TOKENS = synthetic_tokens(3 * 256, 22)


def _chains(tokens: list[int] = TOKENS) -> dict[str, set[str]]:
    """The prompt's chunk hashes (hex) under every start auto tries."""
    return {
        label: {f"{h:x}" for h in lmcache_chunk_hashes(tokens, 256, s)} for label, s in hash_starts("auto", own_seed="")
    }


def _diagnose(keys: list[str], fmt: KeyFormat, start: str = "none", *, auto: bool = True) -> Diagnosis:
    return diagnose(keys, fmt, start, _chains(), auto=auto, tokens=TOKENS, chunk_size=256)


def test_the_closest_group_names_the_one_flag_that_differs() -> None:
    held = [lmcache_key("mix/model", 2, w, h, "bfloat16") for w in (0, 1) for h in lmcache_chunk_hashes(TOKENS)]
    other = [lmcache_key("mix/model", 1, 0, h, "fp8_e4m3fn") for h in lmcache_chunk_hashes(synthetic_tokens(768, 23))]
    d = _diagnose(other + held, KeyFormat("mix/model", 1, "fp8_e4m3fn", ()))
    assert (d.keys_listed, d.keys_for_model, d.closest) == (9, 9, 0)
    best = d.groups[0]
    assert (best.world_size, best.dtype, best.prompt_chunks_held, best.workers) == (2, "bfloat16", 3, [0, 1])
    assert best.differs_in == ["world_size", "dtype"] and best.changes == {"world_size": 2, "dtype": "bf16"}
    assert d.causes[0].endswith("pass --world-size 2 and --dtype bf16"), d.causes
    assert d.causes[1].startswith("keys of 'mix/model' are mixed: 2 groups (world size 2, dtype bfloat16, no tags")
    fp8 = d.groups[1]
    assert fp8.prompt_chunks_held == 0 and fp8.differs_in == [] and fp8.flags == []


def test_an_explicit_wrong_seed_is_named_but_auto_finds_it_itself() -> None:
    seeded = lmcache_chunk_hashes(TOKENS, 256, vllm_seeded_start("42"))
    keys = [lmcache_key("m", 1, 0, h, "half", (("user", "alice"),)) for h in seeded]
    fmt = KeyFormat("m", 1, "half", (("user", "alice"),))
    explicit = _diagnose(keys, fmt, "none", auto=False)
    assert explicit.groups[0].differs_in == ["hash_start"] and explicit.groups[0].vllm_hash_seed == "42"
    assert explicit.causes[0].endswith("pass --vllm-hash-seed 42")
    assert _diagnose(keys, fmt, "none", auto=True).causes[0].startswith("the keys match (world size 1, dtype half")
    untagged = _diagnose(keys, KeyFormat("m", 1, "half", ()))
    assert untagged.causes[0].endswith("pass --tag user=alice"), untagged.causes


def test_a_start_no_candidate_gives_is_found_by_following_the_chain() -> None:
    unknown = lmcache_chunk_hashes(TOKENS, 256, vllm_seeded_start("999"))
    keys = [lmcache_key("m", 1, 0, h, "bfloat16") for h in unknown]
    d = _diagnose(keys, KeyFormat("m", 1, "bfloat16", ()))
    assert d.groups[0].prompt_chunks_held == 0 and d.groups[0].unknown_start_chunks == 3
    assert "under a hash chain start that none of the vLLM hash seeds tried gives" in d.causes[0]
    # Only the first two chunks held: the chain is followed as far as it goes; one chunk confirms nothing.
    parsed = [p for p in (parse_lmcache_key(k) for k in keys[:2]) if p is not None]
    assert unknown_start_chunks(parsed, TOKENS, 256) == 2
    assert unknown_start_chunks(parsed, TOKENS[:300], 256) == 0


def test_a_store_without_the_model_or_without_lmcache_keys_says_so() -> None:
    keys = [lmcache_key("other/model", 1, 0, h, "bfloat16") for h in lmcache_chunk_hashes(TOKENS)]
    d = _diagnose(keys, KeyFormat("mine", 1, "bfloat16", ()))
    assert d.causes == ["the store holds no keys for model 'mine'; it holds: other/model (3)"] and d.closest is None
    empty = _diagnose(["not-a-key", "m@1@0@ab@bfloat16@7"], KeyFormat("m", 1, "bfloat16", ()))  # a layerwise key
    assert empty.keys_listed == 2 and empty.causes[0].startswith("the store holds no LMCache-format keys at all")


def test_flags_quote_tags_and_drop_them_when_the_group_has_none() -> None:
    changes = {"world_size": 4, "dtype": "fp16", "tags": ["user=a b"], "vllm_hash_seed": "42"}
    assert changes_as_flags(changes) == ["--world-size 4", "--dtype fp16", "--tag 'user=a b'", "--vllm-hash-seed 42"]
    assert changes_as_flags({"tags": []}) == ["drop --tag"]
