"""Malformed target models through the real CLI: GGUF files (layout, metadata, tensor table, tokenizer, chat
template) and mlx-lm directories (config.json, safetensors weights, tokenizer files). Every one ends with one
`error:` line and exit status 2: no traceback, no native crash, no hang."""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import pytest
from gguf_files import (
    ARR,
    F32,
    I32,
    STR,
    U32,
    build,
    byte_level_vocab,
    llama_meta,
    llama_tensors,
    patch,
    tiny_llama,
)
from mlx.utils import tree_flatten
from one_line import CLI, assert_one_line_error, generate, run

from mlx_redrafter.model import Model, ModelArgs
from mlx_redrafter.models.gguf_header import parse_header
from mlx_redrafter.models.tokenizer import TextTokenizer

BASE, LAYOUT = tiny_llama()
NO_DRAFTER = ("--drafter", "none", "--draft", "lookup")  # no drafter, and no notice saying so
F = LAYOUT.fields
VOCAB = len(byte_level_vocab()[0])


def with_meta(**override) -> bytes:
    return build(llama_meta(**override), llama_tensors(VOCAB))[0]


def with_tensors(tensors) -> bytes:
    return build(llama_meta(), tensors)[0]


def swap_tensor(name: str, new) -> list:
    return [new if t[0] == name else t for t in llama_tensors(VOCAB)]


GGUF_CASES = {
    # layout: what MLX's reader would crash on (segmentation fault, floating-point exception) or misread
    "not GGUF": (b"PK\x03\x04" + BASE[4:], ["not a GGUF file"]),
    "version 1": (patch(BASE, F["version"], "<I", 1), ["GGUF version 1"]),
    "big-endian": (patch(BASE, F["version"], "<I", 0x03000000), ["big-endian"]),
    "huge key count": (patch(BASE, F["n_kv"], "<Q", 1 << 50), ["metadata keys"]),
    "huge tensor count": (patch(BASE, F["n_tensors"], "<Q", 1 << 50), ["tensors"]),
    "key longer than the file": (patch(BASE, F["kv3.keylen"], "<Q", 1 << 40), ["metadata key 4", "length"]),
    "string longer than the file": (patch(BASE, F["kv0.value"], "<Q", 1 << 40), ["past the end of the file"]),
    "array longer than the file": (patch(BASE, F["kv11.value"] + 4, "<Q", 1 << 40), ["tokenizer.ggml.tokens"]),
    "unknown value type": (patch(BASE, F["kv3.type"], "<I", 99), ["unknown value type 99"]),
    "array of arrays": (patch(BASE, F["kv11.value"], "<I", ARR), ["array of arrays"]),
    "key not UTF-8": (BASE[:F["kv0.keylen"] + 8] + b"\xff" + BASE[F["kv0.keylen"] + 9:], ["not UTF-8"]),
    "zero alignment": (with_meta(general__alignment=0, general__alignment__type=U32), ["general.alignment"]),
    "alignment not a power of two": (with_meta(general__alignment=48, general__alignment__type=U32),
                                     ["general.alignment"]),
    "unknown tensor type": (patch(BASE, F["t1.type"], "<I", 99), ["type 99"]),
    "zero-size block type": (patch(BASE, F["t1.type"], "<I", 4), ["type 4", "Q4_2"]),
    "type MLX cannot read": (patch(BASE, F["t1.type"], "<I", 6), ["Q5_0"]),
    "five dimensions": (patch(BASE, F["t1.ndims"], "<I", 5), ["5 dimensions"]),
    "zero dimension": (patch(BASE, F["t1.dim0"], "<Q", 0), ["dimensions [0]"]),
    "huge dimension": (patch(BASE, F["t1.dim0"], "<Q", 1 << 40), ["dimensions"]),
    "Q8_0 rows not of 32": (with_tensors(swap_tensor("output_norm.weight", ("output_norm.weight", (33,), 8,
                                                                             bytes(68)))), ["block of 32"]),
    "tensor offset past the data": (patch(BASE, F["t3.offset"], "<Q", 1 << 62), ["corrupt file"]),
    "misaligned tensor offset": (patch(BASE, F["t3.offset"], "<Q", 3), ["alignment"]),
    "tensors sharing bytes": (patch(BASE, F["t3.offset"], "<Q", struct.unpack_from("<Q", BASE, F["t2.offset"])[0]),
                              ["share bytes", "corrupt file"]),
    "duplicate tensor": (with_tensors(llama_tensors(VOCAB) + llama_tensors(VOCAB)[-1:]), ["appears twice"]),
    "cut inside the metadata": (BASE[:F["kv12.value"] + 10], ["past the end of the file", "re-download"]),
    "cut after the metadata": (BASE[:LAYOUT.data_start + 100], ["incomplete download", "re-download"]),
    # metadata a Llama and its tokenizer need
    "no architecture": (with_meta(general__architecture=None), ["no model metadata"]),
    "another architecture": (with_meta(general__architecture="gpt2"), ["architecture 'gpt2'"]),
    "no head count": (with_meta(llama__attention__head_count=None), ["lacks llama.attention.head_count"]),
    "zero heads": (with_meta(llama__attention__head_count=0), ["llama.attention.head_count = 0"]),
    "head count a string": (with_meta(llama__attention__head_count="4", llama__attention__head_count__type=STR),
                            ["llama.attention.head_count = '4'"]),
    "head count a float": (with_meta(llama__attention__head_count=4.0, llama__attention__head_count__type=F32),
                           ["is not an integer"]),
    "kv heads do not divide": (with_meta(llama__attention__head_count_kv=3), ["num_key_value_heads 3"]),
    "heads do not divide the width": (with_meta(llama__attention__head_count=5), ["not a multiple"]),
    "odd head size": (with_meta(llama__rope__dimension_count=15), ["head size 15 is odd"]),
    "zero context": (with_meta(llama__context_length=0), ["llama.context_length = 0"]),
    "negative epsilon": (with_meta(llama__attention__layer_norm_rms_epsilon=-1.0), ["layer_norm_rms_epsilon"]),
    "NaN rope base": (with_meta(llama__rope__freq_base=float("nan")), ["llama.rope.freq_base = nan"]),
    "no vocabulary": (with_meta(tokenizer__ggml__tokens=None), ["no vocabulary"]),
    "vocabulary of numbers": (with_meta(tokenizer__ggml__tokens=(I32, [1, 2, 3])), ["no vocabulary"]),
    "no merges": (with_meta(tokenizer__ggml__merges=None), ["without merges"]),
    "merges without a pair": (with_meta(tokenizer__ggml__merges=(STR, ["Ġt"])), ["without merges"]),
    "unknown tokenizer": (with_meta(tokenizer__ggml__model="bert"), ["tokenizer.ggml.model = 'bert'"]),
    "bos outside the vocabulary": (with_meta(tokenizer__ggml__bos_token_id=VOCAB + 5),
                                   [f"tokenizer.ggml.bos_token_id = {VOCAB + 5}"]),
    "eos outside the vocabulary": (with_meta(tokenizer__ggml__eos_token_id=1 << 31),
                                   ["tokenizer.ggml.eos_token_id"]),
    "token types of another length": (with_meta(tokenizer__ggml__token_type=(I32, [1, 1])),
                                      ["tokenizer.ggml.token_type"]),
    "scores not numbers": (with_meta(tokenizer__ggml__scores=(STR, ["a"] * VOCAB)), ["tokenizer.ggml.scores"]),
    # tensor table against the metadata
    "missing tensor": (with_tensors(llama_tensors(VOCAB)[:-1]), ["lacks tensor blk.1.ffn_down.weight"]),
    "wrong shape": (with_tensors(swap_tensor("blk.0.attn_k.weight", ("blk.0.attn_k.weight", (64, 64), 0,
                                                                      bytes(64 * 64 * 4)))), ["blk.0.attn_k.weight"]),
    "a layer too many": (with_tensors(llama_tensors(VOCAB, layers=3)), ["unexpected tensor blk.2"]),
    "quantized vector": (with_tensors(swap_tensor("output_norm.weight", ("output_norm.weight", (64,), 8,
                                                                          bytes(68)))), ["vector"]),
    "embedding of another vocabulary": (with_meta(llama__vocab_size=VOCAB - 10), ["token_embd.weight"]),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_malformed_gguf(tmp_path, case):
    data, needles = GGUF_CASES[case]
    f = tmp_path / "model.gguf"
    f.write_bytes(data)
    assert_one_line_error(generate(tmp_path, "--model", str(f), *NO_DRAFTER), *needles)


def test_the_valid_tiny_gguf_generates(tmp_path):
    """The control: the file every case above corrupts loads and decodes."""
    f = tmp_path / "model.gguf"
    f.write_bytes(BASE)
    proc = generate(tmp_path, "--model", str(f), *NO_DRAFTER, "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["tokens"]) == 4


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_the_prompt(tmp_path):
    """Ids the embedding has no row for would make MLX read out of bounds: the prompt is refused instead."""
    small = VOCAB - 3  # the merged tokens (Ġt, he, Ġthe) have ids beyond the embedding
    data = build(llama_meta(llama__vocab_size=small), llama_tensors(small))[0]
    f = tmp_path / "model.gguf"
    f.write_bytes(data)
    assert_one_line_error(generate(tmp_path, "--model", str(f), *NO_DRAFTER, "--raw"),
                          "token id", f"has {small} tokens")


TEMPLATES = {
    "division by zero": ("{{ 1 // 0 }}", ["ZeroDivisionError"]),
    "type error": ("{{ messages + 1 }}", ["TypeError"]),
    "range too big": ("{% for i in range(10**12) %}x{% endfor %}", ["1000000000000"]),
    "endless loop": ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
                     ["longer than"]),
    "huge repetition": ("{{ 'x' * 10**11 }}", ["repeats"]),
    "memory exhaustion": ("{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                          "{% endfor %}{{ ns.s }}", ["was stopped"]),  # by memory, or by time on a busy machine
    "huge width": ("{{ '{:>99999999999}'.format(1) }}", ["width"]),
    "huge output": ("{% for i in range(99999) %}{{ 'y' * 999 }}{% endfor %}", ["output"]),
    "syntax error": ("{% for m in messages %}", ["does not parse"]),
    "unbounded recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", ["RecursionError"]),
    "raise_exception": ("{{ raise_exception('only user messages') }}", ["refused", "only user messages"]),
    "undefined attribute": ("{{ messages[3].content.upper() }}", ["UndefinedError"]),
}


@pytest.mark.parametrize("case", list(TEMPLATES))
def test_broken_chat_templates(tmp_path, case):
    template, needles = TEMPLATES[case]
    f = tmp_path / "model.gguf"
    f.write_bytes(with_meta(tokenizer__chat_template=template))
    msg = assert_one_line_error(generate(tmp_path, "--model", str(f), *NO_DRAFTER), *needles)
    assert msg.startswith("the chat template (the model's own)")


def test_chat_template_file_not_utf8(tmp_path):
    f = tmp_path / "bad.jinja"
    f.write_bytes(b"{{ messages }}\xff")
    proc = run([*CLI, "chat", "--template", str(f), "--drafter", "none"], tmp_path)
    assert_one_line_error(proc, "chat template", "not UTF-8")


# --- mlx-lm directories ----------------------------------------------------------------------------------------

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 256, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A valid tiny mlx-lm directory: config.json, model.safetensors, tokenizer.json + tokenizer_config.json."""
    d = tmp_path_factory.mktemp("tiny-llama")
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(CONFIG))
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (d / "config.json").write_text(json.dumps(CONFIG))
    TextTokenizer.from_gguf_metadata(parse_header(BASE, "tiny").metadata).save(d)
    return d


def copy_dir(src, dst, **files):
    """A copy of the model directory with some files replaced (bytes, str, dict/list as JSON, None: removed)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    for name, content in files.items():
        name = name.replace("__", ".")
        if content is None:
            (dst / name).unlink()
        elif isinstance(content, (dict, list)):
            (dst / name).write_text(json.dumps(content))
        else:
            (dst / name).write_bytes(content.encode() if isinstance(content, str) else content)
    return dst


def safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


DIR_CASES = {
    "config not an object": (dict(config__json=[1, 2]), ["JSON array, expected a JSON object"]),
    "config not JSON": (dict(config__json="{'model_type': llama"), ["not valid JSON"]),
    "config not UTF-8": (dict(config__json=b'{"model_type": "llama\xff"}'), ["not UTF-8"]),
    "no config.json": (dict(config__json=None), ["no config.json"]),
    "config.json a directory": ("config dir", ["is a directory"]),
    "missing key": (dict(config__json={k: v for k, v in CONFIG.items() if k != "hidden_size"}),
                    ["lacks hidden_size"]),
    "zero heads": (dict(config__json={**CONFIG, "num_attention_heads": 0}), ["num_attention_heads = 0"]),
    "a string for an int": (dict(config__json={**CONFIG, "num_hidden_layers": "1"}), ["num_hidden_layers = '1'"]),
    "absurd width": (dict(config__json={**CONFIG, "hidden_size": 10**9}), ["hidden_size = 1000000000"]),
    "unsupported rope type": (dict(config__json={**CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4}}),
                              ["rope_scaling type 'yarn'"]),
    "rope scaling without factor": (dict(config__json={**CONFIG, "rope_scaling": {"type": "linear"}}),
                                    ["lacks factor"]),
    "rope scaling not an object": (dict(config__json={**CONFIG, "rope_scaling": "linear"}), ["rope_scaling"]),
    "another model type": (dict(config__json={**CONFIG, "model_type": "gpt2"}), ["model_type = 'gpt2'"]),
    "quantization bits": (dict(config__json={**CONFIG, "quantization": {"bits": 7, "group_size": 64}}),
                          ["bits = 7"]),
    "quantization not an object": (dict(config__json={**CONFIG, "quantization": 4}), ["quantization"]),
    "weights cut short": ("cut", ["truncated", "re-download"]),
    "weights header not JSON": (dict(model__safetensors=struct.pack("<Q", 9) + b"not json!"), ["not valid JSON"]),
    "weights header lies about sizes": (dict(model__safetensors=safetensors_bytes(
        {"w": {"dtype": "F32", "shape": [1 << 20], "data_offsets": [0, 8]}}, bytes(8))), ["data_offsets"]),
    "weights sharing bytes": (dict(model__safetensors=safetensors_bytes(
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))), ["share bytes 4-7"]),
    "weights with a gap": (dict(model__safetensors=safetensors_bytes(
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}}, bytes(20))), ["bytes 8-11", "no tensor"]),
    "weights of an unknown dtype": (dict(model__safetensors=safetensors_bytes(
        {"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, bytes(16))), ["dtype 'F128'"]),
    "weights that do not fit the config": (dict(model__safetensors=safetensors_bytes(
        {"model.norm.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))),
        ["do not match a Llama model"]),
    "tokenizer.json garbage": (dict(tokenizer__json="{]"), ["tokenizer.json"]),
    "tokenizer.json a directory": ("tokenizer dir", ["is a directory"]),
    "tokenizer_config not UTF-8": (dict(tokenizer_config__json=b'{"x": "\xfe"}'), ["not UTF-8"]),
    "chat template a number": (dict(tokenizer_config__json={"chat_template": 42}), ["chat_template = 42"]),
    "chat template list of strings": (dict(tokenizer_config__json={"chat_template": ["a"]}), ["chat_template"]),
    "chat_template.jinja not UTF-8": (dict(tokenizer_config__json={}, chat_template__jinja=b"{{ 1 }}\xff"),
                                      ["chat template", "not UTF-8"]),
    "special token not a string": (dict(tokenizer_config__json={"eos_token": 7}), ["special token is 7"]),
    "eos id a string": (dict(config__json={**CONFIG, "eos_token_id": "2"}), ["eos_token_id = '2'"]),
    "sentencepiece model garbage": (dict(tokenizer__json=None, tokenizer__model=b"\x00garbage"),
                                    ["not a SentencePiece model"]),
    "added tokens not ids": (dict(tokenizer__json=None, tokenizer__model=b"x", added_tokens__json={"<x>": "1"}),
                             ["added_tokens.json"]),
}


@pytest.mark.parametrize("case", list(DIR_CASES))
def test_malformed_model_directory(tmp_path, model_dir, case):
    files, needles = DIR_CASES[case]
    if files == "cut":
        data = (model_dir / "model.safetensors").read_bytes()
        d = copy_dir(model_dir, tmp_path / "m", model__safetensors=data[: len(data) // 2])
    elif files in ("tokenizer dir", "config dir"):
        name = "tokenizer.json" if files == "tokenizer dir" else "config.json"
        d = copy_dir(model_dir, tmp_path / "m", **{name.replace(".", "__"): None})
        (d / name).mkdir()
    else:
        d = copy_dir(model_dir, tmp_path / "m", **files)
    assert_one_line_error(generate(tmp_path, "--model", str(d), *NO_DRAFTER), *needles)


def test_the_valid_tiny_directory_generates(tmp_path, model_dir):
    proc = generate(tmp_path, "--model", str(model_dir), *NO_DRAFTER, "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["tokens"]) == 4


def test_a_float_vocabulary_array_is_read_as_numbers():
    """Metadata arrays come back as Python values (the checks see what the tokenizer will use)."""
    meta = parse_header(with_meta(tokenizer__ggml__scores=(F32, [0.5] * VOCAB)), "x").metadata
    assert meta["tokenizer.ggml.scores"] == [0.5] * VOCAB and meta["llama.embedding_length"] == 64


def test_the_template_budget_counts_cpu_time_not_waiting():
    """A low-priority job on a busy machine waits for the CPU: that must not stop its chat template (it stopped the
    data job once). Sleeping past the budget, then running Python lines, stays within it."""
    import time

    from mlx_redrafter.models.templates import RENDER_SECONDS, _Budget

    def slow_to_get_the_cpu():
        time.sleep(RENDER_SECONDS + 0.3)
        return sum(i for i in range(100))

    assert _Budget().run(slow_to_get_the_cpu) == 4950
