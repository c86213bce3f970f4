"""The long-context evaluation's report: markdown tables, PNG plots and the files they go to."""

from __future__ import annotations

import json
import os

import numpy as np

from .retrieval_stats import cell_counts, cell_interval

__all__ = ["retrieval_table", "plot_retrieval", "plot_loss_by_position", "pyplot", "write"]


def retrieval_table(result: dict, task: str, metric: str = "accuracy") -> str:
    """A markdown table of one task's ``metric``: a row per depth, a column per length.

    ``metric``: a cell field (``accuracy``, ``token_accuracy``, ``log_likelihood``) or
    ``interval``: the exact match with its 95% Wilson interval, ``0.45 [0.30, 0.61]``. The
    exact-match tables (``accuracy``, ``interval``) end with a row ``all`` over every depth of
    the length (files without the ``by_length`` field get it from their cells)."""
    task_result = result["tasks"][task]
    lengths, depths = result["lengths"], result["depths"]
    cells = {(c["length"], c["depth"]): c for c in task_result["cells"]}
    if metric == "interval":
        show = _with_interval
    else:
        fmt = "{:.2f}" if metric != "log_likelihood" else "{:.3f}"
        show = lambda c: fmt.format(c[metric])  # noqa: E731
    lines = [
        "| depth \\ length | " + " | ".join(str(n) for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for d in depths:
        lines.append(f"| {d:g} | " + " | ".join(show(cells[(n, d)]) for n in lengths) + " |")
    if metric in ("accuracy", "interval"):
        totals = _by_length(task_result, lengths)
        lines.append("| all | " + " | ".join(show(totals[n]) for n in lengths) + " |")
    return "\n".join(lines)


def _with_interval(cell: dict) -> str:
    low, high = cell_interval(cell)
    return f"{cell['accuracy']:.2f} [{low:.2f}, {high:.2f}]"


def _by_length(task_result: dict, lengths) -> dict:
    """Exact match per length over all its depths: the stored ``by_length``, else summed from
    the cells (a file written before that field existed)."""
    stored = {c["length"]: c for c in task_result.get("by_length", [])}
    out = {}
    for n in lengths:
        if n in stored:
            out[n] = stored[n]
            continue
        counts = [cell_counts(c) for c in task_result["cells"] if c["length"] == n]
        k, trials = sum(c[0] for c in counts), sum(c[1] for c in counts)
        out[n] = {"accuracy": k / trials, "correct": k, "trials": trials}
    return out


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_retrieval(result: dict, task: str, path: str, title: str = "") -> str:
    """Heatmap PNG of one task's greedy exact-match accuracy (depth rows x length columns),
    each cell labelled with its accuracy and, below it, its 95% Wilson interval."""
    plt = pyplot()
    lengths, depths = result["lengths"], result["depths"]
    cells = {(c["length"], c["depth"]): c for c in result["tasks"][task]["cells"]}
    grid = np.array([[cells[(n, d)]["accuracy"] for n in lengths] for d in depths])
    bounds = [[cell_interval(cells[(n, d)]) for n in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(lengths), 1.2 + 0.6 * len(depths)))
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            low, high = bounds[i][j]
            label = f"{grid[i, j]:.2f}\n{low:.2f}-{high:.2f}"
            ax.text(j, i, label, ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, label="accuracy (greedy exact match; 95% Wilson interval)")
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
