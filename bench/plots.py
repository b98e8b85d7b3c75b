"""PNG plots of a sweep (matplotlib, Agg): speedup heatmap over W x L, tokens/step vs W, time split per step."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402


def _save(fig: Any, path: Path) -> Path:
    """Save a figure atomically (temp file + rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return path


def _cells(summary: list[dict], dtype: str) -> tuple[list[int], list[int], dict[tuple[int, int], dict]]:
    cells = {(s["beam_width"], s["beam_length"]): s for s in summary
             if s["dtype"] == dtype and s["method"] == "redrafter"}
    widths = sorted({w for w, _ in cells})
    lengths = sorted({L for _, L in cells})
    return widths, lengths, cells


def _baseline(summary: list[dict], dtype: str, method: str) -> dict | None:
    return next((s for s in summary if s["dtype"] == dtype and s["method"] == method), None)


def speedup_heatmap(summary: list[dict], title: str, path: Path) -> Path:
    """Mean speedup over our AR per (W, L), one panel per dtype; 1.0 = white, green faster, red slower."""
    dtypes = sorted({s["dtype"] for s in summary if s["method"] == "redrafter"})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(1.2 + 4.6 * len(dtypes), 4.6), squeeze=False,
                             layout="constrained")
    for ax, dtype in zip(axes[0], dtypes):
        widths, lengths, cells = _cells(summary, dtype)
        grid = [[cells[(w, L)]["speedup_vs_ar"] if (w, L) in cells else float("nan") for w in widths]
                for L in lengths]
        vals = [v for row in grid for v in row if v == v]
        lo, hi = min(vals + [0.99]), max(vals + [1.01])
        norm = TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 0.99), vmax=max(hi, 1.01))
        im = ax.imshow(grid, cmap="RdYlGn", norm=norm, origin="lower", aspect="auto")
        ax.set_xticks(range(len(widths)), [str(w) for w in widths])
        ax.set_yticks(range(len(lengths)), [str(L) for L in lengths])
        ax.set_xlabel("beam width W")
        ax.set_ylabel("beam length L (incl. first token)")
        for i, _L in enumerate(lengths):
            for j, _w in enumerate(widths):
                v = grid[i][j]
                if v == v:
                    ax.text(j, i, f"{v:.2f}x", ha="center", va="center", fontsize=9)
        ar = _baseline(summary, dtype, "ar")
        ref = _baseline(summary, dtype, "mlx_lm")
        sub = f"AR {ar['decode_tokens_per_s']:.1f} tok/s" if ar else ""
        if ref:
            sub += f", mlx-lm {ref['decode_tokens_per_s']:.1f} tok/s"
        ax.set_title(f"{dtype}: speedup vs our AR\n{sub}", fontsize=10)
        fig.colorbar(im, ax=ax, label="decode speedup (x)")
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def tokens_per_step(summary: list[dict], title: str, path: Path) -> Path:
    """Mean tokens per target call vs W, one line per L (AR = 1)."""
    dtypes = sorted({s["dtype"] for s in summary if s["method"] == "redrafter"})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(1.0 + 4.8 * len(dtypes), 4.2), squeeze=False,
                             layout="constrained")
    for ax, dtype in zip(axes[0], dtypes):
        widths, lengths, cells = _cells(summary, dtype)
        for L in lengths:
            ws = [w for w in widths if (w, L) in cells]
            ax.plot(ws, [cells[(w, L)]["tokens_per_step"] for w in ws], marker="o", label=f"L={L}")
        ax.axhline(1.0, color="grey", lw=1, ls="--", label="AR")
        ax.set_xticks(widths)
        ax.set_xlabel("beam width W")
        ax.set_ylabel("tokens per target call")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        ax.set_title(dtype, fontsize=10)
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def time_split(summary: list[dict], title: str, path: Path) -> Path:
    """Stacked ms per step (draft / verify / accept) per cell, with AR's ms per token as a reference line."""
    dtypes = sorted({s["dtype"] for s in summary if s["method"] == "redrafter"})
    ncells = max(len(_cells(summary, d)[2]) for d in dtypes)
    fig, axes = plt.subplots(len(dtypes), 1, figsize=(max(6.0, 0.5 * ncells + 2.5) + 2.6, 4.2 * len(dtypes)),
                             squeeze=False, layout="constrained")
    for ax, dtype in zip(axes[:, 0], dtypes):
        widths, lengths, cells = _cells(summary, dtype)
        keys = [(w, L) for w in widths for L in lengths if (w, L) in cells]
        x = range(len(keys))
        draft = [cells[k]["draft_ms_per_step"] for k in keys]
        verify = [cells[k]["verify_ms_per_step"] for k in keys]
        accept = [cells[k]["accept_ms_per_step"] for k in keys]
        ax.bar(x, draft, label="draft (beam search + pack)", color="#4c72b0")
        ax.bar(x, verify, bottom=draft, label="verify (target forward)", color="#dd8452")
        ax.bar(x, accept, bottom=[d + v for d, v in zip(draft, verify)], label="accept + commit", color="#55a868")
        ar = _baseline(summary, dtype, "ar")
        if ar and ar["decode_tokens_per_s"] > 0:
            ax.axhline(1e3 / ar["decode_tokens_per_s"], color="black", ls="--", lw=1, label="AR ms per token")
        ax.set_xticks(list(x), [f"{w}x{L}" for w, L in keys], rotation=60 if len(keys) > 10 else 0, fontsize=8)
        ax.set_xlabel("cell (W x L)")
        ax.set_ylabel("ms per decoding step")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_title(dtype, fontsize=10)
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def plot_all(summary: list[dict], title: str, out: Path, stem: str) -> dict[str, str]:
    """All three plots as <out>/<stem>-{speedup,tokens-per-step,time-split}.png; returns their file names."""
    return {
        "speedup": speedup_heatmap(summary, title, out / f"{stem}-speedup.png").name,
        "tokens_per_step": tokens_per_step(summary, title, out / f"{stem}-tokens-per-step.png").name,
        "time_split": time_split(summary, title, out / f"{stem}-time-split.png").name,
    }


def plot_title(meta: dict) -> str:
    m = meta["machine"]
    return (f"{meta['device']}: {meta.get('model_name', '')} + {meta.get('drafter_name', '')} "
            f"({m['cpu']}, {m['backend']}, BLAS {m['blas']})")


if __name__ == "__main__":  # re-draw the plots of a run: python -m bench.plots bench/results/X/bench-ID.json
    import json
    import sys

    for arg in sys.argv[1:]:
        path = Path(arg)
        meta = json.loads(path.read_text())
        print(plot_all(meta["summary"], plot_title(meta), path.parent, path.stem))
