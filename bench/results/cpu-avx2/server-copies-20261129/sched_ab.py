"""Server path A/B: the Scheduler in-process, 3 concurrent jobs at a time over 6 MT-bench turns (128 tokens), plus
one request predicted by its own answer; prints wall time, target calls, ids hash."""
import sys
sys.path.insert(0, sys.argv[1])
import mlx_redrafter; assert mlx_redrafter.__file__.startswith(sys.argv[1]), mlx_redrafter.__file__
from mlx_redrafter import install_blas; install_blas()
import asyncio, hashlib, json, time
from mlx_redrafter import api
from mlx_redrafter.prompts import first_turns
from mlx_redrafter.server.scheduler import Scheduler, Job
lm = api.load()
curve = api.cost_curve(lm, 3, 4)
turns = first_turns(); N = 6
prompts = [lm.tokenizer.encode_chat([{"role": "user", "content": turns[(k * len(turns)) // N]["prompt"]}]) for k in range(N)]
story = lm.tokenizer.encode_chat([{"role": "user", "content": "Write a short story about a robot."}])
pred = api.generate(lm, story, max_tokens=128, draft="none", chat=False).text

async def run(jobs_spec):
    loop = asyncio.get_running_loop()
    s = Scheduler(lm, max_active=3, curve=curve); s.start()
    jobs = [Job(ids, api.decode_options(max_tokens=128, **kw), [], loop) for ids, kw in jobs_spec]
    t = time.perf_counter()
    s.submit(*jobs)
    out, calls = [], 0
    for j in jobs:
        toks = []
        while True:
            ev = await j.queue.get()
            if ev.kind == "text":
                toks.append("".join(t for t, _ in ev.pieces))
            else:
                if ev.kind == "done":
                    calls += ev.ended.stats.steps
                break
        out.append("".join(toks))
    dt = time.perf_counter() - t
    s.stop()
    return dt, calls, hashlib.md5(json.dumps(out).encode()).hexdigest()[:8]

res = {}
res["mt"] = asyncio.run(run([(p, {}) for p in prompts]))
res["pred"] = asyncio.run(run([(story, {"prediction": pred})]))
res["nopred"] = asyncio.run(run([(story, {})]))
print(json.dumps(res))
