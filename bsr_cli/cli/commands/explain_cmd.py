"""`bsr explain`: why a prompt was (not) reused, or why a request's restore failed, in one verdict with its
evidence chain and the next command to run. The facts are gathered here; bsr_cli.core.explain joins them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from bsr_cli.cli.commands.operate import PromptFileOpt, SeedOpt, SyntheticOpt, TokensFileOpt, WOpt
from bsr_cli.cli.commands.probe_options import PromptFlags, StoreProbeOptions
from bsr_cli.cli.context import AppState, JsonFlag, state
from bsr_cli.errors import EngineError, InvalidInput

if TYPE_CHECKING:
    from bsr_cli.core.bitmap import HitBitmap
    from bsr_cli.core.explain import Explanation


def explain(
    ctx: typer.Context,
    request: Annotated[
        str | None,
        typer.Argument(
            help="A request id (req-...): why its restore ended as it did.", metavar="REQ", show_default=False
        ),
    ] = None,
    tokens_file: TokensFileOpt = None,
    prompt_file: PromptFileOpt = None,
    synthetic: SyntheticOpt = None,
    seed: SeedOpt = 0,
    w: WOpt = None,
    store: Annotated[
        str | None,
        typer.Option("--store", help="Explain from a Mooncake store LMCache wrote: mooncake://HOST:PORT (no engine)."),
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="With --store: model name in the keys.")] = None,
    world_size: Annotated[
        int, typer.Option("--world-size", "--tp", help="With --store: TP world size in the keys.")
    ] = 1,
    dtype: Annotated[str, typer.Option("--dtype", help="With --store: KV dtype in the keys.")] = "bf16",
    tag: Annotated[list[str] | None, typer.Option("--tag", help="With --store: a request tag KEY=VALUE.")] = None,
    vllm_hash_seed: Annotated[
        str, typer.Option("--vllm-hash-seed", help="With --store: vLLM's PYTHONHASHSEED, 'none' or 'auto'.")
    ] = "auto",
    metadata: Annotated[str | None, typer.Option("--metadata", help="With --store: metadata server URL.")] = None,
    master_admin: Annotated[str | None, typer.Option("--master-admin", help="With --store: master admin URL.")] = None,
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="With --store: LMCache chunk size.", min=1)] = 256,
    json_flag: JsonFlag = False,
) -> None:
    """Why a prompt was not reused (or will be): one verdict, the evidence, the fix and the next command.

    Joins the probe (which tier holds which prefix on which rank, where and why it breaks), force-local markers,
    armed faults, rank and tier health, W against the budget B, and the last restore of the prompt per rank and
    window. With --store it asks a Mooncake store LMCache wrote, naming a key-format mismatch (world size, dtype,
    tags, vLLM hash seed) or a gone segment holder. With a request id it explains how that restore ended.
    """
    from bsr_cli.cli.render import ops as render_ops

    st = state(ctx, json_flag)
    prompt = PromptFlags(tokens_file, prompt_file, synthetic, seed)
    _check_subject(request, prompt.given(), store)
    flags = prompt.as_flags()
    if store is not None:
        from bsr_cli.cli.commands import store_probe
        from bsr_cli.core.explain import explain_store

        opts = StoreProbeOptions(
            store,
            model=model,
            world_size=world_size,
            metadata=metadata,
            admin=master_admin,
            dtype=dtype,
            tags=tuple(tag or ()),
            vllm_hash_seed=vllm_hash_seed,
            chunk_size=chunk_size,
        )
        data = store_probe.collect(st, opts, prompt, None)
        result = explain_store(
            prompt="",
            prompt_flags=flags,
            store=data,
            command=lambda verb, changes: opts.command(verb, prompt, changes),
        )
    elif request is not None:
        result = _explain_request(st, request)
    else:
        result = _explain_prompt(st, tokens_file, prompt_file, synthetic, seed, w, flags)
    st.out.result(result, render_ops.explain)


def _check_subject(request: str | None, prompts_given: int, store: str | None) -> None:
    """One subject: a request id, or one prompt (which --store reads from a Mooncake store)."""
    if request is not None and prompts_given:
        raise InvalidInput(
            "give a request id or a prompt (--tokens-file/--prompt-file/--synthetic), not both",
            hint="`bsr explain REQ`: how a request ended; `bsr explain --synthetic N`: why a prompt is (not) reused",
        )
    if request is None and prompts_given != 1:
        raise InvalidInput(
            "give a request id, or exactly one of --tokens-file, --prompt-file or --synthetic N",
            hint="e.g. `bsr explain req-00012` or `bsr explain --synthetic 65536 --seed 1`",
        )
    if store is not None and request is not None:
        raise InvalidInput(
            "--store explains a prompt, not a request id",
            hint="explain the prompt with --tokens-file, or drop --store to explain a request on an engine",
        )


def _explain_prompt(
    st: AppState,
    tokens_file: Path | None,
    prompt_file: Path | None,
    synthetic: int | None,
    seed: int,
    w: int | None,
    flags: str,
) -> Explanation:
    from bsr_cli.client import AdminClient
    from bsr_cli.core.evidence import EventKind
    from bsr_cli.core.explain import explain_engine, fold_restore
    from bsr_cli.core.keys import prompt_hash
    from bsr_cli.prompts import prompt_body

    with AdminClient.from_settings(st.settings) as client:
        info = client.info()
        tokenizer = info.tokenizer if prompt_file is not None else None
        body = prompt_body(tokens_file, prompt_file, synthetic, seed, tokenizer)
        tokens = body.token_ids()
        prompt = prompt_hash(tokens)
        health = client.health()
        registration = client.registration()
        bitmap: HitBitmap | None = None
        probe_error = None
        try:
            bitmap = client.probe(body).bitmap
        except EngineError as e:
            if health.ok:
                raise
            probe_error = e.message  # a rank is down: the probe cannot run, the verdict says why
        markers = client.markers()
        faults = client.faults().faults
        # The prompt's last restore, from the engine's event store: its start, then every event of that request.
        starts = (EventKind.RESTORE_STARTED.value, EventKind.REQUEST_ADMITTED.value)
        found = client.events(prompt=prompt, kinds=starts, limit=1, newest=True).events
        if not found:
            # A vLLM worker's loads stand for a prefix of the prompt (their key hashes the first prefix_tokens
            # tokens): look among the recent starts for one this prompt begins with.
            recent = client.events(kinds=starts, limit=500, newest=True).events
            found = [e for e in recent if _covers(e.get("prompt"), e.get("prefix_tokens"), tokens, prompt)]
        last_events = client.held_events(0, request=str(found[-1]["request"]))[0] if found else []
    # A vLLM worker's marker stands for a prefix: one this prompt starts with is this prompt's marker. It keeps
    # its own id (the one `bsr markers list`, `status` and the events show).
    covering = {m.prompt for m in markers if _covers(m.prompt, m.host_fields.get("prefix_tokens"), tokens, prompt)}
    last = fold_restore(last_events) if last_events else None
    result = explain_engine(
        prompt=prompt,
        prompt_flags=flags,
        registration=registration,
        bitmap=bitmap,
        probe_error=probe_error,
        n_tokens=len(tokens),
        info=info,
        health=health,
        markers=markers,
        faults=faults,
        w=w,
        last_restore=last,
        covering=covering,
    )
    return dataclasses.replace(result, url=client.url)


def _covers(key: object, prefix_tokens: object, tokens: list[int], prompt: str) -> bool:
    """Whether a marker or a restore keyed by ``key`` stands for this prompt: keyed by the whole prompt, or (a vLLM
    worker's, which stand for a prefix: any prompt starting with it) by the hash of its first ``prefix_tokens``
    tokens."""
    from bsr_cli.core.keys import prompt_hash

    if key == prompt:
        return True
    n = prefix_tokens
    return isinstance(n, int) and 0 < n <= len(tokens) and prompt_hash(tokens[:n]) == key


def _explain_request(st: AppState, request: str) -> Explanation:
    from bsr_cli.client import AdminClient
    from bsr_cli.core.explain import explain_request

    with AdminClient.from_settings(st.settings) as client:
        events, _ = client.held_events(0, request=request)
        health = client.health()
        markers = client.markers()
    mine = events
    if not mine:
        raise InvalidInput(
            f"no events of request {request!r} on {client.url}",
            hint="`bsr events --since 1d --kind restore_started` lists recent requests; the engine keeps events "
            "for its retention (7 days / 512 MiB by default)",
        )
    result = explain_request(mine, health=health, markers=markers)
    return dataclasses.replace(result, url=client.url)
