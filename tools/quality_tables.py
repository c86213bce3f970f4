#!/usr/bin/env python3
"""Recompute docs/quality.md's seeded tables from a sweep's committed raw output.

    python tools/quality_tables.py docs/quality/code-125m-16k-seeds/results.csv \\
        --reference dense --positions docs/quality/code-125m-16k-seeds/runs --window 1024

prints the summary table (per setting: seeds, mean validation loss and tokens/s with 95%
intervals, the loss difference to the reference paired by seed, and the verdict under the
differences-within-noise rule), and with ``--positions`` the same for the mean loss per token
inside the S2 window (positions < ``--window``) and beyond it, from every run's
``loss_by_position.json``. ``--write DIR`` also writes summary.csv, summary.md and
frontier.png there (what ``megatron-s2-sweep collect`` writes for a study with seeds).
"""

from __future__ import annotations

import argparse
import sys

from megatron_s2.training.seed_stats import (
    SPEED,
    SUMMARY_COLUMNS,
    position_rows,
    read_results,
    summarize,
    summary_markdown,
    write_summary,
)


def curve_tables(runs_dir: str, rows: list, reference) -> list:
    """(title, summaries, loss name) for every validation step of the runs' ``metrics.jsonl``
    under ``runs_dir`` (one folder per point): the learning curve with intervals."""
    import json
    import os

    by_step: dict = {}
    for row in rows:
        path = os.path.join(runs_dir, row["point"], "metrics.jsonl")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for line in f:
                rec = json.loads(line) if line.strip() else {}
                if rec.get("kind") == "valid" and "loss" in rec:
                    step_rows = by_step.setdefault(rec["iteration"], [])
                    step_rows.append({**row, "final_valid_loss": rec["loss"]})
    out = []
    for step in sorted(by_step):
        name = f"valid loss at step {step}"
        out.append((name, summarize(by_step[step], reference, ()), name))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a sweep's results.csv")
    ap.add_argument("--reference", default=None, help="the setting compared against (dense)")
    ap.add_argument(
        "--positions",
        default=None,
        metavar="RUNS_DIR",
        help="folder of the runs' loss_by_position.json (one sub-folder per point)",
    )
    ap.add_argument("--window", type=int, default=1024, help="S2 local window in tokens")
    ap.add_argument(
        "--curve",
        action="store_true",
        help="also the validation loss at every validation step (from --positions' metrics.jsonl)",
    )
    ap.add_argument("--write", default=None, metavar="DIR", help="also write the summary files")
    args = ap.parse_args(argv)
    rows = read_results(args.results)
    columns = [c for c in SUMMARY_COLUMNS if any(r.get(c) for r in rows)]
    try:
        tables = [("valid loss", summarize(rows, args.reference, columns), "valid loss")]
        if args.positions:
            speed = {r["point"]: r.get(SPEED, "") for r in rows}
            order = {r["point"]: i for i, r in enumerate(rows)}
            pos = sorted(
                position_rows(args.positions, args.window),
                key=lambda r: order.get(r["point"], len(order)),
            )
            for r in pos:
                r[SPEED] = speed.get(r["point"], "")
            for key, name in (
                ("loss_in_window", f"loss at positions < {args.window}"),
                ("loss_beyond_window", f"loss at positions >= {args.window}"),
            ):
                tables.append((name, summarize(pos, args.reference, (), loss_key=key), name))
        if args.curve and args.positions:
            tables += curve_tables(args.positions, rows, args.reference)
    except ValueError as e:
        print(f"quality_tables: {e}", file=sys.stderr)
        return 2
    for i, (title, summaries, loss_name) in enumerate(tables):
        if i:
            sys.stdout.write(f"\n{title}:\n\n")
        cols = columns if i == 0 else ()
        sys.stdout.write(summary_markdown(summaries, args.reference, cols, loss_name=loss_name))
    if args.write:
        write_summary(rows, args.write, reference=args.reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
