"""The `redrafter-mlx` typer app: each command lives in its own module (cmd/main.py runs it)."""

from __future__ import annotations

import typer

from mlx_redrafter.cmd.chat import chat
from mlx_redrafter.cmd.common import installs_blas
from mlx_redrafter.cmd.generate import generate
from mlx_redrafter.cmd.quantize import quantize
from mlx_redrafter.cmd.serve import serve
from mlx_redrafter.cmd.train import answers, distill, eval_drafter, features, self_prompts, train
from mlx_redrafter.cmd.tune import tune

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Exact speculative decoding (ReDrafter + lookup drafting) in pure MLX.")
for name, command in (("generate", generate), ("chat", chat), ("serve", serve), ("tune", tune), ("distill", distill),
                      ("self-prompts", self_prompts),
                      ("features", features), ("answers", answers), ("train", train), ("eval-drafter", eval_drafter),
                      ("quantize", quantize)):
    app.command(name)(installs_blas(command))
