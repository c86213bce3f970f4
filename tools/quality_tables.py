#!/usr/bin/env python3
"""Recompute docs/quality.md's seeded tables from a sweep's committed raw output.

    python tools/quality_tables.py docs/quality/code-125m-16k-seeds/results.csv \\
        --reference dense --positions docs/quality/code-125m-16k-seeds/runs --window 1024

prints the summary table (per setting: seeds, mean validation loss and tokens/s with 95%
intervals, the loss difference to the reference paired by seed, and the verdict under the
differences-within-noise rule), and with ``--positions`` the same for the mean loss per token
inside the S2 window (positions < ``--window``) and beyond it, from every run's
``loss_by_position.json`` (``--adopted-runs DIR``: where the points adopted from another study,
results.csv's ``adopted_from``, keep theirs under that study's names). ``--write DIR`` also
writes summary.csv, summary.md and frontier.png there (what ``megatron-s2-sweep collect``
writes for a study with seeds).

Several results files (and ``--positions`` folders) make one set of runs: each point's row is
taken from the first file where that point finished, its loss by position and metrics from the
first folder that has them, e.g. a study's reruns in front of its committed runs::

    python tools/quality_tables.py STUDY/reruns/results.csv STUDY/results.csv \
        --reference dense --positions STUDY/reruns/runs STUDY/runs

``--per-seed`` also prints every finished run's validation loss and tokens/s with its paired
difference to the reference's run of the same seed (the values the paired interval is taken
over), and the reference's own spread over its seeds: the noise band a difference is read
against.

``--speed-model`` prints instead the speed model (``seed_stats.SpeedModel``: seconds per token
linear in the model's attention density, fitted to the file's finished settings) and every
setting's measured tokens/s against its prediction, the settings not run yet included;
``--speed-fit OTHER.csv`` fits it to another study's runs (one host, the same length) and
predicts this file's settings with it.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_s2.training.seed_stats import (
    CPU_NOTE,
    SPEED,
    SUMMARY_COLUMNS,
    fit_speed_model,
    per_seed_markdown,
    position_rows,
    read_results,
    speed_model_markdown,
    speed_rows,
    summarize,
    summary_markdown,
    trained_on_cpu,
    write_summary,
)


def curve_tables(runs_dirs: list, rows: list, reference, adopted: dict | None = None) -> list:
    """(step, summaries) for every validation step of the runs' ``metrics.jsonl`` under
    ``runs_dirs`` (folders of one folder per point; a point's from the first that has it): the
    learning curve with intervals. ``adopted``: {point name: run folder} for points kept
    elsewhere, as ``position_rows`` takes it."""
    import json

    adopted = adopted or {}
    by_step: dict = {}
    for row in rows:
        folders = [os.path.join(d, row["point"]) for d in runs_dirs]
        if row["point"] in adopted:
            folders.append(adopted[row["point"]])
        paths = [os.path.join(f, "metrics.jsonl") for f in folders]
        path = next((q for q in paths if os.path.isfile(q)), None)
        if path is None:
            continue
        with open(path) as f:
            for line in f:
                rec = json.loads(line) if line.strip() else {}
                if rec.get("kind") == "valid" and "loss" in rec:
                    # A validation point of a run stopped later is a real measurement: the LR
                    # schedule up to it depends only on train_iters, not on where the run
                    # stopped, so it counts like a finished run's.
                    step_rows = by_step.setdefault(rec["iteration"], [])
                    step_rows.append({**row, "status": "finished", "final_valid_loss": rec["loss"]})
    return [(step, summarize(by_step[step], reference, ())) for step in sorted(by_step)]


def curve_markdown(curves: list, reference: str, tokens_per_step: float) -> str:
    """One table of the learning curve: a row per validation step (its training tokens, in
    millions, from ``tokens_per_step``) and a column per setting other than ``reference``: the
    loss difference to it (%, 95% interval, paired by seed) and the number of seeds."""
    settings: list = []
    for _, summaries in curves:
        for s in summaries:
            if s.setting != reference and s.setting not in settings:
                settings.append(s.setting)
    head = ["step", "tokens (M)"] + [f"{s} vs {reference}" for s in settings]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for step, summaries in curves:
        by = {s.setting: s for s in summaries}
        cells = [str(step), f"{step * tokens_per_step / 1e6:.1f}"]
        for name in settings:
            s = by.get(name)
            if s is None:
                cells.append("")
            elif s.loss_diff is None:
                cells.append(f"{len(s.seeds)} seed(s): no interval")
            else:
                cells.append(f"{s.loss_diff.text('{:+.2f}')}% ({len(s.seeds)}, {s.verdict})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "results",
        nargs="+",
        help="a sweep's results.csv; several: one set of runs, each point's row from the first "
        "file where it finished (a study's reruns in front of its committed runs)",
    )
    ap.add_argument(
        "--reference", default=None, help="the setting compared against, e.g. dense (no default)"
    )
    ap.add_argument(
        "--positions",
        nargs="+",
        default=None,
        metavar="RUNS_DIR",
        help="folder of the runs' loss_by_position.json (one sub-folder per point); several: a "
        "point's from the first folder that has it",
    )
    ap.add_argument(
        "--adopted-runs",
        default=None,
        metavar="DIR",
        help="with --positions: the folder of the runs that points adopted from another study "
        "(results.csv's adopted_from) were copied from, e.g. that study's committed runs/; such "
        "a point's loss by position (and --curve's metrics.jsonl) is read from DIR/<its adopted "
        "run's folder name>",
    )
    ap.add_argument("--window", type=int, default=1024, help="S2 local window in tokens")
    ap.add_argument(
        "--curve",
        action="store_true",
        help="also the validation loss at every validation step (from --positions' metrics.jsonl)",
    )
    ap.add_argument(
        "--curve-table",
        type=float,
        default=None,
        metavar="TOKENS_PER_STEP",
        help="with --curve: the learning curve as one table of differences to the reference "
        "instead of one table per step (TOKENS_PER_STEP: global batch x sequence length)",
    )
    ap.add_argument(
        "--per-seed",
        action="store_true",
        help="also every run's loss and tokens/s with its paired difference to the reference's "
        "run of the same seed, and the reference's spread over its seeds (the noise band)",
    )
    ap.add_argument("--write", default=None, metavar="DIR", help="also write the summary files")
    ap.add_argument(
        "--speed-model",
        action="store_true",
        help="print the speed model (seconds per token linear in attention density) fitted to "
        "this file's finished settings, and every setting's measured tokens/s against it",
    )
    ap.add_argument(
        "--speed-fit",
        default=None,
        metavar="RESULTS_CSV",
        help="with --speed-model: fit it to this other study's results.csv instead (runs of one "
        "host at the same sequence length) and predict the first file's settings",
    )
    args = ap.parse_args(argv)
    if args.adopted_runs and not args.positions:
        print("quality_tables: --adopted-runs goes with --positions", file=sys.stderr)
        return 2
    if args.per_seed and not args.reference:
        print("quality_tables: --per-seed needs --reference", file=sys.stderr)
        return 2
    if args.speed_fit and not args.speed_model:
        print("quality_tables: --speed-fit goes with --speed-model", file=sys.stderr)
        return 2
    if args.speed_model:
        return _speed_model(args)
    try:
        rows = merged_results(args.results)
    except OSError as e:
        print(f"quality_tables: {e}", file=sys.stderr)
        return 2
    columns = [c for c in SUMMARY_COLUMNS if any(r.get(c) for r in rows)]
    # Points adopted from another study: their run folders, where --positions has none.
    adopted = (
        {
            r["point"]: os.path.join(
                args.adopted_runs, os.path.basename(r["adopted_from"].rstrip("/"))
            )
            for r in rows
            if r.get("adopted_from")
        }
        if args.adopted_runs
        else {}
    )
    try:
        tables = [("valid loss", summarize(rows, args.reference, columns), "valid loss")]
        if args.positions:
            speed = {r["point"]: r.get(SPEED, "") for r in rows}
            order = {r["point"]: i for i, r in enumerate(rows)}
            pos = sorted(
                position_rows(args.positions, args.window, adopted),
                key=lambda r: order.get(r["point"], len(order)),
            )
            for r in pos:
                r[SPEED] = speed.get(r["point"], "")
            if not pos:
                print(
                    f"quality_tables: no loss_by_position.json under {' '.join(args.positions)}",
                    file=sys.stderr,
                )
            elif args.reference and not any(r["setting"] == args.reference for r in pos):
                # Runs carried in from an earlier GPU lease have no checkpoint to evaluate, so a
                # study can hold curves for some settings only; without the reference's there
                # is no difference to compute, but the other tables still stand.
                have = sorted({r["setting"] for r in pos})
                print(
                    f"quality_tables: the position tables are left out: reference "
                    f"{args.reference!r} has no loss_by_position.json under "
                    f"{' '.join(args.positions)} "
                    f"(settings with one: {', '.join(have)})",
                    file=sys.stderr,
                )
                pos = []
            for key, name in (
                ()
                if not pos
                else (
                    ("loss_in_window", f"loss at positions < {args.window}"),
                    ("loss_beyond_window", f"loss at positions >= {args.window}"),
                )
            ):
                tables.append((name, summarize(pos, args.reference, (), loss_key=key), name))
        if args.curve and args.positions:
            curves = curve_tables(args.positions, rows, args.reference, adopted)
            if args.curve_table and args.reference:
                tables.append(("learning curve", curves, None))
            else:
                for step, summaries in curves:
                    name = f"valid loss at step {step}"
                    tables.append((name, summaries, name))
        per_seed = per_seed_markdown(rows, args.reference) if args.per_seed else ""
    except ValueError as e:
        print(f"quality_tables: {e}", file=sys.stderr)
        return 2
    for i, (title, summaries, loss_name) in enumerate(tables):
        if i:
            sys.stdout.write(f"\n{title}:\n\n")
        cols = columns if i == 0 else ()
        if loss_name is None:
            sys.stdout.write(curve_markdown(summaries, args.reference, args.curve_table))
            continue
        sys.stdout.write(summary_markdown(summaries, args.reference, cols, loss_name=loss_name))
        if i == 0 and trained_on_cpu(rows):
            sys.stdout.write(f"\n{CPU_NOTE}\n")
    if per_seed:
        sys.stdout.write("\nper seed:\n\n" + per_seed)
    if args.write:
        # The plot's title is the study's name, as the sweep's own: the folder of its results.csv.
        study = os.path.basename(os.path.dirname(os.path.abspath(args.results[0])))
        write_summary(rows, args.write, reference=args.reference, title=study)
    return 0


def merged_results(paths: list) -> list[dict]:
    """The rows of several results.csv files as one set: each point's row from the first file
    where it finished, else from the first file that lists it; in the order points first
    appear."""
    chosen: dict = {}
    for path in paths:
        for row in read_results(path):
            have = chosen.get(row["point"])
            if have is None or (
                have.get("status", "finished") != "finished"
                and row.get("status", "finished") == "finished"
            ):
                chosen[row["point"]] = row
    return list(chosen.values())


def _speed_model(args) -> int:
    """--speed-model: the line fitted to --speed-fit's file (else the results file's) and the
    results file's settings against it."""
    others = [
        option
        for option, value in (
            ("--reference", args.reference),
            ("--positions", args.positions),
            ("--adopted-runs", args.adopted_runs),
            ("--curve", args.curve),
            ("--curve-table", args.curve_table),
            ("--per-seed", args.per_seed),
            ("--write", args.write),
        )
        if value
    ]
    if others:
        print(
            f"quality_tables: --speed-model prints the speed model only; leave out "
            f"{', '.join(others)} (the summary tables are a run without --speed-model)",
            file=sys.stderr,
        )
        return 2
    if len(args.results) > 1:
        print("quality_tables: --speed-model takes one results file", file=sys.stderr)
        return 2
    args.results = args.results[0]
    fit_on = args.speed_fit or args.results
    try:
        rows = read_results(fit_on)
        model = fit_speed_model(rows)
    except (ValueError, OSError) as e:
        print(f"quality_tables: {fit_on}: {e}", file=sys.stderr)
        return 2
    try:
        if args.speed_fit:  # else the rows just read
            rows = read_results(args.results)
        table = speed_rows(rows, model)
    except (ValueError, OSError) as e:
        print(f"quality_tables: {args.results}: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(speed_model_markdown(table, model, fit_on))
    return 0


if __name__ == "__main__":
    sys.exit(main())
