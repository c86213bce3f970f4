"""The long-context evaluation's report: markdown tables, PNG plots and the files they go to."""

from __future__ import annotations

import json
import os

import numpy as np

__all__ = ["retrieval_table", "plot_retrieval", "plot_loss_by_position", "pyplot", "write"]


def retrieval_table(result: dict, task: str, metric: str = "accuracy") -> str:
    """A markdown table of one task's ``metric``: a row per depth, a column per length."""
    cells = {(c["length"], c["depth"]): c[metric] for c in result["tasks"][task]["cells"]}
    lengths, depths = result["lengths"], result["depths"]
    fmt = "{:.2f}" if metric != "log_likelihood" else "{:.3f}"
    lines = [
        "| depth \\ length | " + " | ".join(str(n) for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for d in depths:
        lines.append(f"| {d:g} | " + " | ".join(fmt.format(cells[(n, d)]) for n in lengths) + " |")
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_retrieval(result: dict, task: str, path: str, title: str = "") -> str:
    """Heatmap PNG of one task's greedy exact-match accuracy (depth rows x length columns)."""
    plt = pyplot()
    lengths, depths = result["lengths"], result["depths"]
    cells = {(c["length"], c["depth"]): c["accuracy"] for c in result["tasks"][task]["cells"]}
    grid = np.array([[cells[(n, d)] for n in lengths] for d in depths])
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.5 * len(depths)))
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy (greedy exact match)")
    ax.set_title(title or task)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_loss_by_position(result: dict, path: str, title: str = "") -> str:
    """PNG of the mean loss per position bin (x: bin centre in tokens)."""
    plt = pyplot()
    centres = [(b["start"] + b["end"]) / 2 for b in result["bins"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(centres, [b["loss"] for b in result["bins"]], "o-")
    ax.set_xlabel("token position")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or f"loss by position ({result['num_sequences']} held-out sequences)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(out_dir: str, name: str, content) -> str:
    """Write ``content`` (text, or a JSON-able object) to ``out_dir/name``; returns the path."""
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        if isinstance(content, str):
            f.write(content)
        else:
            json.dump(content, f, indent=1)
    return path
