"""A prompt as an engine is asked about it (probe, submit, restore): its token ids, or a synthetic prompt the engine
generates itself from a length and a seed, so nothing large crosses the wire.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bsr_cli.core import wire
from bsr_cli.core.keys import synthetic_tokens


@dataclass(frozen=True)
class SyntheticPrompt:
    """``n`` tokens the engine generates from ``seed`` (one seed's prompts are prefixes of each other)."""

    n: int
    seed: int

    to_wire = wire.writer()


@dataclass(frozen=True)
class Prompt:
    """Exactly one of: the token ids, or the synthetic prompt. Its wire form is the part of a request body that
    names the prompt (``{"tokens": [...]}`` or ``{"synthetic": {"n": .., "seed": ..}}``)."""

    tokens: tuple[int, ...] | None = wire.field(omit_none=True, default=None)
    synthetic: SyntheticPrompt | None = wire.field(omit_none=True, default=None)

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.synthetic is None):
            raise ValueError("a prompt is its tokens or a synthetic prompt, exactly one")

    @classmethod
    def of_tokens(cls, tokens: Sequence[int]) -> Prompt:
        return cls(tokens=tuple(tokens))

    @classmethod
    def synthetic_of(cls, n: int, seed: int) -> Prompt:
        return cls(synthetic=SyntheticPrompt(n, seed))

    def token_ids(self) -> list[int]:
        """The prompt's token ids (a synthetic prompt's, as the engine generates them)."""
        if self.synthetic is not None:
            return synthetic_tokens(self.synthetic.n, self.synthetic.seed)
        return list(self.tokens or ())

    to_wire = wire.writer()


__all__ = ["Prompt", "SyntheticPrompt"]
