"""The data engines side by side: tokens per second of batched greedy generation (the target writes its own
answers) and of the teacher-forced feature pass (the target labels a given text), on the same prompts, one BLAS
thread each, float32. Results: OUT/data-engines.{json,md}.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from mlx_redrafter.files import write_atomic


def measure(num_prompts: int, max_new_tokens: int, batch_size: int, log=print) -> dict[str, Any]:
    """Generate greedy answers to `num_prompts` prompts of the corpus plan, then teacher-force the same sequences."""
    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.system.blas import set_threads
    from mlx_redrafter.system.machine import machine_info
    from mlx_redrafter.system.machine_state import machine_now
    from mlx_redrafter.train.corpus import Shard
    from mlx_redrafter.train.features import teacher_forced
    from mlx_redrafter.train.greedy import generate_greedy

    set_threads(1)
    target = load_target(None, "float32")
    tok = target.tokenizer
    rows = [json.loads(line) for line in Path("../shared/data/train_prompts.jsonl").open(encoding="utf-8")]
    picked = [rows[i] for i in np.random.default_rng(0).permutation(len(rows))[:num_prompts]]
    prompts = [tok.encode_chat([{"role": "user", "content": r["prompt"]}]) for r in picked]
    before = machine_now()
    order = np.argsort([len(p) for p in prompts], kind="stable")
    answers: dict[int, list[int]] = {}
    c0, t0 = time.process_time(), time.perf_counter()
    for b in range(0, len(order), batch_size):
        part = [int(i) for i in order[b : b + batch_size]]
        outs, _ = generate_greedy(target.model, [prompts[i] for i in part], max_new_tokens, tok.eos_ids)
        answers.update(zip(part, outs))
    gen_cpu, gen_wall = time.process_time() - c0, time.perf_counter() - t0
    new_tokens = sum(len(a) for a in answers.values())
    seqs = [prompts[i] + answers[i] for i in range(len(prompts))]
    lens = [len(s) for s in seqs]
    shard = Shard(tokens=np.concatenate([np.array(s, np.int32) for s in seqs]),
                  offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                  prompt_len=np.array([len(p) for p in prompts], np.int32),
                  prompt_index=np.arange(len(seqs), dtype=np.int32), turn=np.ones(len(seqs), np.int8), split="train")
    c0, t0 = time.process_time(), time.perf_counter()
    teacher_forced(target.model, shard, tok.eos_ids[0])
    tf_cpu, tf_wall = time.process_time() - c0, time.perf_counter() - t0
    log(f"generation {new_tokens} new tokens in {gen_cpu:.0f} CPU s; teacher-forced {sum(lens)} tokens in "
        f"{tf_cpu:.0f} CPU s")
    return {
        "prompts": num_prompts, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
        "generation": {"new_tokens": new_tokens, "cpu_s": round(gen_cpu, 1), "wall_s": round(gen_wall, 1),
                       "new_tokens_per_cpu_s": round(new_tokens / gen_cpu, 1)},
        "teacher_forced": {"tokens": int(sum(lens)), "response_tokens": new_tokens, "cpu_s": round(tf_cpu, 1),
                           "wall_s": round(tf_wall, 1), "tokens_per_cpu_s": round(sum(lens) / tf_cpu, 1),
                           "response_tokens_per_cpu_s": round(new_tokens / tf_cpu, 1)},
        "machine": machine_info(), "machine_before": before, "machine_after": machine_now(),
    }


def write(res: dict[str, Any], out_dir: Path) -> Path:
    g, t = res["generation"], res["teacher_forced"]
    rows = [f"| batched greedy generation (batch {res['batch_size']}) | the target's own answers | "
            f"{g['new_tokens']:,} new | {g['cpu_s']} | {g['new_tokens_per_cpu_s']} new tokens |",
            f"| teacher-forced pass | hidden states + top-8 labels of the same sequences | {t['tokens']:,} (prompt "
            f"+ answer) | {t['cpu_s']} | {t['tokens_per_cpu_s']} tokens ({t['response_tokens_per_cpu_s']} answer "
            f"tokens) |"]
    ratio = t["response_tokens_per_cpu_s"] / g["new_tokens_per_cpu_s"]
    md = "\n".join([
        "# Data engines: generation vs teacher forcing", "",
        f"{res['prompts']} prompts of the corpus plan's pool, answers of up to {res['max_new_tokens']} tokens, "
        f"float32, one BLAS thread, the runtime's own model; load average before / after: "
        f"{res['machine_before'].get('loadavg')} / {res['machine_after'].get('loadavg')}.", "",
        "| engine | what it makes | tokens | CPU s | per CPU second |", "|---|---|---|---|---|", *rows, "",
        f"Labelling a given text costs {ratio:.1f}x less CPU per answer token than writing it. Reproduce: "
        "`python -m bench engines`.", ""])
    write_atomic(out_dir / "data-engines.json", json.dumps(res, indent=1) + "\n")
    return write_atomic(out_dir / "data-engines.md", md)
