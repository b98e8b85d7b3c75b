"""A small, fast drafter-recipe pilot: what the recurrent drafter conditions on and how it is trained, compared at
equal data and steps on the held-out shard.

`features` runs the target teacher-forced over some corpus shards (float32, one batched forward) and keeps, at
every context position, the RMS-normalised residual stream after a few layers (EAGLE-3 fuses low, middle and high
layers) besides the post-norm state the runtime's drafter uses, and the target's top-k labels. `train` trains one
drafter variant on such files and prints, every `--eval-every` steps, held-out top-1 per draft step and the
tokens per call of a width-1 chain of length T (teacher forced, which for a greedy chain equals replayed decoding).

Variants: `final` (the shipped conditioning), `final+l15`, `all` (layers 3, 9, 16, 23 and the final state through a
learned projection that starts as the identity on the final state), `final+prev` (the previous position's state
too); modifiers `:reg<w>` (an EAGLE-style regression of the drafter's pre-head features onto the target's next
post-norm states, weight w), `:noise<a>` (U(-a, a) on the context state), `:frozen` (head kept at the target's
rows). Results of the 2026-11-25 pilot: `bench/results/cpu-avx2/drafter-conditioning.md`.

    python -m bench.conditioning features data/corpus/smollm2-135m/shard-00001.npz /tmp/c/g1.npz
    python -m bench.conditioning train final:reg1 /tmp/c/g1.npz,/tmp/c/g2.npz --heldout /tmp/c/ho.npz
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import typer

from mlx_redrafter.cmd import common as c
from mlx_redrafter.errors import UserError

LAYERS = (2, 8, 15, 22)  # 0-based blocks whose output is kept (files hold h0..h3, and h4 = the final state)
PICK = {"final": (4,), "final+l15": (4, 2), "all": (4, 0, 1, 2, 3), "final+prev": (4, "prev")}

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)


def _existing(paths: list[str]) -> list[str]:
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise UserError(f"no such file: {', '.join(missing)} (make one with `python -m bench.conditioning features`)")
    return paths


@app.command()
@c.one_line_errors
def features(shard: Path, out: Path, sequences: int = typer.Option(256, help="First N sequences of the shard."),
             max_batch_tokens: int = 4096) -> None:
    """Teacher-forced multi-layer states and top-8 labels of a corpus shard, into one .npz file."""
    import mlx.core as mx

    from mlx_redrafter.model import prefill_chunk
    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.train.batch import left_padded
    from mlx_redrafter.train.corpus import load_shard
    from mlx_redrafter.train.features import length_groups, top_labels

    _existing([str(shard)])
    target = load_target(None, "float32")
    model, pad = target.model, target.tokenizer.eos_ids[0]
    sh = load_shard(shard, model.args.vocab_size)
    n_seq = min(sh.num_sequences, sequences)
    lens = sh.offsets[1:] - sh.offsets[:-1]
    per_seq: dict[int, dict] = {}
    t0, done = time.time(), 0

    def rms(x):
        return x * mx.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5)

    for idx in length_groups(lens[:n_seq], max_batch_tokens):
        tok, pos, mask, padded = left_padded([sh.sequence(q).tolist() for q in idx], pad)
        cache = model.make_cache(tok.shape[1])
        taps: list[list] = [[] for _ in range(len(LAYERS) + 1)]
        chunk = prefill_chunk(len(idx))
        for a in range(0, tok.shape[1], chunk):
            b = min(a + chunk, tok.shape[1])
            x = model.embed(mx.array(tok[:, a:b]))
            rope = model.rope(mx.array(pos[:, a:b]), x.dtype)
            m = mx.array(mask[:, :, a:b, :b])
            for li, layer in enumerate(model.model.layers):
                x = layer(x, rope, m, cache, li)
                if li in LAYERS:
                    taps[LAYERS.index(li)].append(rms(x))
            cache.advance(b - a)
            taps[-1].append(model.model.norm(x))
        spans = [(int(padded[r]) + int(sh.prompt_len[q]) - 1, int(padded[r]) + int(lens[q]) - 1)
                 for r, q in enumerate(idx)]
        for k, parts in enumerate(taps):
            h = mx.concatenate(parts, axis=1)
            ctx = mx.concatenate([h[r, s:e] for r, (s, e) in enumerate(spans)])
            if k == len(taps) - 1:
                ids, logp = top_labels(model, ctx, 8)
                mx.eval(ids, logp)
                ids, logp = np.array(ids), np.array(logp)
            h16, start = np.array(ctx.astype(mx.float16)), 0
            for q, (s, e) in zip(idx, spans):
                rec = per_seq.setdefault(int(q), {})
                rec[k] = h16[start : start + e - s]
                if k == len(taps) - 1:
                    rec["ids"], rec["lp"] = ids[start : start + e - s], logp[start : start + e - s]
                start += e - s
        done += int(lens[idx].sum())
        typer.echo(f"{len(per_seq)}/{n_seq} sequences, {done / (time.time() - t0):.0f} tok/s", err=True)
    qs = sorted(per_seq)
    arrays = {f"h{k}": np.concatenate([per_seq[q][k] for q in qs]) for k in range(len(LAYERS) + 1)}
    arrays.update(ids=np.concatenate([per_seq[q]["ids"] for q in qs]),
                  lp=np.concatenate([per_seq[q]["lp"] for q in qs]).astype(np.float16), seqs=np.array(qs),
                  shard=np.array(str(shard)))
    np.savez(out, **arrays)
    typer.echo(f"{out}: {len(qs)} sequences, {arrays['ids'].shape[0]} contexts, {time.time() - t0:.0f} s", err=True)


def _examples(files: list[str], pick: tuple, vocab_size: int):
    from mlx_redrafter.train.corpus import load_shard
    from mlx_redrafter.train.data import Examples

    toks, hid, ids, lp, ti, ends, base = [], [], [], [], [], [], 0
    for f in files:
        z = np.load(f)
        sh = load_shard(str(z["shard"]), vocab_size)
        counts = [int(sh.offsets[q + 1] - sh.offsets[q] - sh.prompt_len[q]) for q in z["seqs"]]
        parts = []
        for k in pick:
            if k == "prev":  # the state one position earlier (a sequence's first context repeats its own)
                h = z["h4"]
                prev = np.concatenate([h[:1], h[:-1]])
                prev[np.cumsum([0] + counts[:-1])] = h[np.cumsum([0] + counts[:-1])]
                parts.append(prev)
            else:
                parts.append(z[f"h{k}"])
        hid.append(np.concatenate(parts, axis=1))
        ids.append(z["ids"])
        lp.append(z["lp"])
        for q in z["seqs"]:
            s, e, P = int(sh.offsets[q]), int(sh.offsets[q + 1]), int(sh.prompt_len[q])
            p = np.arange(P - 1, e - s - 1)
            ti.append(base + p)
            ends.append(np.full(len(p), base + e - s))
            toks.append(sh.tokens[s:e])
            base += e - s
    hidden = np.concatenate(hid)
    return Examples(tokens=np.concatenate(toks).astype(np.int32), hidden=[hidden],
                    shard_of=np.zeros(len(hidden), np.int32), row_of=np.arange(len(hidden)),
                    top_ids=np.concatenate(ids), top_logp=np.concatenate(lp),
                    tok_index=np.concatenate(ti).astype(np.int64), seq_end=np.concatenate(ends).astype(np.int64),
                    sequences=len(ends), response_tokens=len(hidden))


@app.command()
@c.one_line_errors
def train(variant: str, files: str, heldout: Path = typer.Option(..., help="features file of held-out sequences"),
          steps: int = 800, eval_every: int = 200, draft_len: int = 4, vocab: int = 4096, batch: int = 256,
          seed: int = 0) -> None:
    """Train one variant (see the module docstring) on comma-separated feature files; print held-out results."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.train.data import draft_vocabulary, make_batch
    from mlx_redrafter.train.loop import TrainConfig, new_drafter
    from mlx_redrafter.train.loss import hard_loss, recurrent_states

    name, *mods = variant.split(":")
    if name not in PICK or any(not m.startswith(("reg", "noise", "frozen")) for m in mods):
        raise UserError(f"unknown variant {variant!r}: one of {', '.join(PICK)}, then any of :reg<w> :noise<a> :frozen")
    _existing(files.split(",") + [str(heldout)])
    reg = next((float(m[3:]) for m in mods if m.startswith("reg")), 0.0)
    noise = next((float(m[5:]) for m in mods if m.startswith("noise")), 0.0)
    target = load_target(None, "float32")
    model, T = target.model, draft_len
    H, V = model.args.hidden_size, model.args.vocab_size  # the shipped shape: exit_dim = H, 2 ResBlocks, RNN
    tr = _examples(files.split(","), PICK[name], V)
    ho = _examples([str(heldout)], PICK[name], V)
    head = draft_vocabulary(tr, vocab, V, list(target.tokenizer.eos_ids))
    lut = np.full(V, -1, np.int64)
    lut[head] = np.arange(len(head))

    class Conditioned(nn.Module):
        """The trainer's fresh drafter (`new_drafter`), its context state first projected from the variant's
        features (a projection that starts as the identity on the final state)."""

        def __init__(self, width: int):
            super().__init__()
            self.d = new_drafter(target, TrainConfig(draft_vocab_size=len(head), seed=seed), head)
            self.d.freeze(keys=["draft_vocab"])  # token ids, not weights (as the trainer keeps them)
            if width != H:
                self.fuse = nn.Linear(width, H)
                self.fuse.weight = mx.concatenate([mx.eye(H), mx.zeros((H, width - H))], axis=1)
                self.fuse.bias = mx.zeros((H,))

        def head_inputs(self, h, emb):
            if "fuse" in self:
                h = self.fuse(h)
            S = recurrent_states(self.d, emb)
            return self.d.features(mx.broadcast_to(h[:, None, :], S.shape), S)

    net = Conditioned(tr.hidden[0].shape[1])
    if "frozen" in mods:
        net.d.lm_head[-1].freeze()

    def embed(x):
        return model.embed(x).astype(mx.float32)

    def next_states(idx):  # the target's post-norm states at p+1..p+T (the regression targets)
        t0 = tr.tok_index[idx]
        valid = t0[:, None] + np.arange(1, T + 1)[None] < tr.seq_end[idx][:, None] - 1
        rows = np.where(valid, idx[:, None] + np.arange(1, T + 1)[None], 0)
        return mx.array(tr.hidden[0][rows][..., :H].astype(np.float32))  # the final state is the first block

    def loss_fn(net, b, emb, nxt):
        h = b.h + mx.random.uniform(-noise, noise, b.h.shape) if noise else b.h
        X = net.head_inputs(h, emb)
        loss = hard_loss(net.d.lm_head[-1](X), b)
        if reg:
            d = mx.abs(X - nxt)
            smooth = mx.where(d < 1, 0.5 * d * d, d - 0.5).mean(-1)
            loss = loss + reg * (smooth * b.valid).sum() / mx.maximum(b.valid.sum(), 1)
        return loss

    schedule = optim.join_schedules([optim.linear_schedule(1e-5, 1e-3, 100),
                                     optim.cosine_decay(1e-3, max(steps - 100, 1), end=5e-5)], [100])
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    grad = nn.value_and_grad(net, loss_fn)
    rng = np.random.default_rng(seed)

    def evaluate():
        hits, valid = [], []
        for i in range(0, len(ho), 1024):
            b = make_batch(ho, np.arange(i, min(i + 1024, len(ho))), T, lut)
            ok = (mx.argmax(net.d.lm_head[-1](net.head_inputs(b.h, embed(b.x_in))), -1) == b.target) * b.weight
            mx.eval(ok)
            hits.append(np.array(ok))
            valid.append(np.array(b.valid))
        ok, v = np.concatenate(hits), np.concatenate(valid)
        chain = 1 + np.cumprod(ok[:, : T - 1], axis=1).sum(1).mean()  # g0, then T-1 drafts while all accepted
        return [round(float(a), 4) for a in ok.sum(0) / np.maximum(v.sum(0), 1)], round(float(chain), 4)

    typer.echo(f"{variant}: {len(tr)} train / {len(ho)} held-out contexts, feature width {tr.hidden[0].shape[1]}",
               err=True)
    t0 = time.time()
    for step in range(1, steps + 1):
        idx = rng.integers(0, len(tr), batch)
        b = make_batch(tr, idx, T, lut)
        loss, g = grad(net, b, embed(b.x_in), next_states(idx) if reg else None)
        g, _ = optim.clip_grad_norm(g, 1.0)
        opt.update(net, g)
        mx.eval(net.parameters(), opt.state, loss)
        if step % eval_every == 0 or step == steps:
            top1, chain = evaluate()
            typer.echo(json.dumps({"variant": variant, "step": step, "loss": round(float(loss), 3), "top1": top1,
                                   "w1_chain_tokens_per_call": chain, "s": round(time.time() - t0)}))


def main() -> None:
    import sys

    from mlx_redrafter import install_blas

    try:
        install_blas()
        sys.exit(c.run_app(app, None, "python -m bench.conditioning"))
    except UserError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
