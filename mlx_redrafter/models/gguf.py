"""Read a Llama GGUF file: model config, weights in mlx-lm naming, and tokenizer metadata.

`mx.load` returns F32/F16 tensors as-is and Q4_0/Q4_1/Q8_0 as MLX quantized triples (weight, scales,
biases). GGUF stores the q/k projection rows permuted for llama.cpp's interleaved rotary layout; we undo
that permutation (on whole rows, so quantized rows move with their scales and biases) so the standard
half-split RoPE of `model.py` applies.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_redrafter.errors import UserError

_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    v = meta.get(key, default)
    if isinstance(v, mx.array):
        v = v.item()
    return v


def read_gguf(path: str) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Raw GGUF tensors and metadata; a one-line UserError if the file is not a readable GGUF."""
    try:
        return mx.load(path, return_metadata=True)
    except Exception as e:  # MLX raises RuntimeError/ValueError with long messages
        raise UserError(f"cannot read GGUF file {path}: {str(e).splitlines()[0]} (is the file complete?)") from None


def gguf_config(meta: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm style config.json dict from GGUF metadata."""
    arch = _scalar(meta, "general.architecture")
    if arch is None:
        raise UserError("the GGUF file has no model metadata (general.architecture): is the file complete?")
    if arch != "llama":
        raise UserError(f"GGUF architecture {arch!r} is not supported (only 'llama' family models)")
    p = "llama."
    n_heads = _scalar(meta, p + "attention.head_count")
    hidden = _scalar(meta, p + "embedding_length")
    cfg = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": _scalar(meta, p + "block_count"),
        "intermediate_size": _scalar(meta, p + "feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": _scalar(meta, p + "attention.head_count_kv", n_heads),
        "rms_norm_eps": float(_scalar(meta, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_scalar(meta, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": _scalar(meta, p + "context_length", 4096),
        "vocab_size": _scalar(meta, p + "vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "head_dim": _scalar(meta, p + "rope.dimension_count", hidden // n_heads),
    }
    factor = _scalar(meta, p + "rope.scaling.factor")
    if factor and _scalar(meta, p + "rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"type": "linear", "factor": float(factor)}
    return cfg


def _unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    # llama.cpp: rows of head h are stored as (pairs, 2) interleaved; back to (2, pairs) halves.
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(tensors: dict[str, mx.array], cfg: dict[str, Any]) -> tuple[dict[str, mx.array], dict]:
    """Weights renamed to mlx-lm keys with q/k rows un-permuted, plus per-module quantization info."""
    out: dict[str, mx.array] = {}
    quant: dict[str, dict[str, int]] = {}
    for key, value in tensors.items():
        parts = key.split(".")
        if parts[0] == "blk":
            base, suffix = _NAMES.get(parts[2]), parts[3:]
            prefix = f"model.layers.{parts[1]}.{base}"
        else:
            base, suffix = _NAMES.get(parts[0]), parts[1:]
            prefix = base
        if base is None:
            continue  # e.g. rope_freqs: not used by this architecture
        if base == "self_attn.q_proj":
            value = _unpermute_rows(value, cfg["num_attention_heads"])
        elif base == "self_attn.k_proj":
            value = _unpermute_rows(value, cfg["num_key_value_heads"])
        name = ".".join([prefix, *suffix])
        out[name] = value
    for name, scales in out.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            in_features = _in_features(module, cfg)
            bits = out[module + ".weight"].shape[1] * 32 // in_features
            quant[module] = {"bits": bits, "group_size": in_features // scales.shape[1]}
    return out, quant


def _in_features(module: str, cfg: dict[str, Any]) -> int:
    if module.endswith("o_proj"):
        return cfg["num_attention_heads"] * cfg["head_dim"]
    if module.endswith("down_proj"):
        return cfg["intermediate_size"]
    return cfg["hidden_size"]
