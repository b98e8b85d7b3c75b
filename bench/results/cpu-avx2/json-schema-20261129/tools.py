"""Tokens per target call of tool-call answers: the server's tools format (server/tools.py) over the embedded model and
shipped drafter, default mode, greedy, 64 tokens; prints each answer and its tokens per call."""
from mlx_redrafter import install_blas
install_blas()
from mlx_redrafter import api
from mlx_redrafter.constraint import schema_text
from mlx_redrafter.server.tools import parse_tools, template_messages
lm = api.load()
W = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city today.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
for choice in ("required", "auto"):
    t = parse_tools([W], choice)
    for q in ("What is the weather in Paris?", "What is 2 + 2?"):
        ids = lm.tokenizer.encode_chat(template_messages([{"role": "user", "content": q}], t))
        r = api.generate(lm, ids, max_tokens=64, json_schema=schema_text(t.schema()))
        print(choice, q, repr(r.text), r.stats.tokens_per_step)
