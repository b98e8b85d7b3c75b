"""Prompts written by the target itself, for a corpus whose first turns are as varied as the target's own idea of
a user (Magpie, arXiv 2406.08464: an instruction-tuned model given its chat template up to the start of a user's
message writes that message).

Each prompt is one sampled user turn (temperature 1, top-p 0.95), attempt k drawn with seed `seed + k`, so a file
is reproducible attempt by attempt and can be extended. Kept are finished turns (the model closed the turn) of a
few words that no earlier prompt and no benchmark prompt repeats (`Filter`); the rest are dropped and counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mlx_redrafter.errors import UserError
from mlx_redrafter.files import write_atomic

SOURCE = "self_prompted"
TEMPERATURE, TOP_P = 1.0, 0.95
MAX_PROMPT_TOKENS = 160  # a user turn still open after this many tokens is dropped
MIN_WORDS, MAX_CHARS = 3, 1200
MAX_ATTEMPTS_PER_PROMPT = 20  # a model that needs more attempts per kept prompt does not write usable prompts
MIN_OVERLAP_CHARS = 24  # a prompt inside a benchmark prompt (or one inside it) counts as the same from this length


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's first message begins (its system turn included)."""
    marker = "\x00PROMPT\x00"
    return tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": marker}]).split(marker, 1)[0])


def normalized(text: str) -> str:
    """Lower case, words only: what two prompts must share to count as one."""
    return " ".join(re.findall(r"\w+", text.lower()))


@dataclass
class Filter:
    """Which sampled user turns are kept: finished, a few words, no template tokens, and new (not a repeat of a
    kept prompt, not inside or around a benchmark prompt: `exclude`)."""

    exclude: Iterable[str] = ()
    seen: set[str] = field(default_factory=set)
    dropped: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.exclude = [n for n in (normalized(t) for t in self.exclude) if n]

    def keep(self, text: str, finished: bool) -> str | None:
        """The prompt to keep (stripped), or None (counted in `dropped` under its reason)."""
        text = text.strip()
        why = None
        if not finished:
            why = "unfinished"
        elif "<|" in text or len(text) > MAX_CHARS or len(text.split()) < MIN_WORDS:
            why = "malformed"
        else:
            key = normalized(text)
            if key in self.seen:
                why = "repeated"
            elif any(key == b or (len(key) >= MIN_OVERLAP_CHARS and (key in b or b in key)) for b in self.exclude):
                why = "benchmark"
            else:
                self.seen.add(key)
        if why:
            self.dropped[why] = self.dropped.get(why, 0) + 1
            return None
        return text


def sample_user_turns(lm, first: int, count: int, seed: int, batch_size: int) -> list[tuple[str, bool]]:
    """(text, finished) of attempts first .. first + count - 1: user turns sampled after the template's prefix,
    attempt k with seed `seed + k`."""
    from mlx_redrafter import api
    from mlx_redrafter.options import DecodeOptions
    from mlx_redrafter.sampling import Sampling

    prefix = user_turn_prefix(lm.tokenizer)
    options = DecodeOptions(draft="none", max_tokens=MAX_PROMPT_TOKENS,
                            sampling=Sampling(temperature=TEMPERATURE, top_p=TOP_P, seed=seed + first))
    results = api.generate_batch(lm, [prefix] * count, options, batch_size=batch_size, chat=False)
    return [(r.text, len(r.tokens) < MAX_PROMPT_TOKENS) for r in results]  # stopped before the limit: closed


def partial_file(out: Path) -> Path:
    """Where `make_prompts` keeps the rows kept so far for `out`."""
    return out.with_name(out.name + ".partial")


def read_rows(path: Path) -> list[dict]:
    """Rows of a self-prompts file (or of its `.partial` companion); [] where there is none; a one-line UserError
    for a file that is not what `make_prompts` writes."""
    if not path.exists():
        return []
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if all(isinstance(r, dict) and isinstance(r.get("prompt"), str) and isinstance(r.get("attempt"), int)
               for r in rows):
            return rows
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    raise UserError(f"{path} is not a self-prompts file (JSONL rows with \"prompt\" and \"attempt\"): delete it "
                    "to start over")


def write_rows(path: Path, rows: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def make_prompts(lm, out: Path, num: int, seed: int = 0, batch_size: int = 16, exclude: Iterable[str] = (),
                 progress: Callable[[int, dict[str, int]], None] | None = None, avoid: Iterable[str] = ()) -> dict:
    """Write `num` prompts to `out` (JSONL {"prompt", "source", "attempt"}), sampling attempts in batches until
    that many are kept; none repeats a prompt of `avoid` (e.g. another file's). Resumable: kept rows are saved
    beside `out` (`.partial`) after every batch and a run continues after its last attempt; `out` appears once
    complete. Returns counts of kept and dropped attempts."""
    partial = partial_file(out)
    rows = read_rows(partial)
    filt = Filter(exclude)
    filt.seen.update(normalized(t) for t in [*avoid, *(r["prompt"] for r in rows)])
    attempt = (rows[-1]["attempt"] + 1) if rows else 0
    if progress:
        progress(len(rows), filt.dropped)
    while len(rows) < num:
        if attempt >= MAX_ATTEMPTS_PER_PROMPT * num + batch_size:
            raise UserError(f"the model kept {len(rows)} of {attempt} sampled user turns (dropped: {filt.dropped}): "
                            "it does not write usable prompts; give prompts of your own instead")
        for k, (text, finished) in enumerate(sample_user_turns(lm, attempt, batch_size, seed, batch_size)):
            prompt = filt.keep(text, finished)
            if prompt is not None and len(rows) < num:
                rows.append({"prompt": prompt, "source": SOURCE, "attempt": attempt + k})
        attempt += batch_size
        write_rows(partial, rows)
        if progress:
            progress(len(rows), filt.dropped)
    write_rows(out, rows)
    partial.unlink(missing_ok=True)
    return {"prompts": len(rows), "attempts": attempt, "dropped_this_run": dict(filt.dropped)}
