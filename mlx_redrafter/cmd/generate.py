"""`redrafter-mlx generate`: one completion per prompt, streamed, or as JSON records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from mlx_redrafter.cmd import common as c
from mlx_redrafter.errors import UserError


@c.one_line_errors
@c.with_decode_flags
def generate(
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="Prompt text."),
    prompts_file: Path | None = typer.Option(None, help="JSONL file, one {\"prompt\": ...} per line."),
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    drafter: str = typer.Option("default", help=c.DRAFTER_HELP),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most new tokens per prompt."),
    dtype: str = typer.Option("auto", help=c.DTYPE_HELP),
    chat: bool = typer.Option(True, "--chat/--raw", help="Wrap the prompt in the model's chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per prompt."),
    logprobs: int | None = typer.Option(None, "--logprobs", help="With --json: each token's log-probability under "
                                        "the target and this many likeliest alternatives (0-20)."),
    batch_size: int = typer.Option(1, "--batch-size", "-b", help="Prompts decoded together, sharing each target "
                                   "call (continuous batching; with --prompts-file). 1 = one at a time."),
    *,
    flags: dict,
) -> None:
    """Generate a completion, with speculative decoding unless --no-draft."""
    from mlx_redrafter import api
    from mlx_redrafter.generate import Stats
    from mlx_redrafter.prompts import read_prompts

    if (prompt is None) == (prompts_file is None):
        raise UserError("give exactly one of --prompt TEXT or --prompts-file F.jsonl")
    if logprobs is not None and not as_json:
        raise UserError("--logprobs needs --json: the log-probabilities are printed in the JSON records")
    res = c.resolve_options(model, drafter, dtype, flags, max_tokens=max_tokens, logprobs=logprobs)
    prompts = [prompt] if prompt is not None else [r["prompt"] for r in read_prompts(prompts_file)]
    lm = c.load_model(model, drafter, res)
    s = api.settings(lm, res.options)
    for note in c.decoding_notes(lm, res):
        typer.echo(f"note: {note}", err=True)
    if batch_size != 1:
        _generate_batch(lm, prompts, res, s, batch_size, chat, as_json)
        return
    for p in prompts:
        if as_json:
            typer.echo(_json_record(lm, p, api.generate(lm, p, res.options, chat=chat), res))
            continue
        stats = Stats()
        for r in api.stream_generate(lm, p, res.options, chat=chat):
            sys.stdout.write(r.text)
            sys.stdout.flush()
            if r.record is not None:
                stats.add(r.record)
        sys.stdout.write("\n")
        typer.echo(f"[{stats.generated_tokens} tokens, {stats.decode_tokens_per_s:.1f} tok/s, "
                   f"{stats.tokens_per_step:.2f} tokens/step, dtype={s['dtype']}, draft={s['draft']}, "
                   f"drafter={s['drafter']}]", err=True)


def _generate_batch(lm, prompts: list[str], res, s: dict, batch_size: int, chat: bool, as_json: bool) -> None:
    """Decode the prompts `batch_size` at a time; print each completion whole, in prompt order."""
    import time

    from mlx_redrafter import api

    if batch_size < 1 or batch_size > 256:
        raise UserError(f"--batch-size must be an integer from 1 to 256 (got {batch_size})")
    t = time.perf_counter()
    results = api.generate_batch(lm, prompts, res.options, batch_size=batch_size, chat=chat,
                                 curve=api.cost_curve(lm, min(batch_size, len(prompts)), res.options.copy_length))
    seconds = time.perf_counter() - t
    for p, out in zip(prompts, results):
        if as_json:
            typer.echo(_json_record(lm, p, out, res))
        else:
            typer.echo(out.text)
    tokens = sum(r.stats.generated_tokens for r in results)
    calls = sum(r.stats.steps for r in results)
    typer.echo(f"[{len(prompts)} prompts, {tokens} tokens in {seconds:.1f} s, {tokens / seconds:.1f} tok/s, "
               f"{(tokens - len(prompts)) / max(calls, 1):.2f} tokens per row and call, batch {batch_size}, "
               f"draft={s['draft']}]", err=True)


def _json_record(lm, prompt: str, out, res) -> str:
    """A completion as one JSON line: text, ids, settings, statistics (and log-probabilities when asked for)."""
    record = {"prompt": prompt, "text": out.text, "tokens": out.tokens, **out.settings, **out.stats.as_dict(),
              "settings_source": res.source, "settings_origin": res.origin}
    if out.logprobs is not None:
        text = lm.tokenizer.token_text
        record["logprobs"] = [{"token": e.token, "text": text(e.token), "logprob": e.logprob,
                               "top": [{"token": i, "text": text(i), "logprob": v} for i, v in e.top]}
                              for e in out.logprobs]
    return json.dumps(record)
