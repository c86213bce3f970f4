#!/usr/bin/env python3
"""Recompute docs/quality.md's seeded tables from a sweep's committed ``results.csv``.

    python tools/quality_tables.py docs/quality/code-125m-16k-seeds/results.csv --reference dense

prints the summary table (per setting: seeds, mean validation loss and tokens/s with 95%
intervals, the loss difference to the reference paired by seed, and the verdict under the
differences-within-noise rule); ``--write DIR`` also writes summary.csv, summary.md and
frontier.png there (what ``megatron-s2-sweep collect`` writes for a study with seeds).
"""

from __future__ import annotations

import argparse
import sys

from megatron_s2.training.seed_stats import (
    SUMMARY_COLUMNS,
    read_results,
    summarize,
    summary_markdown,
    write_summary,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a sweep's results.csv")
    ap.add_argument("--reference", default=None, help="the setting compared against (dense)")
    ap.add_argument("--write", default=None, metavar="DIR", help="also write the summary files")
    args = ap.parse_args(argv)
    rows = read_results(args.results)
    columns = [c for c in SUMMARY_COLUMNS if any(r.get(c) for r in rows)]
    try:
        summaries = summarize(rows, args.reference, columns)
    except ValueError as e:
        print(f"quality_tables: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(summary_markdown(summaries, args.reference, columns))
    if args.write:
        write_summary(rows, args.write, reference=args.reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
