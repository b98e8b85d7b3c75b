"""Build GGUF files byte by byte for the bad-input tests and the parser fuzzer: a valid tiny Llama (byte-level BPE
tokenizer, F32 and Q8_0 weights) and the offsets of every header field, so a test can corrupt exactly one; and the
model-only copy of a real GGUF that the PyTorch reference reads."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B", U64: "<Q", I64: "<q",
        F64: "<d"}
T_F32, T_Q8_0 = 0, 8

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2


@dataclass
class Layout:
    """Byte offsets of the fields of a built file (for corrupting one of them)."""

    fields: dict[str, int] = field(default_factory=dict)
    data_start: int = 0


def _value(vtype: int, v: Any) -> bytes:
    if vtype == STR:
        b = v.encode() if isinstance(v, str) else v
        return struct.pack("<Q", len(b)) + b
    if vtype == ARR:
        etype, items = v
        return struct.pack("<IQ", etype, len(items)) + b"".join(_value(etype, x) for x in items)
    return struct.pack(_FMT[vtype], v)


def build(meta: list[tuple[str, int, Any]], tensors: list[tuple[str, tuple[int, ...], int, bytes]],
          version: int = 3, alignment: int = 32) -> tuple[bytes, Layout]:
    """A GGUF file: metadata (key, value type, value; arrays as (element type, items)) and tensors (name, dims in
    GGUF order, type, data); data offsets aligned to `alignment`. Returns the bytes and the field offsets."""
    lay = Layout()
    out = bytearray(b"GGUF")
    lay.fields["version"] = len(out)
    out += struct.pack("<I", version)
    lay.fields["n_tensors"] = len(out)
    out += struct.pack("<Q", len(tensors))
    lay.fields["n_kv"] = len(out)
    out += struct.pack("<Q", len(meta))
    for i, (key, vtype, v) in enumerate(meta):
        lay.fields[f"kv{i}.keylen"] = len(out)
        out += _value(STR, key)
        lay.fields[f"kv{i}.type"] = len(out)
        out += struct.pack("<I", vtype)
        lay.fields[f"kv{i}.value"] = len(out)
        out += _value(vtype, v)
    rel = 0
    offsets = []
    for j, (name, dims, ttype, data) in enumerate(tensors):
        lay.fields[f"t{j}.namelen"] = len(out)
        out += _value(STR, name)
        lay.fields[f"t{j}.ndims"] = len(out)
        out += struct.pack("<I", len(dims))
        for d, n in enumerate(dims):
            lay.fields[f"t{j}.dim{d}"] = len(out)
            out += struct.pack("<Q", n)
        lay.fields[f"t{j}.type"] = len(out)
        out += struct.pack("<I", ttype)
        lay.fields[f"t{j}.offset"] = len(out)
        out += struct.pack("<Q", rel)
        offsets.append(rel)
        rel += len(data) + (-len(data)) % alignment
    out += bytes((-len(out)) % alignment)
    lay.data_start = len(out)
    for (_, _, _, data), off in zip(tensors, offsets):
        out += bytes(lay.data_start + off - len(out)) + data
    return bytes(out), lay


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary (GPT-2's 256 byte characters, a few merges, ChatML specials) and its merges."""
    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(c) for c in range(ord("¡"), ord("¬") + 1)] + [
        chr(c) for c in range(ord("®"), ord("ÿ") + 1)]
    n = 0
    for b in range(256):
        if chr(b) not in chars:
            chars.append(chr(256 + n))
            n += 1
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *chars, "Ġt", "he", "Ġthe", "in"]
    return tokens, merges


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def llama_meta(**override: Any) -> list[tuple[str, int, Any]]:
    """Metadata of the tiny Llama; `override` replaces values by key (None drops the key); dots as '__'."""
    tokens, merges = byte_level_vocab()
    meta = [
        ("general.architecture", STR, "llama"),
        ("llama.block_count", U32, LAYERS),
        ("llama.context_length", U32, 256),
        ("llama.embedding_length", U32, HIDDEN),
        ("llama.feed_forward_length", U32, FFN),
        ("llama.attention.head_count", U32, HEADS),
        ("llama.attention.head_count_kv", U32, KV_HEADS),
        ("llama.rope.freq_base", F32, 10000.0),
        ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        ("tokenizer.ggml.model", STR, "gpt2"),
        ("tokenizer.ggml.pre", STR, "default"),
        ("tokenizer.ggml.tokens", ARR, (STR, tokens)),
        ("tokenizer.ggml.token_type", ARR, (I32, [3, 3, 3] + [1] * (len(tokens) - 3))),
        ("tokenizer.ggml.merges", ARR, (STR, merges)),
        ("tokenizer.ggml.bos_token_id", U32, 1),
        ("tokenizer.ggml.eos_token_id", U32, 2),
        ("tokenizer.chat_template", STR, CHATML),
    ]
    out = []
    for key, vtype, v in meta:
        k = key.replace(".", "__")
        if k in override:
            v = override.pop(k)
            if v is None:
                continue
            vtype = override.pop(k + "__type", vtype)
        out.append((key, vtype, v))
    for k, v in list(override.items()):
        if not k.endswith("__type") and v is not None:
            guess = ARR if isinstance(v, tuple) else F32 if isinstance(v, float) else U32 if isinstance(v, int) else STR
            out.append((k.replace("__", "."), override.get(k + "__type", guess), v))
    return out


def q8_0(w: np.ndarray) -> bytes:
    """Q8_0 blocks of a float matrix (rows of multiples of 32 weights)."""
    blocks = w.reshape(-1, 32).astype(np.float32)
    scale = np.maximum(np.abs(blocks).max(axis=1), 1e-8) / 127
    q = np.clip(np.round(blocks / scale[:, None]), -127, 127).astype(np.int8)
    out = bytearray()
    for s, row in zip(scale.astype(np.float16), q):
        out += s.tobytes() + row.tobytes()
    return bytes(out)


def llama_tensors(vocab: int, seed: int = 0, layers: int = LAYERS) -> list[tuple[str, tuple[int, ...], int, bytes]]:
    """Random weights of the tiny Llama (GGUF dims: innermost first); the embedding in Q8_0, the rest F32."""
    rng = np.random.default_rng(seed)
    hd = HIDDEN // HEADS

    def f32(*shape: int) -> tuple[tuple[int, ...], int, bytes]:
        return tuple(reversed(shape)), T_F32, (rng.standard_normal(shape) * 0.05).astype(np.float32).tobytes()

    out = [("token_embd.weight", tuple(reversed((vocab, HIDDEN))), T_Q8_0,
            q8_0(rng.standard_normal((vocab, HIDDEN)) * 0.05)),
           ("output_norm.weight", *f32(HIDDEN))]
    for i in range(layers):
        for name, shape in (("attn_norm", (HIDDEN,)), ("ffn_norm", (HIDDEN,)), ("attn_q", (HEADS * hd, HIDDEN)),
                            ("attn_k", (KV_HEADS * hd, HIDDEN)), ("attn_v", (KV_HEADS * hd, HIDDEN)),
                            ("attn_output", (HIDDEN, HEADS * hd)), ("ffn_gate", (FFN, HIDDEN)),
                            ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN))):
            out.append((f"blk.{i}.{name}.weight", *f32(*shape)))
    return out


def tiny_llama(**override: Any) -> tuple[bytes, Layout]:
    """A valid tiny Llama GGUF (metadata overrides as in `llama_meta`)."""
    meta = llama_meta(**override)
    vocab = len(byte_level_vocab()[0])
    return build(meta, llama_tensors(vocab))


def patch(data: bytes, offset: int, fmt: str, value: Any) -> bytes:
    """`data` with one field (struct format `fmt`) at `offset` replaced."""
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def model_only(src: Path, dst: Path) -> None:
    """Write the GGUF at `src` to `dst` without its metadata arrays (the tokenizer's ~150k strings and ids): the same
    tensors, bytes unchanged, and scalar metadata, with `{arch}.vocab_size` stated where the token list said it.
    transformers parses every metadata field in Python; on the embedded model the arrays cost it ~12 s of ~28."""
    from mlx_redrafter.models.gguf_header import ARRAY, TENSOR_TYPES, read_header

    h = read_header(src)
    codes = {t: code for code, t in TENSOR_TYPES.items()}
    arch = h.metadata["general.architecture"]
    meta = [(k, h.value_types[k], v) for k, v in h.metadata.items() if h.value_types[k] != ARRAY]
    if f"{arch}.vocab_size" not in h.metadata:
        meta.append((f"{arch}.vocab_size", U32, len(h.metadata["tokenizer.ggml.tokens"])))
    with open(src, "rb") as f:
        tensors = []
        for t in h.tensors:
            f.seek(t.offset)
            tensors.append((t.name, tuple(reversed(t.shape)), codes[t.type], f.read(t.nbytes)))
    dst.write_bytes(build(meta, tensors, version=h.version, alignment=h.alignment)[0])
