"""float16, bfloat16 and quantized: greedy speculative output agrees with AR of the same dtype (tie-aware rule,
`bench.agreement`), and our quantized model matches mlx-lm's on the same packed weights.

float16 and bfloat16 are slow on MLX's CPU backend (no BLAS: ~25x and ~6x slower than float32 at decoding); a
quantized model computes the float32 model's products from its packed weights there (`loader.quantized_activations`,
`model.QuantizedFusedLinear`; tested bit for bit below), but mlx-lm's reference runs MLX's own quantized products,
which cost per row. So the tests run the real SmolLM2-135M weights cut to their first layers
(`agreement.load_first_layers`: the loader's own path for each dtype, the final norm and the full tied head kept):
4 layers in float16 / bfloat16, 3 in quantized, and few tokens. The shipped drafter reads target layers 2, 15 and
24 besides the last; on a cut target it reads the cut's last three layers instead (`shipped_for`: same weights,
and exactness does not depend on which layers a drafter reads). The full model (10 MT-bench prompts x 64 tokens
per dtype, and the calibration of the tie bound) is the offline report `python -m bench dtype-agreement`
(bench/results/cpu/dtype-agreement/).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from bench.agreement import EPSILON, FP32_TIE, TIE_FACTOR, compare, load_first_layers, tie_bound
from mlx_redrafter import api
from mlx_redrafter.draft.redrafter import random_drafter
from mlx_redrafter.generate import Stats, collect
from mlx_redrafter.models.loader import quantized_activations
from mlx_redrafter.system import packed_linear

LAYERS = {"float16": 4, "bfloat16": 4, "quantized": 3}
CHAT_PROMPT = "Name three colors, one per line."
# mlx-lm vs ours on quantized weights: max |difference| within this many float16 unit roundoffs x max |value|.
# Measured on the full 30-layer model (bench/results/cpu/dtype-agreement/README.md): 0 here in float16, bfloat16
# and quantized (bit-identical: MLX's CPU kernels for these dtypes do not depend on how the ops are batched), and
# 8.5 (hidden) / 13.8 (logits) in float32, where MKL reorders sums; 16 gives a backend whose low-precision kernels
# reorder sums (Metal) the slack float32 needs here.
MLX_LM_TOLERANCE = 16
# (draft mode, drafter, rnn width, lookup width, new tokens) per dtype; L = 3 (the shipped default). Every mode
# runs in bfloat16 with both drafters; float16 and quantized (slower) run a subset.
RUNS = {
    "bfloat16": [("rnn", "shipped", 1, 1, 10), ("rnn", "random", 2, 1, 10), ("lookup", None, 1, 1, 10),
                 ("rnn+lookup", "shipped", 1, 1, 10), ("rnn+lookup", "random", 1, 1, 10)],
    "float16": [("rnn", "random", 2, 1, 8), ("lookup", None, 1, 1, 8), ("rnn+lookup", "shipped", 1, 1, 8)],
    "quantized": [("rnn", "random", 2, 1, 8), ("rnn+lookup", "shipped", 1, 1, 8)],
}
CASES = [(dt, *run) for dt, runs in RUNS.items() for run in runs]


def shipped_for(target, tmp: Path) -> Path:
    """The shipped drafter's folder, or, where it reads target layers a cut target lacks, a copy of it (same
    weights) that reads the cut's last layers instead."""
    src = api.shipped_drafter_path(target.name)
    assert src is not None, "the shipped drafter of the default model is missing"
    cfg = json.loads((src / "config.json").read_text())
    n, layers = target.model.args.num_hidden_layers, cfg.get("feature_layers") or []
    if not layers or max(layers) < n:
        return src
    dst = tmp / f"shipped-reading-{n}-layers"
    if not dst.exists():
        dst.mkdir(parents=True)
        (dst / "config.json").write_text(json.dumps({**cfg, "feature_layers": list(range(n - len(layers), n))}))
        (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def setups(tmp_path_factory) -> dict:
    """Per dtype, loaded on first use: the cut target, its drafters, the prompt ids and AR outputs by length."""
    return {"tmp": tmp_path_factory.mktemp("drafters")}


def setup(setups: dict, dtype: str) -> dict:
    if dtype not in setups:
        target = load_first_layers(None, LAYERS[dtype], dtype)
        tok, model = target.tokenizer, target.model
        shipped, _ = api.resolve_drafter(str(shipped_for(target, setups["tmp"])), target)
        a = model.args
        setups[dtype] = {
            "target": target, "ar": {},
            "drafters": {"shipped": shipped, "random": random_drafter(a.hidden_size, a.vocab_size, seed=0,
                                                                      exit_dim=128, draft_vocab_size=4096,
                                                                      dtype=model.dtype)},
            "ids": tok.encode_chat([{"role": "user", "content": CHAT_PROMPT}]),
        }
    return setups[dtype]


def decode(s: dict, options: api.DecodeOptions, drafter: str | None = None) -> tuple[list[int], Stats]:
    lm = api.LoadedModel(s["target"], s["drafters"][drafter] if drafter else None, drafter or "none")
    return collect(api.decode(lm, s["ids"], options))


def ar_output(s: dict, max_tokens: int) -> list[int]:
    if max_tokens not in s["ar"]:
        s["ar"][max_tokens] = decode(s, api.decode_options(draft="none", max_tokens=max_tokens))[0]
    return s["ar"][max_tokens]


@pytest.mark.parametrize("dtype,draft,drafter,rnn_width,lookup_width,max_tokens", CASES)
def test_speculative_agrees_with_ar(setups, dtype, draft, drafter, rnn_width, lookup_width, max_tokens):
    s = setup(setups, dtype)
    model = s["target"].model
    assert model.dtype == (quantized_activations() if dtype == "quantized" else getattr(mx, dtype))
    ar = ar_output(s, max_tokens)
    got, stats = decode(s, api.decode_options(draft=draft, beam_width=rnn_width, beam_length=3,
                                              lookup_width=lookup_width, max_tokens=max_tokens), drafter)
    result = compare(model, s["ids"], ar, got)
    assert result.problem() is None, result.problem()
    assert stats.steps >= 1 and stats.verified_tokens > stats.steps  # packed verification of real candidates ran


def test_tie_bound_per_dtype():
    """float32 keeps an absolute 1e-4; low precision scales with the unit roundoff and the logits."""
    assert tie_bound("float32", 30.0) == FP32_TIE == 1e-4
    for dtype in ("float16", "bfloat16"):
        assert tie_bound(dtype, 20.0) == pytest.approx(TIE_FACTOR[dtype] * EPSILON[dtype] * 20.0)
    assert tie_bound("bfloat16", 20.0) > tie_bound("float16", 20.0) > tie_bound("float32", 20.0)


def test_quantized_matches_mlx_lm(setups):
    """Our Llama vs `mlx_lm.models.llama.Model` quantized the same way from our parameters (packed GGUF weights,
    the activation dtype of a quantized model on this backend): every post-norm hidden state and the last
    position's logits."""
    from bench.mlx_lm_ref import mlx_lm_model

    s = setup(setups, "quantized")
    model = s["target"].model
    ref = mlx_lm_model(model)
    assert any(type(m).__name__ == "QuantizedLinear" for _, m in ref.named_modules())
    ids = mx.array([s["ids"]])
    logits, hidden = model(ids, model.make_cache(len(s["ids"])), last_only=True)
    hidden = model.last_state(hidden)  # without the layers the paired drafter reads besides the last
    ref_hidden = ref.model(ids)  # mlx-lm's LlamaModel: post-norm hidden states
    ref_logits = ref.model.embed_tokens.as_linear(ref_hidden[:, -1:])  # the head on the last position only
    u = EPSILON["float16"]
    for ours, theirs in ((hidden, ref_hidden), (logits, ref_logits)):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == quantized_activations()
        a, b = ours.astype(mx.float32), theirs.astype(mx.float32)
        diff, scale = mx.abs(a - b).max().item(), mx.abs(b).max().item()
        assert diff <= MLX_LM_TOLERANCE * u * scale, (diff, scale)
    assert mx.argmax(logits[0, -1]).item() == mx.argmax(ref_logits[0, -1]).item()


def test_a_quantized_model_on_a_cpu_computes_the_float32_models_bits(setups):
    """On a CPU backend a quantized model's products read its packed weights (few rows, through the compiled layers)
    or those weights dequantized for the product (more rows, through the modules): the logits and states of the
    float32 model loaded from the same file, bit for bit, from 4-8 bits per weight."""
    if mx.default_device() != mx.cpu:
        pytest.skip("a GPU backend computes a quantized model in float16")
    from mlx_redrafter.model import QuantizedFusedLinear

    q = setup(setups, "quantized")["target"]
    f = load_first_layers(None, LAYERS["quantized"], "float32")
    assert isinstance(q.model.model.layers[0].self_attn.qkv, QuantizedFusedLinear)
    rows = packed_linear.max_rows(kept_quantized=True)
    assert q.model.compiled.usable(1, rows) and not q.model.compiled.usable(1, rows + 1)
    ids = q.tokenizer.encode_chat([{"role": "user", "content": CHAT_PROMPT + " And say why."}]) * 3
    assert len(ids) > rows
    for n in (1, 6, 7, 40, len(ids)):  # the packed kernel in one pass, in passes over the rows, then dequantized
        a, ha = q.model(mx.array([ids[:n]]), q.model.make_cache(n))
        b, hb = f.model(mx.array([ids[:n]]), f.model.make_cache(n))
        same_states = mx.array_equal(q.model.last_state(ha), f.model.last_state(hb)).item()  # (q reads tapped layers)
        assert mx.array_equal(a, b).item() and same_states, n


def test_quantized_drafter_is_dequantized_for_a_float32_cpu_target(tmp_path, caplog):
    """A quantized drafter given to a float32 target on a CPU backend runs dequantized (quantized matmuls skip
    BLAS there), with one stderr notice; the weights are exactly the dequantized ones."""
    from mlx_redrafter.draft.redrafter import load_drafter, quantize_drafter, save_drafter

    target = load_first_layers(None, 3, "float32")
    path = save_drafter(quantize_drafter(load_drafter(shipped_for(target, tmp_path)), 4, 64), tmp_path / "q4")
    kept = load_drafter(path)
    assert kept.args.quantization == {"bits": 4, "group_size": 64}
    caplog.set_level("WARNING", logger="mlx_redrafter")
    for _ in range(2):
        d, _ = api.resolve_drafter(str(path), target)
        assert d.args.quantization is None and type(d.lm_head[-1]).__name__ == "Linear"
        assert d.lm_head[-1].weight.dtype == mx.float32
    q = kept.lm_head[-1]
    assert mx.array_equal(d.lm_head[-1].weight, mx.dequantize(q.weight, q.scales, q.biases, 64, 4))
    notices = [r.getMessage() for r in caplog.records if "dequantized to float32" in r.getMessage()]
    assert len(notices) == 1 and "4-bit" in notices[0]


def test_auto_keeps_a_model_quantized_on_a_cpu_where_its_float32_copy_would_not_fit(caplog):
    if mx.default_device() != mx.cpu:
        pytest.skip("auto is float32 only on a CPU backend")
    from mlx_redrafter.models.loader import float32_bytes, pick_dtype, read_checkpoint, resolve_model
    from mlx_redrafter.system.machine import available_memory

    _, path = resolve_model(None)
    _, weights, quant, _ = read_checkpoint(path)
    size = float32_bytes(weights, quant)
    assert size == 4 * 134_515_008  # SmolLM2-135M's parameters (tied head), from its packed Q8_0 / Q4_1 matrices
    assert available_memory() > size and pick_dtype("auto", True, size) == "float32"
    with caplog.at_level("WARNING", logger="mlx_redrafter"):
        assert pick_dtype("auto", True, 2 * available_memory()) == "quantized"
    assert any("keeps the model quantized" in r.getMessage() for r in caplog.records)
    assert pick_dtype("auto", False, 2 * available_memory()) == "float32"  # nothing quantized to keep
