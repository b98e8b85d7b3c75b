"""Drafter training: distillation data cache, a tiny real training run, and bad inputs (real model, no mocks)."""

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from mlx_redrafter.cli import app
from mlx_redrafter.distill import generate_batch, generate_dataset, load_shard, read_prompts, shard_path
from mlx_redrafter.drafter import load_drafter, random_drafter, save_drafter
from mlx_redrafter.errors import UserError
from mlx_redrafter.train import TrainConfig, train_drafter

PROMPTS = ["What is the capital of France?", "Name three colors.", "Say hello.", "Count to five."]


def test_batched_generation_matches_single(target):
    """Left-padded batched greedy generation gives the same tokens as one prompt alone, and hidden states
    for every position but the last."""
    tok = target.tokenizer
    ids = [tok.encode(tok.chat_prompt([{"role": "user", "content": p}])) for p in PROMPTS[:2]]
    batch = generate_batch(target.model, ids, 6, tok.eos_ids)
    for p, (seq, hid) in zip(ids, batch):
        (alone, _), = generate_batch(target.model, [p], 6, tok.eos_ids)
        assert seq == alone
        assert seq[: len(p)] == p
        assert hid.shape == (len(seq) - 1, target.model.args.hidden_size) and hid.dtype == np.float16


def test_cache_resumes(target, tmp_path):
    cache = tmp_path / "cache"
    first = generate_dataset(target, PROMPTS[:2], cache, shard_size=2, batch_size=2, max_new_tokens=4,
                             progress=False)
    assert len(first) == 1
    stamp = first[0].stat().st_mtime_ns
    (first[0].parent / "shard-00001.npz.tmp").write_bytes(b"interrupted write")  # a half-written shard
    both = generate_dataset(target, PROMPTS, cache, shard_size=2, batch_size=2, max_new_tokens=4, progress=False)
    assert both[0] == first[0] and both[0].stat().st_mtime_ns == stamp  # reused, not regenerated
    assert both[1] == shard_path(cache / target.name, 1)
    sh = load_shard(both[1])
    assert sh.num_sequences == 2 and len(sh.hidden) == len(sh.tokens) - 2


def test_tiny_training_run(target, tmp_path):
    shards = generate_dataset(target, PROMPTS, tmp_path / "cache", shard_size=4, batch_size=4, max_new_tokens=12,
                              progress=False)
    cfg = TrainConfig(steps=30, batch_size=32, draft_vocab_size=512, num_draft_layers=1, warmup=3, eval_every=10,
                      checkpoint_every=15, lr=3e-3, val_fraction=0.25)
    drafter, summary = train_drafter(target, shards, tmp_path / "run", cfg, log=lambda m: None)
    hist = summary["history"]
    assert hist[-1]["train_loss"] < hist[0]["train_loss"]
    assert len(hist[-1]["acc"]) == cfg.draft_len
    loaded = load_drafter(tmp_path / "run" / "checkpoint")
    assert loaded.args.draft_vocab_size == 512 and loaded.args.hidden_size == target.model.args.hidden_size
    assert mx.array_equal(loaded.draft_vocab, drafter.draft_vocab)
    # resuming a finished run does no more steps and keeps the weights
    again, s2 = train_drafter(target, shards, tmp_path / "run", cfg, log=lambda m: None)
    assert mx.allclose(again.lm_head[-1].weight, drafter.lm_head[-1].weight)


def test_bad_prompt_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError, match="no prompts"):
        read_prompts(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(UserError, match="prompt"):
        read_prompts(bad)


def test_checkpoint_for_another_model(target, tmp_path):
    shards = generate_dataset(target, PROMPTS[:2], tmp_path / "cache", shard_size=2, batch_size=2, max_new_tokens=4,
                              progress=False)
    save_drafter(random_drafter(64, 100, seed=0), tmp_path / "run" / "checkpoint")
    with pytest.raises(UserError) as e:
        train_drafter(target, shards, tmp_path / "run", TrainConfig(steps=1), log=lambda m: None)
    assert "hidden_size" in str(e.value) and "\n" not in str(e.value)


def test_cli_errors(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["train", "--prompts", str(tmp_path / "missing.jsonl")])
    assert res.exit_code != 0 and "error: prompts file" in res.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    res = runner.invoke(app, ["train", "--prompts", str(empty)])
    assert res.exit_code != 0 and "error:" in res.output and "no prompts" in res.output
    other = tmp_path / "other"
    save_drafter(random_drafter(64, 100, seed=0), other)
    res = runner.invoke(app, ["eval-drafter", "--drafter", str(other), "--num-prompts", "1", "--widths", "1",
                              "--lengths", "2"])
    assert res.exit_code != 0 and "error:" in res.output and "hidden_size" in res.output
    res = runner.invoke(app, ["eval-drafter", "--widths", "x"])
    assert res.exit_code != 0 and "error: --widths" in res.output


def test_train_help_explains_steps():
    res = CliRunner().invoke(app, ["train", "--help"])
    assert res.exit_code == 0
    assert "generate" in res.output and "save" in res.output



def test_shipped_drafter_loads(target):
    from mlx_redrafter.api import resolve_drafter, shipped_drafter_path

    path = shipped_drafter_path(target.name)
    assert path is not None and (path / "MODEL_CARD.md").exists()
    assert sum(f.stat().st_size for f in path.iterdir()) <= 25 * 2**20
    drafter, name = resolve_drafter("default", target)
    assert drafter is not None and name == f"shipped:{target.name}"
    assert drafter.lm_head[-1].weight.dtype == target.model.dtype
