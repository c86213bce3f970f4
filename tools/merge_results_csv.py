#!/usr/bin/env python3
"""Merge one lease's sweep table into a study's committed one: the finished rows of NEW replace
the same points' rows of COMMITTED (in place), every other row stays as it is.

    python tools/merge_results_csv.py \
        docs/long_context/results/retrieval-125m-extend-32k/results.csv \
        sweeps/retrieval-125m-extend-32k/results.csv

Why: a study spread over several GPU leases trains a few points per lease, and each lease's sweep
writes a whole ``results.csv`` in which the points run elsewhere are ``not run``. Copying that
file over the committed one would lose the earlier leases' rows; this keeps them.

A point finished in both whose NEW row differs only by cells NEW leaves empty (a run carried
into a later lease, whose sweep could not recompute e.g. ``wall_time_s`` from the files carried)
keeps its committed row.

Refused, with exit code 2 and nothing written: a file that is not a sweep table, tables with
different columns (another sweep version or study; only ``adopted_from``, which a sweep writes
when a point was adopted from another study, may be in one table alone: the merged table has
it, empty where a row had none), and a point finished in both with
different values (two runs of the same point: say which one stands with ``--replace``). Rows
are matched by the ``point`` column; points new to the committed table are appended in NEW's
order.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile

FINISHED = "finished"
# Columns a sweep writes only when they apply (megatron-s2-sweep adopt).
OPTIONAL = ("adopted_from",)


def read_table(path: str) -> tuple[list[str], list[dict[str, str]]]:
    """``(columns, rows)`` of a sweep's ``results.csv``; ValueError naming the file when it
    cannot be read or has no ``point``/``status`` columns."""
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            columns = list(reader.fieldnames or [])
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    missing = [c for c in ("point", "status") if c not in columns]
    if missing:
        raise ValueError(f"{path} has no {' and '.join(missing)} column: not a sweep's results.csv")
    return columns, rows


def merge(
    committed: list[dict[str, str]], new: list[dict[str, str]], replace: bool = False
) -> tuple[list[dict[str, str]], list[str]]:
    """``(rows, changes)``: ``committed`` with each finished row of ``new`` in place of the
    same point's row (appended when the point is new); ``changes`` says what happened to each
    such point. Raises ValueError naming the point when both finished it with different values
    and ``replace`` is false."""
    out = [dict(r) for r in committed]
    where = {r["point"]: i for i, r in enumerate(out)}
    changes = []
    for row in new:
        if row["status"] != FINISHED:
            continue
        name = row["point"]
        if name not in where:
            where[name] = len(out)
            out.append(dict(row))
            changes.append(f"{name}: added")
            continue
        old = out[where[name]]
        if old == row:
            changes.append(f"{name}: unchanged")
            continue
        blank = sorted(k for k in row if old.get(k) != row[k] and row[k] == "" and old.get(k))
        if (
            old["status"] == FINISHED
            and blank
            and all(old.get(k) == row[k] for k in row if k not in blank)
        ):
            # The same run carried into a later lease: its sweep recomputes every column from
            # the run's files, and one those files do not hold (wall_time_s, from the sessions
            # log that older committed runs lack) comes out empty; the committed value stays.
            changes.append(f"{name}: unchanged (kept the committed {', '.join(blank)})")
            continue
        if old["status"] == FINISHED and not replace:
            differ = sorted(k for k in row if old.get(k) != row[k])
            raise ValueError(
                f"point {name!r} is finished in both tables with different values "
                f"({', '.join(differ)}): two runs of it; --replace keeps NEW's"
            )
        changes.append(f"{name}: {old['status']} -> {FINISHED}")
        out[where[name]] = dict(row)
    return out, changes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="merge_results_csv",
        description="Merge a lease's sweep results.csv into a study's committed one (finished "
        "rows replace the same points' rows; the others stay).",
    )
    p.add_argument("committed", help="the study's committed results.csv (rewritten in place)")
    p.add_argument("new", help="the lease's sweeps/<study>/results.csv")
    p.add_argument(
        "--replace",
        action="store_true",
        help="a point finished in both with different values: keep NEW's (default: refuse)",
    )
    args = p.parse_args(argv)
    try:
        columns, committed = read_table(args.committed)
        new_columns, new = read_table(args.new)
    except ValueError as exc:
        print(f"merge_results_csv: error: {exc}", file=sys.stderr)
        return 2

    def required(cols: list) -> list:
        return [c for c in cols if c not in OPTIONAL]

    if required(new_columns) == required(columns):
        # The table with the optional columns gives the order (a sweep puts each in its place).
        columns = max(columns, new_columns, key=len)
    if new_columns != columns and required(new_columns) != required(columns):
        only_old = [c for c in columns if c not in new_columns]
        only_new = [c for c in new_columns if c not in columns]
        print(
            f"merge_results_csv: error: the tables' columns differ (only in {args.committed}: "
            f"{only_old or 'none'}; only in {args.new}: {only_new or 'none'}; or their order): "
            "not the same sweep's tables",
            file=sys.stderr,
        )
        return 2
    try:
        rows, changes = merge(committed, new, args.replace)
    except ValueError as exc:
        print(f"merge_results_csv: error: {exc}", file=sys.stderr)
        return 2
    if not changes:
        print(f"merge_results_csv: {args.new} has no finished point; nothing merged")
        return 0
    # Written beside it and renamed: an interrupted merge leaves the committed table whole.
    folder = os.path.dirname(os.path.abspath(args.committed))
    fd, tmp = tempfile.mkstemp(prefix=".results-", suffix=".csv", dir=folder)
    with os.fdopen(fd, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, args.committed)
    for line in changes:
        print(f"{args.committed}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
