"""The CUDA job (bench/torch_ref/cuda_job.py) on this CPU: its PyTorch engine decides what the runtime decides, its
features carry the target's own labels, and its answers land as plan shards that say where they were made."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from exactness import reading_layers

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")


def test_batched_engine_equals_the_runtimes_greedy(target, hf, chat_ids):
    from bench.torch_ref.cuda_job import greedy
    from mlx_redrafter.train.greedy import generate_greedy

    prompts = [chat_ids[0], chat_ids[5][:9], chat_ids[9]]  # different lengths: left padding
    eos = target.tokenizer.eos_ids
    ours, _ = generate_greedy(target.model, prompts, 12, eos)
    theirs, tops = greedy(hf, prompts, 12, eos, "cpu", top5=True)
    assert theirs == ours
    assert [len(t) for t in tops] == [len(o) for o in ours]
    assert all((t[:, 5] == np.array(o)).all() for t, o in zip(tops, ours))  # top-1 of the top-5 is the decision


def test_slot_engine_answers_what_the_runtime_answers(target, hf, chat_ids):
    """Continuous batching over fewer slots than prompts, prompts sharing a prefix, one prompt answered with eos at
    once: every answer is the runtime's greedy answer to the whole prompt."""
    from bench.torch_ref.slots import Unit, generate
    from mlx_redrafter.train.greedy import generate_greedy

    eos = target.tokenizer.eos_ids
    follows = [target.tokenizer.encode(" Say it again, shorter."), target.tokenizer.encode(" Why?")]
    units = [Unit(chat_ids[0][:-1], [chat_ids[0][-1:]], ["a"]), Unit(chat_ids[3], follows, ["b", "c"]),
             Unit(chat_ids[7][:-1], [chat_ids[7][-1:]], ["d"]), Unit(chat_ids[5][:4], [[eos[0]]], ["e"])]
    prompts = {k: u.prefix + f for u in units for f, k in zip(u.follows, u.keys)}
    ours, _ = generate_greedy(target.model, list(prompts.values()), 12, eos)
    expected = dict(zip(prompts, ours))
    single = [units[0], units[2], units[3]]  # one-token follow-ups taking every slot at once, in no set order
    for slots, some in ((2, units), (5, units), (3, single)):
        theirs = generate(hf, some, 12, eos, "cpu", slots=slots, max_len=max(map(len, prompts.values())) + 12)
        assert theirs == {k: expected[k] for u in some for k in u.keys}


def test_slot_engine_stops_admitting_before_its_deadline(hf, chat_ids):
    """Within `drain_s` of the deadline no unit starts: what is queued is left for another run, without error."""
    import time

    from bench.torch_ref.slots import Unit, generate

    units = [Unit(chat_ids[0][:-1], [chat_ids[0][-1:]], ["a"])]
    assert generate(hf, units, 4, [0], "cpu", slots=2, max_len=128, deadline=time.perf_counter() + 60,
                    drain_s=120) == {}
    with pytest.raises(ValueError, match="more follow-ups than"):  # it could never start: refused, not a hang
        generate(hf, [Unit([1, 2], [[3], [4], [5]], ["a", "b", "c"])], 4, [0], "cpu", slots=2, max_len=16)


def test_turn2_prompts_built_there_are_the_plans(target, tmp_path):
    """The job sends no turn-2 prompts, only which rows and follow-ups: the CUDA machine rebuilds each from the
    turn-1 shards of the corpus, and gets the prompts the plan's own code makes (cut first answers skipped)."""
    from bench.torch_ref.cuda_job import GEN_ENGINE, _save_sequences, land, prepare, turn2_units
    from mlx_redrafter.train.corpus import Corpus
    from mlx_redrafter.train.greedy import GreedySource

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Describe the number {k} in {k % 7 + 2} words."}) + "\n"
                               for k in range(1300)))
    corpus, job, result = tmp_path / "corpus", tmp_path / "job", tmp_path / "result"
    prepare(job, prompts, corpus, write_gguf=False)
    eos = target.tokenizer.eos_ids[0]
    with np.load(job / "job.npz") as z:
        got = {(1, int(j), int(r)): (z["t1_tok"][a:b].tolist(), [5, 6] + ([eos] if r % 5 else []))
               for j, r, a, b in zip(z["t1_job"], z["t1_row"], z["t1_off"][:-1], z["t1_off"][1:]) if 1 <= j <= 4}
    result.mkdir()
    _save_sequences(result, got, [1, 2, 3, 4])
    (result / "report.json").write_text(json.dumps({"device_name": "test", "generation_engine": GEN_ENGINE,
                                                    "generation": {"tokens": 3, "seconds": 1.0}}))
    land(result, prompts, corpus)
    assert sorted(Corpus(corpus).entries) == [f"shard-{k:05d}.npz" for k in (1, 2, 3, 4)]
    prepare(tmp_path / "job2", prompts, corpus, write_gguf=False)
    spec = json.loads((tmp_path / "job2" / "job.json").read_text())
    with np.load(tmp_path / "job2" / "job.npz") as z:
        units = turn2_units(dict(z), spec, {})
    built = {k: u.prefix + f for u in units for f, k in zip(u.follows, u.keys)}
    src = GreedySource(target, prompts)
    c = Corpus(corpus)
    expected = {}
    for j in src.jobs():
        if j.turn == 2:
            for r, p in zip(j.rows, src.turn2_prompts(c, j, set(target.tokenizer.eos_ids))):
                if p is not None:
                    expected[(2, j.index, r)] = p
    assert built == expected and len(built) > 100 and any(len(u.follows) > 1 for u in units)
    assert len({k[2] for k in built}) < len(built) // 2  # rows continued by several passes, prefilled once


def test_features_hold_the_targets_own_states_and_labels(target, hf, chat_ids):
    from bench.torch_ref.cuda_job import TOP_K, Features
    from mlx_redrafter.train.greedy import generate_greedy

    prompts = [chat_ids[1], chat_ids[2]]
    answers, _ = generate_greedy(target.model, prompts, 10, target.tokenizer.eos_ids)
    seqs = [(np.array(p + a), len(p)) for p, a in zip(prompts, answers)]
    layers = (2, 15, 24)
    f = Features(hf, seqs, "cpu", taps=layers)
    assert len(f) == sum(len(a) for a in answers) and f.top_ids.shape == (len(f), TOP_K)
    H, row = target.model.args.hidden_size, 0
    with reading_layers(target.model, layers):  # the runtime's features: the last state, then each layer over its RMS
        for s, P in seqs:
            logits, hidden = target.model(mx.array(s[None]), target.model.make_cache(len(s)))
            ctx, rows = slice(P - 1, len(s) - 1), slice(row, row + len(s) - P)
            assert (f.top_ids[rows, 0].numpy() == np.array(logits[0, ctx].argmax(-1))).all()
            assert np.allclose(f.hidden[rows].float().numpy(), np.array(hidden[0, ctx, :H]), atol=2e-2)
            taps = f.tap_hidden[rows].float().numpy().reshape(len(s) - P, -1)
            assert np.allclose(taps, np.array(hidden[0, ctx, H:]), atol=2e-2)
            row += len(s) - P


def test_replay_on_the_gpu_decides_what_the_runtimes_replay_decides(target, hf, chat_ids):
    """The CUDA job's tokens per call of the drafter alone (W1 L4, every start's run from one teacher-forced pass,
    then decoding's walk) equal the runtime's replay (`train/replay.py`, drafting step by step) of the same greedy
    answers with the same drafter, up to a step that float rounding between the two forwards may decide otherwise;
    only the first `max_tokens` answer tokens count."""
    from bench.torch_ref.cuda_job import Features, replay_rate
    from bench.torch_ref.drafter import from_mlx
    from mlx_redrafter import api
    from mlx_redrafter.train.replay import Answer, replay_answers
    from mlx_redrafter.train.replay import greedy_answers as runtime_answers

    try:
        drafter_model, name = api.resolve_drafter("default", target)
        lm = api.LoadedModel(target=target, drafter=drafter_model, drafter_name=name)
        answers = runtime_answers(lm, [chat_ids[5], chat_ids[6], chat_ids[7]], 40)
        opts = api.decode_options(draft="rnn", beam_width=1, beam_length=4, max_tokens=40)
        drafter = from_mlx(lm.drafter)
        emb = hf.model.embed_tokens.weight.detach().float()
        feats = Features(hf, [(a.tokens.astype(np.int64), a.prompt_len) for a in answers], "cpu", taps=(2, 15, 24))
        for max_tokens in (40, 17):
            mine = replay_rate(drafter, lambda x: emb[x], feats, length=4, max_tokens=max_tokens)
            cut = [Answer(a.tokens[: a.prompt_len + max_tokens], a.prompt_len, a.hidden) for a in answers]
            theirs = replay_answers(cut, lambda: api.make_allocator(lm, opts), 4, max_tokens)
            calls, decided = sum(st.steps for st in theirs), sum(st.decided for st in theirs)
            assert decided == sum(min(len(a.tokens) - a.prompt_len, max_tokens) - 1 for a in answers)
            hist = [sum(st.accepted_hist[k] for st in theirs) for k in range(4)]  # beam length 4: 3 drafted
            assert len(mine["accepted_hist"]) == 4 and sum(mine["accepted_hist"]) == mine["calls"]
            # float rounding (batched here, one sequence there) may flip a draft or two: the walks part there
            assert sum(abs(x - y) for x, y in zip(mine["accepted_hist"], hist)) <= 4, (mine, hist)
            assert abs(mine["tokens_per_call"] - decided / calls) <= 2 / calls and mine["tokens_per_call"] > 1
            assert mine["sequences"] == 3
        one_row = replay_rate(drafter, lambda x: emb[x], feats, max_tokens=17, head_rows=1)  # a head of one token
        assert one_row["tokens_per_call"] < mine["tokens_per_call"]
        with pytest.raises(ValueError, match="stride 1"):
            replay_rate(drafter, lambda x: emb[x], Features(hf, [(answers[0].tokens.astype(np.int64), 9)], "cpu",
                                                            taps=(2, 15, 24), stride=2))
    finally:  # the target's forward as the other tests expect it: its last state alone
        target.model.feature_layers = ()


def test_a_drafter_is_returned_averaged_with_its_start_where_that_replays_better(target, hf, chat_ids):
    """`soup` leaves the drafter as the best of start + alpha * (trained - start) by replayed tokens per call: a
    drafter 'trained' into noise comes back halfway to where it started (better than as trained), one trained into
    nothing new comes back as it was, and with no held-out answers to replay it comes back as trained."""
    from bench.torch_ref.cuda_job import Features, replay_rate, soup
    from bench.torch_ref.drafter import from_mlx
    from mlx_redrafter.api import resolve_drafter
    from mlx_redrafter.train.greedy import generate_greedy

    try:
        drafter = from_mlx(resolve_drafter("default", target)[0])
    finally:
        target.model.feature_layers = ()
    prompts = [chat_ids[8], chat_ids[9]]
    answers, _ = generate_greedy(target.model, prompts, 24, target.tokenizer.eos_ids)
    feats = Features(hf, [(np.array(p + a), len(p)) for p, a in zip(prompts, answers)], "cpu", taps=(2, 15, 24))
    emb = hf.model.embed_tokens.weight.detach().float()
    start = {k: t.clone() for k, t in drafter.state_dict().items()}
    torch.manual_seed(0)
    with torch.no_grad():
        for t in drafter.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn_like(t) * t.std() * 0.5)
    noisy = {k: t.clone() for k, t in drafter.state_dict().items()}
    got = soup(drafter, start, lambda x: emb[x], {"answers": feats}, alphas=(1.0, 0.5))
    assert got["alpha"] == 0.5 and set(got["replay_by_alpha"]) == {"1.0", "0.5"}
    assert got["replay_by_alpha"]["0.5"]["answers"] > got["replay_by_alpha"]["1.0"]["answers"]
    w = drafter.state_dict()["rnn_w.weight"]
    assert torch.allclose(w, (start["rnn_w.weight"] + noisy["rnn_w.weight"]) / 2, atol=1e-6)
    assert torch.equal(drafter.state_dict()["draft_vocab"], start["draft_vocab"])
    assert replay_rate(drafter, lambda x: emb[x], feats)["tokens_per_call"] == got["replay_by_alpha"]["0.5"]["answers"]
    drafter.load_state_dict(start)
    assert soup(drafter, start, lambda x: emb[x], {"answers": feats})["alpha"] == 1.0  # ties: as trained
    drafter.load_state_dict(noisy)
    assert soup(drafter, start, lambda x: emb[x], {}) == {"replay_by_alpha": {"1.0": {}}, "alpha": 1.0}
    assert torch.equal(drafter.state_dict()["rnn_w.weight"], noisy["rnn_w.weight"])


def test_strided_features_keep_every_label_and_the_states_of_every_nth_position(hf, chat_ids):
    """With a stride, drafts start from every n-th position of each sequence (the states of those only are kept)
    and still read the labels of every later position: the same batch as the full features give there."""
    from bench.torch_ref.cuda_job import Features

    seqs = [(np.array(chat_ids[1][:20]), 9), (np.array(chat_ids[2][:15]), 4), (np.array(chat_ids[3][:6]), 5)]
    full = Features(hf, seqs, "cpu", taps=(2,))
    third = Features(hf, seqs, "cpu", taps=(2,), stride=3)
    assert len(full) == 11 + 11 + 1 and len(third) == 4 + 4 + 1 and third.starts_of(2) == 8
    lut = torch.arange(hf.config.vocab_size)
    a = full.batch(third.start, 4, lut)
    b = third.batch(torch.arange(len(third)), 4, lut)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_feature_pass_past_its_deadline_keeps_the_sequences_it_finished(hf, chat_ids):
    """Past the deadline the pass starts no new run of sequences: the features hold the first runs' sequences, equal
    to what a pass without a deadline computes for them (at least one run, whatever the deadline)."""
    from bench.torch_ref.cuda_job import Features

    seqs = [(np.array(chat_ids[k][:12 + k]), 5) for k in range(1, 7)]
    full = Features(hf, seqs, "cpu", taps=(2,), stride=2)
    cut = Features(hf, seqs, "cpu", taps=(2,), stride=2, deadline=0.0, chunks=3)
    assert cut.sequences == 2 and full.sequences == 6 and cut.starts_of(6) == cut.starts_of(2) == len(cut)
    assert len(cut) == full.starts_of(2) and cut.response_tokens == sum(len(s) - 5 for s, _ in seqs[:2])
    lut = torch.arange(hf.config.vocab_size)
    a = full.batch(torch.arange(len(cut)), 3, lut)
    b = cut.batch(torch.arange(len(cut)), 3, lut)
    for k in a:  # other batches, other padding: float16 states equal to their rounding
        assert (torch.allclose(a[k], b[k], atol=2e-2, rtol=1e-2) if a[k].is_floating_point()
                else torch.equal(a[k], b[k])), k


def test_the_feature_stride_rises_until_the_features_fit_the_gpu():
    from bench.torch_ref.cuda_job import FEATURE_RESERVE, fitting_stride

    per_start = 2 * 576 * 4 + 8  # float16 states of the last layer and three tapped ones, and the start's index
    free = FEATURE_RESERVE + 64 * 1000 + per_start * 500
    assert fitting_stride(1000, 3, 576, free) == 2 and fitting_stride(1000, 3, 576, free, stride=3) == 3
    assert fitting_stride(400, 3, 576, free) == 1
    with pytest.raises(SystemExit):
        fitting_stride(1000, 3, 576, FEATURE_RESERVE)


def test_land_writes_plan_shards_that_name_their_engine(target, tmp_path):
    from bench.torch_ref.cuda_job import GEN_ENGINE, _save_sequences, land, prepare
    from mlx_redrafter.train.corpus import Corpus

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Name {k + 2} animals that live in {c}.", "source": "oasst"})
                               + "\n" for k, c in enumerate(["deserts", "forests", "oceans", "caves"] * 65)))
    corpus, job, result = tmp_path / "corpus", tmp_path / "job", tmp_path / "result"
    prepare(job, prompts, corpus, write_gguf=False)
    with np.load(job / "job.npz") as z:
        mine = [(int(r), z["t1_tok"][a:b].tolist())
                for j, r, a, b in zip(z["t1_job"], z["t1_row"], z["t1_off"][:-1], z["t1_off"][1:]) if j == 1]
    assert len(mine) == 4  # 260 prompts: the held-out shard 0 takes 256
    eos = target.tokenizer.eos_ids[0]
    got = {(1, 1, r): (p, [p[-1], 7, eos]) for r, p in mine}
    result.mkdir()
    _save_sequences(result, got, [1])
    (result / "report.json").write_text(json.dumps({"device_name": "test", "generation_engine": GEN_ENGINE,
                                                    "generation": {"tokens": 12, "seconds": 2.0}}))
    land(result, prompts, corpus)
    c = Corpus(corpus)
    assert sorted(c.entries) == ["shard-00001.npz"]  # only the finished shard; shard 0 stays to be made
    entry = c.entries["shard-00001.npz"]
    assert entry["engine"] == GEN_ENGINE and entry["device"] == "test" and entry["new_tokens_per_s"] == 6.0
    shard = c.shard("shard-00001.npz")
    assert sorted(shard.sequence(i).tolist() for i in range(4)) == sorted(p + [p[-1], 7, eos] for _, p in mine)
    prepare(tmp_path / "back", prompts, tmp_path / "empty", from_end=True, max_shards=1, write_gguf=False)
    assert json.loads((tmp_path / "back" / "job.json").read_text())["jobs"] == ["shard-00001.npz"]  # the last first


def test_a_grown_drafter_drafts_what_it_grew_from():
    import torch

    from bench.torch_ref.cuda_job import VARIANTS, grown
    from bench.torch_ref.drafter import TorchDrafter, random_torch_drafter

    d = random_torch_drafter(16, 40, exit_dim=12, num_draft_layers=2)
    w, cfg = grown(d.state_dict(), d.cfg, VARIANTS["soft-deep"].extra_layers)
    g = TorchDrafter(cfg)
    g.load_state_dict(w, strict=True)
    assert cfg["num_draft_layers"] == 2 + VARIANTS["soft-deep"].extra_layers
    h, s = torch.randn(3, 16), torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(g.logits(h, s), d.logits(h, s))


def test_a_drafter_grown_to_a_wider_head_keeps_its_rows_and_adds_the_most_decided_tokens():
    import numpy as np
    import torch

    from bench.torch_ref.cuda_job import VARIANTS, grown
    from bench.torch_ref.drafter import TorchDrafter

    cfg = {"model_type": "recurrent_drafting_drafter", "vocab_size": 40, "hidden_size": 16, "exit_dim": 12,
           "num_draft_layers": 2, "rnn": True, "num_lookback_tokens": 1, "draft_vocab_size": 8}
    torch.manual_seed(0)
    d = TorchDrafter(cfg).float().eval()
    d.draft_vocab.copy_(torch.tensor([3, 7, 1, 20, 5, 9, 11, 2]))
    counts = np.zeros(40)
    counts[[30, 4, 7]] = [9, 5, 100]
    target_rows = np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32)
    assert VARIANTS["soft-fuse3-wide"].head_rows == 16384
    w, grown_cfg = grown(d.state_dict(), d.cfg, head_rows=10, counts=counts, target_rows=target_rows)
    g = TorchDrafter(grown_cfg)
    g.load_state_dict({k: (t.long() if k == "draft_vocab" else t.float()) for k, t in w.items()}, strict=True)
    assert grown_cfg["draft_vocab_size"] == 10 and g.draft_vocab.tolist() == [3, 7, 1, 20, 5, 9, 11, 2, 30, 4]
    assert torch.equal(w["lm_head.2.weight"][:8], d.state_dict()["lm_head.2.weight"])


def test_a_drafter_grown_to_fuse_tapped_layers_starts_as_it_was():
    import torch

    from bench.torch_ref.cuda_job import VARIANTS, context_of, grown
    from bench.torch_ref.drafter import TorchDrafter, random_torch_drafter

    d = random_torch_drafter(16, 40, exit_dim=12, num_draft_layers=2)
    taps = VARIANTS["soft-fuse3"].taps
    w, cfg = grown(d.state_dict(), d.cfg, taps=VARIANTS["soft-fuse"].taps)
    g = TorchDrafter(cfg)
    g.load_state_dict(w, strict=True)
    assert cfg["feature_layers"] == list(VARIANTS["soft-fuse"].taps)
    h, s = torch.randn(3, 16), torch.randn(3, 16)
    batch = {"h": h, "taps": torch.randn(3, len(taps), 16)}
    with torch.no_grad():
        assert torch.equal(g.logits(context_of(g, batch, taps), s), d.logits(context_of(d, batch, taps), s))


def test_a_noisy_variant_reads_the_states_within_its_noise_and_evaluates_them_clean():
    import torch

    from bench.torch_ref.cuda_job import VARIANTS, context_of, grown
    from bench.torch_ref.drafter import TorchDrafter, random_torch_drafter

    d = random_torch_drafter(16, 40, exit_dim=12, num_draft_layers=2)
    taps = VARIANTS["soft-fuse3-wide-noise"].taps
    batch = {"h": torch.randn(3, 16), "taps": torch.randn(3, len(taps), 16)}
    a = VARIANTS["soft-fuse3-wide-noise"].noise
    noisy = context_of(d, batch, taps, a)
    assert 0 < (noisy - batch["h"]).abs().max() <= a and torch.equal(context_of(d, batch, taps), batch["h"])
    w, cfg = grown(d.state_dict(), d.cfg, taps=taps)
    g = TorchDrafter(cfg)
    g.load_state_dict(w, strict=True)  # fused: the noise goes on the states before the fusion, as in train/loop.py
    with torch.no_grad():
        assert not torch.equal(context_of(g, batch, taps, a), context_of(g, batch, taps))
        assert torch.equal(context_of(g, batch, taps), context_of(g, batch, taps))


def test_a_drafter_returned_in_parts_lands_whole(tmp_path, capsys):
    import json

    import numpy as np
    import pytest
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    from bench.torch_ref.cuda_job import drafter_folders, joined, part_files, weight_parts
    from bench.torch_ref.drafter import random_torch_drafter

    d = random_torch_drafter(16, 40, exit_dim=12, num_draft_layers=2)
    sd = {k: t.half().contiguous() for k, t in d.state_dict().items()}
    limit = 600  # under the head's 40 x 12 halves: it must travel as row blocks, as a wide head does in 15 MiB parts
    assert max(t.numel() * 2 for t in sd.values()) > limit
    parts = weight_parts(sd, limit=limit)
    assert len(parts) > 2 and all(sum(t.numel() * t.element_size() for t in p.values()) <= limit for p in parts)
    for k, part in enumerate(parts):
        save_file(part, str(tmp_path / ("drafter_x.safetensors" + (f".{k}" if k else ""))),
                  metadata={"config": json.dumps(d.cfg)})
    (folder,) = drafter_folders(tmp_path, tmp_path / "out")
    back = load_file(str(folder / "model.safetensors"))
    assert set(back) == set(sd) and all(np.array_equal(back[k], sd[k].numpy()) for k in sd)
    assert json.loads((folder / "config.json").read_text()) == d.cfg
    # what a run starting from those parts reads (torch tensors)
    from safetensors.torch import load_file as load_torch

    files = part_files(tmp_path / "drafter_x.safetensors")
    again = joined({k: t for f in files for k, t in load_torch(str(f)).items()})
    assert set(again) == set(sd) and all(bool((again[k] == sd[k]).all()) for k in sd)
    # a part that did not come back is one error line, not a drafter without its head
    (tmp_path / "drafter_x.safetensors.1").unlink()
    with pytest.raises(SystemExit) as e:
        drafter_folders(tmp_path, tmp_path / "out2")
    assert e.value.code == 2 and "drafter_x.safetensors.1" in capsys.readouterr().err


def test_a_fused_drafter_grown_again_keeps_its_fusion_and_a_run_reads_its_layers(tmp_path):
    import json

    from safetensors.torch import save_file

    from bench.torch_ref.cuda_job import VARIANTS, grown, start_config
    from bench.torch_ref.drafter import random_torch_drafter

    d = random_torch_drafter(16, 40, exit_dim=12, num_draft_layers=2)
    taps = VARIANTS["soft-fuse3"].taps
    w, cfg = grown(d.state_dict(), d.cfg, taps=taps)
    w["fuse.weight"] = w["fuse.weight"] + 1.0  # as if trained
    again, cfg2 = grown(w, cfg, taps=taps)
    assert torch.equal(again["fuse.weight"], w["fuse.weight"]) and cfg2 == cfg
    with pytest.raises(SystemExit):
        grown(w, cfg, taps=VARIANTS["soft-fuse"].taps)
    save_file({k: t.contiguous() for k, t in w.items()}, str(tmp_path / "fused.safetensors"),
              metadata={"config": json.dumps(cfg)})
    assert start_config(tmp_path / "nowhere", tmp_path / "fused.safetensors")["feature_layers"] == list(taps)


def test_a_packed_corpus_unpacks_into_the_sequences_it_holds(tmp_path, capsys):
    """The corpus travels to the CUDA machine as one xz pack beside the job (`prepare`), and `run` rebuilds from it
    the sequences and turn-1 conversations the checkout's shards hold."""
    import shutil

    from bench.torch_ref.cuda_job import corpus_sequences, pack_corpus, turn1_sequences, unpack_corpus

    committed = Path(__file__).resolve().parents[1] / "data" / "corpus" / "smollm2-135m"
    entries = json.loads((committed / "manifest.json").read_text())["shards"]
    names = ["shard-00000.npz", "shard-00001.npz", "shard-00002.npz"]  # held out, turn 1, turn 1
    names.append(next(n for n, e in sorted(entries.items()) if e.get("turn") == 2))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for n in names:
        shutil.copy(committed / n, corpus / n)
    (corpus / "manifest.json").write_text(json.dumps({"shards": {n: entries[n] for n in names}}))
    pack = pack_corpus([corpus], tmp_path / "job" / "corpus")
    assert pack["parts"] == 1 and pack["shards"] == 4 and (tmp_path / "job" / "corpus.xz.0").is_file()
    back = unpack_corpus(pack, [None, tmp_path / "job"], tmp_path / "unpacked")
    want, got = corpus_sequences(corpus), corpus_sequences(back)
    assert {k: len(v) for k, v in got.items()} == {k: len(v) for k, v in want.items()} and want["heldout"]
    for k in want:
        assert all(np.array_equal(a, b) and p == q for (a, p), (b, q) in zip(want[k], got[k]))
    assert turn1_sequences(back, [1, 2], [2]) == turn1_sequences(corpus, [1, 2], [2])
    assert pack_corpus([tmp_path / "nothing"], tmp_path / "job" / "empty")["parts"] == 0
    # several corpora (the self-prompted ones) in one pack: each shard under its corpus' folder, splits kept
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(committed / names[0], other / names[0])
    (other / "manifest.json").write_text(json.dumps({"shards": {names[0]: entries[names[0]]}}))
    both = unpack_corpus(pack_corpus([corpus, other], tmp_path / "job" / "selfs"), [tmp_path / "job"],
                         tmp_path / "both")
    assert (both / "other" / names[0]).is_file() and (both / "corpus" / names[1]).is_file()
    got = corpus_sequences(both)
    assert len(got["heldout"]) == 2 * len(want["heldout"]) and len(got["train"]) == len(want["train"])
    assert len(corpus_sequences(both, turn=1)["train"]) < len(got["train"])  # the turn-2 shard's left out
    (tmp_path / "job" / "corpus.xz.0").unlink()
    with pytest.raises(SystemExit) as e:
        unpack_corpus(pack, [tmp_path / "job"], tmp_path / "again")
    assert e.value.code == 2 and "corpus.xz" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["prepare", "--max-shards", "-1"], "--max-shards -1"),
    (["prepare", "--self-corpus", "data/corpus/smollm2-135m-self", "--self-corpus", "no/such"],
     "--self-corpus no/such: no corpus there"),
    (["run", "--out", "x", "--variants", "soft,bogus"], "unknown variant(s) bogus"),
    (["run", "--out", "x", "--min-variant-steps", "-1"], "--min-variant-steps -1"),
])
def test_bad_options_of_the_cuda_job_are_one_error_line(argv, says, tmp_path, monkeypatch, capsys):
    import sys

    from bench.torch_ref.cuda_job import main

    monkeypatch.setattr(sys, "argv", ["cuda_job", *argv, "--job", str(tmp_path / "job")])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and says in err and err.count("\n") == 1
    assert not (tmp_path / "job").exists()


def test_variants_side_by_side_go_on_only_while_each_gets_its_steps():
    from bench.torch_ref.cuda_job import variants_that_fit

    two, three = ("a", "b"), ("a", "b", "c")
    # run 8's step (6.9 ms for one variant) and its 250 s of training: one variant 36k steps, two 18k each
    assert variants_that_fit(two, 0.0138, 250, 30_000) == ("a",)
    assert variants_that_fit(two, 0.0138, 450, 30_000) == two  # a faster feature pass leaves 450 s: 32.6k each
    assert variants_that_fit(three, 0.0207, 450, 30_000) == two
    assert variants_that_fit(two, 0.0138, 1, 30_000) == ("a",)  # the first trains however little time is left
    assert variants_that_fit(two, 0.0138, 1, 0) == two


def test_a_run_too_short_for_two_variants_trains_and_returns_the_first_alone(target, hf, chat_ids, tmp_path,
                                                                             monkeypatch):
    import time

    from bench.torch_ref import cuda_job
    from bench.torch_ref.cuda_job import Features, train
    from mlx_redrafter.api import shipped_drafter_path
    from mlx_redrafter.train.greedy import generate_greedy

    prompts = [chat_ids[3], chat_ids[4]]
    answers, _ = generate_greedy(target.model, prompts, 12, target.tokenizer.eos_ids)
    seqs = [(np.array(p + a), len(p)) for p, a in zip(prompts, answers)]
    feats = Features(hf, seqs, "cpu", taps=(2, 15, 24))
    monkeypatch.setattr(cuda_job, "TIMED_STEPS", 4)  # a step here takes ~0.3 s, not a GPU's ~7 ms
    t0 = time.perf_counter()
    rep = train(hf, feats, feats, shipped_drafter_path(target.name), tmp_path, t0 + 6, t0, batch=4, lr=1e-4,
                variants=("soft-fuse3", "soft-fuse3-wide"), min_steps=10**9, replay_sets={"answers": feats})
    assert rep["dropped_variants"] == ["soft-fuse3-wide"] and rep["steps"] > 4
    assert "acc" in rep["soft-fuse3"] and "soft-fuse3-wide" not in rep
    for measured in (rep["before"], rep["soft-fuse3"]):  # decoding's measure beside the teacher-forced one
        assert list(measured["replay"]) == ["answers"] and measured["replay"]["answers"] >= 1
    assert rep["soft-fuse3"]["soup"]["alpha"] in (1.0, 0.7, 0.5)  # returned: as trained or averaged with its start
    names = sorted(f.name for f in tmp_path.iterdir())  # the drafter in its parts, and nothing else
    assert names[0] == "drafter_soft-fuse3.safetensors" and all(n.startswith(names[0]) for n in names)
