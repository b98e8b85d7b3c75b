"""The GGUF layout (header, metadata, tensor table), read and checked in Python before MLX sees the file.

MLX's GGUF reader (gguflib) trusts the file: a key or string length past the end of the file, a tensor type it
does not know or one whose block size is zero, more than 4 dimensions, a zero alignment or a tensor whose data
lies past the end of the file make it read or write out of bounds, divide by zero or abort. `read_header` walks
the whole structure with bounds checks and returns the metadata as Python values and the tensor table; only a
file that passes is handed to `mx.load`. The checks:

- magic `GGUF`, version 2 or 3 (little-endian), key-value and tensor counts within `MAX_COUNT`;
- every length (keys, strings, arrays) within the file and within `MAX_KEY` / `MAX_ARRAY`; keys and strings
  UTF-8; known value types; no arrays of arrays; no duplicate keys; `general.alignment` a uint32 power of two;
- tensors: unique UTF-8 names, 1 to 4 dimensions, each 1 to 2^31 - 1, a type MLX reads (`TENSOR_TYPES`) whose
  blocks divide the first dimension, a data offset aligned as the file says, and data inside the file: a file
  cut after its tensor table is an incomplete download.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlx_redrafter.errors import UserError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_COUNT = 1 << 24  # key-value pairs or tensors
MAX_KEY = 65535  # bytes in a key or tensor name (the GGUF spec's limit)
MAX_ARRAY = (1 << 31) - 1  # elements of a metadata array (MLX indexes them with an int)
MAX_DIMS = 4
MAX_DIM = (1 << 31) - 1  # MLX shapes are int32
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorType:
    """A GGUF tensor type: its name, the weights per block and the bytes per block."""

    name: str
    block: int
    size: int


# The types MLX's reader turns into arrays: copied (F32, F16), unpacked into MLX quantized triples (Q4_0, Q4_1,
# Q8_0) or dequantized to float16 by gguflib (BF16, Q2_K, Q4_K, Q6_K).
TENSOR_TYPES = {
    0: TensorType("F32", 1, 4), 1: TensorType("F16", 1, 2), 2: TensorType("Q4_0", 32, 18),
    3: TensorType("Q4_1", 32, 20), 8: TensorType("Q8_0", 32, 34), 10: TensorType("Q2_K", 256, 82),
    12: TensorType("Q4_K", 256, 144), 14: TensorType("Q6_K", 256, 210), 30: TensorType("BF16", 1, 2),
}
# Types the format defines that MLX cannot read as weights (named in messages).
OTHER_TENSOR_TYPES = {
    4: "Q4_2 (removed from the format)", 5: "Q4_3 (removed from the format)", 6: "Q5_0", 7: "Q5_1", 9: "Q8_1",
    11: "Q3_K", 13: "Q5_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL",
    21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
}

# Metadata value types: struct formats of the scalars, numpy dtypes for arrays of them.
UINT32, BOOL, STRING, ARRAY = 4, 7, 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
_VALUE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
                8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor table entry: shape in MLX order (GGUF stores it reversed), type, absolute data offset, bytes."""

    name: str
    shape: tuple[int, ...]
    type: TensorType
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """A checked GGUF file: metadata (Python values: int, float, bool, str, lists of them), each key's value
    type, the tensor table and the file size."""

    version: int
    metadata: dict[str, Any]
    value_types: dict[str, int]
    tensors: list[TensorInfo]
    data_offset: int
    alignment: int
    size: int


class _Reader:
    """Bounds-checked little-endian reads from a buffer (an mmap or bytes)."""

    def __init__(self, data: Any, where: str):
        self.data, self.size, self.off, self.where = data, len(data), 0, where

    def fail(self, detail: str) -> UserError:
        return UserError(f"cannot read GGUF file {self.where}: {detail}")

    def past_end(self, what: str, need: int) -> UserError:
        return self.fail(f"{what} runs past the end of the file ({need:,} bytes at byte {self.off:,}, "
                         f"{self.size - self.off:,} left): an incomplete download or a corrupt file; re-download it")

    def take(self, n: int, what: str) -> int:
        """Start of the next n bytes (advancing past them)."""
        if n > self.size - self.off:
            raise self.past_end(what, n)
        start = self.off
        self.off += n
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.data, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.data, self.take(8, what))[0]

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64(f"the length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"{what} claims a length of {n:,} bytes (at most {limit:,}): a corrupt file")
        start = self.take(n, what)
        try:
            return str(self.data[start:start + n], "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text: a corrupt file") from None

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            v = struct.unpack_from(fmt, self.data, self.take(struct.calcsize(fmt), f"the value of {key!r}"))[0]
            return bool(v) if vtype == BOOL else v
        if vtype == STRING:
            return self.string(f"the value of {key!r}")
        if vtype == ARRAY:
            etype = self.u32(f"the element type of {key!r}")
            count = self.u64(f"the length of {key!r}")
            if count > MAX_ARRAY:
                raise self.fail(f"metadata array {key!r} claims {count:,} elements (at most {MAX_ARRAY:,})")
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                start = self.take(count * struct.calcsize(fmt), f"metadata array {key!r} ({count:,} elements)")
                arr = np.frombuffer(self.data, dtype=np.dtype(fmt), count=count, offset=start)
                values = (arr != 0).tolist() if etype == BOOL else arr.tolist()
                del arr  # releases the buffer (an mmap cannot close while numpy holds it)
                return values
            if etype == STRING:
                return self.strings(count, key)
            if etype == ARRAY:
                raise self.fail(f"metadata {key!r} is an array of arrays, which MLX cannot read")
            raise self.fail(f"metadata array {key!r} has elements of unknown type {etype}")
        raise self.fail(f"metadata {key!r} has unknown value type {vtype} (known: 0-12)")

    def strings(self, count: int, key: str) -> list[str]:
        data, size, off, out = self.data, self.size, self.off, []
        try:
            for i in range(count):
                if size - off < 8:
                    self.off = off
                    raise self.past_end(f"string {i:,} of metadata array {key!r}", 8)
                (n,) = _U64.unpack_from(data, off)
                off += 8
                if n > size - off:
                    self.off = off
                    raise self.past_end(f"string {i:,} of metadata array {key!r}", n)
                out.append(str(data[off:off + n], "utf-8"))
                off += n
        except UnicodeDecodeError:
            raise self.fail(f"string {len(out):,} of metadata array {key!r} is not UTF-8 text: a corrupt "
                            f"file") from None
        self.off = off
        return out


def parse_header(data: Any, where: str) -> GGUFHeader:
    """Check a GGUF file's bytes (`data`: bytes or an mmap of the whole file) and read its header, metadata and
    tensor table; `where` names the file in messages. A one-line UserError for anything MLX could not read
    safely (see the module docstring)."""
    r = _Reader(data, where)
    if r.size < 4 or bytes(data[:4]) != MAGIC:
        raise r.fail(f"not a GGUF file (it starts with {bytes(data[:4])!r}, not {MAGIC!r})")
    r.off = 4
    version = r.u32("the version")
    if version not in VERSIONS:
        if version in (0x02000000, 0x03000000):
            raise r.fail("a big-endian GGUF file: convert it to little-endian with llama.cpp's gguf tools")
        raise r.fail(f"GGUF version {version} is not supported (versions {' and '.join(map(str, VERSIONS))} are)")
    n_tensors = r.u64("the tensor count")
    n_kv = r.u64("the metadata count")
    for count, what in ((n_tensors, "tensors"), (n_kv, "metadata keys")):
        if count > MAX_COUNT:
            raise r.fail(f"the header claims {count:,} {what} (at most {MAX_COUNT:,}): a corrupt file")
    meta: dict[str, Any] = {}
    types: dict[str, int] = {}
    for i in range(n_kv):
        key = r.string(f"metadata key {i + 1:,} of {n_kv:,}", MAX_KEY)
        if key in meta:
            raise r.fail(f"metadata key {key!r} appears twice: a corrupt file")
        types[key] = r.u32(f"the value type of metadata key {key!r}")
        meta[key] = r.value(types[key], key)
    alignment = _alignment(r, meta, types)
    infos: list[tuple[str, tuple[int, ...], TensorType, int]] = []
    names: set[str] = set()
    for j in range(n_tensors):
        name = r.string(f"the name of tensor {j + 1:,} of {n_tensors:,}", MAX_KEY)
        if name in names:
            raise r.fail(f"tensor {name!r} appears twice: a corrupt file")
        names.add(name)
        n_dims = r.u32(f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims:,} dimensions (1 to {MAX_DIMS} are supported)")
        dims = [r.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
        if not all(1 <= d <= MAX_DIM for d in dims):
            raise r.fail(f"tensor {name!r} has dimensions {dims} (each must be 1 to {MAX_DIM:,})")
        code = r.u32(f"the type of tensor {name!r}")
        ttype = TENSOR_TYPES.get(code)
        if ttype is None:
            what = OTHER_TENSOR_TYPES.get(code, "an unknown type")
            raise r.fail(f"tensor {name!r} has type {code} ({what}), which MLX cannot read; supported: "
                         f"{', '.join(t.name for t in TENSOR_TYPES.values())} (re-quantize the model, e.g. to Q4_0 "
                         f"or Q8_0)")
        if dims[0] % ttype.block:
            raise r.fail(f"tensor {name!r} ({ttype.name}) has rows of {dims[0]:,} weights, not a multiple of its "
                         f"block of {ttype.block}")
        rel = r.u64(f"the data offset of tensor {name!r}")
        if rel % alignment:
            raise r.fail(f"tensor {name!r} has data offset {rel:,}, not a multiple of the file's alignment "
                         f"{alignment}: a corrupt file")
        infos.append((name, tuple(reversed(dims)), ttype, rel))
    data_offset = r.off + (-r.off) % alignment
    tensors = []
    for name, shape, ttype, rel in infos:
        nbytes = math.prod(shape) // ttype.block * ttype.size
        tensors.append(TensorInfo(name, shape, ttype, data_offset + rel, nbytes))
    packed = data_offset + sum(t.nbytes + (-t.nbytes) % alignment for t in tensors)  # the data, back to back
    for t in tensors:
        if t.offset + t.nbytes > packed:
            raise r.fail(f"tensor {t.name!r} has its data at byte {t.offset:,}, past the end of the data its tensor "
                         f"table describes ({packed:,} bytes): a corrupt file")
    ordered = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if b.offset < a.offset + a.nbytes:
            raise r.fail(f"tensors {a.name!r} and {b.name!r} share bytes {b.offset:,}-"
                         f"{min(a.offset + a.nbytes, b.offset + b.nbytes) - 1:,} of the file: a corrupt file")
    need = max((t.offset + t.nbytes for t in tensors), default=0)
    if need > r.size:
        raise UserError(f"{where} is an incomplete download: its tensors need {need:,} bytes but the file has "
                        f"{r.size:,}; re-download it")
    return GGUFHeader(version, meta, types, tensors, data_offset, alignment, r.size)


def _alignment(r: _Reader, meta: dict[str, Any], types: dict[str, int]) -> int:
    """The data alignment: `general.alignment` (a uint32 power of two, as gguflib reads it) or 32."""
    if "general.alignment" not in meta:
        return DEFAULT_ALIGNMENT
    value = meta["general.alignment"]
    if types["general.alignment"] != UINT32 or value <= 0 or value & (value - 1):
        raise r.fail(f"general.alignment = {value!r} ({_VALUE_NAMES.get(types['general.alignment'], 'unknown')}) "
                     f"is not a uint32 power of two: a corrupt file")
    return value


def read_header(path: str | Path) -> GGUFHeader:
    """Check a GGUF file and read its header, metadata and tensor table (see `parse_header`)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise UserError(f"model file {p} is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return parse_header(mm, str(p))
    except OSError as e:
        raise UserError(f"cannot read GGUF file {p}: {e.strerror or type(e).__name__}") from None
