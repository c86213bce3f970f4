#!/usr/bin/env python3
"""Recompute a study's retrieval tables from its raw evaluator output (markdown on stdout).

    python tools/retrieval_tables.py docs/long_context/results/<study>
    python tools/retrieval_tables.py docs/long_context/results/<study> --tasks passkey,multikey \
        --reference dense --output docs/long_context/results/<study>/tables.md

Reads ``<study>/<arm>/seed<k>/retrieval.json`` (the evaluator's own file, one per arm and
seed). Per task: each arm's greedy exact match per length, in points, the mean over the
length's depths and then over seeds, with the 95% Student-t interval over seeds; then each arm's
difference to the reference arm (``dense`` unless ``--reference``), per length, in points, paired
by seed where both arms ran two or more of the same seeds (Welch's interval otherwise). See
``megatron_s2/training/evaluation/retrieval_stats.py``.

    python tools/retrieval_tables.py docs/long_context/results/retrieval-125m-extend-32k --goal

``--goal``: instead, issue 50's goal per arm (each arm within 5 points of the reference at 16k
and 32k on passkey and multikey, no worse on code-value by exact match and by the right
answer's log-likelihood in nats, >= 1.3x its tokens/s, 3 seeds), the
tokens/s from the study's ``results.csv`` beside the arms (the sweep's, rows ``<arm>,seed=<k>``).

    python tools/retrieval_tables.py docs/long_context/results/<study>-zone --by-depth

``--by-depth``: instead, each arm's exact match per depth and length, trials pooled over its
seeds, with Wilson intervals (where in the context an arm fails; needs no reference arm).

    python tools/retrieval_tables.py docs/long_context/results/<study> --seeds 2,3 --tasks needle

``--seeds``: only these seeds of every arm (a task that later seeds added, such as the long
base's ``needle`` from seed 2 on, is in the tables only over the seeds that ran it: the tables
hold the tasks every file has).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_s2.training.evaluation.retrieval_stats import (  # noqa: E402
    depth_markdown,
    goal_markdown,
    read_arm_results,
    study_markdown,
    study_tokens_per_s,
    tasks_of,
)


def keep_seeds(
    arms: dict, seeds: str, reference: Optional[str] = "dense"
) -> tuple[dict, list[str]]:
    """``arms`` (``{arm: {seed: retrieval.json}}``) with only the seeds of the comma list
    ``seeds``, and the arms that ran none of them (left out of the tables). Raises ValueError
    naming ``--seeds`` for a list that is not integers, a seed no arm ran, or a selection that
    leaves the ``reference`` arm without seeds (each with the seeds found; ``None``: no arm
    is the reference, as for ``--by-depth``)."""
    try:
        wanted = sorted({int(x) for x in seeds.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--seeds: a comma list of integers, got {seeds!r}") from None
    found = {arm: sorted(runs) for arm, runs in arms.items()}
    missing = [k for k in wanted if not any(k in runs for runs in arms.values())]
    if not wanted or missing:
        raise ValueError(f"--seeds: {missing or seeds!r} not run by any arm; seeds: {found}")
    kept = {arm: {k: r for k, r in runs.items() if k in wanted} for arm, runs in arms.items()}
    if reference in arms and not kept[reference]:
        raise ValueError(
            f"--seeds: leaves the reference arm {reference} without seeds; seeds: {found}"
        )
    dropped = [arm for arm, runs in kept.items() if not runs]
    return {arm: runs for arm, runs in kept.items() if runs}, dropped


def _lacking(arms: dict, tasks: list) -> str:
    """For the error on ``--tasks``: which arm/seed files lack which of ``tasks`` that other
    files hold (a task added from a later seed on), and the option that selects seeds."""
    lacking = {
        t: [
            f"{arm}/seed{k}"
            for arm, runs in arms.items()
            for k, r in runs.items()
            if t not in r["tasks"]
        ]
        for t in tasks
        if any(t in r["tasks"] for runs in arms.values() for r in runs.values())
    }
    if not lacking:
        return ""
    where = "; ".join(f"{t} missing in {', '.join(files)}" for t, files in lacking.items())
    return f" ({where}: --seeds selects the seeds that ran it)"


def main(argv=None) -> int:
    """Print (or write, ``--output``) the study's tables; exit code 2 on bad input."""
    p = argparse.ArgumentParser(prog="retrieval_tables", description=__doc__.split("\n\n")[0])
    p.add_argument("study", help="directory holding <arm>/seed<k>/retrieval.json")
    p.add_argument("--tasks", help="comma list (default: every task all files hold)")
    p.add_argument("--reference", default="dense", help="the reference arm (default dense)")
    p.add_argument("--output", help="also write the markdown to this file")
    p.add_argument(
        "--seeds", help="comma list of seeds to keep in every arm (default: every seed found)"
    )
    p.add_argument(
        "--goal",
        action="store_true",
        help="print issue 50's goal table instead (needs <study>/results.csv for tokens/s)",
    )
    p.add_argument(
        "--speed-reference",
        metavar="STUDY",
        help="with --goal: the reference arm's tokens/s from this other study's results.csv "
        "(its runs of the reference's seeds), e.g. a twin on the fused dense kernels where the "
        "study's own twin runs a slower one (dense layers with learned sinks), so that a slow "
        "twin cannot inflate the speed-up",
    )
    p.add_argument(
        "--by-depth",
        action="store_true",
        help="print each arm's exact match by depth and length instead (trials pooled over "
        "seeds, Wilson intervals; no reference needed)",
    )
    args = p.parse_args(argv)
    if args.speed_reference and not args.goal:
        print("retrieval_tables: error: --speed-reference goes with --goal", file=sys.stderr)
        return 2
    if args.goal and args.by_depth:
        print("retrieval_tables: error: --goal and --by-depth are two views: give one",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        arms = read_arm_results(args.study)
        if args.seeds:
            reference = None if args.by_depth else args.reference
            arms, dropped = keep_seeds(arms, args.seeds, reference)
            if dropped:
                print(f"retrieval_tables: --seeds {args.seeds}: left out {', '.join(dropped)} "
                      "(none of those seeds)", file=sys.stderr)  # fmt: skip
        known = tasks_of([r for seeds in arms.values() for r in seeds.values()])
        tasks = [t for t in (args.tasks or "").split(",") if t] or known
        unknown = [t for t in tasks if t not in known]
        if unknown:
            raise ValueError(
                f"--tasks: {unknown} not in every file; allowed: {', '.join(known)}"
                + _lacking(arms, unknown)
            )
        if args.by_depth:
            text = depth_markdown(arms, tasks)
        elif args.reference not in arms:
            raise ValueError(
                f"--reference: {args.reference!r} is not an arm of {args.study}; arms: "
                + ", ".join(arms)
            )
        elif args.goal:
            speed = study_tokens_per_s(os.path.join(args.study, "results.csv"), arms)
            note = ""
            if args.speed_reference:
                ref = args.reference
                other = os.path.join(args.speed_reference, "results.csv")
                theirs = study_tokens_per_s(other, {ref: arms[ref]}).get(ref, {})
                missing = sorted(set(arms[ref]) - set(theirs))
                if missing:
                    raise ValueError(
                        f"--speed-reference: {other} has no finished run of {ref!r} with "
                        f"seed(s) {', '.join(map(str, missing))} (the reference's seeds here)"
                    )
                speed[ref] = theirs
                note = (
                    f"\n\ntokens/s vs {ref}: {ref}'s tokens/s from {other} (seeds "
                    f"{', '.join(map(str, sorted(theirs)))}), not from this study's runs."
                )
            text = goal_markdown(arms, speed, reference=args.reference) + note
        else:
            text = study_markdown(arms, tasks, reference=args.reference)
    except (OSError, ValueError, KeyError) as exc:
        print(f"retrieval_tables: error: {exc}", file=sys.stderr)
        return 2
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
