"""`redrafter-mlx distill`, `train` and `eval-drafter`: grow the distillation corpus, train and measure a drafter."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from mlx_redrafter.cmd import common as c
from mlx_redrafter.errors import UserError
from mlx_redrafter.files import check_writable_dir, check_writable_file
from mlx_redrafter.schema import Field, check_option
from mlx_redrafter.train.config import TrainConfig
from mlx_redrafter.train.evaluate import format_eval

DEFAULT_CORPUS = Path("data/corpus")
DEFAULT_FEATURES = Path(".cache/features")
DEFAULT_REPLAY = Path(".cache/replay")


SOURCES = ("greedy", "self", "text", "endpoint")
SHARED_PROMPTS = Path("../shared/data/train_prompts.jsonl")
SELF_PROMPTS = "prompts.jsonl"  # in the self-prompted corpus' own folder (CORPUS/<model>-self/)
THREADS = Field("", int, 1, 1024)  # BLAS threads of the data commands


def corpus_dir(corpus: Path, model_name: str, source: str) -> Path:
    """Where a model's corpus of one source lives: CORPUS/<model> (greedy answers), CORPUS/<model>-<source>."""
    return corpus / (model_name if source == "greedy" else f"{model_name}-{source}")


@c.one_line_errors
def distill(
    source: str | None = typer.Option(None, help="Where sequences come from: greedy (the target's own answers), "
                                      "self (its answers to prompts it wrote itself: `self-prompts`), text (fixed "
                                      "prompt/response pairs, --responses), endpoint (an OpenAI-compatible "
                                      "server's answers, --endpoint) \\[greedy; endpoint with --endpoint]."),
    prompts: Path | None = typer.Option(None, help="JSONL prompts ({\"prompt\", \"source\"} per line) for greedy, "
                                        f"self and endpoint [{SHARED_PROMPTS}; self: CORPUS/<model>-self/"
                                        f"{SELF_PROMPTS}]."),
    responses: Path = typer.Option(Path("../shared/data/responses.jsonl"), help="JSONL {\"prompt\", \"response\"} "
                                   "pairs for --source text."),
    endpoint: str | None = typer.Option(None, help="Base URL of an OpenAI-compatible server, e.g. "
                                        "http://127.0.0.1:8080/v1 (implies --source endpoint)."),
    endpoint_model: str | None = typer.Option(None, help="The model name to ask the endpoint for."),
    api_key: str | None = typer.Option(None, envvar="OPENAI_API_KEY", help="Bearer token for the endpoint."),
    concurrency: int = typer.Option(4, help="Endpoint requests in flight at once."),
    corpus: Path = typer.Option(DEFAULT_CORPUS, help="Corpus root; shards go to CORPUS/<model>[-<source>]/."),
    corpus_name: str | None = typer.Option(None, "--corpus-name", help="The corpus' folder under CORPUS instead, "
                                           "e.g. smollm2-135m-self2 for a second self-prompted corpus (self: its "
                                           "prompts.jsonl holds the prompts) [<model>[-<source>]]."),
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    shards: int | None = typer.Option(None, help="Stop after this many new shards (default: the whole plan)."),
    hours: float | None = typer.Option(None, help="Stop starting new shards after this many hours."),
    features: Path = typer.Option(DEFAULT_FEATURES, help="Local cache for the hidden states computed while "
                                  "generating (derived data, not committed)."),
    feature_layers: str | None = typer.Option(None, "--feature-layers", help="Also keep the states of these target "
                                              "layers, e.g. 2,15,24, so that training a drafter that fuses them "
                                              "needs only the labels' pass; empty for none [the shipped drafter's]."),
    threads: int = typer.Option(1, help="BLAS threads (1 is right when other work shares the cores)."),
    nice: int = typer.Option(19, help="Scheduling niceness added to this process and its session group (0 = none)."),
    worker: str = typer.Option("0/1", help="I/N: make only the shards whose index is I modulo N (run N processes, "
                               "one per core)."),
) -> None:
    """Extend a corpus: the target's greedy answers to the next prompts of the plan (default), fixed text, or an
    endpoint's answers.

    Resumable (finished shards are kept; a corrupt one is regenerated; greedy keeps a shard's finished answers in
    the corpus' partial/, which is committed with it), batched, float32. Run it in the background; stop it any time
    (Ctrl-C, kill): the answers it finished are saved in partial/ first. Progress and ETA are per shard
    (or group of shards made together).
    """
    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.system.blas import set_threads
    from mlx_redrafter.system.memory import reuse_freed_memory
    from mlx_redrafter.system.priority import lower_priority
    from mlx_redrafter.train.distill import check_worker, grow

    if endpoint is not None and not endpoint.strip():
        raise UserError("--endpoint is empty: give the server's base URL, e.g. http://127.0.0.1:8080/v1")
    if endpoint is not None and source not in (None, "endpoint"):
        raise UserError(f"--endpoint makes --source endpoint, not {source}: drop one of the two")
    source = source or ("endpoint" if endpoint else "greedy")
    if source not in SOURCES:
        raise UserError(f"--source must be one of {', '.join(SOURCES)} (got {source!r})")
    if source == "endpoint" and not endpoint:
        raise UserError("--source endpoint needs --endpoint URL (e.g. http://127.0.0.1:8080/v1)")
    check_option("--nice", nice, Field("", int, 0, 19))
    i, n = check_worker(worker)
    check_option("--shards", shards, Field("", int, 1, None))
    check_option("--hours", hours, Field("", float, hi=1e6, positive=True))
    check_option("--threads", threads, THREADS)
    check_writable_dir(corpus, "--corpus")
    check_writable_dir(features, "--features")
    if corpus_name is not None and (not corpus_name.strip() or Path(corpus_name).name != corpus_name
                                    or corpus_name in (".", "..")):
        raise UserError(f"--corpus-name takes a folder name, without '/', e.g. smollm2-135m-self2 "
                        f"(got {corpus_name!r})")
    layers = feature_layer_list(feature_layers) if feature_layers is not None else None
    lower_priority(nice)
    set_threads(threads)
    reuse_freed_memory()
    target = load_target(model, "float32")
    layers = shipped_feature_layers(target.name) if layers is None else layers
    check_layers_exist(layers, target)
    root = corpus / corpus_name if corpus_name else corpus_dir(corpus, target.name, source)
    if source == "self" and prompts is None:
        prompts = root / SELF_PROMPTS
        if not prompts.is_file():
            raise UserError(f"--source self has no prompts at {prompts}: write them first with `redrafter-mlx "
                            "self-prompts` (or give --prompts FILE)")
    prompts = prompts or SHARED_PROMPTS
    if source in ("greedy", "self"):
        from mlx_redrafter.train.greedy import GreedySource

        src = GreedySource(target, prompts, capture=True, layers=layers)
    elif source == "text":
        from mlx_redrafter.train.text import TextSource

        src = TextSource(target, responses)
    else:
        from mlx_redrafter.train.endpoint import EndpointSource

        src = EndpointSource(target, endpoint, prompts, model=endpoint_model, api_key=api_key,
                             concurrency=concurrency)
    with c.stops_cleanly():
        out = grow(src, target, root, max_shards=shards, hours=hours, features_dir=features / root.name,
                   worker=(i, n))
    typer.echo(json.dumps(out.stats()))


@c.one_line_errors
def self_prompts(
    num: int = typer.Option(4096, "--num", "-n", help="Prompts to write."),
    out: Path | None = typer.Option(None, "--out", "-o", help=f"Where [CORPUS/<model>-self/{SELF_PROMPTS}, the "
                                    "prompts `distill --source self` answers]."),
    corpus: Path = typer.Option(DEFAULT_CORPUS, help="Corpus root (for the default --out)."),
    seed: int = typer.Option(0, help="Attempt k samples with seed SEED + k (another file: a SEED past the other "
                             "file's attempts)."),
    avoid: list[Path] = typer.Option([], "--avoid", help="A prompts file whose prompts the new ones must not "
                                     "repeat, e.g. an earlier self-prompts file (repeat the option)."),
    batch: int = typer.Option(32, help="User turns sampled at once."),
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    threads: int = typer.Option(2, help="BLAS threads."),
    nice: int = typer.Option(19, help="Scheduling niceness added to this process and its session group (0 = none)."),
) -> None:
    """Write prompts with the target itself: user turns it samples after its chat template's opening of a user
    message (Magpie), kept where finished, new and not a benchmark's, for a corpus of more varied first turns.
    Resumable (kept prompts are saved beside --out after every batch; --out appears once complete)."""
    from tqdm import tqdm

    from mlx_redrafter import api
    from mlx_redrafter.prompts import packaged, read_prompts
    from mlx_redrafter.system.blas import set_threads
    from mlx_redrafter.system.priority import lower_priority
    from mlx_redrafter.train.self_prompts import make_prompts, partial_file, read_rows

    check_option("--num", num, Field("", int, 1, 10**7))
    check_option("--batch", batch, Field("", int, 1, 1024))
    check_option("--seed", seed, Field("", int, 0, 2**31))
    check_option("--threads", threads, THREADS)
    check_option("--nice", nice, Field("", int, 0, 19))
    if out is not None:
        check_writable_file(out, "--out")
    avoided = [r["prompt"] for f in avoid for r in read_prompts(f)]
    lower_priority(nice)
    set_threads(threads)
    lm = api.load(model, drafter="none", dtype="float32")
    if out is None:  # a given --out was checked before the model loaded
        out = check_writable_file(corpus_dir(corpus, lm.target.name, "self") / SELF_PROMPTS, "--out")
    if out.exists():
        have = len(read_prompts(out))
        if have >= num:
            typer.echo(f"{out} already holds {have} prompts")
            return
        raise UserError(f"{out} already holds {have} prompts, fewer than --num {num}: a corpus' prompts file stays "
                        "as its shards were planned on; write more prompts to another --out")
    read_rows(partial_file(out))  # a damaged one: an error before any work
    benchmark = [t for r in read_prompts(packaged()) for t in (r.get("turns") or [r["prompt"]])]
    bar = tqdm(total=num, desc=f"self-prompts {out.name}", unit="prompt", dynamic_ncols=True)

    def progress(kept: int, dropped: dict[str, int]) -> None:
        bar.update(kept - bar.n)
        bar.set_postfix(dropped=sum(dropped.values()), refresh=False)

    with c.stops_cleanly():
        stats = make_prompts(lm, out, num, seed=seed, batch_size=batch, exclude=benchmark, progress=progress,
                             avoid=avoided)
    bar.close()
    typer.echo(json.dumps({"out": str(out), **stats}))


@c.one_line_errors
def features(
    corpus: list[Path] = typer.Option(None, "--corpus", help="Corpus directories (repeat the option) [every corpus "
                                      "of the model under data/corpus]."),
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    cache: Path = typer.Option(DEFAULT_FEATURES, "--features", help="Where features are cached (not committed)."),
    threads: int = typer.Option(1, help="BLAS threads (1 is right when other work shares the cores)."),
    nice: int = typer.Option(19, help="Scheduling niceness added to this process and its session group (0 = none)."),
    worker: str = typer.Option("0/1", help="I/N: build only every N-th missing shard, starting at I."),
    shards: str | None = typer.Option(None, help="Only the shards with these plan indices, e.g. 0,10-16 "
                                      "(shard-NNNNN.npz) [all]."),
    feature_layers: str | None = typer.Option(None, "--feature-layers", help="Also the states of these target "
                                              "layers, e.g. 2,15,24 (for a drafter that fuses them) [none]."),
) -> None:
    """Build the teacher-forced features of corpora: the target's hidden states and top-k labels at every
    position (float32 forward of the runtime's own model). Resumable; `train` builds what is missing anyway."""

    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.system.blas import set_threads
    from mlx_redrafter.system.priority import lower_priority
    from mlx_redrafter.train.corpus import shard_index
    from mlx_redrafter.train.distill import check_worker
    from mlx_redrafter.train.features import ensure
    from mlx_redrafter.train.pipeline import open_corpus

    i, n = check_worker(worker)
    only = c.int_list(shards, "--shards") if shards is not None else None
    check_option("--threads", threads, THREADS)
    check_writable_dir(cache, "--features")
    lower_priority(nice)
    set_threads(threads)
    layers = feature_layer_list(feature_layers)
    target = load_target(model, "float32")
    check_layers_exist(layers, target)
    roots = corpus or sorted(p for p in DEFAULT_CORPUS.glob(f"{target.name}*") if (p / "manifest.json").exists())
    if not roots:
        raise UserError(f"no corpus of {target.name} under {DEFAULT_CORPUS}: run `make distill` first")
    chosen = []
    for root in roots:
        c_ = open_corpus(root, target.model.args.vocab_size)
        chosen.append((c_, sorted(x for x in c_.entries if only is None or shard_index(x) in only)))
    if only is not None and not any(names for _, names in chosen):
        raise UserError(f"--shards {shards}: no shard of {', '.join(map(str, roots))} has one of these plan indices: "
                        "list the shard numbers of data/corpus/<model>/shard-NNNNN.npz (e.g. --shards 1-9)")
    with c.stops_cleanly():
        for c_, names in chosen:
            ensure(c_, target.model, target.tokenizer.eos_ids[0], cache / c_.name, names, worker=(i, n),
                   log=lambda m: typer.echo(m, err=True), layers=layers)


@c.one_line_errors
def answers(
    corpus: Path = typer.Option(DEFAULT_CORPUS, help="Corpus root (CORPUS/<model>/ from `distill`)."),
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    out: Path | None = typer.Option(None, help="Output file \\[the model's shipped drafter folder: answers.npz]."),
) -> None:
    """Write the answer table that lookup drafting copies from: the target's answers in the corpus's train split."""
    from mlx_redrafter.api import shipped_folder
    from mlx_redrafter.files import write_atomic
    from mlx_redrafter.models.loader import DEFAULT_MODEL, load_target
    from mlx_redrafter.train.corpus import Corpus, answer_table_bytes

    name = model or DEFAULT_MODEL
    dest = check_writable_file(out or shipped_folder(name) / "answers.npz", "--out")
    root = corpus / name
    if not (root / "manifest.json").exists():
        raise UserError(f"no corpus at {root}: grow one with `make distill` (or pass --corpus)")
    c_ = Corpus(root)  # a bad manifest fails before the model loads
    made_by = c_.manifest.get("model")  # the model whose vocabulary the table's ids index (--model names the corpus)
    c_.vocab_size = load_target(made_by if isinstance(made_by, str) else name, "float32").model.args.vocab_size
    data, meta = answer_table_bytes(c_)
    path = write_atomic(dest, data)
    typer.echo(f"wrote {path}: {meta['sequences']} answers, {meta['tokens']} tokens")


@c.one_line_errors
def train(
    corpus: list[Path] = typer.Option(None, "--corpus", help="Corpus directories to train on (repeat the option) "
                                      "[the recipe's: " + ", ".join(TrainConfig.sources) + " corpora of the model "
                                      "under data/corpus]."),
    heldout: Path | None = typer.Option(None, help="Corpus whose held-out shard measures the run [the first "
                                        "--corpus, else the model's greedy corpus]."),
    features: Path = typer.Option(DEFAULT_FEATURES, help="Derived-data cache (hidden states and labels; rebuilt on "
                                  "demand)."),
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    output: Path | None = typer.Option(None, "--output", "-o", help="Where the drafter is written [RUN_DIR/drafter; "
                                       "to replace the shipped one, mlx_redrafter/drafters/<model>]."),
    run_dir: Path | None = typer.Option(None, help="Checkpoints and history (resumable) [runs/drafter, other kinds: "
                                        "runs/drafter-KIND]."),
    kind: str | None = typer.Option(None, "--kind", help="Drafter kind: redrafter, medusa, semi_ar_transformer "
                                    "or semi_ar_lstm (same data, loss and budget) \\[redrafter, or the --init-from "
                                    "drafter's]."),
    corpus_tokens: int | None = typer.Option(None, help="Train on each corpus' first N response tokens only "
                                             "[with no --shards: STEPS x BATCH, what the run's steps read once]."),
    shards: str | None = typer.Option(None, help="Train only on the shards with these plan indices, e.g. 10-32 "
                                      "(shard-NNNNN.npz; the held-out shard measures the run either way) [all]."),
    steps: int = typer.Option(TrainConfig.steps, help="Optimizer steps."),
    batch: int = typer.Option(TrainConfig.batch_size, help="Context positions per step."),
    lr: float = typer.Option(TrainConfig.lr, help="Peak learning rate (warmup + cosine)."),
    exit_dim: int = typer.Option(TrainConfig.exit_dim, help="Drafter width E."),
    layers: int = typer.Option(TrainConfig.num_draft_layers, help="ResBlocks."),
    draft_vocab: int = typer.Option(TrainConfig.draft_vocab_size, help="Head size K: the K most frequent tokens."),
    draft_len: int = typer.Option(TrainConfig.draft_len, help="T: draft steps trained per position."),
    labels: str = typer.Option(TrainConfig.labels, help="hard (the target's top-1 token) or soft (its top-k "
                               "distribution within the head)."),
    dropout: float = typer.Option(TrainConfig.input_dropout, help="Training-only dropout on the drafter's inputs."),
    noise: float = typer.Option(TrainConfig.feature_noise, help="Training-only uniform noise U(-a, a) on the "
                                "target's hidden state."),
    freeze_head: bool = typer.Option(TrainConfig.freeze_head, "--freeze-head/--train-head",
                                     help="Keep the vocabulary projection at the target's own output rows."),
    head_only: bool = typer.Option(TrainConfig.head_only, "--head-only", help="With --init-from: train its "
                                   "vocabulary projection alone, the rest frozen (e.g. the rows --head-rows adds, "
                                   "without moving what the drafter already computes)."),
    weight_decay: float = typer.Option(TrainConfig.weight_decay, help="AdamW weight decay."),
    seed: int = typer.Option(TrainConfig.seed, help="Random seed."),
    init_from: Path | None = typer.Option(None, "--init-from", help="Start from this drafter's weights and head "
                                          "vocabulary (e.g. fine-tune a shipped drafter on new data); its shape "
                                          "replaces the shape options."),
    feature_layers: str | None = typer.Option(None, "--feature-layers", help="Target layers whose states the "
                                              "drafter fuses with the last one, e.g. 2,15,24 (EAGLE-3 style; the "
                                              "features then hold them too) [none, or the --init-from drafter's]."),
    head_rows: int | None = typer.Option(None, "--head-rows", help="With --init-from: grow its head to this many "
                                         "rows, adding the tokens the target decides most often in the training "
                                         "data that it lacks (each starting from the target's own output row) "
                                         "[its own rows]."),
    resume: bool = typer.Option(True, "--resume/--restart", help="Continue from RUN_DIR/checkpoint."),
    float16: bool = typer.Option(True, "--float16/--float32", help="Storage dtype of the saved weights."),
    eval_prompts: int = typer.Option(0, help="Also measure tokens per target call on this many held-out prompts."),
    force: bool = typer.Option(False, "--force", help="Let --output replace a folder that holds only drafter "
                               "files but no valid drafter (a folder with other files is never replaced)."),
) -> None:
    """Train a drafter on the distillation corpus, in three steps.

    1. features: the target's hidden state at every context position of the chosen shards (kept from
       `distill` when present, else a teacher-forced float32 pass; cached in --features).
    2. train: the drafter learns to predict T tokens ahead (AdamW, warmup + cosine; checkpoints in --run-dir).
    3. save: config.json + model.safetensors + MODEL_CARD.md to --output (default RUN_DIR/drafter; compare it with
       the shipped drafter by `redrafter-mlx eval-drafter --drafter DIR` before replacing that one).
    """
    import time

    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.system.memory import reuse_freed_memory
    from mlx_redrafter.train.kinds import DRAFT_MODE, check_kind, kind_of_config
    from mlx_redrafter.train.loop import check_head_rows, planned_layers, train_drafter
    from mlx_redrafter.train.pipeline import model_card, prepare, save_shipped

    if kind is not None:
        check_kind(kind)
    if init_from is not None:
        from mlx_redrafter.draft.kinds import check_drafter_config
        from mlx_redrafter.files import read_json

        try:
            check_drafter_config(init_from)
        except UserError as e:
            raise UserError(f"--init-from {init_from} is not a drafter folder ({e}): give the folder of a drafter, "
                            f"e.g. mlx_redrafter/drafters/<model>") from None
        start = read_json(init_from / "config.json", "drafter config")
        has = kind_of_config(start)
        if kind is not None and kind != has:
            raise UserError(f"--kind {kind}, but --init-from {init_from} is a {has} drafter: leave --kind out, or "
                            f"start from a {kind} drafter")
        kind = has
        if head_rows is not None and kind == "redrafter":
            check_head_rows(head_rows, start.get("draft_vocab_size"), start["vocab_size"])
    kind = kind or TrainConfig.kind
    cfg = TrainConfig(exit_dim=exit_dim, num_draft_layers=layers, draft_vocab_size=draft_vocab, draft_len=draft_len,
                      labels=labels, steps=steps, batch_size=batch, lr=lr, input_dropout=dropout,
                      feature_noise=noise, freeze_head=freeze_head, head_only=head_only, weight_decay=weight_decay,
                      seed=seed, kind=kind, init_from=str(init_from) if init_from is not None else None,
                      feature_layers=feature_layer_list(feature_layers), head_rows=head_rows,
                      ).check()
    check_option("--corpus-tokens", corpus_tokens, Field("", int, 1, None))
    only = c.int_list(shards, "--shards") if shards is not None else None
    check_option("--eval-prompts", eval_prompts, Field("", int, 0, 100_000))
    run_dir = run_dir or Path("runs/drafter" if kind == "redrafter" else f"runs/drafter-{kind}")
    check_writable_dir(run_dir, "--run-dir")
    check_writable_dir(features, "--features")
    if output is not None:
        check_output_dir(output, force)
    reuse_freed_memory()
    target = load_target(model, "float32")
    layers = planned_layers(cfg, run_dir, resume)
    check_layers_exist(layers, target)
    corpora = corpus or [corpus_dir(DEFAULT_CORPUS, target.name, s) for s in cfg.sources]
    t0 = time.perf_counter()
    typer.echo("step 1/3: features", err=True)
    if corpus_tokens is None and only is None:  # features only for what the steps can read
        corpus_tokens = steps * batch
        typer.echo(f"training on the first {corpus_tokens:,} response tokens of each corpus (--steps x --batch: "
                   f"one pass; --corpus-tokens or --shards to choose)", err=True)
    with c.stops_cleanly():  # Ctrl-C or SIGTERM: the features done and the last checkpoint stay for a rerun
        try:
            tr, ho, used = prepare(target, corpora, features, corpus_tokens,
                                   heldout=heldout or corpora[0],
                                   log=lambda m: typer.echo(m, err=True), shards=only, layers=layers)
            t1 = time.perf_counter()
            typer.echo(f"step 2/3: training ({steps} steps) -> {run_dir}", err=True)
            drafter, summary = train_drafter(target, tr, ho, run_dir, cfg, resume=resume,
                                             log=lambda m: typer.echo(m, err=True))
        except KeyboardInterrupt:
            typer.echo(f"stopped: {resume_point(run_dir)}; the same command goes on from there", err=True)
            raise
    timings = {"features_s": round(t1 - t0), "train_s": round(time.perf_counter() - t1)}
    extra = ""
    if eval_prompts:
        from mlx_redrafter.train.evaluate import heldout_prompt_ids, run_eval

        save_shipped(drafter, run_dir / "final", "", float16=float16)
        res = run_eval(str(run_dir / "final"), model, [1, 4], [3, 5],
                       heldout_prompt_ids(corpus / target.name, eval_prompts), 128, "the corpus' held-out shard",
                       draft=DRAFT_MODE[kind], log=None)
        extra = "\n" + format_eval(res) + "\n"
        typer.echo(format_eval(res), err=True)
    out = output or run_dir / "drafter"  # never the shipped drafter unless asked: compare first (eval-drafter)
    summary.update(used=used, timings=timings)
    from mlx_redrafter.files import write_atomic

    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=1))
    save_shipped(drafter, out, model_card(target.name, cfg, summary, used, timings, extra), float16=float16)
    typer.echo(f"step 3/3: saved {out}", err=True)



def resume_point(run_dir: Path) -> str:
    """What a rerun of a stopped `train` starts from: the checkpoint's step, or the features computed so far."""
    from mlx_redrafter.files import read_json

    state = run_dir / "checkpoint" / "trainer_state.json"
    try:
        return f"the checkpoint in {state.parent} holds step {read_json(state, 'training state')['step']}"
    except (UserError, KeyError, TypeError):
        return "no checkpoint yet, the features computed so far are kept"


def feature_layer_list(text: str | None) -> tuple[int, ...]:
    """The layers `--feature-layers` names (none for an empty option); a one-line UserError for a malformed list."""
    layers = tuple(c.int_list(text, "--feature-layers")) if text else ()
    if layers:
        from mlx_redrafter.draft.redrafter import check_feature_layers

        check_feature_layers(list(layers), "--feature-layers")
    return layers


def shipped_feature_layers(model_name: str) -> tuple[int, ...]:
    """The target layers the drafter shipped for a model fuses (none without such a drafter)."""
    from mlx_redrafter.draft.redrafter import read_checkpoint
    from mlx_redrafter.shipped import shipped_drafter_path

    path = shipped_drafter_path(model_name)
    return tuple(read_checkpoint(path)[0].get("feature_layers") or ()) if path is not None else ()


def check_layers_exist(layers: tuple[int, ...], target) -> None:
    """One-line error unless the target has every layer of `layers` (feature layers of a drafter)."""
    if layers and max(layers) >= target.model.args.num_hidden_layers:
        raise UserError(f"--feature-layers {','.join(map(str, layers))}: {target.name} has layers 0-"
                        f"{target.model.args.num_hidden_layers - 1}")


def check_output_dir(out: Path, force: bool) -> None:
    """One-line error unless `out` may receive a drafter: absent, empty, or a drafter folder (a valid drafter
    config.json and only the files a drafter save writes); with `force`, any folder holding only such files. A
    folder with other files is never replaced."""
    from mlx_redrafter.draft.kinds import check_drafter_config
    from mlx_redrafter.draft.redrafter import check_replaceable

    check_writable_dir(out, "--output")
    check_replaceable(out, "--output")
    if force or not out.exists() or not any(out.iterdir()):
        return
    try:
        check_drafter_config(out)
    except UserError as e:
        raise UserError(f"--output {out} does not hold a drafter ({e}): choose another directory, or pass --force "
                        f"to replace it") from None


@c.one_line_errors
def eval_drafter(
    drafter: str = typer.Option("default", help=c.DRAFTER_HELP),
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    widths: str = typer.Option("1,2,4", help="Beam widths W, comma-separated."),
    lengths: str = typer.Option("2,3,4,5", help="Beam lengths L (first token + drafts), comma-separated."),
    num_prompts: int = typer.Option(80, help="Prompts to use."),
    max_tokens: int = typer.Option(128, help="New tokens per prompt (greedy)."),
    prompts: Path | None = typer.Option(None, help="Prompts JSONL [MT-bench first turns shipped in the package]."),
    heldout: bool = typer.Option(False, "--heldout", help="Use the corpus' held-out prompts instead."),
    corpus: Path = typer.Option(DEFAULT_CORPUS, help="For --heldout: a corpus root (its <model>/ corpus) or one "
                                "corpus' folder, e.g. data/corpus/smollm2-135m-self."),
    draft: str = typer.Option("rnn", help="Drafting to measure: rnn, lookup, rnn+lookup or lookup-else-rnn."),
    drafter_vocab: int | None = c.DECODE_FLAGS["drafter_vocab"][1],
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    replay: bool = typer.Option(False, "--replay", help=(
        "Decode each prompt once and replay its greedy answer for every W x L instead of decoding it again: the "
        "same tokens per call up to float rounding, in a fraction of the time, without draft / verify times.")),
    replay_cache: Path = typer.Option(DEFAULT_REPLAY, help="Where --replay keeps the greedy answers it decoded "
                                      "(per target, tapped layers, prompts and --max-tokens), for the next run."),
) -> None:
    """Acceptance of a drafter on prompts it never saw: tokens per target call, per-position acceptance and the
    accepted-length histogram per W x L (greedy, fp32)."""
    from mlx_redrafter.models.loader import resolve_model
    from mlx_redrafter.prompts import first_turns
    from mlx_redrafter.train.evaluate import heldout_prompt_ids, run_eval

    if replay:
        check_writable_dir(replay_cache, "--replay-cache")
    if heldout:
        root = corpus if (corpus / "manifest.json").is_file() else corpus / resolve_model(model)[0]
        ids = heldout_prompt_ids(root, num_prompts)
        texts, source = ids, f"the held-out shard of {root.name}"
    else:
        texts = [r["prompt"] for r in first_turns(prompts, num_prompts)]
        source = str(prompts) if prompts else "MT-bench first turns"
    res = run_eval(drafter, model, c.int_list(widths, "--widths"), c.int_list(lengths, "--lengths"), texts,
                   max_tokens, source, draft=draft, drafter_vocab=drafter_vocab, log=lambda m: typer.echo(m, err=True),
                   replay=replay, replay_cache=replay_cache)
    typer.echo(json.dumps(res) if as_json else format_eval(res))
