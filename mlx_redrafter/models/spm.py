"""SentencePiece tokenizers (Llama-1/2, Vicuna): a `tokenizer.model` file or the `llama` tokenizer of a GGUF.

Special tokens (`<s>`, `</s>`, added tokens) written in text are split out before SentencePiece sees the
text, as Hugging Face's LlamaTokenizer does, so a chat template's `</s>` becomes the eos id. `legacy`
follows that tokenizer's flag: legacy (the default) gives every text segment SentencePiece's dummy prefix
"▁"; non-legacy gives it only at the start of the text.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

from mlx_redrafter.errors import UserError
from mlx_redrafter.files import read_bytes

_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class SentencePieceBackend:
    """encode(text) -> ids / decode(ids) -> text over a SentencePiece model, with special-token splitting."""

    def __init__(self, proto: bytes, added: dict[str, int] | None = None, legacy: bool = True):
        self.proto = proto
        self.sp = spm.SentencePieceProcessor(model_proto=proto)
        model = pb.ModelProto.FromString(proto)
        self.dummy_prefix = model.normalizer_spec.add_dummy_prefix
        self.legacy = legacy
        self._no_prefix = None
        if not legacy and self.dummy_prefix:
            model.normalizer_spec.add_dummy_prefix = False
            self._no_prefix = spm.SentencePieceProcessor(model_proto=model.SerializeToString())
        n = self.sp.get_piece_size()
        self.pieces = [self.sp.id_to_piece(i) for i in range(n)]
        self.specials = {self.pieces[i]: i for i in range(n) if self.sp.is_control(i) or self.sp.is_unknown(i)}
        self.specials.update(added or {})
        self.id_text = {i: t for t, i in self.specials.items()}
        self.vocab_size = max([n, *[i + 1 for i in self.id_text]])
        names = sorted((t for t in self.specials if t), key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None
        self._bytes = {i: int(m.group(1), 16) for i, p in enumerate(self.pieces) if self.sp.is_byte(i)
                       and (m := _BYTE.match(p))}

    def token_to_id(self, text: str) -> int | None:
        """Id of a special token or a whole piece, else None."""
        if text in self.specials:
            return self.specials[text]
        i = self.sp.piece_to_id(text)
        return i if self.pieces[i] == text else None

    def id_to_token(self, i: int) -> str | None:
        """The piece (or special token text) of an id."""
        return self.id_text.get(i) or (self.pieces[i] if 0 <= i < len(self.pieces) else None)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens in it map to their ids."""
        parts = self._split.split(text) if self._split else [text]
        ids: list[int] = []
        for k, part in enumerate(parts):
            if not part:
                continue
            if k % 2 == 1:  # a special token (re.split puts captured separators at odd indexes)
                ids.append(self.specials[part])
            elif self._no_prefix is None or (k == 0 and part):
                ids.extend(self.sp.encode(part))
            else:
                ids.extend(self._no_prefix.encode(part))
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of token ids; byte-fallback tokens are joined into UTF-8 (an incomplete sequence ends in U+FFFD)."""
        out = bytearray()
        for pos, i in enumerate(ids):
            i = int(i)
            if i in self.id_text:
                out += self.id_text[i].encode()
            elif i in self._bytes:
                out.append(self._bytes[i])
            elif 0 <= i < len(self.pieces):
                piece = self.pieces[i]
                if pos == 0 and self.dummy_prefix and piece.startswith("\u2581"):
                    piece = piece[1:]  # SentencePiece drops the dummy prefix of the first piece
                out += piece.replace("\u2581", " ").encode()
        return out.decode("utf-8", errors="replace")


def from_file(path: Path, added: dict[str, int] | None = None, legacy: bool = True) -> SentencePieceBackend:
    """A backend from a `tokenizer.model` file; a one-line UserError if it is not a SentencePiece model."""
    data = read_bytes(path, "SentencePiece model")
    try:
        return SentencePieceBackend(data, added, legacy)
    except Exception as e:  # sentencepiece raises RuntimeError/DecodeError with long messages
        raise UserError(f"{path} is not a SentencePiece model: {str(e).splitlines()[0]}") from None


def proto_from_gguf(meta: dict[str, Any]) -> bytes:
    """A SentencePiece model (serialized) from a GGUF `llama` tokenizer (metadata as Python values, checked by
    `gguf.check_metadata`): pieces, scores and token types."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)]
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(tokens)
    m.trainer_spec.byte_fallback = 6 in types
    for key, field in (("unknown", "unk_id"), ("bos", "bos_id"), ("eos", "eos_id"), ("padding", "pad_id")):
        v = meta.get(f"tokenizer.ggml.{key}_token_id")
        setattr(m.trainer_spec, field, int(v) if v is not None else -1)
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for tok, score, ty in zip(tokens, scores, types):
        p = m.pieces.add()
        p.piece, p.score = tok, score
        p.type = ty if ty in (1, 2, 3, 4, 5, 6) else 1
    return m.SerializeToString()
