"""PNG plots of a benchmark run (matplotlib, Agg), one panel per draft mode (columns) and dtype x temperature
(rows): speedup heatmap over width x L, tokens per target call vs width, time split per step.

Re-draw from a run's JSON: `python -m bench.plots bench/results/<DEVICE>/bench-<RUN>.json`.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402

from mlx_redrafter.files import write_atomic  # noqa: E402
from mlx_redrafter.sweep import cell_width, is_cell  # noqa: E402

NAN = float("nan")


def _save(fig: Any, path: Path) -> str:
    """Save a figure atomically; returns the file name."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    write_atomic(path, buf.getvalue())
    return path.name


width_of = cell_width  # W, lookup width or Medusa tree nodes (mlx_redrafter.sweep)


def _panels(summary: list[dict], size: tuple[float, float]) -> tuple[Any, list[tuple[Any, str, list[dict]]]]:
    """A figure with one axis per (dtype, temperature) row x draft mode column, and each axis's cells."""
    cells = [s for s in summary if is_cell(s)]
    order = ["rnn", "lookup", "rnn+lookup", "medusa", "semi_ar"]
    drafts = sorted({s["draft"] for s in cells}, key=lambda d: (order.index(d) if d in order else len(order), d))
    groups = sorted({(s["dtype"], s["temperature"], s.get("accept", "greedy")) for s in cells})
    fig, axes = plt.subplots(len(groups), len(drafts), squeeze=False, layout="constrained",
                             figsize=(0.6 + size[0] * len(drafts), size[1] * len(groups)))
    out = []
    for i, (dtype, temp, rule) in enumerate(groups):
        for j, draft in enumerate(drafts):
            mine = [s for s in cells if (s["dtype"], s["temperature"], s.get("accept", "greedy"), s["draft"])
                    == (dtype, temp, rule, draft)]
            out.append((axes[i][j], f"{draft}, {dtype}, T={temp:g}" + (f" {rule}" if temp else ""), mine))
    return fig, out


def _baseline(summary: list[dict], cells: list[dict], decoder: str) -> dict | None:
    if not cells:
        return None
    c = cells[0]
    return next((s for s in summary if s["decoder"] == decoder and s["draft"] == "none"
                 and (s["dtype"], s["temperature"]) == (c["dtype"], c["temperature"])), None)


def speedup_heatmap(summary: list[dict], title: str, path: Path) -> str:
    """Speedup over our AR per (width, L), pooled over the prompts (`sweep.pooled_speedup`); 1.0 = white, green
    faster, red slower."""
    fig, panels = _panels(summary, (4.6, 4.4))
    for ax, name, cells in panels:
        widths, lengths = sorted({width_of(s) for s in cells}), sorted({s["beam_length"] for s in cells})
        at = {(width_of(s), s["beam_length"]): s["speedup_vs_ar"] for s in cells}
        grid = [[at.get((w, L), NAN) for w in widths] for L in lengths]
        vals = [v for row in grid for v in row if v == v]
        norm = TwoSlopeNorm(vcenter=1.0, vmin=min(vals + [0.99]), vmax=max(vals + [1.01]))
        im = ax.imshow(grid, cmap="RdYlGn", norm=norm, origin="lower", aspect="auto")
        ax.set_xticks(range(len(widths)), [str(w) for w in widths])
        ax.set_yticks(range(len(lengths)), [str(L) for L in lengths])
        ax.set_xlabel("lookup width" if name.startswith("lookup") else "beam width W")
        ax.set_ylabel("candidate length L (incl. first token)")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, f"{v:.2f}x", ha="center", va="center", fontsize=9)
        ar, ref = _baseline(summary, cells, "ours"), _baseline(summary, cells, "mlx_lm")
        sub = f"AR {ar['decode_tokens_per_s']:.1f} tok/s" if ar else ""
        sub += f", mlx-lm {ref['decode_tokens_per_s']:.1f} tok/s" if ref else ""
        ax.set_title(f"{name}: speedup vs our AR\n{sub}", fontsize=10)
        fig.colorbar(im, ax=ax, label="decode speedup (x)")
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def tokens_per_step(summary: list[dict], title: str, path: Path) -> str:
    """Mean tokens per target call vs width, one line per L (AR = 1)."""
    fig, panels = _panels(summary, (4.6, 4.0))
    for ax, name, cells in panels:
        widths = sorted({width_of(s) for s in cells})
        for L in sorted({s["beam_length"] for s in cells}):
            pts = sorted((width_of(s), s["tokens_per_step"]) for s in cells if s["beam_length"] == L)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"L={L}")
        ax.axhline(1.0, color="grey", lw=1, ls="--", label="AR")
        ax.set_xticks(widths)
        ax.set_xlabel("lookup width" if name.startswith("lookup") else "beam width W")
        ax.set_ylabel("tokens per target call")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        ax.set_title(name, fontsize=10)
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def time_split(summary: list[dict], title: str, path: Path) -> str:
    """Stacked ms per step per cell from `Stats.phase_s` (draft incl. packing / verify incl. acceptance / rest
    of the loop), with AR's ms per token as a reference line."""
    ncells = max(Counter((s["dtype"], s["temperature"], s.get("accept"), s["draft"]) for s in summary
                         if is_cell(s)).values())
    fig, panels = _panels(summary, (max(4.0, 0.45 * ncells + 2.0), 4.0))
    for ax, name, cells in panels:
        cells = sorted(cells, key=lambda s: (width_of(s), s["beam_length"]))
        x = range(len(cells))
        draft = [s["phase_ms_per_step"].get("draft", 0.0) for s in cells]
        verify = [s["phase_ms_per_step"].get("verify", 0.0) for s in cells]
        rest = [max(s["decode_ms_per_step"] - d - v, 0.0) for s, d, v in zip(cells, draft, verify)]
        ax.bar(x, draft, label="draft + pack", color="#4c72b0")
        ax.bar(x, verify, bottom=draft, label="verify + accept", color="#dd8452")
        ax.bar(x, rest, bottom=[d + v for d, v in zip(draft, verify)], label="rest of the loop", color="#55a868")
        ar = _baseline(summary, cells, "ours")
        if ar and ar["decode_tokens_per_s"] > 0:
            ax.axhline(1e3 / ar["decode_tokens_per_s"], color="black", ls="--", lw=1, label="AR ms per token")
        ax.set_xticks(list(x), [f"{width_of(s)}x{s['beam_length']}" for s in cells], rotation=60 if len(cells) > 10
                      else 0, fontsize=8)
        ax.set_xlabel("cell (width x L)")
        ax.set_ylabel("ms per decoding step")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(name, fontsize=10)
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


PLOTS: dict[str, tuple[str, Callable[[list[dict], str, Path], str]]] = {
    "speedup": ("speedup", speedup_heatmap),
    "tokens_per_step": ("tokens-per-step", tokens_per_step),
    "time_split": ("time-split", time_split),
}


def plot_title(meta: dict) -> str:
    """Device, model, drafter and machine of a run (and a mark when the machine was not quiet)."""
    m = meta["machine"]
    quiet = "" if meta.get("quiet", True) else " [machine NOT quiet]"
    return (f"{meta['device']}: {meta.get('model', '')} + {meta.get('drafter', '')} "
            f"({m['cpu']}, {m['backend']}, BLAS {m['blas']}){quiet}")


def plot_all(meta: dict, out: Path, stem: str) -> dict[str, str]:
    """All plots as <out>/<stem>-<kind>.png; returns {kind: file name} (none without speculative cells)."""
    summary = meta["summary"]
    if not any(is_cell(s) for s in summary):
        return {}
    return {k: fn(summary, plot_title(meta), out / f"{stem}-{suffix}.png") for k, (suffix, fn) in PLOTS.items()}


if __name__ == "__main__":
    import json
    import sys

    for arg in sys.argv[1:]:
        p = Path(arg)
        print(plot_all(json.loads(p.read_text()), p.parent, p.stem))
