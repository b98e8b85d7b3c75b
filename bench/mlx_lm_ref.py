"""mlx-lm's own autoregressive generation on our loaded weights: the external AR baseline."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_redrafter.model import Model


@dataclass
class RefRun:
    """Tokens and timings of one mlx-lm generation (same conventions as decode.Stats)."""

    tokens: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    peak_memory_gb: float = 0.0
    stop_reason: str = ""

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0


def mlx_lm_model(model: Model) -> nn.Module:
    """An `mlx_lm.models.llama.Model` sharing our model's weights (quantized layers quantized the same way)."""
    from mlx_lm.models import llama

    a = model.args
    ref = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
        intermediate_size=a.intermediate_size, num_attention_heads=a.num_attention_heads,
        rms_norm_eps=a.rms_norm_eps, vocab_size=a.vocab_size, head_dim=a.head_dim,
        max_position_embeddings=a.max_position_embeddings, num_key_value_heads=a.num_key_value_heads,
        attention_bias=a.attention_bias, mlp_bias=a.mlp_bias, rope_theta=a.rope_theta,
        rope_scaling=a.rope_scaling, tie_word_embeddings=a.tie_word_embeddings,
    ))
    quant = {name: {"group_size": m.group_size, "bits": m.bits}
             for name, m in model.named_modules() if hasattr(m, "group_size") and hasattr(m, "bits")}
    if quant:
        nn.quantize(ref, class_predicate=lambda path, m: quant.get(path, False))
    ref.load_weights(tree_flatten(model.parameters()), strict=True)
    mx.eval(ref.parameters())
    return ref


def generate_ref(ref: nn.Module, prompt: list[int], max_tokens: int, eos_ids: list[int]) -> RefRun:
    """Greedy mlx-lm generation (`generate_step`, argmax); eos ends it and is not emitted."""
    import importlib

    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    run, eos = RefRun(), set(eos_ids)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    t_first = None
    for tok, _ in generate_step(mx.array(prompt), ref, max_tokens=max_tokens):
        tok = int(tok)
        if t_first is None:
            t_first = time.perf_counter()
            run.prefill_s = t_first - t0
        if tok in eos:
            run.stop_reason = "eos"
            break
        run.tokens.append(tok)
    run.stop_reason = run.stop_reason or "max_tokens"
    run.decode_s = time.perf_counter() - (t_first if t_first is not None else t0)
    run.peak_memory_gb = mx.get_peak_memory() / 1e9
    return run
