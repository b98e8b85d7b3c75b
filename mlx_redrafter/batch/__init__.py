"""Batched decoding: several sequences share each target call (continuous batching).

    cache.py   RowsCache: one KV cache whose rows have their own lengths (holes masked)
    step.py    one batched step: plain (every row one token) or speculative (every row its own tree)
    budget.py  how many tokens each row verifies per step, from a measured cost curve
    loop.py    the loop: rows join and leave between steps; yields one record per row and call
"""
