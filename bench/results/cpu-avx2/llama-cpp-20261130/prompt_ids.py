"""Dump the benchmark prompts as token ids (our chat template) for the llama.cpp comparison."""
import sys, json
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
from mlx_redrafter import api
from mlx_redrafter.prompts import first_turns
from mlx_redrafter.train.evaluate import heldout_prompt_ids
lm = api.load(None, dtype="float32")
rows = first_turns()
out = {"mtbench": [api.encode_prompt(lm, rows[i]["prompt"]) for i in range(0, 80, 5)],
       "heldout": heldout_prompt_ids("data/corpus/smollm2-135m", 16),
       "eos": list(lm.tokenizer.eos_ids)}
json.dump(out, open(sys.argv[1], "w"))
print({k: len(v) for k, v in out.items() if v})
