"""The seeds' other drafters in the same runtime: Medusa-1 heads (static tree) and the semi-autoregressive drafter
(simplified transformer, LSTM): tree construction, exactness, typical acceptance, checkpoints, conversion from the
FasterDecoding layout, and training each kind with `redrafter-mlx train --kind`."""

import json

import mlx.core as mx
import numpy as np
import pytest
from exactness import ar_tokens, divergence, speculative_tokens
from typer.testing import CliRunner

from mlx_redrafter import api
from mlx_redrafter.cmd.app import app
from mlx_redrafter.draft.base import Allocator, DecodeState, Slot
from mlx_redrafter.draft.kinds import draft_kind, load_any_drafter
from mlx_redrafter.draft.medusa import MedusaArgs, MedusaHeads, MedusaSource, random_medusa
from mlx_redrafter.draft.medusa_trees import CPU_TREE, MC_SIM_7B_63, check_tree, parse_tree
from mlx_redrafter.draft.redrafter import save_drafter
from mlx_redrafter.draft.semi_ar import SemiARSource, random_semi_ar
from mlx_redrafter.errors import UserError
from mlx_redrafter.sampling import Sampling
from mlx_redrafter.tree import pack

H, V = 576, 49152
MAX_TOKENS = 24


# --- Medusa trees ------------------------------------------------------------------------------------------------
def known_heads() -> MedusaHeads:
    """Three tiny heads (H=4, V=16, no ResBlocks) whose ranking for h = e_0 is fixed: head k's top tokens below."""
    heads = MedusaHeads(MedusaArgs(vocab_size=16, hidden_size=4, medusa_num_heads=3, medusa_num_layers=0))
    for k, top in enumerate([[3, 7, 1], [5, 2, 9], [4, 8, 6]]):
        w = np.zeros((16, 4), dtype=np.float32)
        w[top, 0] = [10.0, 9.0, 8.0]
        heads.medusa_head[k][0].weight = mx.array(w)
    return heads


STATE = DecodeState(tokens=[11], g0=mx.array([11], dtype=mx.int32), h=mx.array([[1.0, 0.0, 0.0, 0.0]]))
SMALL_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def test_medusa_tree_candidates_pack_into_the_hand_checked_tree():
    cands = MedusaSource(known_heads(), SMALL_TREE).propose(STATE, 4, 100)
    # leaves in tree order: (0,1), (1,0), (0,0,0); column 0 = g0, then the heads' tokens of the path's ranks
    assert cands.tolist() == [[11, 3, 2, -1], [11, 7, 5, -1], [11, 3, 5, 4]]
    t = pack(cands)
    assert t.size == 7  # = the tree's 6 nodes + g0
    assert t.tokens.tolist() == [11, 3, 2, 7, 5, 5, 4]
    assert t.depth.tolist() == [0, 1, 2, 1, 2, 2, 3]
    assert t.parent.tolist() == [-1, 0, 1, 0, 3, 1, 5]
    assert t.unpacker.tolist() == [[0, 1, 2, 0], [0, 3, 4, 0], [0, 1, 5, 6]]
    ancestors = [{0}, {0, 1}, {0, 1, 2}, {0, 3}, {0, 3, 4}, {0, 1, 5}, {0, 1, 5, 6}]
    assert np.array(t.mask).tolist() == [[b in a for b in range(7)] for a in ancestors]


def test_medusa_tree_is_cut_at_the_candidate_length_and_width():
    src = MedusaSource(known_heads(), SMALL_TREE)
    assert src.propose(STATE, 3, 100).tolist() == [[11, 3, 5], [11, 3, 2], [11, 7, 5]]  # leaves (0,0) (0,1) (1,0)
    assert src.propose(STATE, 2, 100).tolist() == [[11, 3], [11, 7]]
    assert src.propose(STATE, 4, 2).tolist() == [[11, 3, 2, -1], [11, 7, 5, -1]]  # the first two paths
    assert src.propose(STATE, 6, 100)[:, 4:].tolist() == [[-1, -1]] * 3  # deeper than the tree: PAD
    assert src.num_paths(4) == 3 and src.num_paths(2) == 2


def test_shipped_trees():
    assert len(MC_SIM_7B_63) == 63 and max(map(len, MC_SIM_7B_63)) == 4 and max(max(p) for p in MC_SIM_7B_63) == 9
    for n in range(1, 64):  # Medusa's greedy order: every prefix is a tree
        check_tree(MC_SIM_7B_63[:n])
    assert CPU_TREE == parse_tree("cpu") == parse_tree("mc_sim_7b_63:7")
    heads = random_medusa(H, V, seed=1, num_heads=4, draft_vocab_size=2048)
    h = mx.random.normal((1, H), key=mx.random.key(0))
    state = DecodeState(tokens=[5], g0=mx.array([5], dtype=mx.int32), h=h)
    assert pack(MedusaSource(heads, "cpu").propose(state, 4, 100)).size == 8  # 7 nodes + g0
    assert pack(MedusaSource(heads, "mc_sim_7b_63").propose(state, 5, 100)).size == 64
    top = np.argsort(-np.array(heads.logits(h[0])), axis=-1)[:, :10]  # the heads' own ranking, host side
    cands = np.array(MedusaSource(heads, "mc_sim_7b_63").propose(state, 5, 100))
    dv = np.array(heads.draft_vocab)
    for c, path in zip(cands, [p for p in MC_SIM_7B_63 if not any(q[: len(p)] == p and q != p for q in MC_SIM_7B_63)]):
        assert c[1 : 1 + len(path)].tolist() == [dv[top[i, r]] for i, r in enumerate(path)]


@pytest.mark.parametrize("bad,needle", [("nope", "unknown Medusa tree"), ("cpu:0", "N must be"),
                                        ("mc_sim_7b_63:64", "N must be")])
def test_bad_tree_names(bad, needle):
    with pytest.raises(UserError, match=needle):
        parse_tree(bad)
    with pytest.raises(UserError, match="parent"):
        check_tree([(0,), (1, 0)])


# --- teacher forcing = what inference computes ----------------------------------------------------------------------
@pytest.mark.parametrize("tlm", ["transformer", "lstm"])
def test_semi_ar_teacher_forced_logits_equal_the_incremental_drafting_path(target, tlm):
    d = random_semi_ar(H, V, seed=2, tlm=tlm, draft_vocab_size=1024)
    h = mx.random.normal((2, H), key=mx.random.key(1))
    emb = target.model.embed(mx.array([[5, 7, 9, 11], [1, 2, 3, 4]]))
    forced = d.teacher_forced_logits(h, emb)
    state, steps = d.initial_state(2, 1, mx.float32)[:, 0], []
    for j in range(4):
        state = d.next_state(state, emb[:, j])
        steps.append(d.logits(h, state))
    assert forced.shape == (2, 4, 1024)
    assert mx.allclose(forced, mx.stack(steps, axis=1), atol=1e-4).item()


def test_medusa_teacher_forced_step_j_is_head_j():
    heads = random_medusa(64, 300, seed=3, num_heads=3)
    h = mx.random.normal((2, 64), key=mx.random.key(2))
    forced = heads.teacher_forced_logits(h, mx.zeros((2, 3, 64)))
    for j in range(3):
        assert mx.array_equal(forced[:, j], heads.head_logits(h, j))
    with pytest.raises(UserError, match="3 heads"):
        heads.teacher_forced_logits(h, mx.zeros((2, 4, 64)))


# --- exactness: greedy speculative == AR (fp32) for every kind ------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(target, chat_ids):
    return [chat_ids[3], target.tokenizer.encode_chat([{"role": "user", "content": "Count from one to twenty."}])]


@pytest.fixture(scope="module")
def ar_outputs(target, prompts):
    return [ar_tokens(target.model, p, MAX_TOKENS, target.tokenizer.eos_ids) for p in prompts]


def _medusa(tree):
    heads = random_medusa(H, V, seed=0, num_heads=4, draft_vocab_size=4096)
    return lambda target: (MedusaSource(heads, tree), None)


def _semi_ar(tlm, width):
    d = random_semi_ar(H, V, seed=0, tlm=tlm, draft_vocab_size=4096)
    return lambda target: (SemiARSource(d, target.model.embed), width)


KINDS = {
    "medusa-cpu-L4": (_medusa("cpu"), 4),
    "medusa-mc12-L5": (_medusa("mc_sim_7b_63:12"), 5),  # paths shorter than L: PAD slots
    "semi_ar_transformer-W3-L4": (_semi_ar("transformer", 3), 4),
    "semi_ar_lstm-W2-L5": (_semi_ar("lstm", 2), 5),  # W = 1 (greedy drafting): test_draft_modes_through_the_api
}


@pytest.mark.parametrize("case", list(KINDS))
def test_greedy_equals_autoregressive(target, prompts, ar_outputs, case):
    make, length = KINDS[case]
    for p, ar in zip(prompts, ar_outputs):
        source, width = make(target)
        width = width or source.num_paths(length)
        got, stats = speculative_tokens(target.model, p, Allocator([Slot(source, width)]), length, MAX_TOKENS,
                                        target.tokenizer.eos_ids)
        problem = divergence(target.model, p, ar, got)
        assert problem is None, problem
        assert stats.steps <= stats.verified_tokens <= stats.candidate_tokens
        assert set(stats.source_proposed) == {source.name}


# --- the runtime: draft modes, typical acceptance, checkpoints -------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    out = {"medusa": save_drafter(random_medusa(H, V, seed=4, num_heads=3, draft_vocab_size=2048), root / "medusa"),
           "semi_ar": save_drafter(random_semi_ar(H, V, seed=5, tlm="lstm", draft_vocab_size=2048), root / "semi")}
    return out


def test_checkpoints_round_trip_and_name_their_kind(checkpoints):
    for mode, path in checkpoints.items():
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["model_type"] == {"medusa": "medusa", "semi_ar": "semi_ar_drafter"}[mode]
        d = load_any_drafter(path)
        assert draft_kind(d) == mode
        again = load_any_drafter(save_drafter(d, path.with_name(path.name + "-again")))
        from mlx.utils import tree_flatten

        a, b = dict(tree_flatten(d.parameters())), dict(tree_flatten(again.parameters()))
        assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
        assert d.draft_vocab.dtype == mx.int32


def test_draft_modes_through_the_api(target, checkpoints, prompts, ar_outputs):
    for mode, path in checkpoints.items():
        drafter, name = api.resolve_drafter(str(path), target)
        lm = api.LoadedModel(target=target, drafter=drafter, drafter_name=name)
        res = api.generate(lm, prompts[0], api.decode_options(draft=mode, beam_length=4, max_tokens=MAX_TOKENS))
        assert res.tokens == ar_outputs[0]
        assert res.settings["draft"] == mode and res.settings["drafter"] == str(path)
        assert api.draft_mode(lm, api.decode_options()).name == mode  # auto picks the drafter's own kind
        rnn = r"--draft rnn\+lookup needs a ReDrafter \(rnn\) drafter.*use --draft auto"
        with pytest.raises(UserError, match=rnn):
            api.make_allocator(lm, api.decode_options(draft="rnn+lookup"))
        other = "semi_ar" if mode == "medusa" else "medusa"
        with pytest.raises(UserError, match=f"--draft {other} needs a .* drafter, but {path} is a"):
            api.make_allocator(lm, api.decode_options(draft=other))
    no_drafter = api.LoadedModel(target=target, drafter=None, drafter_name="none")
    with pytest.raises(UserError, match="needs a Medusa drafter, but none is loaded .*: pass --drafter DIR"):
        api.make_allocator(no_drafter, api.decode_options(draft="medusa"))
    with pytest.raises(UserError, match="unknown Medusa tree"):
        api.decode_options(draft="medusa", medusa_tree="big")


@pytest.mark.parametrize("accept", ["typical", "exact"])
def test_medusa_samples_at_temperature(target, checkpoints, prompts, accept):
    drafter = load_any_drafter(checkpoints["medusa"])
    lm = api.LoadedModel(target=target, drafter=drafter, drafter_name="medusa")
    s = Sampling(temperature=0.8, seed=0, accept=accept)
    res = api.generate(lm, prompts[1], api.decode_options(draft="medusa", beam_length=4, max_tokens=16,
                                                             sampling=s))
    assert 0 < len(res.tokens) <= 16 and res.stats.steps > 0 and res.settings["accept"] == accept


def test_fasterdecoding_dir_given_as_drafter_is_a_one_line_error(tmp_path, target):
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    mx.save_safetensors(str(tmp_path / "medusa_lm_head.safetensors"), {"0.0.linear.bias": mx.zeros((4,))})
    with pytest.raises(UserError, match="FasterDecoding layout: convert it") as e:
        api.resolve_drafter(str(tmp_path), target)
    assert "\n" not in str(e.value)


# --- conversion from the FasterDecoding/Medusa layout ---------------------------------------------------------------
def torch_medusa(num_heads: int, num_layers: int, hidden: int, vocab: int, seed: int):
    """Medusa heads with FasterDecoding's module layout (ResBlock = `linear` + SiLU, residual), random weights."""
    torch = pytest.importorskip("torch")

    class ResBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(hidden, hidden)

        def forward(self, x):
            return x + torch.nn.functional.silu(self.linear(x))

    torch.manual_seed(seed)
    return torch.nn.ModuleList([
        torch.nn.Sequential(*[ResBlock() for _ in range(num_layers)], torch.nn.Linear(hidden, vocab, bias=False))
        for _ in range(num_heads)])


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_fasterdecoding_checkpoint_converts_and_keeps_the_top_k(tmp_path, capsys, fmt):
    torch = pytest.importorskip("torch")
    from convert import from_torch

    heads_t = torch_medusa(3, 2, 64, 500, seed=7)
    src = tmp_path / "medusa-vicuna"
    src.mkdir()
    sd = {k: v.detach().contiguous() for k, v in heads_t.state_dict().items()}
    assert "1.2.weight" in sd and "0.1.linear.bias" in sd  # the repository's key layout
    if fmt == "pt":
        torch.save(sd, src / "medusa_lm_head.pt")
    else:
        from safetensors.torch import save_file

        save_file(sd, str(src / "medusa_lm_head.safetensors"))
    (src / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2,
                                                 "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}))
    out = tmp_path / "out"
    rc = from_torch.main([str(src), "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "3 heads x 2 ResBlocks" in cap.out
    heads = load_any_drafter(out)
    assert draft_kind(heads) == "medusa" and heads.args.medusa_num_heads == 3
    h = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = torch.stack([head(h) for head in heads_t], dim=1)  # (5, 3, V)
    got = np.array(heads.logits(mx.array(h.numpy())))
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-4, atol=1e-4)
    assert (np.argsort(-got, axis=-1)[..., :10] == torch.topk(ref, 10, dim=-1).indices.numpy()).all()


def test_bad_medusa_checkpoints_are_one_line_errors(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from convert import from_torch

    sd = {k: v.detach().contiguous() for k, v in torch_medusa(2, 1, 16, 40, seed=0).state_dict().items()}
    cases = {
        "missing": {k: v for k, v in sd.items() if k != "1.1.weight"},
        "unknown": {**sd, "rnn_u.weight": torch.zeros(16, 16)},
        "layers": {k: v for k, v in sd.items() if not k.startswith("1.")} | {"1.0.weight": sd["1.1.weight"]},
    }
    for name, tensors in cases.items():
        src = tmp_path / name
        src.mkdir()
        save_file(tensors, str(src / "medusa_lm_head.safetensors"))
        rc = from_torch.main([str(src), "--out", str(tmp_path / f"{name}-out")])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), (name, err)
        assert not (tmp_path / f"{name}-out").exists()
    rc = from_torch.main([str(tmp_path / "missing"), "--quantize", "4", "--out", str(tmp_path / "q")])
    assert rc == 2 and "not supported for Medusa" in capsys.readouterr().err


# --- training every kind with `redrafter-mlx train --kind` ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_corpus(target, tmp_path_factory):
    from mlx_redrafter.train.distill import grow
    from mlx_redrafter.train.greedy import GreedySource
    from mlx_redrafter.train.plan import Settings

    root = tmp_path_factory.mktemp("tiny")
    prompts = root / "p.jsonl"
    texts = ["Name a color.", "Say hi.", "Count to three.", "Name a fruit."]
    prompts.write_text("".join(json.dumps({"prompt": p, "source": "oasst"}) + "\n" for p in texts))
    settings = Settings(max_new_tokens=12, shard_size=2, batch_size=2, heldout=2, turn2_every=100)
    grow(GreedySource(target, prompts, settings, capture=True), target, root / "c" / target.name,
         features_dir=root / "f" / target.name, progress=False, log=lambda m: None)
    return root


@pytest.mark.parametrize("kind", ["medusa", "semi_ar_transformer", "semi_ar_lstm"])
def test_train_each_kind_from_the_command_line(target, tiny_corpus, kind):
    run, out = tiny_corpus / f"run-{kind}", tiny_corpus / f"out-{kind}"
    args = ["train", "--corpus", str(tiny_corpus / "c" / target.name), "--features", str(tiny_corpus / "f"),
            "--kind", kind, "--steps", "3", "--batch", "16", "--draft-vocab", "256", "--layers", "1",
            "--draft-len", "3", "--run-dir", str(run), "--output", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["config"]["kind"] == kind and summary["history"][-1]["positions_seen"] == 3 * 16
    assert len(summary["final"]["acc"]) == 3
    d = load_any_drafter(out)
    assert d.args.draft_vocab_size == 256 and draft_kind(d) == ("medusa" if kind == "medusa" else "semi_ar")
    assert (out / "MODEL_CARD.md").read_text().startswith("# Medusa" if kind == "medusa" else "# Semi-AR")
    if kind == "medusa":  # resuming the run dir as another kind
        res = CliRunner().invoke(app, [*args[:6], "semi_ar_lstm", *args[7:]])
        assert res.exit_code == 2 and "holds a medusa drafter, not semi_ar_lstm" in res.output, res.output


def test_train_rejects_an_unknown_kind():
    res = CliRunner().invoke(app, ["train", "--kind", "eagle"])
    assert res.exit_code == 2 and "error: --kind must be one of" in res.output
