"""Drive a running `redrafter-mlx serve` with MT-bench first turns (3 at once, 128 tokens, greedy) and print what
its /metrics counted next to what the answers' usage says. Usage: python traffic.py URL"""

import concurrent.futures
import json
import sys

import httpx
import openai

from mlx_redrafter.prompts import first_turns


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def main() -> None:
    url = sys.argv[1]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    prompts = [r["prompt"] for r in first_turns()][:80:10]
    before = metrics(url)

    def ask(p: str):
        return client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": p}],
                                              max_tokens=128, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, prompts))
    after = metrics(url)
    grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    usage = {"prompt_tokens": sum(a.usage.prompt_tokens for a in answers),
             "completion_tokens": sum(a.usage.completion_tokens for a in answers)}
    steps = grew["redrafter_completion_steps_total"]
    accepted = sum(v for k, v in grew.items() if k.startswith("redrafter_accepted_draft_tokens_total{"))
    print(json.dumps({"usage": usage, "metrics_grew": grew,
                      "tokens_per_completion_step": round((grew["redrafter_generation_tokens_total"] - len(answers))
                                                          / steps, 3),
                      "completions_per_target_call": round(steps / grew["redrafter_target_calls_total"], 3),
                      "accepted_share_of_decode_tokens": round(accepted / (grew["redrafter_generation_tokens_total"]
                                                                           - len(answers)), 3)}, indent=1))


if __name__ == "__main__":
    main()
