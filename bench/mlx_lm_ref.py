"""mlx-lm's own autoregressive generation on our loaded weights: the external AR baseline of the benchmark."""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_redrafter.api import DecodeOptions
from mlx_redrafter.generate import Stats
from mlx_redrafter.model import Model
from mlx_redrafter.sweep import Config


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


class MlxLmDecoder:
    """A sweep decoder running mlx-lm's `generate_step` (argmax, or its sampler at temperature > 0)."""

    def __init__(self, model: Model, eos_ids: list[int]):
        self.ref, self.eos = mlx_lm_model(model), set(eos_ids)

    def __call__(self, prompt: list[int], options: DecodeOptions) -> tuple[list[int], Stats]:
        """New token ids (eos ends the generation and is not emitted) and Stats with our conventions.

        mlx-lm runs on the process's BLAS (MKL when preloaded) but never on our small-GEMM path, which it does
        not ship: it is timed as a user of mlx-lm with an optimized BLAS would run it."""
        from mlx_redrafter.system.blas import small_gemm_disabled

        with small_gemm_disabled():
            return self._decode(prompt, options)

    def _decode(self, prompt: list[int], options: DecodeOptions) -> tuple[list[int], Stats]:
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_sampler

        s = options.sampling
        sampler = None if s.greedy else make_sampler(s.temperature, top_p=s.top_p if s.top_p < 1 else 0.0,
                                                     min_p=s.min_p, top_k=s.top_k)
        if s.seed is not None:
            mx.random.seed(s.seed)
        stats, tokens, t_first = Stats(prompt_tokens=len(prompt)), [], None
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        # On our stream: on its own stream mlx-lm runs on a second thread, after which every later run in this
        # process is slower (measured: our AR 28 -> 19 tokens/s), ours and mlx-lm's alike.
        for tok, _ in generate_step(mx.array(prompt), self.ref, max_tokens=options.max_tokens, sampler=sampler,
                                    stream=mx.default_stream(mx.default_device())):
            tok = int(tok)
            if t_first is None:
                t_first = time.perf_counter()
            if tok in self.eos:
                stats.stop_reason = "eos"
                break
            tokens.append(tok)
        stats.prefill_s = (t_first or t0) - t0
        stats.decode_s = time.perf_counter() - (t_first or t0)
        stats.stop_reason = stats.stop_reason or "max_tokens"
        stats.generated_tokens = len(tokens)
        stats.steps = max(len(tokens) - 1 + (stats.stop_reason == "eos"), 0)  # target calls after the first token
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        return tokens, stats


def mlx_lm_configs(decoder: MlxLmDecoder, ar_configs: list[Config]) -> list[Config]:
    """One mlx-lm configuration per AR configuration (same sampling and length)."""
    return [Config(c.name.replace("ar", "mlx_lm", 1), c.options, decoder, "mlx_lm") for c in ar_configs]
