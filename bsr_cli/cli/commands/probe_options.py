"""The prompt and store flags of `bsr probe` and `bsr explain`, each read once into a dataclass and passed down
whole (to the store probe, the explainer, the incident bundle) instead of argument by argument."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
        if self.synthetic is not None:
            return f"--synthetic {self.synthetic} --seed {self.seed}"
        if self.tokens_file is not None:
            return f"--tokens-file {self.tokens_file}"
        if self.prompt_file is not None:
            return f"--prompt-file {self.prompt_file}"
        return ""


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

    def key_flags(self) -> str:
        """The flags that fix the key format, for the next command a result suggests."""
        tags = "".join(f" --tag {t}" for t in self.tags)
        return f"--model {self.model} --world-size {self.world_size} --dtype {self.dtype}{tags}"
