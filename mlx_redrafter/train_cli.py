"""`redrafter-mlx train` and `redrafter-mlx eval-drafter`: reproduce and measure the shipped drafter."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import typer

from .errors import UserError

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = ROOT / "data" / "train_prompts_subset.jsonl"
DEFAULT_MT_BENCH = ROOT / "data" / "mt_bench.jsonl"
DEFAULT_OUT = Path(__file__).resolve().parent / "drafters" / "smollm2-135m"


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _parse_list(s: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{name} must be a comma-separated list of integers (got {s!r})") from None
    if not vals:
        raise UserError(f"{name} is empty")
    return vals


def train(
    output: Path = typer.Option(DEFAULT_OUT, "--output", "-o", help="Where the trained drafter is written."),
    model: str | None = typer.Option(None, "--model", "-m", help="Target model (default: embedded SmolLM2-135M)."),
    prompts: Path = typer.Option(DEFAULT_PROMPTS, help="JSONL prompts file ({\"prompt\", \"source\"} per line)."),
    num_prompts: int = typer.Option(832, help="Use the first N prompts of the file (13 shards of 64)."),
    mix: bool = typer.Option(False, "--mix/--no-mix",
                             help="Reweight by `source` toward general chat (for the full shared pool)."),
    max_new_tokens: int = typer.Option(256, help="Step 1: longest greedy answer per prompt."),
    batch_size: int = typer.Option(64, help="Step 1: prompts generated together."),
    gen_minutes: float = typer.Option(90.0, help="Step 1: stop starting new shards after this many minutes."),
    cache_dir: Path = typer.Option(Path(".cache/distill"), help="Step 1: shard cache (resumable)."),
    run_dir: Path = typer.Option(Path("runs/drafter"), help="Step 2: checkpoints, history.jsonl."),
    steps: int = typer.Option(1200, help="Step 2: optimizer steps."),
    train_batch: int = typer.Option(256, help="Step 2: context positions per step (x draft_len predictions)."),
    lr: float = typer.Option(1e-3, help="Step 2: peak learning rate (warmup + cosine)."),
    dropout: float = typer.Option(0.0, help="Step 2: training-only dropout on the drafter's inputs."),
    weight_decay: float = typer.Option(0.01, help="Step 2: AdamW weight decay."),
    exit_dim: int = typer.Option(576, help="Drafter width E (input_proj 2H -> E)."),
    layers: int = typer.Option(2, help="Drafter ResBlocks."),
    draft_vocab: int = typer.Option(8192, help="Head size K: the K most frequent tokens (0 = full vocabulary)."),
    resume: bool = typer.Option(True, "--resume/--restart", help="Step 2: continue from run_dir/checkpoint."),
    float16: bool = typer.Option(True, "--float16/--float32", help="Step 3: storage dtype of the saved weights."),
) -> None:
    """Train a drafter for a target model by self-distillation, in three steps.

    1. generate: the target writes greedy answers (<= max-new-tokens, stops at eos) to chat-formatted prompts, in
       batches, capturing its post-norm hidden state at every position; shards go to --cache-dir and are reused
       when the run is repeated or resumed.
    2. train: the drafter learns to predict 5 tokens ahead from (hidden state, previous tokens) with AdamW
       (warmup + cosine, gradient clipping); checkpoints in --run-dir, resumable.
    3. save: config.json + model.safetensors + MODEL_CARD.md to --output (loaded automatically as the 'default'
       drafter when it is the package's drafters/<model> folder).

    The defaults reproduce the shipped SmolLM2-135M drafter.
    """
    try:
        from .distill import generate_dataset, read_prompts, select_prompts
        from .loader import load_target
        from .train import TrainConfig, save_shipped, train_drafter

        if num_prompts < 1 or steps < 1 or batch_size < 1 or train_batch < 1 or max_new_tokens < 1:
            raise UserError("--num-prompts, --steps, --batch-size, --train-batch and --max-new-tokens must be >= 1")
        rows = read_prompts(prompts)
        rows = select_prompts(rows, num_prompts) if mix else rows[:num_prompts]
        t_all = time.perf_counter()
        target = load_target(model, "float32")
        typer.echo(f"step 1/3: distillation data from {len(rows)} prompts -> {cache_dir}", err=True)
        t0 = time.perf_counter()
        shards = generate_dataset(target, [r["prompt"] for r in rows], cache_dir, shard_size=batch_size,
                                  batch_size=batch_size, max_new_tokens=max_new_tokens,
                                  time_budget_s=gen_minutes * 60, log=lambda m: typer.echo(m, err=True))
        gen_s = time.perf_counter() - t0
        typer.echo(f"step 2/3: training ({steps} steps) -> {run_dir}", err=True)
        cfg = TrainConfig(exit_dim=exit_dim, num_draft_layers=layers, draft_vocab_size=draft_vocab, steps=steps,
                          batch_size=train_batch, lr=lr, input_dropout=dropout, weight_decay=weight_decay)
        drafter, summary = train_drafter(target, shards, run_dir, cfg, resume=resume,
                                         log=lambda m: typer.echo(m, err=True))
        summary.update(generation_s=round(gen_s, 1), shards=len(shards), total_s=round(time.perf_counter() - t_all))
        (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
        card = model_card(target.name, summary, cfg)
        out = save_shipped(drafter, output, card, float16=float16)
        typer.echo(f"step 3/3: saved {out}", err=True)
    except UserError as e:
        _fail(str(e))


def model_card(model_name: str, summary: dict, cfg) -> str:
    """A MODEL_CARD.md text from a training summary (eval-drafter results are appended separately)."""
    final = summary.get("final", {})
    return f"""# ReDrafter drafter for {model_name}

Trained here by self-distillation with `redrafter-mlx train` (see below).

- Shape: exit_dim {cfg.exit_dim} (input_proj 2H -> E), {cfg.num_draft_layers} ResBlocks, rnn, head over the
  {cfg.draft_vocab_size} most frequent tokens of the distillation data (covers {summary.get('head_coverage')} of them);
  {summary.get('params')} parameters, stored as float16.
- Data: greedy answers of the target itself (<= 256 new tokens) to {summary.get('train_sequences')} + \
{summary.get('val_sequences')} (held out) prompts of `data/train_prompts_subset.jsonl`; \
{summary.get('train_response_tokens')} response tokens. Generation {summary.get('generation_s')} s.
- Training: {cfg.steps} steps x {cfg.batch_size} context positions x {cfg.draft_len} draft tokens, AdamW lr {cfg.lr}
  (warmup + cosine), {summary.get('train_time_s')} s on {platform.machine()} CPU ({platform.processor() or 'cpu'}).
- Held-out top-1 accuracy per draft position (teacher forced): {final.get('acc')}; loss {final.get('val_loss')}.

Reproduce: `make train` (= `redrafter-mlx train`); measure: `redrafter-mlx eval-drafter`.
"""


def eval_drafter(
    drafter: str = typer.Option("default", help="Drafter directory, or 'default' (shipped for the model)."),
    model: str | None = typer.Option(None, "--model", "-m", help="Target model (default: embedded SmolLM2-135M)."),
    widths: str = typer.Option("1,2,4", help="Beam widths W, comma-separated."),
    lengths: str = typer.Option("2,3,4,5", help="Beam lengths L (first token + drafts), comma-separated."),
    num_prompts: int = typer.Option(80, help="MT-bench first turns to use (from the start of the file)."),
    max_tokens: int = typer.Option(128, help="New tokens per prompt (greedy)."),
    questions: Path = typer.Option(DEFAULT_MT_BENCH, help="MT-bench questions JSONL."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Acceptance of a drafter on MT-bench first turns: tokens per target call and accepted-draft histogram
    for every W x L (greedy, fp32)."""
    try:
        res = run_eval(drafter, model, _parse_list(widths, "--widths"), _parse_list(lengths, "--lengths"),
                       num_prompts, max_tokens, questions)
        if as_json:
            typer.echo(json.dumps(res))
        else:
            typer.echo(format_eval(res))
    except UserError as e:
        _fail(str(e))


def run_eval(drafter_spec: str, model: str | None, widths: list[int], lengths: list[int], num_prompts: int,
             max_tokens: int, questions: Path, progress: bool = True) -> dict:
    """Tokens per target call (mean over prompts, and pooled) per W x L, with per-position acceptance rates."""
    from . import api
    from .decode import Stats, generate_tokens

    if not questions.exists():
        raise UserError(f"questions file {questions} does not exist")
    with questions.open(encoding="utf-8") as f:
        qs = [json.loads(line)["turns"][0] for line in f if line.strip()][:num_prompts]
    if not qs:
        raise UserError(f"questions file {questions} has no questions")
    for w in widths:
        for length in lengths:
            api.check_beam(w, length)
    runner = api.load(model, drafter_spec, "float32")
    if runner.drafter is None:
        raise UserError(f"no drafter for {runner.target.name}: pass --drafter DIR")
    tok = runner.tokenizer
    ids = [tok.encode(tok.chat_prompt([{"role": "user", "content": q}])) for q in qs]
    results = []
    for w in widths:
        for length in lengths:
            per_prompt, hist, steps, decided, t0 = [], {}, 0, 0, time.perf_counter()
            draft_s = verify_s = 0.0
            for p in ids:
                st = Stats()
                for _ in generate_tokens(runner.target.model, p, drafter=runner.drafter, beam_width=w,
                                         beam_length=length, max_tokens=max_tokens, eos_ids=tok.eos_ids, stats=st):
                    pass
                if st.steps:
                    per_prompt.append(st.tokens_per_step)
                    steps += st.steps
                    decided += st.tokens_per_step * st.steps
                    draft_s, verify_s = draft_s + st.draft_s, verify_s + st.verify_s
                for k, v in st.accepted_hist.items():
                    hist[k] = hist.get(k, 0) + v
            total = sum(hist.values())
            # P(draft position k accepted) = share of steps that accepted >= k drafts
            pos_acc = [round(sum(v for n, v in hist.items() if n >= k) / max(total, 1), 4) for k in range(1, length)]
            rec = {"W": w, "L": length, "tokens_per_step": round(sum(per_prompt) / max(len(per_prompt), 1), 4),
                   "tokens_per_step_pooled": round(decided / max(steps, 1), 4), "steps": steps,
                   "accept_rate_by_position": pos_acc,
                   "draft_ms_per_step": round(1000 * draft_s / max(steps, 1), 1),
                   "verify_ms_per_step": round(1000 * verify_s / max(steps, 1), 1),
                   "accepted_hist": {str(k): hist[k] for k in sorted(hist)},
                   "seconds": round(time.perf_counter() - t0, 1)}
            results.append(rec)
            if progress:
                typer.echo(json.dumps(rec), err=True)
    return {"model": runner.target.name, "drafter": runner.drafter_name, "prompts": len(ids),
            "max_tokens": max_tokens, "results": results}


def format_eval(res: dict) -> str:
    """A markdown table of tokens per target call by W x L."""
    Ls = sorted({r["L"] for r in res["results"]})
    Ws = sorted({r["W"] for r in res["results"]})
    cell = {(r["W"], r["L"]): r["tokens_per_step"] for r in res["results"]}
    lines = [f"tokens per target call, {res['model']} + {res['drafter']}, {res['prompts']} MT-bench first turns, "
             f"greedy, {res['max_tokens']} new tokens", "",
             "| W \\ L | " + " | ".join(str(L) for L in Ls) + " |", "|---" * (len(Ls) + 1) + "|"]
    for w in Ws:
        lines.append(f"| {w} | " + " | ".join(f"{cell[(w, L)]:.2f}" if (w, L) in cell else "" for L in Ls) + " |")
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    """Add the `train` and `eval-drafter` commands to the main CLI."""
    app.command("train")(train)
    app.command("eval-drafter")(eval_drafter)
