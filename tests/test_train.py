"""The drafter data engine and training: corpus growth, resume, corrupt shards, features, a tiny real run."""

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from mlx_redrafter.cmd.app import app
from mlx_redrafter.draft.redrafter import load_drafter, random_drafter, save_drafter
from mlx_redrafter.errors import UserError
from mlx_redrafter.train.corpus import Corpus, load_shard
from mlx_redrafter.train.distill import grow, partial_path, partial_states_path
from mlx_redrafter.train.features import feature_paths, teacher_forced
from mlx_redrafter.train.greedy import GreedySource, follow_up_suffix, generate_greedy
from mlx_redrafter.train.loop import TrainConfig, train_drafter
from mlx_redrafter.train.pipeline import prepare
from mlx_redrafter.train.plan import FOLLOW_UPS, Settings, follow_choice, hash_unit, plan_jobs

PROMPTS = ["What is the capital of France?", "Name three colors.", "Say hello.", "Count to five.",
           "Tell me a fun fact.", "Name a fruit."]
SETTINGS = Settings(max_new_tokens=16, shard_size=2, batch_size=2, heldout=2, turn2_every=2)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "source": "oasst"}) + "\n" for p in PROMPTS))
    return f


def build(target, prompts_file, root, settings, features_dir=None, **kw):
    """Grow a greedy corpus (the target's own answers) at `root`."""
    source = GreedySource(target, prompts_file, settings, capture=features_dir is not None)
    return grow(source, target, root, features_dir=features_dir, **kw)


@pytest.fixture(scope="module")
def corpus_dirs(target, prompts_file, tmp_path_factory):
    """A greedy corpus `c` and its features root `f` (the states generation kept are in f/c)."""
    root = tmp_path_factory.mktemp("corpus")
    build(target, prompts_file, root / "c", SETTINGS, features_dir=root / "f" / "c", progress=False,
          log=lambda m: None)
    return root / "c", root / "f"


def test_batched_generation_matches_one_prompt_alone(target):
    tok = target.tokenizer
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    batch, hid = generate_greedy(target.model, ids, 8, tok.eos_ids, capture=True)
    for p, out, h in zip(ids, batch, hid):
        (alone,), _ = generate_greedy(target.model, [p], 8, tok.eos_ids)
        assert out == alone
        assert h.shape == (len(out), target.model.args.hidden_size) and h.dtype == np.float16


def test_branches_of_a_shared_prompt_match_their_full_prompts(target):
    """Several continuations of one prompt (prefilled once, its cache row copied per branch) give the ids each
    full prompt gives alone, whatever the suffixes' lengths."""
    from mlx_redrafter.train.greedy import follow_up_suffix

    tok = target.tokenizer
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    first, _ = generate_greedy(target.model, ids, 12, tok.eos_ids)
    convs = [i + o for i, o in zip(ids, first)]
    sfx = [follow_up_suffix(target, t) for t in FOLLOW_UPS[:3]]
    assert len({len(x) for x in sfx}) > 1
    branches = [(i, sfx[j]) for i in range(3) for j in range(3) if (i + j) % 2 == 0 or j == 1]
    out, hid = generate_greedy(target.model, convs, 10, tok.eos_ids, capture=True, branches=branches)
    full, hid_full = generate_greedy(target.model, [convs[i] + s for i, s in branches], 10, tok.eos_ids,
                                     capture=True)
    assert out == full
    for a, b in zip(hid, hid_full):
        assert a.shape == b.shape and np.allclose(a.astype(np.float32), b.astype(np.float32), atol=0.05)


def test_prompts_that_join_a_running_batch_decide_what_they_decide_alone(target):
    """Continuous batching in the data engine: groups of prompts join rows that are already decoding (longer and
    shorter than them, so either side's cache is shifted to align them), finished rows leave, and every row still
    decides the ids (and states) its prompt decides alone."""
    from mlx_redrafter.train.greedy import ROOM, GreedyRows, follow_up_suffix

    tok = target.tokenizer
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    long_prompt = tok.encode_chat([{"role": "user", "content": " ".join(PROMPTS) * 3}])
    sfx = follow_up_suffix(target, FOLLOW_UPS[0])
    rows = GreedyRows(target.model, 10, tok.eos_ids, capture=True)
    rows.add(ids[:2], [(0, []), (1, [])], ["a", "b"])
    for _ in range(3):
        rows.step()
    rows.add([long_prompt], [(0, [])], ["long"])  # longer than the running rows' cache: they shift
    rows.step()
    rows.add(ids[2:4], [(0, sfx), (1, []), (1, sfx)], ["c+", "d", "d+"])  # shorter: the new rows shift
    assert rows.cache.keys[0].shape[2] == rows.cache.offset + ROOM  # no more free slots than that after a join
    while rows.live:
        rows.step()
    wanted = {"a": ids[0], "b": ids[1], "long": long_prompt, "c+": ids[2] + sfx, "d": ids[3], "d+": ids[3] + sfx}
    for key, prompt in wanted.items():
        (alone,), (h_alone,) = generate_greedy(target.model, [prompt], 10, tok.eos_ids, capture=True)
        out, h = rows.result(key)
        assert out == alone, key
        assert np.allclose(h.astype(np.float32), h_alone.astype(np.float32), atol=0.05), key


def test_turn2_passes_over_the_same_sequences_are_made_together(target, prompts_file, corpus_dirs, tmp_path):
    """The data job makes the later turn-2 passes over a group's sequences together (one prefill for their
    follow-ups): each shard holds what it holds made alone, and its manifest entry names its group."""
    import shutil

    from mlx_redrafter.train.greedy import SIBLINGS

    root, _ = corpus_dirs
    source = GreedySource(target, prompts_file, SETTINGS)
    jobs = source.jobs()
    job = next(j for j in jobs if j.turn == 2 and j.follow_pass > 0 and j.rows)
    group = [job, *source.companions(job, jobs)]
    assert len(group) == SIBLINGS and len({j.follow_pass for j in group}) == SIBLINGS
    assert len({follow_choice(job.rows[0], j.follow_pass, SETTINGS) for j in group}) == SIBLINGS
    together, alone = tmp_path / "together", tmp_path / "alone"
    shutil.copytree(root, together)
    shutil.copytree(root, alone)
    made = source.make_group(group, Corpus(together, target.model.args.vocab_size), lambda units, tokens: None)
    again = []  # the partial files hold every answer: a resumed group decodes nothing
    source.make_group(group, Corpus(together, target.model.args.vocab_size), lambda units, tokens: again.append(tokens))
    assert sum(again) == 0
    for j, m in zip(group, made):
        single = source.make(j, Corpus(alone, target.model.args.vocab_size), lambda units, tokens: None)
        assert m.seqs == single.seqs and m.prompt_lens == single.prompt_lens and m.index == single.index
        assert m.info["made_with"] == [g.name for g in group]
    entries = Corpus(root).entries  # the fixture's corpus was grown by `grow`, which groups them
    grouped = [e for e in entries.values() if "made_with" in e]
    assert grouped and all(e["cpu_seconds"] > 0 for e in grouped)


def test_a_stopped_group_saves_the_answers_it_finished(target, prompts_file, corpus_dirs, tmp_path):
    """Ctrl-C or SIGTERM (a KeyboardInterrupt: `cmd.common.stops_cleanly`) inside a group of turn-2 shards saves
    the answers finished since the last periodic save; the resumed group equals an uninterrupted one."""
    import shutil

    root, _ = corpus_dirs
    source = GreedySource(target, prompts_file, replace(SETTINGS, batch_size=64))  # no periodic save before the end
    jobs = source.jobs()
    job = next(j for j in jobs if j.turn == 2 and j.follow_pass > 0 and j.rows)
    group = [job, *source.companions(job, jobs)]
    shutil.copytree(root, tmp_path / "a")
    shutil.copytree(root, tmp_path / "b")
    corpus = Corpus(tmp_path / "a", target.model.args.vocab_size)
    reported = []

    def stopped(units, tokens):
        if tokens:
            reported.append(units)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        source.make_group(group, corpus, stopped)
    held = [len(np.load(partial_path(corpus, j.name))["index"]) for j in group if partial_path(corpus, j.name).exists()]
    assert reported and sum(held) == reported[0] > 0
    resumed = source.make_group(group, corpus, lambda units, tokens: None)
    fresh = source.make_group(group, Corpus(tmp_path / "b", target.model.args.vocab_size), lambda units, tokens: None)
    assert [m.seqs for m in resumed] == [m.seqs for m in fresh]


def test_rows_a_group_skips_count_before_its_answers(target, prompts_file, corpus_dirs, tmp_path):
    """Turn-2 prompts too long with their turn-1 answer are skipped; the progress bar counts them at once, so its
    rate and ETA are those of the answers still to make (counted at the end, they made the ETA ~1.6x too long)."""
    import shutil

    root, _ = corpus_dirs
    source = GreedySource(target, prompts_file, replace(SETTINGS, max_prompt_tokens=60))
    jobs = source.jobs()
    job = next(j for j in jobs if j.turn == 2 and j.follow_pass > 0 and j.rows)
    group = [job, *source.companions(job, jobs)]
    shutil.copytree(root, tmp_path / "c")
    calls = []
    made = source.make_group(group, Corpus(tmp_path / "c", target.model.args.vocab_size),
                             lambda units, tokens: calls.append((units, tokens)))
    skipped = sum(m.info["skipped_prompts"] for m in made)
    assert 0 < skipped < sum(len(j.rows) for j in group), "the limit should skip some of the group's rows"
    assert calls[0] == (skipped, 0) and all(tokens > 0 for units, tokens in calls[1:] if units)


def _stopped_while_running(args: list[str], tmp_path, sig, started: str, stderr_first: bool = False) -> str:
    """Run `redrafter-mlx ARGS` with Ctrl-C ignored (as a script's shell starts background commands), send `sig`
    a second after its first line (on stdout, or stderr) holds `started`; it must stop with status 130 and no
    traceback. Returns its stderr."""
    import signal
    import subprocess
    import sys
    import time

    from one_line import cli_env

    p = subprocess.Popen([sys.executable, "-m", "mlx_redrafter.cmd.main", *args], env=cli_env(tmp_path), cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    first = (p.stderr if stderr_first else p.stdout).readline()
    assert started in first, first
    time.sleep(1)
    p.send_signal(sig)
    try:
        err = p.communicate(timeout=120)[1]
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"{args[0]} ran on after {sig.name}")
    assert p.returncode == 130 and "Traceback" not in err, (sig.name, p.returncode, err[-2000:])
    return err


def test_a_stopped_data_job_exits_cleanly_even_started_with_ctrl_c_ignored(tmp_path):
    """`make distill` starts its workers in the background of a shell, which starts them with Ctrl-C ignored: they
    used to run on after the make had stopped. A worker now stops on Ctrl-C (and SIGTERM) with status 130 and no
    traceback."""
    import signal

    prompts = tmp_path / "p.jsonl"  # enough answers to be stopped in the middle of them
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about the number {i}.", "source": "oasst"}) + "\n"
                               for i in range(100)))
    for sig in (signal.SIGINT, signal.SIGTERM):  # the plan's line: the worker has started generating
        _stopped_while_running(["distill", "--prompts", str(prompts), "--corpus", str(tmp_path / "c"),
                                "--features", str(tmp_path / "f"), "--nice", "0"], tmp_path, sig, "shards to make")
        assert not list((tmp_path / "c").glob("*/shard-*.npz")), sig.name  # stopped before a shard was written


def test_a_stopped_training_exits_cleanly_and_says_where_a_rerun_goes_on(tmp_path):
    """`train` is long work too (hours here): Ctrl-C, even where a script's shell ignores it, stops it with status
    130, no traceback, and a line saying what a rerun starts from (SIGTERM takes the same path: `stops_cleanly`, as
    the data job's test above shows for both)."""
    import signal
    from pathlib import Path

    corpus = Path(__file__).resolve().parents[1] / "data" / "corpus" / "smollm2-135m"
    err = _stopped_while_running(["train", "--corpus", str(corpus), "--shards", "1", "--steps", "1", "--run-dir",
                                  str(tmp_path / "run"), "--features", str(tmp_path / "f")], tmp_path, signal.SIGINT,
                                 "step 1/3: features", stderr_first=True)  # the model is loaded, features begin
    assert "stopped: no checkpoint yet" in err and "the same command goes on" in err, err[-2000:]


def test_corpus_resumes_after_interruption_and_regenerates_corrupt_shards(target, prompts_file, tmp_path):
    root, messages, settings = tmp_path / "c", [], replace(SETTINGS, max_new_tokens=8)  # short answers: resuming
    first = build(target, prompts_file, root, settings, max_shards=2, progress=False, log=messages.append)
    assert sorted(first.entries) == ["shard-00000.npz", "shard-00001.npz"]
    stamp = (root / "shard-00000.npz").stat().st_mtime_ns
    (root / ".shard-00002.npz.tmp").write_bytes(b"an interrupted write")  # what a kill leaves behind at worst
    (root / "shard-00001.npz").write_bytes(b"junk")  # a corrupt shard
    done = build(target, prompts_file, root, settings, progress=False, log=messages.append)
    assert (root / "shard-00000.npz").stat().st_mtime_ns == stamp  # kept, not regenerated
    assert any("shard-00001.npz is corrupt" in m and "regenerating" in m for m in messages)
    assert done.check("shard-00001.npz") is None
    stats = done.stats()
    assert stats["prompts"] == len(PROMPTS) and stats["response_tokens"] > 0
    turn2 = [n for n, e in done.entries.items() if e["turn"] == 2]
    assert turn2, "multi-turn continuations are part of the plan"
    # a shard damaged after the fact is a one-line error for training, never silently skipped
    (root / "shard-00002.npz").write_bytes(b"junk")
    with pytest.raises(UserError, match="corrupt.*make distill"):
        Corpus(root).shards()


def test_a_partial_shards_states_are_kept_only_for_the_layers_they_were_captured_with(tmp_path):
    from mlx_redrafter.train.greedy import Partial

    corpus, prompts = Corpus(tmp_path / "c"), [[1, 2, 3], [4, 5]]
    Partial(corpus, "shard-00001.npz", prompts, 8, True).save({0: [7, 8]}, {0: np.ones((2, 576), np.float16)})
    responses, hiddens, _ = Partial(corpus, "shard-00001.npz", prompts, 8, True).load()
    assert responses == {0: [7, 8]} and hiddens[0].shape == (2, 576)
    responses, hiddens, _ = Partial(corpus, "shard-00001.npz", prompts, 8, True, (2, 15)).load()
    assert responses == {0: [7, 8]} and hiddens == {}  # the answers resume; their states are captured anew


def test_an_interrupted_shard_resumes_from_its_finished_batches(target, prompts_file, tmp_path, capsys):
    """A kill inside a shard keeps its finished batches; the resumed shard equals an uninterrupted one, and its
    manifest entry counts what the batches made before the kill cost."""
    settings = Settings(max_new_tokens=8, shard_size=4, batch_size=2, heldout=4, turn2_every=2)
    source = GreedySource(target, prompts_file, settings, capture=True)
    job = source.jobs()[0]
    corpus = Corpus(tmp_path / "c", target.model.args.vocab_size)

    def killed(units, tokens):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        source.make(job, corpus, killed)
    assert partial_path(corpus, job.name).exists()
    new_tokens = []
    resumed = source.make(job, corpus, lambda units, tokens: new_tokens.append(tokens))
    assert new_tokens[0] == 0 and new_tokens[1] > 0  # the first batch came from the partial file
    fresh = source.make(job, Corpus(tmp_path / "d", target.model.args.vocab_size), lambda units, tokens: None)
    assert resumed.seqs == fresh.seqs and resumed.prompt_lens == fresh.prompt_lens
    assert all(np.array_equal(a, b) for a, b in zip(resumed.hidden, fresh.hidden))
    assert resumed.info["resumed_seconds"] > 0 and resumed.info["resumed_cpu_seconds"] > 0
    assert "resumed_seconds" not in fresh.info
    assert partial_path(corpus, job.name).parent.name == "partial"  # committed with the corpus
    partial_states_path(corpus, job.name).unlink()  # the states stay on the machine that captured them
    elsewhere = source.make(job, corpus, lambda units, tokens: new_tokens.append(tokens))
    assert elsewhere.seqs == fresh.seqs and elsewhere.hidden is None  # features rebuilt by the teacher-forced pass
    logged = []
    grow(source, target, tmp_path / "c", max_shards=1, progress=True, log=logged.append)
    assert logged[0].startswith(f"distill {corpus.name} (greedy): shards to make: 1 ")
    assert f"distill {corpus.name} {job.name}" in capsys.readouterr().err  # the bar and its ETA: the shard in hand
    assert not partial_path(corpus, job.name).exists()  # removed once the shard is written
    assert not partial_path(corpus, job.name).parent.exists()
    entry = Corpus(tmp_path / "c").entries[job.name]  # every batch came from the partial file: its cost is theirs
    assert entry["cpu_seconds"] > 0 and entry["seconds"] > 0 and "resumed_seconds" not in entry


def test_the_plan_goes_on_after_the_prompts_without_renumbering_a_shard():
    """Once every prompt has its first answer, further turn-2 passes continue the rest of each group's sequences:
    the interleaved plan is a prefix of the full one; every row of a group is continued once in each cycle of
    passes, with a follow-up it was not asked before, until it has been asked every follow-up."""
    s = Settings(shard_size=8, heldout=8, turn2_every=4)
    jobs = plan_jobs(8 + 8 * 9, s)  # 9 turn-1 shards: two full groups of 4 and one shard left over
    first = [j for j in jobs if j.follow_pass == 0]
    assert jobs[: len(first)] == first and [j.index for j in jobs] == list(range(len(jobs)))
    assert [j.turn for j in first] == [1] + ([1] * 4 + [2]) * 2 + [1]
    later = jobs[len(first):]
    assert [j.follow_pass for j in later] == [k for k in range(1, 4 * len(FOLLOW_UPS)) for _ in range(2)]
    assert all(j.turn == 2 for j in later)
    for group in (first[1:5], first[6:10]):
        parents = [j.index for j in group]
        asked: dict[int, list[int]] = {}
        for j in jobs:
            if j.turn == 2 and j.parents == parents:
                for r in j.rows:
                    asked.setdefault(r, []).append(follow_choice(r, j.follow_pass, s))
        assert sorted(asked) == sorted(r for j in group for r in j.rows)
        assert all(sorted(v) == list(range(len(FOLLOW_UPS))) for v in asked.values())
    assert first[5].rows == [r for j in first[1:5] for r in j.rows if hash_unit(f"turn2:0:{r}") < 0.25]


def test_committed_turn2_shards_ask_the_follow_ups_the_plan_gives_them(target):
    """The plan grows by later rounds of follow-ups without changing what an earlier pass asks: every committed
    turn-2 shard's prompts end with the follow-up `follow_choice` gives its row and pass today."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "data" / "corpus" / "smollm2-135m"
    c = Corpus(root)
    s = Settings(**json.loads((root / "manifest.json").read_text())["settings"])
    n_rows = 1 + max(e["plan_rows"][1] for e in c.entries.values() if e["turn"] == 1)
    jobs = {j.name: j for j in plan_jobs(n_rows, s)}
    suffixes = [follow_up_suffix(target, t) for t in FOLLOW_UPS]
    checked = 0
    for name in sorted(n for n, e in c.entries.items() if e["turn"] == 2)[::20]:
        sh = load_shard(root / name)
        for i in range(min(3, len(sh.prompt_len))):
            prompt = sh.sequence(i)[: sh.prompt_len[i]].tolist()
            want = suffixes[follow_choice(int(sh.prompt_index[i]), jobs[name].follow_pass, s)]
            assert prompt[-len(want):] == want
            checked += 1
    assert checked > 60


def test_turn2_sequences_continue_the_first_answer(target, corpus_dirs):
    root, _ = corpus_dirs
    c = Corpus(root)
    for name, e in c.entries.items():
        if e["turn"] != 2 or not e["sequences"]:
            continue
        sh = load_shard(root / name)
        text = target.tokenizer.decode(sh.sequence(0).tolist())
        assert text.count("<|im_start|>user") == 2 and text.count("<|im_start|>assistant") == 2


def test_captured_features_equal_a_teacher_forced_pass(target, corpus_dirs):
    root, feats = corpus_dirs
    c = Corpus(root)
    for name in sorted(c.entries)[:2]:
        sh = load_shard(root / name)
        captured = np.load(feature_paths(feats / "c", name, c.entries[name]["sha256"]).hidden).astype(np.float32)
        forced = teacher_forced(target.model, sh, target.tokenizer.eos_ids[0])[0].astype(np.float32)
        assert captured.shape == forced.shape
        scale = np.abs(forced).max(axis=1, keepdims=True)
        assert (np.abs(captured - forced) <= 2e-3 * scale + 1e-3).all()  # float16 storage, batched vs single


def test_tiny_training_run_learns_and_resumes(target, corpus_dirs, tmp_path):
    root, feats = corpus_dirs
    (tmp_path / "f").symlink_to(feats, target_is_directory=True)
    tr, ho, used = prepare(target, [root], tmp_path / "f", log=lambda m: None)
    assert used["corpora"]["c"]["train_shards"] >= 1 and len(tr) > 0 and len(ho) > 0
    cfg = TrainConfig(steps=24, batch_size=32, draft_vocab_size=512, num_draft_layers=1, warmup=3, eval_every=12,
                      checkpoint_every=12, lr=3e-3)
    drafter, summary = train_drafter(target, tr, ho, tmp_path / "run", cfg, progress=False, log=lambda m: None)
    hist = summary["history"]
    assert [r["step"] for r in hist] == [0, 12, 24] and "train_loss" not in hist[0]  # measured before step 1 too
    assert hist[-1]["train_loss"] < hist[1]["train_loss"] and "val_loss" in hist[0]
    assert len(hist[-1]["acc"]) == cfg.draft_len
    ckpt = tmp_path / "run" / "checkpoint"
    assert ckpt.is_symlink() and {p.name for p in ckpt.iterdir()} >= {"model.safetensors", "optimizer.safetensors",
                                                                      "trainer_state.json", "config.json"}
    assert [p.name for p in (tmp_path / "run").glob("ckpt-*")] == [ckpt.resolve().name]  # older ones removed
    (tmp_path / "run" / "ckpt-9999999").mkdir()  # what an interrupted save leaves: never linked, never read
    loaded = load_drafter(tmp_path / "run" / "checkpoint")
    assert loaded.args.draft_vocab_size == 512 and mx.array_equal(loaded.draft_vocab, drafter.draft_vocab)
    again, _ = train_drafter(target, tr, ho, tmp_path / "run", cfg, progress=False, log=lambda m: None)
    assert mx.allclose(again.lm_head[-1].weight, drafter.lm_head[-1].weight)  # a finished run does no more steps
    soft = TrainConfig(**{**cfg.__dict__, "labels": "soft", "steps": 4, "eval_every": 4, "checkpoint_every": 4})
    _, s = train_drafter(target, tr, ho, tmp_path / "soft", soft, progress=False, log=lambda m: None)
    assert np.isfinite(s["history"][-1]["train_loss"])


def test_checkpoint_for_another_model_is_a_one_line_error(target, corpus_dirs, tmp_path):
    root, feats = corpus_dirs
    tr, ho, _ = prepare(target, [root], feats, log=lambda m: None)
    save_drafter(random_drafter(64, 100, seed=0), tmp_path / "run" / "checkpoint")
    (tmp_path / "run" / "checkpoint" / "trainer_state.json").write_text('{"step": 1}')
    with pytest.raises(UserError) as e:
        train_drafter(target, tr, ho, tmp_path / "run", TrainConfig(steps=2), progress=False, log=lambda m: None)
    assert "hidden_size" in str(e.value) and "\n" not in str(e.value)


def test_shards_option_picks_shards_by_plan_index(target, corpus_dirs, tmp_path):
    root, feats = corpus_dirs
    train_names = [p.name for p in Corpus(root).shards("train")]
    _, _, used = prepare(target, [root], feats, log=lambda m: None, shards=[2])
    assert used["corpora"][root.name]["train_shards"] == 1 and "shard-00002.npz" in train_names
    with pytest.raises(UserError) as e:
        prepare(target, [root], feats, log=lambda m: None, shards=[0])  # the held-out shard never trains
    assert "--shards" in str(e.value)
    res = CliRunner().invoke(app, ["features", "--corpus", str(root), "--features", str(tmp_path / "f"),
                                   "--shards", "3-1", "--nice", "0"])
    assert res.exit_code == 2 and "error: --shards takes" in res.output


def test_cli_errors(tmp_path):
    lm = CliRunner()
    res = lm.invoke(app, ["train", "--corpus", str(tmp_path / "none")])
    assert res.exit_code == 2 and "error: no corpus" in res.output
    res = lm.invoke(app, ["distill", "--prompts", str(tmp_path / "missing.jsonl"), "--nice", "0"])
    assert res.exit_code == 2 and "error: prompts file" in res.output
    other = tmp_path / "other"
    save_drafter(random_drafter(64, 100, seed=0), other)
    res = lm.invoke(app, ["eval-drafter", "--drafter", str(other), "--num-prompts", "1", "--widths", "1",
                              "--lengths", "2"])
    assert res.exit_code == 2 and "hidden_size" in res.output
    res = lm.invoke(app, ["eval-drafter", "--widths", "x"])
    assert res.exit_code == 2 and "error: --widths" in res.output
    for layers, needle in (("2,40", "has layers 0-29"), ("x", "--feature-layers takes"), ("-1,2", "feature_layers")):
        res = lm.invoke(app, ["features", "--feature-layers", layers, "--nice", "0", "--features",
                              str(tmp_path / "f")])
        assert res.exit_code == 2 and res.output.startswith("error: ") and needle in res.output, res.output
    assert not (tmp_path / "f").exists() or not any((tmp_path / "f").iterdir())


def test_train_help_explains_the_steps():
    res = CliRunner().invoke(app, ["train", "--help"])
    assert res.exit_code == 0 and "features" in res.output and "save" in res.output


def test_shipped_drafter_loads(target):
    from mlx_redrafter.api import resolve_drafter, shipped_drafter_path

    path = shipped_drafter_path(target.name)
    assert path is not None and (path / "MODEL_CARD.md").exists()
    assert sum(f.stat().st_size for f in path.iterdir()) <= 25 * 2**20
    drafter, name = resolve_drafter("default", target)
    assert drafter is not None and name == f"shipped:{target.name}"
    assert drafter.lm_head[-1].weight.dtype == target.model.dtype


def test_answer_table_holds_the_train_split_answers(target, corpus_dirs, tmp_path):
    from mlx_redrafter.draft.lookup import AnswerTable

    corpus_dir, _ = corpus_dirs
    out = tmp_path / "answers.npz"
    res = CliRunner().invoke(app, ["answers", "--corpus", str(corpus_dir.parent), "--model", corpus_dir.name,
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    corpus = Corpus(corpus_dir)
    want = []
    for path in corpus.shards("train"):
        shard = load_shard(path)
        for i in range(shard.num_sequences):
            want += [*shard.sequence(i)[int(shard.prompt_len[i]):].tolist(), -1]
    table = AnswerTable.load(out)
    assert table.tokens[: len(want)].tolist() == want and table.meta["sequences"] == want.count(-1)
    assert set(table.meta["shards"]) == {p.name for p in corpus.shards("train")}  # the held-out shard stays out
    res = CliRunner().invoke(app, ["answers", "--corpus", str(tmp_path / "none"), "--out", str(out)])
    assert res.exit_code != 0 and "no corpus at" in res.output


def test_eval_drafter_drafts_from_the_head_rows_it_is_given():
    lm = CliRunner()
    args = ["eval-drafter", "--num-prompts", "1", "--widths", "1", "--lengths", "3", "--max-tokens", "8", "--json"]
    res = lm.invoke(app, [*args, "--drafter-vocab", "4096"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["drafter_vocab"] == 4096 and out["results"][0]["steps"] > 0
    res = lm.invoke(app, [*args, "--drafter-vocab", "99999"])
    assert res.exit_code == 2 and "error: --drafter-vocab must be between 1 and the drafter's 8192" in res.output


def test_eval_drafter_replay_decides_what_decoding_decides(tmp_path):
    """Replaying the greedy answers gives the tokens per call that decoding the prompts gives, for a chain and a
    tree of the shipped (layer-fusing) drafter and for the default mode's lookup-else-rnn; the answers are decoded
    once and read back by the next run."""
    lm = CliRunner()
    replay = ["--replay", "--replay-cache", str(tmp_path / "answers")]
    for draft, widths in (("rnn", "1,2"), ("lookup-else-rnn", "1")):
        args = ["eval-drafter", "--num-prompts", "2", "--widths", widths, "--lengths", "3", "--max-tokens", "32",
                "--draft", draft, "--json"]
        runs = {}
        for how in ("decode", "replay", "replay again"):
            res = lm.invoke(app, args + (replay if how != "decode" else []))
            assert res.exit_code == 0, res.output
            runs[how] = json.loads(res.stdout.strip().splitlines()[-1])
            assert ("greedy answers to replay" in res.output) == (how == "replay" and draft == "rnn")
        assert runs["replay again"] == runs["replay"] | {"results": runs["replay again"]["results"]}
        assert [r["tokens_per_step_pooled"] for r in runs["replay again"]["results"]] == \
            [r["tokens_per_step_pooled"] for r in runs["replay"]["results"]]
        assert runs["replay"]["method"] == "replay" and runs["decode"]["method"] == "decode"
        for d, r in zip(runs["decode"]["results"], runs["replay"]["results"]):
            assert r["steps"] > 0 and r["draft_ms_per_step"] is None
            # the same steps, up to one that float rounding between the two forwards may decide otherwise
            assert abs(r["steps"] - d["steps"]) <= 1, (draft, d, r)
            assert abs(r["tokens_per_step_pooled"] - d["tokens_per_step_pooled"]) <= 2 / d["steps"], (draft, d, r)
    assert len(list((tmp_path / "answers").iterdir())) == 1  # both modes replayed the same answers and states
    (tmp_path / "file").write_text("")
    res = lm.invoke(app, ["eval-drafter", "--replay", "--replay-cache", str(tmp_path / "file")])
    assert res.exit_code == 2 and res.output.startswith("error: ") and "--replay-cache" in res.output
