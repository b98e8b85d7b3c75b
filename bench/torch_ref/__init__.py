"""PyTorch reference path for parity checks (optional extra `torch`).

A deliberately plain re-implementation of what `mlx_redrafter` does, written from the algorithm (not from
our MLX code): the target is Hugging Face transformers' `LlamaForCausalLM` (loaded from the same GGUF or an
mlx-lm directory), the drafter follows Apple's ml-recurrent-drafter semantics, prefix dedup/packing uses
explicit loops, and the greedy ReDrafter loop uses transformers' KV cache. Device: cpu or cuda.
"""
