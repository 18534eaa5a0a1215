"""The prompt and store flags of `bsr probe` and `bsr explain`, each read once into a dataclass and passed down
whole (to the store probe, the explainer, the incident bundle) instead of argument by argument."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bsr_cli.core.store_probe import KeyFormatValue


@dataclass(frozen=True)
class PromptFlags:
    """The prompt as the command line gave it: exactly one of a token file, a text file or a synthetic length."""

    tokens_file: Path | None = None
    prompt_file: Path | None = None
    synthetic: int | None = None
    seed: int = 0

    def given(self) -> int:
        return sum(x is not None for x in (self.tokens_file, self.prompt_file, self.synthetic))

    def as_flags(self) -> str:
        """The flags that name this prompt again, for the next command a result suggests."""
        return shlex.join(self.as_args())

    def as_args(self) -> list[str]:
        """`as_flags` as an argument list."""
        if self.synthetic is not None:
            return ["--synthetic", str(self.synthetic), "--seed", str(self.seed)]
        if self.tokens_file is not None:
            return ["--tokens-file", str(self.tokens_file)]
        if self.prompt_file is not None:
            return ["--prompt-file", str(self.prompt_file)]
        return []


@dataclass(frozen=True)
class StoreProbeOptions:
    """Every --store flag of `bsr probe` and `bsr explain`, read once from the command line and passed down whole."""

    store: str
    model: str | None = None
    world_size: int = 1
    metadata: str | None = None
    admin: str | None = None
    dtype: str = "bf16"
    tags: tuple[str, ...] = ()
    vllm_hash_seed: str = "auto"
    chunk_size: int = 256
    verbose: bool = False

    def args(self, changes: Mapping[str, KeyFormatValue] | None = None) -> list[str]:
        """Every --store flag as parsed, with the fields in `changes` replaced (world_size, dtype, tags as
        KEY=VALUE items, vllm_hash_seed, chunk_size): what a suggested command passes so that it asks the same
        store, through the same endpoints, with only the differing key-format fields changed."""
        parsed: dict[str, KeyFormatValue] = {
            "world_size": self.world_size,
            "dtype": self.dtype,
            "tags": list(self.tags),
            "vllm_hash_seed": self.vllm_hash_seed,
            "chunk_size": self.chunk_size,
        }
        o = parsed | dict(changes or {})
        unknown = set(o) - {"world_size", "dtype", "tags", "vllm_hash_seed", "chunk_size"}
        if unknown:
            raise ValueError(f"not a key-format field: {sorted(unknown)}")
        out = ["--store", self.store]
        if self.metadata:
            out += ["--metadata", self.metadata]
        if self.admin:
            out += ["--master-admin", self.admin]
        if self.model:
            out += ["--model", self.model]
        out += ["--world-size", str(o["world_size"]), "--dtype", str(o["dtype"])]
        tags = o["tags"]
        for t in tags if isinstance(tags, list) else [tags]:
            out += ["--tag", str(t)]
        out += ["--vllm-hash-seed", str(o["vllm_hash_seed"]), "--chunk-size", str(o["chunk_size"])]
        return out

    def command(self, verb: str, prompt: PromptFlags, changes: Mapping[str, KeyFormatValue] | None = None) -> str:
        """A whole `bsr probe|explain --store ...` command line for this store and prompt (shell-quoted)."""
        if verb not in ("probe", "explain"):
            raise ValueError(f"--store is an option of `bsr probe` and `bsr explain`, not of `bsr {verb}`")
        return shlex.join(["bsr", verb, *self.args(changes), *prompt.as_args()])
