"""PNG plots of an evaluation (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import NullFormatter, PercentFormatter  # noqa: E402

from .report import COMPARED, fidelity_cells, suite_summary  # noqa: E402

HEATMAP_PREFERENCE = ("tactic P=0.9", "hybrid P=0.9", "quest 10%", "lserve 10%")
STYLE = {"tactic": ("o", "-"), "hybrid": ("x", "--"), "quest": ("s", "-"), "lserve": ("^", "-."),
         "streaming": ("v", ":")}  # hybrid without streaming heads coincides with tactic: keep both visible


def make_all(results: Dict, out_dir: Path) -> List[str]:
    names = []
    lengths = sorted({c["length"] for c in results["cells"] if c["task"] == "fidelity"})
    for L in lengths:
        names.append(fidelity_curves(results, L, out_dir / f"fidelity-{L}.png"))
        names.append(heatmaps(results, L, out_dir / f"heatmaps-{L}.png"))
    variants = sorted({c["variant"] for c in results["cells"] if c["task"] == "retrieval"})
    for v in variants:
        names.append(retrieval_grid(results, v, out_dir / f"retrieval-{v}.png"))
    if any(c["task"] == "suite" for c in results["cells"]):
        names.append(suite_curve(results, out_dir / "suite-curve.png"))
    return [n for n in names if n]


def fidelity_curves(results: Dict, length: int, path: Path) -> str:
    cells = fidelity_cells(results, length)
    metrics = [("mass_mean", "attention mass kept", False), ("out_err_mean", "relative output error", True),
               ("kl", "KL(dense || method), nats", True), ("ppl", "perplexity (dense: dotted)", True)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.6 * len(metrics), 3.8))
    for ax, (key, title, log) in zip(axes, metrics):
        for m in COMPARED:
            pts = sorted((c["kv_fraction"], c[key]) for c in cells if c["method"] == m)
            if pts:
                marker, ls = STYLE[m]
                ax.plot([p[0] for p in pts], [max(p[1], 1e-12) if log else p[1] for p in pts], marker=marker,
                        ls=ls, label=m)
        dense = [c for c in cells if c["method"] == "dense"]
        if dense and key == "ppl":
            ax.axhline(dense[0]["ppl"], color="k", ls=":")
        elif dense and not log:
            ax.scatter([dense[0]["kv_fraction"]], [dense[0][key]], color="k", marker="*", s=80, label="dense", zorder=5)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        ax.xaxis.set_minor_formatter(NullFormatter())
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("fraction of KV read")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{Path(results['model']).name}: fidelity vs cost at {length} tokens", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def heatmaps(results: Dict, length: int, path: Path) -> str:
    cells = {c["label"]: c for c in fidelity_cells(results, length)}
    chosen = [lab for lab in HEATMAP_PREFERENCE if lab in cells] or [lab for lab in cells if lab != "dense"][:4]
    if not chosen:
        return ""
    fig, axes = plt.subplots(2, len(chosen), figsize=(3.2 * len(chosen), 7), squeeze=False)
    for j, lab in enumerate(chosen):
        lh = cells[lab]["layer_head"]
        for i, (key, title, cmap) in enumerate((("kv_fraction", "KV read per KV head", "viridis"),
                                                 ("mass", "mass kept per query head", "magma"))):
            ax = axes[i][j]
            im = ax.imshow(np.array(lh[key]), aspect="auto", cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
            ax.set_title(f"{lab}\n{title}", fontsize=9)
            ax.set_xticks(range(len(lh[key][0])))
            ax.set_xlabel("head")
            ax.set_ylabel("layer")
            fig.colorbar(im, ax=ax, fraction=0.05)
    fig.suptitle(f"per layer and head at {length} tokens (mean over steps and windows)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def retrieval_grid(results: Dict, variant: str, path: Path) -> str:
    cells = [c for c in results["cells"] if c["task"] == "retrieval" and c["variant"] == variant]
    labels = list(dict.fromkeys(c["label"] for c in cells))
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({d for c in cells for d in c["depths"]})
    cols = min(4, len(labels))
    rows = -(-len(labels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(0.9 * len(lengths) * cols + 2, (0.35 * len(depths) + 1.2) * rows),
                             squeeze=False)
    for ax in axes.flat[len(labels):]:
        ax.axis("off")
    for ax, lab in zip(axes.flat, labels):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for c in cells:
            if c["label"] == lab:
                for d, s in zip(c["depths"], c["scores"]):
                    grid[depths.index(d), lengths.index(c["length"])] = s
        ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for (i, j), val in np.ndenumerate(grid):
            if not np.isnan(val):
                ax.text(j, i, f"{val:.2g}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_title(lab, fontsize=8)
        ax.set_xlabel("context")
    for row in axes:
        row[0].set_ylabel("needle depth")
    fig.suptitle(f"{variant}: score by depth x length", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def suite_curve(results: Dict, path: Path, rows: Optional[List[Dict]] = None, title: Optional[str] = None) -> str:
    """Retrieval (share of dense's correct cases found) against KV read, one panel for all
    lengths and one per length; every point of a method joined in order of KV read, its
    default point ringed; the dotted line is the 99% target. rows: report.suite_summary's
    rows to draw instead of the results' own (e.g. pooled over seeds). No plot ("") where
    dense answered no case: found is then undefined everywhere."""
    rows = [r for r in (rows if rows is not None else suite_summary(results)) if r["method"] != "dense"]
    if not any(r["found"].get(k, (0, 0))[1] for r in rows for k in r["found"]):
        return ""
    lengths = sorted({k for r in rows for k in r["kv"] if k != "all"})
    keys = ["all", *lengths]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for m in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["kv"][key], r["found"][key][0] / r["found"][key][1], r["label"].endswith("default"))
                         for r in rows if r["method"] == m and r["found"].get(key, (0, 0))[1])
            if not pts:
                continue
            marker, ls = STYLE.get(m, ("o", "-"))
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, ls=ls, label=m)
            ax.scatter([p[0] for p in pts if p[2]], [p[1] for p in pts if p[2]], s=160, facecolors="none",
                       edgecolors=line.get_color(), linewidths=1.5, zorder=5)
        ax.axhline(0.99, color="k", ls=":", lw=1)
        ax.set_ylim(top=1.005)
        ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=1))
        ax.set_xlabel("fraction of KV read")
        ax.set_title("all lengths" if key == "all" else f"{key} tokens", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("found (of dense's correct cases)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title or f"{Path(results['model']).name}: retrieval suite, found vs KV read "
                 "(ringed: default; dotted: 99%)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
