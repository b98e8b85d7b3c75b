"""An OpenAI-compatible chat-completions endpoint as a corpus source (vLLM, SGLang, llama.cpp's llama-server,
mlx_lm.server, redrafter-mlx serve, ...): for users whose answers come from bigger machines.

The endpoint answers the plan's prompts (greedy: temperature 0); the answers are tokenized with the target's own
tokenizer and chat template, and the target's teacher-forced pass (`features.py`) supplies the labels, so the
serving model only has to write plausible text. Several requests are in flight at once (servers batch them).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlx_redrafter.errors import UserError
from mlx_redrafter.models.loader import Target
from mlx_redrafter.schema import Field, check_http_url, check_option
from mlx_redrafter.train.corpus import Corpus, sha256_file
from mlx_redrafter.train.distill import Made
from mlx_redrafter.train.plan import LICENSES, Job, Settings, plan_jobs, plan_order


def chat_url(base: str) -> str:
    """The chat-completions URL of an endpoint given as its base (http://host:port or .../v1)."""
    base = check_http_url(base, "--endpoint")
    if base.endswith("/chat/completions"):
        return base
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


def ask(url: str, model: str | None, prompt: str, max_tokens: int, api_key: str | None = None,
        timeout: float = 600.0) -> tuple[str, bool]:
    """(answer text, whether it ended by itself) of one greedy chat completion; a one-line UserError on failure."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.0,
            "stream": False, **({"model": model} if model else {})}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            reply = json.loads(r.read().decode("utf-8"))
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", "replace")[:200].replace("\n", " ")
        raise UserError(f"endpoint {url} answered HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise UserError(f"cannot reach endpoint {url} ({reason}): is the server running?") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"endpoint {url} did not answer with JSON: is it an OpenAI-compatible server?") from None
    try:
        choice = reply["choices"][0]
        text = choice["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        raise UserError(f"endpoint {url} answered without choices[0].message.content: is it OpenAI-compatible?"
                        ) from None
    return text, choice.get("finish_reason") == "stop"


class EndpointSource:
    """Answers of an OpenAI-compatible endpoint to a JSONL prompts file, in the plan's order (turn 1 only)."""

    kind = "endpoint"

    def __init__(self, target: Target, url: str, prompts_file: str | Path, settings: Settings | None = None,
                 model: str | None = None, api_key: str | None = None, concurrency: int = 4):
        from mlx_redrafter.prompts import read_prompts

        check_option("--concurrency", concurrency, Field("", int, 1, 256))
        self.target, self.settings = target, settings or Settings()
        self.url, self.model, self.api_key, self.concurrency = chat_url(url), model, api_key, concurrency
        self.prompts_file = Path(prompts_file)
        self.rows = read_prompts(prompts_file)
        self.order = plan_order(self.rows, self.settings.seed)

    def identity(self) -> dict[str, Any]:
        return {"settings": vars(self.settings), "prompts_file": self.prompts_file.name,
                "prompts_sha256": sha256_file(self.prompts_file), "endpoint": self.url,
                "endpoint_model": self.model, "licenses": LICENSES,
                "engine": "an OpenAI-compatible endpoint (greedy); labels from the target's teacher-forced pass"}

    def checked_keys(self) -> tuple[str, ...]:
        return ("settings", "prompts_sha256", "endpoint_model")

    def jobs(self) -> list[Job]:
        return plan_jobs(len(self.order), self.settings, turn2=False)

    def total(self, job: Job) -> int:
        return len(job.rows)

    def ready(self, job: Job, corpus: Corpus) -> str | None:
        return None

    def make(self, job: Job, corpus: Corpus, progress: Callable[[int, int], None]) -> Made:
        s, tok = self.settings, self.target.tokenizer
        prompts = {r: self.rows[self.order[r]]["prompt"] for r in job.rows}
        ids = {r: tok.encode_chat([{"role": "user", "content": p}]) for r, p in prompts.items()}
        keep = [r for r in job.rows if 0 < len(ids[r]) <= s.max_prompt_tokens]

        def one(r: int) -> tuple[int, list[int]]:
            text, ended = ask(self.url, self.model, prompts[r], s.max_new_tokens, self.api_key)
            if not text.strip():  # no answer (null or blank content): the prompt is skipped, not stored as one
                progress(1, 0)
                return r, []
            answer = tok.encode(text)[: s.max_new_tokens] + (tok.eos_ids[:1] if ended else [])
            progress(1, len(answer))
            return r, answer

        with ThreadPoolExecutor(self.concurrency) as pool:
            answers = dict(pool.map(one, keep))
        progress(len(job.rows) - len(keep), 0)
        rows = [r for r in keep if answers[r]]
        sources = Counter(self.rows[self.order[r]].get("source", "") for r in rows)
        return Made(seqs=[ids[r] + answers[r] for r in rows], prompt_lens=[len(ids[r]) for r in rows], index=rows,
                    turns=1, info={"skipped_prompts": len(job.rows) - len(rows),
                                   "sources": dict(sorted(sources.items())),
                                   "eos_stops": sum(1 for r in rows if answers[r][-1] in tok.eos_ids)})
