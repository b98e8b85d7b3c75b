"""`redrafter-mlx` command line: generate, chat (and, from other modules, train / bench / tune)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from .errors import UserError
from .prompts import read_prompts

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Exact ReDrafter speculative decoding in pure MLX.")

MODEL_HELP = "Target model: a .gguf file, an mlx-lm directory, a HF repo id or alias (default: embedded SmolLM2-135M)."
DRAFTER_HELP = "Drafter: 'default' (shipped for the model), a directory, or random:SEED."
DTYPE_HELP = "float32 | float16 | bfloat16 | quantized | auto (auto = float32 on CPU, quantized/float16 on GPU)."
BEAM_W_HELP = "Beam width W [tuned for this machine by `redrafter-mlx tune`, else 4]."
BEAM_L_HELP = "Beam length L, first token + drafts [tuned, else 5]."


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _result_json(res, prompt: str) -> dict:
    return {
        "prompt": prompt, "text": res.text, "tokens": res.tokens, **res.settings, **res.stats.as_dict(),
    }


@app.command()
def generate(
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="Prompt text."),
    prompts_file: Path | None = typer.Option(None, help="JSONL file, one {\"prompt\": ...} per line."),
    model: str | None = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    drafter: str = typer.Option("default", help=DRAFTER_HELP),
    no_draft: bool = typer.Option(False, "--no-draft", help="Plain autoregressive decoding."),
    beam_width: int | None = typer.Option(None, "--beam-width", "-w", help=BEAM_W_HELP),
    beam_length: int | None = typer.Option(None, "--beam-length", "-l", help=BEAM_L_HELP),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n"),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    chat: bool = typer.Option(True, "--chat/--raw", help="Wrap the prompt in the model's chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per prompt."),
) -> None:
    """Generate a completion (greedy), with speculative decoding unless --no-draft."""
    from . import api, tuning

    try:
        if (prompt is None) == (prompts_file is None):
            raise UserError("give exactly one of --prompt TEXT or --prompts-file F.jsonl")
        dec = tuning.resolve(model, drafter, beam_width, beam_length, dtype, no_draft)
        if not dec.no_draft:
            api.check_beam(dec.beam_width, dec.beam_length)
        prompts = [prompt] if prompt is not None else [r["prompt"] for r in read_prompts(prompts_file)]
        runner = api.load(model, None if dec.no_draft else drafter, dec.dtype)
        for p in prompts:
            kw = dict(max_tokens=max_tokens, beam_width=dec.beam_width, beam_length=dec.beam_length,
                      chat=chat, no_draft=dec.no_draft or runner.drafter is None)
            if as_json:
                res = api.generate(runner, p, **kw)
                typer.echo(json.dumps({**_result_json(res, p), "settings_source": dec.source}))
            else:
                from .decode import Stats

                stats = Stats()
                for piece, _ in api.stream_generate(runner, p, stats=stats, **kw):
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                sys.stdout.write("\n")
                used = "none" if kw["no_draft"] else runner.drafter_name
                typer.echo(
                    f"[{stats.generated_tokens} tokens, {stats.decode_tokens_per_s:.1f} tok/s, "
                    f"{stats.tokens_per_step:.2f} tokens/step, dtype={runner.target.dtype}, drafter={used}]",
                    err=True,
                )
    except UserError as e:
        _fail(str(e))


@app.command()
def chat(
    model: str | None = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    drafter: str = typer.Option("default", help=DRAFTER_HELP),
    no_draft: bool = typer.Option(False, "--no-draft"),
    beam_width: int | None = typer.Option(None, "--beam-width", "-w", help=BEAM_W_HELP),
    beam_length: int | None = typer.Option(None, "--beam-length", "-l", help=BEAM_L_HELP),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n"),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
) -> None:
    """Interactive chat with streaming output. Empty line or Ctrl-D quits."""
    from . import api, tuning
    from .decode import Stats

    try:
        dec = tuning.resolve(model, drafter, beam_width, beam_length, dtype, no_draft)
        if not dec.no_draft:
            api.check_beam(dec.beam_width, dec.beam_length)
        no_draft = dec.no_draft
        beam_width, beam_length = dec.beam_width, dec.beam_length
        typer.echo("loading model...", err=True)
        runner = api.load(model, None if no_draft else drafter, dec.dtype)
        shape = f"W={beam_width} L={beam_length}" if runner.drafter is not None and not no_draft else "AR"
        typer.echo(f"model={runner.target.name} dtype={runner.target.dtype} drafter={runner.drafter_name} "
                   f"{shape} ({dec.source} settings). Type a message; empty line or Ctrl-D quits.", err=True)
        messages: list[dict[str, str]] = []
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            ids = runner.tokenizer.encode(runner.tokenizer.chat_prompt(messages))
            stats, reply = Stats(), []
            for piece, _ in api.stream_generate(runner, ids, stats=stats, max_tokens=max_tokens,
                                                beam_width=beam_width, beam_length=beam_length,
                                                no_draft=no_draft or runner.drafter is None):
                sys.stdout.write(piece)
                sys.stdout.flush()
                reply.append(piece)
            messages.append({"role": "assistant", "content": "".join(reply)})
            typer.echo(f"\n[{stats.decode_tokens_per_s:.1f} tok/s, {stats.tokens_per_step:.2f} tokens/step]", err=True)
    except UserError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        pass


from .bench_cli import register as _register_bench  # noqa: E402  (bench + tune commands)

_register_bench(app)
from .train_cli import register as _register_train  # noqa: E402  (train + eval-drafter commands)

_register_train(app)


def main() -> None:
    """Console entry point."""
    try:
        app()
    except UserError as e:  # safety net for errors raised outside a command's own handler
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
