"""The target model's config (an mlx-lm / Hugging Face config.json, or one built from GGUF metadata): the types and
ranges of its keys and the relations the model code relies on, checked once where a model is read
(`loader.read_checkpoint`) so every command and the API refuse a bad config with one line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlx_redrafter.errors import UserError
from mlx_redrafter.schema import (
    MAX_CONTEXT,
    MAX_FFN,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VOCAB,
    MAX_WIDTH,
    Field,
    check_fields,
    check_object,
    shown,
)

MODEL_TYPES = ("llama", "mistral")  # what model.py implements (Mistral without its sliding window = Llama)
FIELDS = (
    Field("model_type", str, choices=MODEL_TYPES),
    Field("hidden_size", int, 1, MAX_WIDTH, required=True),
    Field("num_hidden_layers", int, 1, MAX_LAYERS, required=True),
    Field("intermediate_size", int, 1, MAX_FFN, required=True),
    Field("num_attention_heads", int, 1, MAX_HEADS, required=True),
    Field("vocab_size", int, 1, MAX_VOCAB, required=True),
    Field("num_key_value_heads", int, 1, MAX_HEADS),
    Field("head_dim", int, 2, 4096),
    Field("rms_norm_eps", float, hi=1.0, positive=True),
    Field("rope_theta", float, positive=True),
    Field("max_position_embeddings", int, 1, MAX_CONTEXT),
    Field("tie_word_embeddings", bool),
    Field("attention_bias", bool),
    Field("mlp_bias", bool),
)
# rope_scaling by its type ("rope_type", or the older "type"): the keys model.inverse_frequencies reads.
_FACTOR = Field("factor", float, hi=1e6, positive=True, required=True)
ROPE_SCALING = {
    "default": (),
    "linear": (_FACTOR,),
    "llama3": (_FACTOR, Field("low_freq_factor", float, hi=1e6, positive=True),
               Field("high_freq_factor", float, hi=1e6, positive=True),
               Field("original_max_position_embeddings", int, 1, MAX_CONTEXT)),
}
# Quantized mlx-lm checkpoints: what mx.quantize supports.
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUP_SIZES = (32, 64, 128)


def check_model_config(cfg: Any, where: str) -> None:
    """One-line UserError unless `cfg` is a Llama config model.py can build: types, ranges, heads that divide
    evenly, an even head size (RoPE rotates halves) and a supported rope_scaling."""
    check_fields(cfg, FIELDS, where)
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    kv = cfg.get("num_key_value_heads") or heads
    if heads % kv:
        raise UserError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise UserError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} (and "
                            f"no head_dim is given)")
        head_dim = hidden // heads
    if head_dim % 2:
        raise UserError(f"{where}: the head size {head_dim} is odd (rotary embeddings need an even one)")
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        scaling = check_object(scaling, f"{where}: rope_scaling")
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ROPE_SCALING:
            raise UserError(f"{where}: rope_scaling type {shown(kind)} is not supported (supported: "
                            f"{', '.join(ROPE_SCALING)})")
        check_fields(scaling, ROPE_SCALING[kind], f"{where}: rope_scaling")
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        if kind == "llama3" and low == high:
            raise UserError(f"{where}: rope_scaling low_freq_factor and high_freq_factor are both {low}: they must "
                            f"differ")


def quantization(cfg: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """The mlx-lm `quantization` (or `quantization_config`) object of a config, checked: default and per-module
    bits and group sizes that mx.quantize supports ({} when the model is not quantized)."""
    q = cfg.get("quantization") or cfg.get("quantization_config") or {}
    q = check_object(q, f"{where}: quantization")
    fields = (Field("bits", int, choices=QUANT_BITS), Field("group_size", int, choices=QUANT_GROUP_SIZES))
    check_fields(q, fields, f"{where}: quantization")
    for module, over in q.items():
        if isinstance(over, Mapping):
            check_fields(over, fields, f"{where}: quantization of {module}")
    return q
