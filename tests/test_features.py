"""The teacher-forced feature engine and the corpus sources: labels from the target, fixed text, safe manifests,
checkpoints written as one unit."""

import json
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from mlx_redrafter.cmd.app import app
from mlx_redrafter.train.corpus import Corpus, Shard, load_shard
from mlx_redrafter.train.distill import grow
from mlx_redrafter.train.features import TOP_K, ensure, feature_paths, load_features, teacher_forced
from mlx_redrafter.train.plan import Settings
from mlx_redrafter.train.text import TextSource

PAIRS = [("What is 2 + 3?", "2 + 3 = 5. The answer is 5."),
         ("Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b"),
         ("Greet me like a pirate.", "Ahoy, matey! Welcome aboard!"),
         ("Name a primary color.", "Red is a primary color."),
         ("What is the opposite of hot?", "The opposite of hot is cold.")]
SETTINGS = Settings(max_new_tokens=24, shard_size=2, heldout=1)


def shard_of(seqs: list[list[int]], prompt_lens: list[int]) -> Shard:
    lens = [len(s) for s in seqs]
    return Shard(tokens=np.concatenate([np.array(s, np.int32) for s in seqs]),
                 offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                 prompt_len=np.array(prompt_lens, np.int32), prompt_index=np.arange(len(seqs), dtype=np.int32),
                 turn=np.ones(len(seqs), np.int8), split="train")


@pytest.fixture(scope="module")
def responses_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "responses.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "response": r, "source": "oasst", "license": "MIT"}) + "\n"
                         for p, r in PAIRS))
    return f


def test_labels_equal_the_runtimes_own_logits_at_every_position(target):
    """The engine's hidden states and top-k labels at every context position equal what the runtime computes when
    it feeds the same sequence one token at a time (its decode path)."""
    model, tok = target.model, target.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p, _ in PAIRS[:3]]
    seqs = [p + tok.encode(r) for p, (_, r) in zip(prompts, PAIRS[:3])]
    hidden, ids, logp = teacher_forced(model, shard_of(seqs, [len(p) for p in prompts]), tok.eos_ids[0])
    row = 0
    for seq, p in zip(seqs, prompts):
        cache = model.make_cache(len(seq))
        logits, h = model(mx.array([seq[: len(p)]]), cache, last_only=True)
        cache.advance(len(p))
        steps = [(logits[0, -1], h[0, -1])]
        for t in seq[len(p) : -1]:
            logits, h = model(mx.array([[t]]), cache)
            cache.advance(1)
            steps.append((logits[0, -1], h[0, -1]))
        for lg, hh in steps:  # context positions P-1 .. n-2
            x = np.array(lg, dtype=np.float64)  # the normaliser in float64 (MLX's own is off by up to ~3e-4 here)
            lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
            want = np.argsort(-lp, kind="stable")[:TOP_K]
            assert ids[row].tolist() == want.tolist()
            np.testing.assert_allclose(logp[row], lp[want], atol=2e-4)
            np.testing.assert_allclose(hidden[row].astype(np.float32), np.array(hh), atol=2e-2, rtol=2e-3)
            row += 1
    assert row == len(hidden) == len(ids)


def test_fixed_text_becomes_chat_sequences_labelled_by_the_target(target, responses_file, tmp_path):
    tok = target.tokenizer
    corpus = grow(TextSource(target, responses_file, SETTINGS), target, tmp_path / "t", progress=False,
                  log=lambda m: None)
    assert corpus.manifest["source"] == "text" and corpus.stats()["sequences"] == len(PAIRS)
    assert [corpus.entries[n]["split"] for n in sorted(corpus.entries)] == ["heldout", "train", "train"]
    texts, decided_differ = [], False
    paths = ensure(corpus, target.model, tok.eos_ids[0], tmp_path / "f", progress=False, log=lambda m: None)
    for name in sorted(corpus.entries):
        sh = load_shard(tmp_path / "t" / name)
        f = load_features(paths[name], sh)
        start = 0
        for i in range(sh.num_sequences):
            seq, P = sh.sequence(i), int(sh.prompt_len[i])
            texts.append(tok.decode(seq.tolist()))
            assert seq[-1] in tok.eos_ids  # the response ends its turn
            top1 = f.top_ids[start : start + len(seq) - P, 0]
            decided_differ |= bool((top1 != seq[P:]).any())  # labels are the target's, not the text's
            start += len(seq) - P
    assert all(t.count("<|im_start|>assistant") == 1 for t in texts)
    assert any("Ahoy, matey!" in t for t in texts)
    assert decided_differ
    again = grow(TextSource(target, responses_file, SETTINGS), target, tmp_path / "t", progress=False,
                 log=lambda m: None)
    assert again.entries == corpus.entries  # resumable: nothing made twice


def test_labels_are_added_beside_states_kept_from_generation(target, responses_file, tmp_path):
    corpus = grow(TextSource(target, responses_file, SETTINGS), target, tmp_path / "t", progress=False,
                  log=lambda m: None)
    tok = target.tokenizer
    full = ensure(corpus, target.model, tok.eos_ids[0], tmp_path / "a", progress=False, log=lambda m: None)
    name = sorted(corpus.entries)[1]
    kept = feature_paths(tmp_path / "b", name, corpus.entries[name]["sha256"])
    kept.hidden.parent.mkdir(parents=True)
    kept.hidden.write_bytes(full[name].hidden.read_bytes())  # as if generation had stored the states
    messages = []
    ensure(corpus, target.model, tok.eos_ids[0], tmp_path / "b", [name], progress=False, log=messages.append)
    assert "1 labelled from stored states" in messages[0]
    with np.load(full[name].labels) as a, np.load(kept.labels) as b:
        assert (a["top_ids"][:, 0] == b["top_ids"][:, 0]).mean() > 0.99  # float16 states: near-ties may flip
        np.testing.assert_allclose(a["top_logp"][:, 0], b["top_logp"][:, 0], atol=0.05)


def test_a_fused_drafters_features_add_the_tapped_layers_to_the_states_a_cache_holds(target, responses_file,
                                                                                     tmp_path):
    """States and labels cached for a drafter that reads the last layer alone stay; asking for target layers
    teacher-forces the shard again and adds their states, each layer's output over its RMS."""
    corpus = grow(TextSource(target, responses_file, SETTINGS), target, tmp_path / "t", progress=False,
                  log=lambda m: None)
    tok, name = target.tokenizer, sorted(corpus.entries)[1]
    plain = ensure(corpus, target.model, tok.eos_ids[0], tmp_path / "f", [name], progress=False, log=lambda m: None)
    before = np.load(plain[name].hidden)
    messages = []
    wide = ensure(corpus, target.model, tok.eos_ids[0], tmp_path / "f", [name], progress=False, log=messages.append,
                  layers=(2, 15, 24))
    assert "1 shards teacher-forced with target layers 2, 15, 24" in messages[0]
    assert wide[name].hidden == plain[name].hidden and wide[name].taps.name.endswith(".taps-2-15-24.npy")
    f = load_features(wide[name], load_shard(corpus.root / name))
    assert f.taps.shape == (before.shape[0], 3 * 576) and np.array_equal(np.asarray(f.hidden), before)
    sh = load_shard(corpus.root / name)
    forced, _, _ = teacher_forced(target.model, sh, tok.eos_ids[0], layers=(2, 15, 24))
    assert np.array_equal(forced[:, 576:], np.asarray(f.taps)) and target.model.feature_layers == ()
    again = []
    ensure(corpus, target.model, tok.eos_ids[0], tmp_path / "f", [name], progress=False, log=again.append,
           layers=(2, 15, 24))
    assert again == []  # nothing left to build


def test_bad_responses_files_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    for content, needle in ((b'{"prompt": "x"}\n', "response"), (b"\xff\xfe", "UTF-8"), (b"not json\n", "JSON")):
        bad.write_bytes(content)
        res = CliRunner().invoke(app, ["distill", "--source", "text", "--responses", str(bad), "--nice", "0",
                                       "--corpus", str(tmp_path / "c")])
        assert res.exit_code == 2 and res.output.startswith("error: ") and needle in res.output, res.output
    res = CliRunner().invoke(app, ["distill", "--source", "endpoint", "--nice", "0"])
    assert res.exit_code == 2 and "--endpoint" in res.output


WRITER = textwrap.dedent("""
    import sys, time
    from mlx_redrafter.train.corpus import Corpus
    root, me, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    c = Corpus(root)  # loaded once: every later write merges with what the other process wrote meanwhile
    for i in range(n):
        c.write_shard(f"shard-{me}-{i:03d}.npz", f"{me}{i}".encode(), {"split": "train", "turn": 1, "sequences": 1,
                      "response_tokens": 1})
""")


def test_concurrent_workers_never_lose_or_roll_back_manifest_entries(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    (root / "manifest.json").write_text(json.dumps({"format": "redrafter-mlx-corpus/1", "shards": {}}))
    stale = Corpus(root)  # a worker that loaded the manifest before the others wrote anything
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(root), me, "30"]) for me in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    fresh = Corpus(root)
    assert len(fresh.entries) == 60 and all(fresh.check(n) is None for n in fresh.entries)
    stale.entries["shard-a-000.npz"] = {**fresh.entries["shard-a-000.npz"], "sha256": "0" * 64, "created_unix": 1.0}
    stale.write_shard("shard-z.npz", b"z", {"split": "train", "turn": 1, "sequences": 1, "response_tokens": 1})
    after = Corpus(root)
    assert len(after.entries) == 61 and after.check("shard-a-000.npz") is None  # the newer entry was kept


def test_train_output_refuses_a_folder_that_is_not_a_drafter(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("my notes")
    res = CliRunner().invoke(app, ["train", "--output", str(notes), "--corpus", str(tmp_path / "none")])
    assert res.exit_code == 2 and "does not write (todo.txt)" in res.output
    assert (notes / "todo.txt").read_text() == "my notes"


def test_chunked_forward_equals_one_forward(target):
    """Feeding a long left-padded batch in chunks through one KV cache gives the states of one forward."""
    from mlx_redrafter.model import forward_chunked
    from mlx_redrafter.train.batch import left_padded

    rng = np.random.default_rng(0)
    tok, pos, mask, _ = left_padded([rng.integers(100, 40000, n).tolist() for n in (300, 170, 41)],
                                    target.tokenizer.eos_ids[0])
    _, one = target.model(mx.array(tok), target.model.make_cache(tok.shape[1]), mx.array(pos), mx.array(mask))
    cache = target.model.make_cache(tok.shape[1])
    _, chunked = forward_chunked(target.model, cache, mx.array(tok), mx.array(pos), mx.array(mask), all_hidden=True)
    assert cache.offset == tok.shape[1]
    assert chunked.shape == one.shape
    real = mx.array(mask[:, 0, -1, :])  # pad slots see only themselves: compare the real positions
    assert mx.abs(mx.where(real[..., None], chunked - one, 0)).max().item() < 1e-4
