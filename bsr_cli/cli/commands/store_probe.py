"""`bsr probe --store mooncake://HOST:PORT`: which ranks of a real LMCache deployment hold which chunks of a prompt,
asked of the Mooncake store directly (no engine), whether the processes holding them are still alive, and why
nothing matches when nothing does.

The command reads its flags into a query (bsr_cli.core.store_match: the key format, the hash chain starts to try),
hands it to the probe (bsr_cli.mooncake.store_probe: the store's and the holders' answers, made into the result by
the core) and renders the result. Only the standard library and Mooncake's client are imported on this path: a probe
is typed during an incident."""

from __future__ import annotations

import os
from typing import Any

from bsr_cli.cli import process_exit
from bsr_cli.cli.commands.probe_options import PromptFlags, StoreProbeOptions
from bsr_cli.cli.context import AppState
from bsr_cli.core.store_match import store_query
from bsr_cli.core.store_probe import StoreProbe
from bsr_cli.errors import InvalidInput
from bsr_cli.loaders import read_tokens_file
from bsr_cli.mooncake.store_probe import probe_store


def run(st: AppState, opts: StoreProbeOptions, prompt: PromptFlags, width: int | None) -> None:
    st.out.result(collect(st, opts, prompt, width), _render)


def _render(console: Any, d: StoreProbe) -> None:
    from bsr_cli.cli.render import ops as render_ops  # rich: only for text output

    render_ops.store_probe(console, d)


def collect(st: AppState, opts: StoreProbeOptions, prompt: PromptFlags, width: int | None) -> StoreProbe:
    """The store probe's result: bitmap (live holders only), key format, liveness and (on a miss) the diagnosis."""
    query = store_query(
        opts.store,
        model=opts.model,
        world_size=opts.world_size,
        metadata=opts.metadata,
        admin=opts.admin,
        dtype=opts.dtype,
        tags=opts.tags,
        vllm_hash_seed=opts.vllm_hash_seed,
        chunk_size=opts.chunk_size,
        own_seed=os.environ.get("PYTHONHASHSEED", ""),
    )
    return probe_store(
        query,
        lambda: _tokens(prompt),
        timeout_s=st.settings.timeout_s,
        verbose=opts.verbose,
        width=width,
        leave_open=process_exit.leave_open,
    )


def _tokens(prompt: PromptFlags) -> list[int]:
    """The prompt's token ids from its flags: a token file or a synthetic prompt (a text file cannot be tokenized)."""
    if prompt.given() != 1:
        raise InvalidInput(
            "give exactly one of --tokens-file, --prompt-file or --synthetic N", hint="e.g. --tokens-file prompt.json"
        )
    if prompt.prompt_file is not None:
        raise InvalidInput(
            "--store needs token ids (--tokens-file): bsr cannot reproduce your model's tokenizer",
            hint="write the prompt's token ids (from your tokenizer) to a file and pass --tokens-file",
        )
    if prompt.synthetic is not None:
        from bsr_cli.core.keys import synthetic_tokens

        return synthetic_tokens(prompt.synthetic, prompt.seed)
    assert prompt.tokens_file is not None
    return read_tokens_file(prompt.tokens_file)


__all__ = ["collect", "run"]
