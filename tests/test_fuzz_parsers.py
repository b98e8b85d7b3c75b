"""Property-based fuzzing (hypothesis) of the checks that stand in front of MLX's readers: the GGUF header /
metadata / tensor-table check, the safetensors header check, and the config schemas.

Properties: on any input a check either accepts or raises one-line UserError, never another exception, and
quickly; and every file a check accepts, MLX then reads without crashing the process. Fuzzed files are only ever
parsed by our Python checks in this process; the accepted ones are read by MLX in a subprocess, so a native crash
fails the test instead of killing pytest.

`make test` runs a bounded, derandomized number of cases (PARSER_FUZZ_CASES_FAST per property, default 100);
`make fuzz` runs the `fuzz`-marked variants, PARSER_FUZZ_CASES each (default 3000), with fresh random seeds.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_files import STR, byte_level_vocab, patch, tiny_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_redrafter.draft.medusa import MedusaArgs
from mlx_redrafter.draft.redrafter import Drafter, DrafterArgs
from mlx_redrafter.draft.semi_ar import SemiARArgs
from mlx_redrafter.errors import UserError
from mlx_redrafter.model import ModelArgs, inverse_frequencies
from mlx_redrafter.models import safetensors_header
from mlx_redrafter.models.config import check_model_config
from mlx_redrafter.models.gguf import check_gguf
from mlx_redrafter.models.gguf_header import TENSOR_TYPES, parse_header
from mlx_redrafter.schema import check_fields
from mlx_redrafter.tuning import ENTRY_FIELDS

FAST = int(os.environ.get("PARSER_FUZZ_CASES_FAST", "100"))
MANY = int(os.environ.get("PARSER_FUZZ_CASES", "3000"))
MAX_LOADED = int(os.environ.get("PARSER_FUZZ_LOADED", "40"))  # accepted files handed to MLX per property


def fast(n: int = FAST):
    return settings(max_examples=n, deadline=None, database=None, derandomize=True, print_blob=True,
                    suppress_health_check=list(HealthCheck))


def many(n: int = MANY):
    return settings(max_examples=n, deadline=None, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


def refused_or_accepted(fn, *args) -> bool:
    """True if fn(*args) accepts, False if it raises a one-line UserError; any other exception fails the test."""
    try:
        fn(*args)
    except UserError as e:
        assert "\n" not in str(e) and str(e)
        return False
    return True


class Tally:
    """Cases of one property, and the first MAX_LOADED distinct files the check accepted."""

    def __init__(self) -> None:
        self.cases, self.accepted, self.kept = 0, 0, {}

    def add(self, data: bytes, accepted: bool) -> None:
        self.cases += 1
        self.accepted += accepted
        if accepted and len(self.kept) < MAX_LOADED:
            self.kept[data] = None

    def read_by_mlx(self, what: str, suffix: str, reader: str, tmp_path: Path) -> None:
        """Report the counts, then have MLX read every kept file (see `mlx_reads`)."""
        print(f"\n{what} fuzz: {self.cases} cases, {self.accepted} accepted, {len(self.kept)} read by MLX")
        files = [tmp_path / f"{i}{suffix}" for i in range(len(self.kept))]
        for f, data in zip(files, self.kept):
            f.write_bytes(data)
        mlx_reads(files, reader, tmp_path)


def mlx_reads(files: list[Path], reader: str, tmp_path: Path) -> None:
    """Every file `f`, read by MLX in one subprocess through the statement `reader`: exit 0, no signal. The only
    exception allowed there is a UserError (e.g. a shape MLX itself refuses)."""
    if not files:
        return
    code = (
        "import sys, mlx_redrafter, mlx.core as mx\n"
        "from mlx_redrafter.errors import UserError\n"
        "from mlx_redrafter.models.gguf import read_gguf, gguf_weights\n"
        "for f in sys.argv[1:]:\n"
        "    try:\n"
        f"        {reader}\n"
        "    except UserError:\n"
        "        pass\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, *map(str, files)], capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert proc.returncode == 0, f"MLX failed (rc {proc.returncode}) on an accepted file: {proc.stderr[-3000:]}"


# --- GGUF ------------------------------------------------------------------------------------------------------

BASE, LAYOUT = tiny_llama()
FIELDS = sorted(LAYOUT.fields)
HEADER_END = LAYOUT.data_start
WIDE = ("keylen", "namelen", "dim", "offset", "n_kv", "n_tensors", "value")  # u64 (a value: its length, if any)
SPECIAL = [0, 1, 2, 3, 4, 5, 6, 8, 9, 12, 13, 14, 30, 31, 32, 33, 64, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
           2**40, 2**63, 2**64 - 1]

TYPE_FIELDS = [f for f in FIELDS if f.startswith("t") and f.endswith(".type")]
mutation = st.one_of(
    st.tuples(st.just("field"), st.sampled_from(FIELDS), st.one_of(st.sampled_from(SPECIAL),
                                                                    st.integers(0, 2**64 - 1))),
    st.tuples(st.just("field"), st.sampled_from(TYPE_FIELDS), st.sampled_from([*TENSOR_TYPES, 4, 5, 6, 99])),
    st.tuples(st.just("truncate"), st.integers(0, len(BASE)), st.just(0)),
    st.tuples(st.just("byte"), st.integers(0, HEADER_END - 1), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, HEADER_END), st.binary(min_size=1, max_size=12)),
    st.tuples(st.just("delete"), st.integers(0, HEADER_END - 1), st.integers(1, 12)),
)


def mutate(data: bytes, steps: list) -> bytes:
    for kind, where, value in steps:
        if kind == "field" and LAYOUT.fields[where] + 8 <= len(data):
            wide = any(w in where for w in WIDE)
            data = patch(data, LAYOUT.fields[where], "<Q" if wide else "<I", value % (2**64 if wide else 2**32))
        elif kind == "truncate":
            data = data[:where]
        elif kind == "byte" and where < len(data):
            data = data[:where] + bytes([value]) + data[where + 1:]
        elif kind == "insert":
            data = data[:where] + value + data[where:]
        elif kind == "delete":
            data = data[:where] + data[where + value:]
    return data


def check_gguf_bytes(data: bytes) -> None:
    check_gguf(parse_header(data, "fuzz.gguf"), "fuzz.gguf")


def fuzz_gguf(config, tmp_path: Path) -> None:
    tally = Tally()

    @config
    @given(st.lists(mutation, min_size=1, max_size=4))
    def one(steps):
        data = mutate(BASE, steps)
        tally.add(data, refused_or_accepted(check_gguf_bytes, data) and data != BASE)

    one()
    tally.read_by_mlx("GGUF", ".gguf", "t, meta, cfg = read_gguf(f); gguf_weights(t, cfg)", tmp_path)


def test_gguf_check_never_fails_otherwise(tmp_path):
    assert refused_or_accepted(check_gguf_bytes, BASE)  # the unmutated file passes
    fuzz_gguf(fast(), tmp_path)


@pytest.mark.fuzz
def test_gguf_check_fuzz(tmp_path):
    fuzz_gguf(many(), tmp_path)


def test_gguf_metadata_values_of_every_type_parse():
    """Arrays and scalars of each value type come back as the Python values the checks expect."""
    tokens = byte_level_vocab()[0]
    meta = parse_header(tiny_llama(x__u8=(0, [1, 2]), x__f64=(12, [0.5]), x__bool=(7, [0, 1, 2]),
                                   x__i64=(11, [-1]), x__s=(STR, ["a", "é"]))[0], "x").metadata
    assert meta["x.u8"] == [1, 2] and meta["x.f64"] == [0.5] and meta["x.bool"] == [False, True, True]
    assert meta["x.i64"] == [-1] and meta["x.s"] == ["a", "é"] and meta["tokenizer.ggml.tokens"] == tokens


# --- safetensors ------------------------------------------------------------------------------------------------

ST_DTYPES = list(safetensors_header.DTYPES)
consistent = st.lists(st.tuples(st.sampled_from(ST_DTYPES), st.lists(st.integers(0, 6), max_size=3)),
                      min_size=0, max_size=3)
wild_entry = st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from([*ST_DTYPES, "F128", "", "f32"]), st.integers(), st.none()),
    "shape": st.one_of(st.lists(st.one_of(st.integers(-3, 8), st.sampled_from([2**31 - 1, 2**31, 2**63])),
                                max_size=9), st.text(max_size=2)),
    "data_offsets": st.lists(st.one_of(st.integers(-4, 300), st.sampled_from([2**32, 2**64 + 5])), max_size=3),
})


@st.composite
def safetensors_files(draw) -> bytes:
    header: dict = {}
    off = 0
    for i, (dtype, shape) in enumerate(draw(consistent)):
        n = safetensors_header.DTYPES[dtype]
        for d in shape:
            n *= d
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    for key, entry in draw(st.dictionaries(st.text(max_size=4), wild_entry, max_size=2)).items():
        header[key] = entry
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.one_of(st.none(), st.dictionaries(st.text(max_size=3), st.one_of(
            st.text(max_size=3), st.integers()), max_size=2)))
    text = json.dumps(header).encode()
    data = struct.pack("<Q", len(text)) + text + bytes(off) + draw(st.binary(max_size=8))
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    if cut is not None:
        data = data[:cut]
    if draw(st.booleans()) and len(data) >= 8:  # a corrupt length field
        data = struct.pack("<Q", draw(st.sampled_from([0, 1, 7, len(text) + 1, 2**40, 2**64 - 1]))) + data[8:]
    return data


def fuzz_safetensors(config, tmp_path: Path) -> None:
    tally = Tally()

    @config
    @given(safetensors_files())
    def one(data):
        tally.add(data, refused_or_accepted(safetensors_header.parse_header, data, len(data), "fuzz.safetensors"))

    one()
    tally.read_by_mlx("safetensors", ".safetensors", "mx.eval(list(mx.load(f).values()))", tmp_path)


def test_safetensors_check_never_fails_otherwise(tmp_path):
    fuzz_safetensors(fast(), tmp_path)


@pytest.mark.fuzz
def test_safetensors_check_fuzz(tmp_path):
    fuzz_safetensors(many(), tmp_path)


# --- config schemas ---------------------------------------------------------------------------------------------

def nested(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3))


json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4),
              st.sampled_from([0, 1, 2, 3, 4, 8, 32, 64, 576, 49152, 10**8, 2**31, -1, 1e8, 0.5])),
    nested, max_leaves=6)

VALID = {
    "drafter": {"vocab_size": 64, "hidden_size": 8, "exit_dim": 16, "num_draft_layers": 2, "rnn": True},
    "medusa": {"model_type": "medusa", "vocab_size": 64, "hidden_size": 8, "medusa_num_heads": 2},
    "semi_ar": {"model_type": "semi_ar_drafter", "vocab_size": 64, "hidden_size": 8, "tlm": "lstm", "tlm_dim": 4,
                "exit_dim": 8},
    "model": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
              "vocab_size": 100, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    "tuned": {"draft": "lookup", "beam_width": 1, "dtype": "float32"},
}
KEYS = sorted({k for cfg in VALID.values() for k in cfg} | {
    "draft_vocab_size", "quantization", "emb_norm", "num_lookback_tokens", "medusa_num_layers", "num_layers",
    "max_draft_len", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
    "tie_word_embeddings", "beam_length", "lookup_width", "model_type", "factor", "low_freq_factor"})


def accept_drafter(cfg):
    Drafter(DrafterArgs.from_dict(cfg))  # built lazily: an accepted config never allocates or hangs


def accept_model(cfg):
    check_model_config(cfg, "fuzz config.json")
    inverse_frequencies(ModelArgs.from_dict(cfg))


SCHEMAS = {"drafter": accept_drafter, "medusa": MedusaArgs.from_dict, "semi_ar": SemiARArgs.from_dict,
           "model": accept_model, "tuned": lambda cfg: check_fields(cfg, ENTRY_FIELDS, "fuzz entry")}


def fuzz_configs(config) -> None:
    count = [0, 0]

    @config
    @given(st.sampled_from(sorted(SCHEMAS)), st.dictionaries(st.sampled_from(KEYS), json_value, max_size=4),
           st.lists(st.sampled_from(KEYS), max_size=2), st.one_of(json_value, st.just("valid")))
    def one(kind, changes, dropped, whole):
        cfg = {k: v for k, v in {**VALID[kind], **changes}.items() if k not in dropped}
        count[0] += 1
        count[1] += refused_or_accepted(SCHEMAS[kind], cfg if whole == "valid" else whole)

    one()
    print(f"\nconfig schema fuzz: {count[0]} cases, {count[1]} accepted")


def test_config_schemas_never_fail_otherwise():
    for kind, accept in SCHEMAS.items():
        assert refused_or_accepted(accept, dict(VALID[kind])), kind
    fuzz_configs(fast(5 * FAST))


@pytest.mark.fuzz
def test_config_schemas_fuzz():
    fuzz_configs(many())
