"""Drafters that fuse several target layers (`feature_layers`): the target's features, exact decoding with such a
drafter (alone and batched), the format's checks, and parity of the fused context with the PyTorch drafter."""

import json

import mlx.core as mx
import numpy as np
import pytest
from exactness import ar_tokens, divergence, reading_layers, speculative_tokens

from mlx_redrafter import api
from mlx_redrafter.batch.budget import Budget
from mlx_redrafter.batch.loop import generate_batch
from mlx_redrafter.draft.base import Allocator, Slot
from mlx_redrafter.draft.beam_search import beam_search
from mlx_redrafter.draft.redrafter import (
    Drafter,
    DrafterArgs,
    RnnSource,
    check_compatible,
    load_drafter,
    random_drafter,
    read_features,
    save_drafter,
)
from mlx_redrafter.errors import UserError
from mlx_redrafter.model import TAP_EPS

LAYERS = [2, 15, 24]
MAX_TOKENS = 24
EMBED = mx.random.normal((49152, 576), key=mx.random.key(2)) * 0.05


def embed(ids: mx.array) -> mx.array:
    return EMBED[ids]


@pytest.fixture()
def tapped(target):
    """The session's target with its forward providing LAYERS, restored afterwards."""
    with reading_layers(target.model, tuple(LAYERS)):
        yield target


@pytest.fixture(scope="module")
def fused():
    return random_drafter(576, 49152, seed=3, exit_dim=128, draft_vocab_size=4096, feature_layers=LAYERS)


def test_the_targets_features_are_the_last_state_then_each_tapped_layer_over_its_rms(target, chat_ids, request):
    tokens = mx.array([chat_ids[0][:40]])
    with reading_layers(target.model, ()):
        logits, plain = target.model(tokens, target.model.make_cache(64))
    with reading_layers(target.model, tuple(LAYERS)):
        logits2, wide = target.model(tokens, target.model.make_cache(64))
    H = target.model.args.hidden_size
    assert wide.shape == (1, 40, H * (1 + len(LAYERS)))
    assert mx.array_equal(wide[..., :H], plain) and mx.array_equal(logits2, logits)
    taps = np.array(wide[..., H:]).reshape(1, 40, len(LAYERS), H)
    assert np.allclose((taps.astype(np.float64) ** 2).mean(-1), 1.0, atol=1e-2)  # each divided by its RMS
    try:
        import torch

        from bench.torch_ref.target import forward
    except ImportError:
        return
    hf = request.getfixturevalue("hf")
    with torch.no_grad():  # transformers' own hidden states, normalized here in float64
        states = hf.model(input_ids=torch.tensor(np.array(tokens)), output_hidden_states=True).hidden_states
    for j, layer in enumerate(LAYERS):
        x = states[layer + 1].double()
        ref = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + TAP_EPS)).numpy()
        assert np.abs(taps[:, :, j] - ref).max() < 2e-3
    _, ref_wide = forward(hf, torch.tensor(np.array(tokens)), feature_layers=tuple(LAYERS))  # the PyTorch reference
    assert ref_wide.shape == wide.shape and np.abs(ref_wide.numpy() - np.array(wide)).max() < 2e-3


def test_a_fused_drafter_decodes_exactly_alone_and_batched(tapped, chat_ids, fused):
    target = tapped
    prompts = [chat_ids[5], chat_ids[40][:60], chat_ids[70]]
    ar = [ar_tokens(target.model, p, MAX_TOKENS, target.tokenizer.eos_ids) for p in prompts]
    width, length = 3, 4  # a tree alone; the chain (W = 1) batched below
    for p, want in zip(prompts, ar):
        got, stats = speculative_tokens(target.model, p, Allocator([Slot(RnnSource(fused, target.model.embed),
                                                                         width)]), length, MAX_TOKENS,
                                        target.tokenizer.eos_ids)
        assert divergence(target.model, p, want, got) is None
        assert stats.candidate_tokens == stats.steps * width * length
    out = {i: [] for i in range(len(prompts))}
    for i, r in generate_batch(target.model, prompts, batch_size=2, max_tokens=MAX_TOKENS,
                               eos_ids=target.tokenizer.eos_ids,
                               allocator=lambda: Allocator([Slot(RnnSource(fused, target.model.embed), 1)]),
                               length=4, budget=Budget(4, None)):
        out[i].extend(r.tokens)
    for i, (p, want) in enumerate(zip(prompts, ar)):
        assert divergence(target.model, p, want, out[i]) is None, f"row {i}"


def test_a_fuse_that_passes_the_last_state_drafts_what_the_plain_drafter_does(fused):
    plain = random_drafter(576, 49152, seed=4, exit_dim=128, draft_vocab_size=4096)
    grown = Drafter(DrafterArgs.from_dict({**plain.args.to_dict(), "feature_layers": LAYERS}))
    grown.update(plain.parameters())
    grown.fuse.weight = mx.concatenate([mx.eye(576), mx.zeros((576, 576 * len(LAYERS)))], axis=1)
    h = mx.random.normal((2, 576 * (1 + len(LAYERS))), key=mx.random.key(1))
    first = mx.array([17, 901])
    b1, lp1 = beam_search(plain, embed, h[:, :576], first, width=3, length=4)
    b2, lp2 = beam_search(grown, embed, h, first, width=3, length=4)
    assert mx.array_equal(b1, b2) and mx.allclose(lp1, lp2)
    with pytest.raises(UserError, match="read_features"):
        beam_search(grown, embed, h[:, :576], first, width=1, length=3)
    try:
        import torch

        from bench.torch_ref.drafter import beam_search as torch_beam_search
        from bench.torch_ref.drafter import from_mlx
    except ImportError:
        return
    t = from_mlx(fused)
    table = torch.from_numpy(np.array(EMBED))
    tb, tlp = torch_beam_search(t, lambda ids: table[ids], torch.from_numpy(np.array(h)), torch.tensor([17, 901]),
                                width=3, length=4)
    mb, mlp = beam_search(fused, embed, h, first, width=3, length=4)
    assert np.array_equal(tb.numpy(), np.array(mb)) and np.allclose(tlp.numpy(), np.array(mlp), atol=1e-4)


def test_feature_layers_round_trip_and_bad_values_are_one_line_errors(target, fused, tmp_path):
    out = save_drafter(fused, tmp_path / "d")
    back = load_drafter(out)
    assert back.args.feature_layers == LAYERS and mx.array_equal(back.fuse.weight, fused.fuse.weight)
    drafter, _ = api.resolve_drafter(str(out), target)
    try:
        assert target.model.feature_layers == tuple(LAYERS)
    finally:
        api.resolve_drafter("none", target)
    assert target.model.feature_layers == ()
    cfg = json.loads((out / "config.json").read_text())
    for bad in ([15, 2], [], [-1], "2,15", [2.0], list(range(9))):
        with pytest.raises(UserError, match="feature_layers"):
            DrafterArgs.from_dict({**cfg, "feature_layers": bad})
    with pytest.raises(UserError, match="reads target layer 40"):
        check_compatible(DrafterArgs.from_dict({**cfg, "feature_layers": [2, 40]}), 576, 49152, "d", 30)
    lm = api.LoadedModel(target, back, "fused")
    try:
        assert target.model.feature_layers == tuple(LAYERS)
        assert api.generate(lm, "Say hello.", max_tokens=8).tokens == api.generate(
            api.LoadedModel(target, None, "none"), "Say hello.", max_tokens=8).tokens
    finally:
        read_features(target.model, None)
    assert target.model.feature_layers == ()


def test_a_fused_drafter_has_no_export_to_apples_format(fused, tmp_path):
    from convert.to_torch import export

    with pytest.raises(UserError, match="feature_layers"):
        export(save_drafter(fused, tmp_path / "d"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_cpu_trainer_trains_a_fused_drafter_on_features_with_its_layers(fused, tmp_path):
    """`train --init-from` a fused drafter: the features gain the tapped layers' states (beside the last state and
    labels, which stay as they were) and the trained drafter reads the same layers; other layers are refused."""
    from one_line import assert_one_line_error, run
    from test_bad_training import train

    folder = save_drafter(fused, tmp_path / "fused")
    out = tmp_path / "out"
    proc = run(train(tmp_path, "-o", str(out), "--init-from", str(folder)), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load_drafter(out).args.feature_layers == LAYERS
    taps = sorted((tmp_path / "feat").rglob("*.taps-2-15-24.npy"))
    assert len(taps) == 2  # the held-out shard and the train shard the steps read (2 x 8 positions)
    assert "training on the first 16 response tokens" in proc.stderr
    for f in taps:
        arr = np.load(f).astype(np.float64).reshape(-1, len(LAYERS), 576)
        last = np.load(str(f).replace(".taps-2-15-24", ""))
        assert arr.shape[0] == last.shape[0] == 16 and np.allclose((arr**2).mean(-1), 1.0, atol=2e-2)
    from mlx_redrafter.draft.medusa import random_medusa

    medusa = tmp_path / "medusa"
    save_drafter(random_medusa(576, 49152, seed=1, draft_vocab_size=512), medusa)
    proc = run(train(tmp_path, "-o", str(tmp_path / "other"), "--init-from", str(medusa), "--feature-layers", "2",
                     "--restart"), tmp_path)
    assert_one_line_error(proc, "--feature-layers is for the recurrent drafter")
    for args in (["--init-from", str(folder), "--feature-layers", "3,4", "--restart"],  # not the start's layers
                 ["--feature-layers", "3,4"],  # not the checkpoint's
                 ["--feature-layers", "2,30", "--restart"]):  # the target has layers 0-29
        proc = run(train(tmp_path, "-o", str(tmp_path / "other"), *args), tmp_path)
        assert_one_line_error(proc, "3, 4" if "3,4" in args else "0-29")
        assert not (tmp_path / "other").exists()


def test_a_drafter_grown_to_fuse_layers_starts_as_it_was(target, tapped, chat_ids):
    """`with_feature_layers` adds a fusion that starts as [I, 0, ..., 0]: the grown drafter's teacher-forced
    logits on the target's features (last state + tapped layers) equal the plain drafter's on the last state,
    and they are what beam search drafts from."""
    from mlx_redrafter.train.loop import with_feature_layers
    from mlx_redrafter.train.loss import teacher_forced_logits

    plain = random_drafter(576, 49152, seed=4, exit_dim=128, draft_vocab_size=4096)
    _, wide = tapped.model(mx.array([chat_ids[0][:20]]), tapped.model.make_cache(32))
    h = wide[0, -3:]  # (3, 4 H)
    x = mx.array([[11, 12, 13], [21, 22, 23], [31, 32, 33]])
    before = teacher_forced_logits(plain, h[:, :576], embed(x))
    grown = with_feature_layers(plain, tuple(LAYERS))
    assert grown.args.feature_layers == LAYERS and grown.fuse.weight.shape == (576, 576 * 4)
    after = teacher_forced_logits(grown, h, embed(x))
    assert mx.allclose(before, after, atol=1e-5)
    beams, _ = beam_search(grown, embed, h[:1], mx.array([11]), width=1, length=2)
    assert int(beams[0, 0, 1]) == int(grown.token_ids(mx.argmax(after[0, 0])))


def test_the_data_engine_keeps_the_last_state_on_a_target_that_returns_tapped_layers(target, chat_ids):
    from mlx_redrafter.train.greedy import generate_greedy

    prompts = [chat_ids[1][:30], chat_ids[9][:50]]
    plain, states = generate_greedy(target.model, prompts, 12, target.tokenizer.eos_ids, capture=True)
    target.model.feature_layers = tuple(LAYERS)
    try:
        tapped, tapped_states = generate_greedy(target.model, prompts, 12, target.tokenizer.eos_ids, capture=True)
    finally:
        target.model.feature_layers = ()
    assert tapped == plain
    assert all(a.shape == b.shape == (len(o), 576) and np.array_equal(a, b)
               for a, b, o in zip(states, tapped_states, plain))


def test_the_data_engine_keeps_the_tapped_layers_it_is_asked_for_and_training_then_needs_only_labels(
        target, chat_ids, tmp_path):
    from mlx_redrafter.train.corpus import Corpus, load_shard
    from mlx_redrafter.train.distill import grow
    from mlx_redrafter.train.features import ensure, feature_paths, load_features, teacher_forced
    from mlx_redrafter.train.greedy import GreedySource, generate_greedy
    from mlx_redrafter.train.plan import Settings

    layers, H, eos = tuple(LAYERS), 576, target.tokenizer.eos_ids
    prompts = [chat_ids[1][:30], chat_ids[9][:50]]
    plain, states = generate_greedy(target.model, prompts, 12, eos, capture=True)
    tapped, wide = generate_greedy(target.model, prompts, 12, eos, capture=True, layers=layers)
    assert tapped == plain and target.model.feature_layers == ()
    assert all(w.shape == (len(o), H * 4) and np.array_equal(w[:, :H], s) for w, s, o in zip(wide, states, plain))

    # a shard made by the data job with the drafter's layers: its feature pass is the labels' alone
    rows = tmp_path / "p.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p, "source": "oasst"}) + "\n" for p in ["Say hi.", "Name a fruit."]))
    settings = Settings(max_new_tokens=10, shard_size=2, batch_size=2, heldout=2, turn2_every=100)
    root, feats = tmp_path / "c" / target.name, tmp_path / "f" / target.name
    grow(GreedySource(target, rows, settings, capture=True, layers=layers), target, root, features_dir=feats,
         progress=False, log=lambda m: None)
    corpus = Corpus(root, target.model.args.vocab_size)
    name = sorted(corpus.entries)[0]
    kept = feature_paths(feats, name, corpus.entries[name]["sha256"], layers)
    assert kept.hidden.exists() and kept.taps.exists() and not kept.labels.exists()
    said = []
    ensure(corpus, target.model, eos[0], feats, [name], progress=False, log=said.append, layers=layers)
    assert "0 shards teacher-forced" in said[0] and "1 labelled from stored states" in said[0]
    sh = load_shard(root / name, target.model.args.vocab_size)
    got = load_features(kept, sh)
    hidden, ids, _ = teacher_forced(target.model, sh, eos[0], layers=layers)
    assert np.allclose(got.hidden, hidden[:, :H], atol=2e-2) and np.allclose(got.taps, hidden[:, H:], atol=2e-2)
    assert (got.top_ids[:, 0] == ids[:, 0]).mean() > 0.95


def test_a_fused_drafter_quantizes_and_loads_back(tmp_path):
    from mlx_redrafter.draft.redrafter import quantize_drafter

    d = random_drafter(576, 49152, seed=5, exit_dim=128, draft_vocab_size=4096, feature_layers=LAYERS)
    h = mx.random.normal((2, 576 * (1 + len(LAYERS))), key=mx.random.key(3))
    quantize_drafter(d, 4, 64)
    back = load_drafter(save_drafter(d, tmp_path / "q4"))
    assert back.args.quantization == {"bits": 4, "group_size": 64} and back.args.feature_layers == LAYERS
    first = mx.array([17, 901])
    b1, _ = beam_search(d, embed, h, first, width=2, length=4)
    b2, _ = beam_search(back, embed, h, first, width=2, length=4)
    assert mx.array_equal(b1, b2)
