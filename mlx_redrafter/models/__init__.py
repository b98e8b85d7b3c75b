"""Loading targets: GGUF files, mlx-lm directories and hub repos, the model registry, tokenizers (HF and
SentencePiece), chat templates, and quantization of full-precision checkpoints."""
