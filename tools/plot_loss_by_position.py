"""Overlay the loss-by-position curves of several runs in one PNG.

    python tools/plot_loss_by_position.py --out all.png RUN/long_context_eval/loss_by_position.json

Each input is a ``loss_by_position.json`` written by ``megatron-s2-eval-long-context``; the
curve's label is its run's directory name (the folder above ``long_context_eval``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label_of(path: str) -> str:
    """The run's name: the directory above ``long_context_eval/loss_by_position.json``."""
    return os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(path))))


def plot(paths: list, out: str, title: str = "") -> str:
    """One line per run: mean loss (nats/token) per position bin against the bin centre (tokens)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        centres = [(b["start"] + b["end"]) / 2 for b in result["bins"]]
        ax.plot(
            centres,
            [b["loss"] for b in result["bins"]],
            "o-",
            ms=3,
            label=f"{label_of(path)} (mean {result['loss']:.3f})",
        )
    ax.set_xlabel("token position")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "loss by position on held-out documents")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="+", help="loss_by_position.json files")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    missing = [x for x in args.inputs if not os.path.isfile(x)]
    if missing:
        print(f"no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    print(plot(args.inputs, args.out, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
