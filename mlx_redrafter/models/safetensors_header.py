"""The safetensors layout, checked in Python before MLX reads the file: an 8-byte header length, a JSON header of
{name: {"dtype", "shape", "data_offsets": [begin, end]}} (plus "__metadata__": {str: str}), then the data.

Every entry's dtype must be one MLX reads, its shape a list of non-negative integers, its byte range exactly
shape x itemsize and inside the data section, and the ranges tile the data section (no overlap, no gap); a file
cut short is an incomplete download.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from mlx_redrafter.errors import UserError

MAX_HEADER = 100_000_000  # bytes (the safetensors format's own limit)
MAX_DIMS = 8
MAX_DIM = (1 << 31) - 1  # MLX shapes are int32
# dtype -> bytes per element, for the dtypes MLX's reader accepts (MLX 0.32 has no F64).
DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
          "U16": 2, "U8": 1, "BOOL": 1, "C64": 8, "F8_E4M3": 1, "F8_E8M0": 1}


def parse_header(head: bytes, size: int, where: str) -> dict[str, dict[str, Any]]:
    """Check a safetensors file from its first bytes (`head`: at least the 8-byte length and the JSON header, as
    far as the file has them) and its total `size`; returns {name: {"dtype", "shape", "data_offsets"}}. A one-line
    UserError naming `where` for anything malformed."""
    if size < 8 or len(head) < 8:
        raise UserError(f"{where} is not a safetensors file (only {size} bytes)")
    (n,) = struct.unpack_from("<Q", head)
    if n == 0 or n > MAX_HEADER:
        raise UserError(f"{where} is not a safetensors file (a header of {n:,} bytes)")
    if 8 + n > size:
        raise UserError(f"{where} is truncated: its header needs {8 + n:,} bytes but the file has {size:,} (an "
                        f"incomplete download? re-download it)")
    try:
        header = json.loads(head[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise UserError(f"{where} has a corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise UserError(f"{where} has a corrupt safetensors header (not a JSON object)")
    data = size - 8 - n
    out: dict[str, dict[str, Any]] = {}
    for key, info in header.items():
        if key == "__metadata__":  # null (MLX writes it without metadata) or {str: str}
            if info is not None and (not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values())):
                raise UserError(f"{where}: the safetensors __metadata__ must map strings to strings")
            continue
        out[key] = _check_entry(key, info, data, where)
    _check_layout(out, data, where)
    return out


def _check_layout(entries: dict[str, dict[str, Any]], data: int, where: str) -> None:
    """The tensors' byte ranges tile the data section: no two share a byte and none leaves a gap (what the
    safetensors format requires; a file that breaks it was corrupted or hand-made)."""
    at, prev = 0, None
    for key, info in sorted(entries.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, end = info["data_offsets"]
        if begin < at:
            raise UserError(f"{where} has a corrupt safetensors header: tensors {prev!r} and {key!r} share bytes "
                            f"{begin:,}-{at - 1:,} of the data section")
        if begin > at:
            raise UserError(f"{where} has a corrupt safetensors header: bytes {at:,}-{begin - 1:,} of the data "
                            f"section belong to no tensor")
        at, prev = max(at, end), key
    if at != data:
        raise UserError(f"{where} has a corrupt safetensors header: its tensors end at byte {at:,} of a data "
                        f"section of {data:,}")


def _check_entry(key: str, info: Any, data: int, where: str) -> dict[str, Any]:
    bad = f"{where} has a corrupt safetensors header entry for {key!r}"
    if not isinstance(info, dict):
        raise UserError(f"{bad} (not an object)")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPES:
        raise UserError(f"{bad}: dtype {dtype!r} is not one MLX reads ({', '.join(DTYPES)})")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(
            type(d) is int and 0 <= d <= MAX_DIM for d in shape):
        raise UserError(f"{bad}: shape {shape!r} is not a list of up to {MAX_DIMS} sizes from 0 to {MAX_DIM:,}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets):
        raise UserError(f"{bad}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPES[dtype]:
        raise UserError(f"{bad}: data_offsets {offsets} hold {end - begin:,} bytes but a {dtype} tensor of shape "
                        f"{shape} has {math.prod(shape) * DTYPES[dtype]:,}")
    if end > data:
        raise UserError(f"{where} is truncated: tensor {key!r} ends at byte {end:,} of a data section of {data:,} "
                        f"(an incomplete download? re-download it)")
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def read_header(path: str | Path, what: str = "") -> dict[str, dict[str, Any]]:
    """Check a safetensors file's header against its size (see `parse_header`); `what` prefixes its name in
    messages (e.g. "drafter weights")."""
    p = Path(path)
    where = f"{what} {p}".strip()
    try:
        with p.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            first = f.read(8)
            n = struct.unpack("<Q", first)[0] if len(first) == 8 else 0
            head = first + (f.read(n) if 0 < n <= min(MAX_HEADER, size - 8) else b"")
    except OSError as e:
        raise UserError(f"cannot read {where}: {e.strerror or type(e).__name__}") from None
    if size == 0:
        raise UserError(f"{where} is empty")
    return parse_header(head, size, where)
