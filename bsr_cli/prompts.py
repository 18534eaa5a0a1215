"""Where a prompt's tokens come from: a token file, a text file tokenized as the engine does, or a synthetic
prompt (which the engine generates itself, so nothing large crosses the wire)."""

from __future__ import annotations

from pathlib import Path

from bsr_cli.core.prompt import Prompt
from bsr_cli.errors import InvalidInput
from bsr_cli.loaders import read_tokens_file

# Tokenizers a bsr engine may report in /info; the embedded engine uses one token per UTF-8 byte.
TOKENIZERS = {"bytes": lambda text: list(text.encode())}


def prompt_body(
    tokens_file: Path | None,
    prompt_file: Path | None,
    synthetic: int | None,
    seed: int,
    tokenizer: str | None = None,
) -> Prompt:
    given = [x is not None for x in (tokens_file, prompt_file, synthetic)]
    if sum(given) != 1:
        raise InvalidInput(
            "give exactly one of --tokens-file, --prompt-file or --synthetic N",
            hint="e.g. --synthetic 65536 --seed 1, or --tokens-file prompt.json",
        )
    if synthetic is not None:
        if synthetic <= 0:
            raise InvalidInput("--synthetic needs a positive token count", hint="e.g. --synthetic 65536")
        return Prompt.synthetic_of(synthetic, seed)
    if tokens_file is not None:
        return Prompt.of_tokens(read_tokens_file(tokens_file))
    assert prompt_file is not None
    fn = TOKENIZERS.get(tokenizer or "")
    if fn is None:
        raise InvalidInput(
            f"the engine tokenizes with {tokenizer!r}, which bsr cannot reproduce",
            hint="pass --tokens-file with the engine's token ids instead",
        )
    try:
        text = prompt_file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInput(
            f"cannot read prompt file {prompt_file}: {e}", hint="give a readable UTF-8 text file"
        ) from None
    if not text:
        raise InvalidInput(f"prompt file {prompt_file} is empty", hint="give a file with the prompt's text")
    return Prompt.of_tokens(fn(text))
