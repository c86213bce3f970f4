"""Side-by-side tables of several runs' long-context evaluations (markdown on stdout).

    python tools/compare_retrieval.py sweeps/code-125m-extend-16k/runs/*/
    python tools/compare_retrieval.py dense=RUN_A hybrid=RUN_B --depth-table 8192

Each argument is a run directory, its ``long_context_eval/`` directory or a ``retrieval.json``
written by ``megatron-s2-eval-long-context``, optionally as ``LABEL=PATH`` (default label: the
run directory's name). Printed per task: greedy exact-match accuracy and the answer's
log-likelihood (nats) at each length, the mean over the evaluated depths (each cell's trials
alike); with ``--depth-table LENGTH`` the accuracy by depth at that length; and, where the runs
have ``loss_by_position.json`` beside it, the mean loss per token over position ranges
(``--ranges``, token-weighted over the bins inside each range). Used by
``tools/run_extension_example.sh`` for each study's ``retrieval_summary.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict


def _resolve(arg: str) -> tuple[str, str]:
    """``(label, retrieval.json path)`` of one argument."""
    label, sep, path = arg.partition("=")
    if not sep or os.path.exists(arg.rstrip("/")):
        # A run folder of a seeded study ("dense,seed=2") has "=" in its own name.
        label, path = "", arg
    path = path.rstrip("/")
    if os.path.isdir(os.path.join(path, "long_context_eval")):
        path = os.path.join(path, "long_context_eval")
    if os.path.isdir(path):
        path = os.path.join(path, "retrieval.json")
    if not os.path.isfile(path):
        raise SystemExit(f"compare_retrieval: no retrieval.json at {arg!r} (looked for {path})")
    if not label:
        eval_dir = os.path.dirname(os.path.abspath(path))
        run_dir = os.path.dirname(eval_dir)
        label = os.path.basename(run_dir if os.path.basename(eval_dir) else eval_dir)
    return label, path


def length_means(cells: list[dict]) -> dict[int, dict]:
    """Per length: mean accuracy and log-likelihood over the depths, and the trial count."""
    by_length: dict[int, list[dict]] = defaultdict(list)
    for c in cells:
        by_length[int(c["length"])].append(c)
    out = {}
    for length, cs in sorted(by_length.items()):
        out[length] = {
            "accuracy": sum(c["accuracy"] for c in cs) / len(cs),
            "log_likelihood": sum(c["log_likelihood"] for c in cs) / len(cs),
            "trials": sum(int(c.get("trials", 0)) for c in cs),
        }
    return out


def range_means(bins: list[dict], edges: list[int]) -> list[float | None]:
    """Token-weighted mean loss over the bins inside each ``[edges[i], edges[i+1])``."""
    out = []
    for lo, hi in zip(edges, edges[1:]):
        inside = [b for b in bins if b["start"] >= lo and b["end"] <= hi]
        tokens = sum(b["tokens"] for b in inside)
        out.append(sum(b["loss"] * b["tokens"] for b in inside) / tokens if tokens else None)
    return out


def _fmt_k(n: int) -> str:
    return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)


def tables(runs: list[tuple[str, dict, dict | None]], depth_length, edges) -> str:
    """The markdown tables of ``runs`` ``(label, retrieval, loss_by_position or None)``."""
    lines = []
    tasks = []
    for _, ret, _ in runs:
        tasks += [t for t in ret["tasks"] if t not in tasks]
    for task in tasks:
        means = {
            label: length_means(ret["tasks"].get(task, {}).get("cells", []))
            for label, ret, _ in runs
        }
        lengths = sorted({n for m in means.values() for n in m})
        trials = {m[n]["trials"] for m in means.values() for n in m}
        per = f", {trials.pop()} trials a length" if len(trials) == 1 and 0 not in trials else ""
        lines += [
            f"### {task}: exact match, mean over depths (answer log-likelihood, nats){per}",
            "",
            "| run | " + " | ".join(_fmt_k(n) for n in lengths) + " |",
            "|---|" + "---|" * len(lengths),
        ]
        for label, _, _ in runs:
            row = [
                f"{means[label][n]['accuracy']:.0%} ({means[label][n]['log_likelihood']:.1f})"
                if n in means[label]
                else "-"
                for n in lengths
            ]
            lines.append(f"| {label} | " + " | ".join(row) + " |")
        lines.append("")
        if depth_length is not None:
            depth_rows = []
            depths = set()
            for label, ret, _ in runs:
                cells = [
                    c
                    for c in ret["tasks"].get(task, {}).get("cells", [])
                    if int(c["length"]) == depth_length
                ]
                depths |= {float(c["depth"]) for c in cells}
                depth_rows.append((label, {float(c["depth"]): c["accuracy"] for c in cells}))
            if depths:
                ds = sorted(depths)
                lines += [
                    f"### {task} at {_fmt_k(depth_length)}: exact match by depth "
                    "(0 = the haystack's start, farthest from the question)",
                    "",
                    "| run | " + " | ".join(f"{d:g}" for d in ds) + " |",
                    "|---|" + "---|" * len(ds),
                ]
                for label, acc in depth_rows:
                    row = [f"{acc[d]:.2f}" if d in acc else "-" for d in ds]
                    lines.append(f"| {label} | " + " | ".join(row) + " |")
                lines.append("")
    with_position = [(label, pos) for label, _, pos in runs if pos and pos.get("bins")]
    if with_position:
        heads = [f"{_fmt_k(lo)}-{_fmt_k(hi)}" for lo, hi in zip(edges, edges[1:])]
        lines += [
            "### loss by token position (nats per token, token-weighted over the bins)",
            "",
            "| run | " + " | ".join(heads) + " | all |",
            "|---|" + "---|" * (len(heads) + 1),
        ]
        for label, pos in with_position:
            row = [f"{x:.3f}" if x is not None else "-" for x in range_means(pos["bins"], edges)]
            overall = pos.get("loss")
            row.append(f"{overall:.3f}" if isinstance(overall, (int, float)) else "-")
            lines.append(f"| {label} | " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", metavar="[LABEL=]PATH")
    ap.add_argument("--depth-table", type=int, metavar="LENGTH", help="accuracy by depth here")
    ap.add_argument(
        "--ranges",
        default="0,1024,4096,8192,16384",
        help="position range edges in tokens for the loss table (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    try:
        edges = [int(x) for x in args.ranges.split(",")]
    except ValueError:
        ap.error(f"--ranges: comma-separated integers, got {args.ranges!r}")
    if len(edges) < 2 or edges != sorted(set(edges)):
        ap.error(f"--ranges: at least two increasing edges, got {args.ranges!r}")
    runs = []
    for arg in args.runs:
        label, path = _resolve(arg)
        with open(path) as f:
            ret = json.load(f)
        pos_path = os.path.join(os.path.dirname(path), "loss_by_position.json")
        pos = None
        if os.path.isfile(pos_path):
            with open(pos_path) as f:
                pos = json.load(f)
        runs.append((label, ret, pos))
    sys.stdout.write(tables(runs, args.depth_table, edges))
    return 0


if __name__ == "__main__":
    sys.exit(main())
