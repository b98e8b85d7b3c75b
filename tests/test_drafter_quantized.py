"""Quantized drafters: quantize_drafter, the `quantization` config, save/load round trips, dequantize, errors."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_redrafter.draft.beam_search import beam_search
from mlx_redrafter.draft.redrafter import (
    dequantize_drafter,
    load_drafter,
    quantize_drafter,
    random_drafter,
    save_drafter,
)
from mlx_redrafter.errors import UserError

H, V = 64, 1000  # small shapes: every linear kind is present (input_proj since exit_dim != 2H, ResBlocks, rnn)


def inputs(n: int = 5, seed: int = 0) -> tuple[mx.array, mx.array]:
    """A context (post-norm hidden state) and an RNN state, (n, H) each."""
    return mx.random.normal((n, H), key=mx.random.key(seed)), mx.random.normal((n, H), key=mx.random.key(seed + 1))


def linears(d) -> dict[str, str]:
    """Class name of every linear layer, by path."""
    return {k: type(m).__name__ for k, m in d.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))}


@pytest.mark.parametrize("bits", [4, 8])
def test_round_trip_keeps_config_and_outputs(tmp_path, bits):
    d = random_drafter(H, V, seed=1, exit_dim=192)
    h, s = inputs()
    before = d.logits(h, s)
    q = quantize_drafter(d, bits)
    assert set(linears(q).values()) == {"QuantizedLinear"} and len(linears(q)) == 6
    assert q.args.quantization == {"bits": bits, "group_size": 64}
    logits = q.logits(h, s)
    state = q.next_state(s, h)
    err = float(mx.abs(logits - before).max() / mx.abs(before).max())
    assert err < (0.02 if bits == 8 else 0.3), err  # quantized, but still the same function roughly

    out = save_drafter(q, tmp_path / f"q{bits}")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"bits": bits, "group_size": 64}
    stored = mx.load(str(out / "model.safetensors"))
    assert stored["lm_head.2.weight"].dtype == mx.uint32
    assert stored["lm_head.2.weight"].shape == (V, 192 * bits // 32)
    assert {"lm_head.2.scales", "lm_head.2.biases", "rnn_u.scales", "input_proj.biases"} <= set(stored)

    back = load_drafter(out)
    assert back.args.to_dict() == q.args.to_dict()
    assert linears(back) == linears(q)
    assert np.array_equal(np.array(back.logits(h, s)), np.array(logits))
    assert np.array_equal(np.array(back.next_state(s, h)), np.array(state))
    assert back.num_params() == random_drafter(H, V, seed=1, exit_dim=192).num_params()


def test_draft_vocab_head_quantized(tmp_path):
    d = quantize_drafter(random_drafter(H, V, seed=2, exit_dim=128, draft_vocab_size=256), 4, 32)
    back = load_drafter(save_drafter(d, tmp_path / "fr"))
    assert back.args.draft_vocab_size == 256 and back.args.quantization == {"bits": 4, "group_size": 32}
    assert back.draft_vocab.dtype == mx.int32 and np.array_equal(np.array(back.draft_vocab), np.array(d.draft_vocab))
    h, s = inputs(seed=3)
    assert back.logits(h, s).shape == (5, 256)
    assert np.array_equal(np.array(back.logits(h, s)), np.array(d.logits(h, s)))
    table = mx.random.normal((V, H), key=mx.random.key(4))
    first = mx.array([7, 11])
    beams, lp = beam_search(d, lambda ids: table[ids], h[:2], first, width=3, length=4)
    beams2, lp2 = beam_search(back, lambda ids: table[ids], h[:2], first, width=3, length=4)
    assert np.array_equal(np.array(beams), np.array(beams2)) and np.array_equal(np.array(lp), np.array(lp2))
    assert np.isin(np.array(beams[:, :, 1:]), np.array(d.draft_vocab)).all()


def test_float16_scales_kept_or_cast(tmp_path):
    d = quantize_drafter(random_drafter(H, V, seed=5, exit_dim=192, dtype=mx.float16), 8)
    assert d.lm_head[-1].scales.dtype == mx.float16
    out = save_drafter(d, tmp_path / "h")
    kept = load_drafter(out, dtype=None)
    assert kept.lm_head[-1].scales.dtype == mx.float16 and kept.lm_head[-1].weight.dtype == mx.uint32
    h, s = (x.astype(mx.float16) for x in inputs())
    assert np.array_equal(np.array(kept.logits(h, s)), np.array(d.logits(h, s)))
    up = load_drafter(out)  # default float32: scales and biases cast, packed weights untouched
    assert up.lm_head[-1].scales.dtype == mx.float32 and up.lm_head[-1].weight.dtype == mx.uint32
    assert up.logits(*inputs()).dtype == mx.float32


def test_dequantize(tmp_path):
    q = quantize_drafter(random_drafter(H, V, seed=6, exit_dim=192), 4)
    h, s = inputs()
    logits = q.logits(h, s)
    d = dequantize_drafter(load_drafter(save_drafter(q, tmp_path / "q")))
    assert d.args.quantization is None and set(linears(d).values()) == {"Linear"}
    assert np.allclose(np.array(d.logits(h, s)), np.array(logits), atol=1e-5)
    back = load_drafter(save_drafter(d, tmp_path / "deq"))
    assert "quantization" not in json.loads((tmp_path / "deq" / "config.json").read_text())
    assert np.array_equal(np.array(back.logits(h, s)), np.array(d.logits(h, s)))


def test_bad_quantization_settings(tmp_path):
    d = random_drafter(H, V, seed=7, exit_dim=96)
    for bits, group, needle in [(3, 64, "bits = 3"), (4, 48, "group size = 48"), (4, 64, "exit_dim 96"),
                                (8, 128, "exit_dim 96")]:
        with pytest.raises(UserError, match=needle):
            quantize_drafter(d, bits, group)
    assert d.args.quantization is None and set(linears(d).values()) == {"Linear"}  # untouched by the failures
    q = quantize_drafter(d, 4, 32)
    with pytest.raises(UserError, match="already quantized"):
        quantize_drafter(q, 8, 32)

    out = save_drafter(q, tmp_path / "q")
    cfg = json.loads((out / "config.json").read_text())
    for bad, needle in [({"bits": 5, "group_size": 32}, "bits = 5"), ({"bits": 4}, "group size = None"),
                        ({"bits": 4, "group_size": 32, "mode": "mxfp4"}, "expected"), (4, "expected")]:
        (out / "config.json").write_text(json.dumps({**cfg, "quantization": bad}))
        with pytest.raises(UserError, match=needle):
            load_drafter(out)
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization"}))
    with pytest.raises(UserError, match="do not match its config.json"):
        load_drafter(out)  # quantized weights, float config
    float_dir = save_drafter(random_drafter(H, V, seed=7, exit_dim=96), tmp_path / "f")
    (float_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="do not match its config.json"):
        load_drafter(float_dir)  # float weights, quantized config


@pytest.mark.parametrize("quantized", [False, True])
def test_frequent_head_is_the_first_rows_of_the_full_head(quantized):
    """--drafter-vocab N drafts from the head's first N rows (its most frequent tokens): the same logits there,
    drafts only among those tokens, float and quantized alike; bad N and full-vocabulary heads are clear errors."""
    from mlx_redrafter.draft.redrafter import FrequentHead

    d = random_drafter(H, V, seed=5, exit_dim=128, draft_vocab_size=256)
    if quantized:
        quantize_drafter(d, 4, 32)
    cut = FrequentHead(d, 64)
    h, s = inputs(seed=6)
    full, part = np.array(d.logits(h, s)), np.array(cut.logits(h, s))
    assert part.shape == (5, 64)
    np.testing.assert_allclose(part, full[:, :64], rtol=1e-5, atol=1e-5)
    table = mx.random.normal((V, H), key=mx.random.key(7))
    beams, _ = beam_search(cut, lambda ids: table[ids], h[:2], mx.array([7, 11]), width=2, length=4)
    assert np.isin(np.array(beams[:, :, 1:]), np.array(d.draft_vocab[:64])).all()
    for bad in (0, 257):
        with pytest.raises(UserError, match="--drafter-vocab must be between 1 and the drafter's 256 head rows"):
            FrequentHead(d, bad)
    with pytest.raises(UserError, match="frequency-ordered draft vocabulary"):
        FrequentHead(random_drafter(H, V, seed=5, exit_dim=128), 64)
