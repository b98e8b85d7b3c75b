"""The self-distillation plan: which prompts each shard of a greedy corpus answers, in a fixed order.

Shard 0 holds the held-out prompts (never trained on); then turn-1 shards of `shard_size` prompts, and after every
`turn2_every` of them one turn-2 shard that continues a quarter of their sequences with a short follow-up request
(multi-turn contexts). The order of the prompt pool is a deterministic weighted shuffle, so general chat comes
first and the pool's math and code share trickles in later; every prompt is eventually used.

Once every prompt has its first answer, the plan goes on (so that a data job never runs out of work): further
turn-2 passes continue the other quarters of each group's sequences, each pass with its own draw of follow-ups
(one cycle of passes: every sequence continued once); then more cycles, in each of which every sequence is asked a
follow-up it has not been asked before (`follow_choice`), until each has been asked every one of FOLLOW_UPS (whose
later rounds were added as the earlier ran out: their passes come after the earlier rounds').
Shards already made keep their numbers: the passes come after them.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field

# Sampling weight of a prompt source in the plan order (1.0 where not listed): the pool is 36% gsm8k and 22% code.
SOURCE_WEIGHTS = {"gsm8k_train": 0.15, "gpteacher_codegen": 0.3}
# Licenses of the prompt and text sources this project may redistribute outputs of (Apache-2.0 repository).
LICENSES = {
    "gsm8k_train": "MIT", "dolly15k_partial": "CC-BY-SA-3.0", "gpteacher_codegen": "MIT",
    "gpteacher_roleplay": "MIT", "oasst": "Apache-2.0", "self_instruct_seed": "Apache-2.0",
    "self_prompted": "Apache-2.0",  # written by the target itself (train/self_prompts.py): SmolLM2 is Apache-2.0
}
FOLLOW_UPS = [
    # round 1
    "Make that shorter.",
    "Can you expand on that with more detail?",
    "Rewrite your answer as a bulleted list.",
    "Summarize your answer in one sentence.",
    "Explain that to a ten-year-old.",
    "Give me a concrete example.",
    "Rewrite that in a more formal tone.",
    "What is the most important point in your answer?",
    "Now write it again, but friendlier.",
    "Are you sure? Double-check your answer.",
    # round 2
    "Give me three more examples.",
    "What are the pros and cons?",
    "Turn that into a short story.",
    "Explain the reasoning step by step.",
    "What would an expert add to this?",
    "Write a short poem about it.",
    "What should I ask next to learn more?",
    "Rewrite it as an email to a colleague.",
    "What mistakes do people often make here?",
    "Give it a title and a one-paragraph summary.",
]
FOLLOW_UP_ROUNDS = (10, 10)  # FOLLOW_UPS in rounds: a round's passes come after the earlier rounds' (none renumbered)


@dataclass
class Settings:
    """How sequences are made (part of every shard's identity)."""

    max_new_tokens: int = 512
    max_prompt_tokens: int = 768  # turn-2 prompts carry the first answer
    shard_size: int = 256  # prompts per shard
    batch_size: int = 64
    heldout: int = 256  # prompts in shard 0, never trained on
    turn2_every: int = 4  # after every 4 turn-1 shards, one turn-2 shard continuing 1/4 of their sequences
    seed: int = 0


@dataclass
class Job:
    """One shard to produce: which rows of the plan (turn 1) or whose earlier sequences (turn 2)."""

    index: int
    turn: int
    split: str
    rows: list[int]  # plan rows (turn 1) or plan rows whose turn-1 sequence is continued (turn 2)
    parents: list[int] = field(default_factory=list)  # turn-1 shards the turn-2 sequences come from
    follow_pass: int = 0  # turn 2: which pass over the groups (0: the pass interleaved with the turn-1 shards)

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}.npz"


def hash_unit(text: str) -> float:
    """A deterministic number in [0, 1) from a string."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def plan_order(rows: list[dict], seed: int) -> list[int]:
    """Deterministic order of the prompt pool: weighted shuffle by source (Efraimidis-Spirakis keys)."""
    rng = random.Random(seed)
    keys = [-math.log(1.0 - rng.random()) / SOURCE_WEIGHTS.get(r.get("source", ""), 1.0) for r in rows]
    return sorted(range(len(rows)), key=lambda i: keys[i])


def follow_choice(row: int, follow_pass: int, s: Settings) -> int:
    """Which follow-up (an index into FOLLOW_UPS) the turn-2 sequence of plan row `row` asks in a pass. Within a
    round of n follow-ups (`FOLLOW_UP_ROUNDS`, turn2_every x n passes): a draw per row and pass within the round's
    first cycle of `turn2_every` passes (where each row is continued once), then in cycle c that draw shifted by c,
    so a row is never asked the same follow-up twice."""
    first = 0  # the round's first pass and first follow-up
    for rnd, n in enumerate(FOLLOW_UP_ROUNDS):
        if follow_pass < s.turn2_every * n or rnd == len(FOLLOW_UP_ROUNDS) - 1:
            break
        follow_pass -= s.turn2_every * n
        first += n
    part, cycle = follow_pass % s.turn2_every, follow_pass // s.turn2_every
    key = f"follow:{s.seed}:{row}" if part == 0 else f"follow:{s.seed}:{part}:{row}"
    if rnd:
        key += f":round{rnd}"
    return first + (int(hash_unit(key) * n) + cycle) % n


def plan_jobs(n_rows: int, s: Settings, turn2: bool = True) -> list[Job]:
    """All shards of a full corpus over n_rows ordered rows: the held-out shard, turn-1 shards and (with `turn2`)
    the turn-2 shards: the first pass interleaved with the turn-1 shards, the rest of the first cycle after them,
    then one more cycle per further follow-up."""
    jobs = [Job(0, 1, "heldout", list(range(min(s.heldout, n_rows))))]
    turn1: list[Job] = []
    start = s.heldout
    while start < n_rows:
        job = Job(len(jobs), 1, "train", list(range(start, min(start + s.shard_size, n_rows))))
        jobs.append(job)
        turn1.append(job)
        start += s.shard_size
        if turn2 and len(turn1) % s.turn2_every == 0:
            jobs.append(_turn2_job(len(jobs), turn1[-s.turn2_every:], s, 0))
    if turn2:
        groups = [turn1[g : g + s.turn2_every] for g in range(0, len(turn1) - s.turn2_every + 1, s.turn2_every)]
        for k in range(1, s.turn2_every * len(FOLLOW_UPS)):
            for group in groups:
                jobs.append(_turn2_job(len(jobs), group, s, k))
    return jobs


def _turn2_job(index: int, group: list[Job], s: Settings, k: int) -> Job:
    """The turn-2 shard of pass k over a group of turn-1 shards: the rows whose hash falls in part k mod
    `turn2_every` of as many equal parts (every row of the group is continued once in each cycle of passes)."""
    part = k % s.turn2_every
    lo, hi = part / s.turn2_every, (part + 1) / s.turn2_every
    picked = [r for j in group for r in j.rows if lo <= hash_unit(f"turn2:{s.seed}:{r}") < hi]
    return Job(index, 2, "train", picked, parents=[j.index for j in group], follow_pass=k)
