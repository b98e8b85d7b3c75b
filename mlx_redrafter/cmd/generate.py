"""`redrafter-mlx generate`: one completion per prompt, streamed, or as JSON records."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import typer

from mlx_redrafter.cmd import common as c
from mlx_redrafter.errors import UserError


@c.one_line_errors
def generate(
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="Prompt text."),
    prompts_file: Path | None = typer.Option(None, help="JSONL file, one {\"prompt\": ...} per line."),
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    drafter: str = typer.Option("default", help=c.DRAFTER_HELP),
    draft: str | None = c.Draft,
    no_draft: bool = c.NoDraft,
    beam_width: int | None = c.BeamWidth,
    beam_length: int | None = c.BeamLength,
    lookup_width: int | None = c.LookupWidth,
    lookup: str = c.Lookup,
    answers_width: int = c.AnswersWidth,
    drafter_vocab: int | None = c.DrafterVocab,
    lookup_max_length: int = c.LookupMaxLength,
    medusa_tree: str | None = c.MedusaTree,
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most new tokens per prompt."),
    dtype: str = typer.Option("auto", help=c.DTYPE_HELP),
    temp: float = c.Temp, top_p: float = c.TopP, top_k: int = c.TopK, min_p: float = c.MinP,
    seed: int | None = c.Seed, accept: str = c.Accept, typical_eps: float = c.TypicalEps,
    typical_delta: float = c.TypicalDelta,
    chat: bool = typer.Option(True, "--chat/--raw", help="Wrap the prompt in the model's chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per prompt."),
) -> None:
    """Generate a completion, with speculative decoding unless --no-draft."""
    from mlx_redrafter import api, tuning
    from mlx_redrafter.generate import Stats
    from mlx_redrafter.prompts import read_prompts
    from mlx_redrafter.sampling import Sampling

    if (prompt is None) == (prompts_file is None):
        raise UserError("give exactly one of --prompt TEXT or --prompts-file F.jsonl")
    sampling = Sampling(temp, top_p, top_k, min_p, seed, accept, typical_eps, typical_delta)
    base = api.DecodeOptions(lookup=lookup, answers_width=answers_width, drafter_vocab=drafter_vocab,
                             lookup_max_length=lookup_max_length,
                             max_tokens=max_tokens, sampling=sampling)
    res = tuning.resolve(model, drafter, c.decode_flags(draft, no_draft, beam_width, beam_length, lookup_width,
                                                         medusa_tree),
                         dtype, base)
    res.options.check()
    prompts = [prompt] if prompt is not None else [r["prompt"] for r in read_prompts(prompts_file)]
    need_drafter = "rnn" in res.options.draft or res.options.draft in ("auto", "medusa", "semi_ar")
    runner = api.load(model, drafter if need_drafter else "none", res.dtype)
    if res.options.draft == "auto":
        from mlx_redrafter.chat import drafting_fallback

        note = drafting_fallback(runner, res.options)[1]
        if note:
            typer.echo(note, err=True)
    for p in prompts:
        if as_json:
            out = api.generate(runner, p, res.options, chat=chat)
            typer.echo(json.dumps({"prompt": p, "text": out.text, "tokens": out.tokens, **out.settings,
                                   **out.stats.as_dict(), "settings_source": res.source}))
            continue
        stats = Stats()
        for piece, _ in api.stream_generate(runner, p, res.options, chat=chat, stats=stats):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        s = api.settings(runner, replace(res.options))
        typer.echo(f"[{stats.generated_tokens} tokens, {stats.decode_tokens_per_s:.1f} tok/s, "
                   f"{stats.tokens_per_step:.2f} tokens/step, dtype={s['dtype']}, draft={s['draft']}, "
                   f"drafter={s['drafter']}]", err=True)
