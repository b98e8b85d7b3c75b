"""Fixed public text as a corpus source: instruction/response pairs in the target's chat format.

Nothing is generated: the response text only supplies the context. What the drafter learns from comes from the
target's teacher-forced pass over it (`features.py`: its hidden states and its own top-k distribution at every
position), so tokenizing is the whole cost of a shard. Input: JSON Lines with "prompt" and "response" strings
(and optional "source" and "license"), e.g. `../shared/data/responses.jsonl`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_redrafter.errors import UserError
from mlx_redrafter.models.loader import Target
from mlx_redrafter.train.corpus import Corpus, sha256_file
from mlx_redrafter.train.distill import Made
from mlx_redrafter.train.plan import Job, Settings, plan_jobs, plan_order


def read_pairs(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file with non-empty "prompt" and "response" strings; a one-line UserError otherwise."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"responses file {p} does not exist or is not a file (JSONL with prompt and response)")
    rows = []
    try:
        with p.open(encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    raise UserError(f"{p}:{i} is not valid JSON (expected {{\"prompt\", \"response\"}} per line)"
                                    ) from None
                if not (isinstance(obj, dict) and all(isinstance(obj.get(k), str) and obj[k].strip()
                                                      for k in ("prompt", "response"))):
                    raise UserError(f"{p}:{i} lacks a non-empty \"prompt\" or \"response\" string")
                rows.append(obj)
    except UnicodeDecodeError:
        raise UserError(f"responses file {p} is not UTF-8 text: convert it (e.g. iconv -t UTF-8)") from None
    if not rows:
        raise UserError(f"responses file {p} has no rows")
    return rows


class TextSource:
    """Prompt + response pairs of a JSONL file, chat-formatted for the target, in a fixed weighted order."""

    kind = "text"

    def __init__(self, target: Target, responses_file: str | Path, settings: Settings | None = None):
        self.target, self.settings = target, settings or Settings()
        self.file = Path(responses_file)
        self.rows = read_pairs(self.file)
        self.order = plan_order(self.rows, self.settings.seed)

    def identity(self) -> dict[str, Any]:
        licenses = sorted({f"{r.get('source', '?')}: {r.get('license', '?')}" for r in self.rows})
        return {"settings": vars(self.settings), "responses_file": self.file.name,
                "responses_sha256": sha256_file(self.file), "licenses": licenses,
                "engine": "fixed text (no generation); labels from the target's teacher-forced pass"}

    def checked_keys(self) -> tuple[str, ...]:
        return ("settings", "responses_sha256")

    def jobs(self) -> list[Job]:
        return plan_jobs(len(self.order), self.settings, turn2=False)

    def total(self, job: Job) -> int:
        return len(job.rows)

    def ready(self, job: Job, corpus: Corpus) -> str | None:
        return None

    def make(self, job: Job, corpus: Corpus, progress: Callable[[int, int], None]) -> Made:
        s, tok = self.settings, self.target.tokenizer
        seqs, plens, index, sources = [], [], [], Counter()
        ended = 0
        for r in job.rows:
            row = self.rows[self.order[r]]
            prompt = tok.encode_chat([{"role": "user", "content": row["prompt"]}])
            answer = tok.encode(row["response"]) + tok.eos_ids[:1]
            if not 0 < len(prompt) <= s.max_prompt_tokens:
                continue
            ended += len(answer) <= s.max_new_tokens
            seqs.append(prompt + answer[: s.max_new_tokens])
            plens.append(len(prompt))
            index.append(r)
            sources[row.get("source", "")] += 1
        progress(len(job.rows), sum(len(q) - p for q, p in zip(seqs, plens)))
        return Made(seqs=seqs, prompt_lens=plens, index=index, turns=1,
                    info={"skipped_prompts": len(job.rows) - len(seqs), "sources": dict(sorted(sources.items())),
                          "eos_stops": ended})
