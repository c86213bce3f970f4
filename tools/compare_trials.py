#!/usr/bin/env python3
"""Two evaluations of the same retrieval trials, trial by trial (markdown on stdout).

    python tools/compare_trials.py RESULT.json REFERENCE.json [--depths 0] [--tasks passkey]
        [--lengths 4096]
    python tools/compare_trials.py RESULT.json REFERENCE.json --tasks passkey,multikey --decide 0

RESULT and REFERENCE are ``retrieval.json`` files of ``megatron-s2-eval-long-context`` with the
same evaluator seed (two checkpoints, e.g. a recipe change against the recipe it changes, or one
checkpoint with and without ``--prefix-eod``), holding per-trial records. Per task: each file's
exact match per length and pooled over the lengths, and RESULT minus REFERENCE in points with
Newcombe's paired 95% interval over the same trials (only the trials at ``--depths`` when given,
e.g. ``--depths 0`` for the needle in the context's first tokens; only the context lengths in
``--lengths`` when given, e.g. a base evaluated at 4k only against one evaluated at 4k-32k).
The interval is the evaluation's noise only (which trials a checkpoint happens to get right),
not the spread between training seeds. See ``paired_counts`` in
``megatron_s2/training/evaluation/retrieval_stats.py``.

``--decide DEPTHS`` applies the rule a recipe lever is adopted by (docs/long_context_eval.md,
"Next leases"): on every task, pooled over the lengths, RESULT's paired interval at DEPTHS lies
above 0 (better where the lever aims) and at the other depths holds 0 or lies above (not worse
elsewhere). It prints both pooled rows per task and the verdict, ``adopt: yes`` or ``adopt: no``
with the reason. One evaluation per arm, so it picks the next runs; it is not itself a result.
Exit code 2 on bad input (files that do not hold the same trials, a task, depth or length not
in them, a malformed list).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_s2.training.evaluation.retrieval_stats import (  # noqa: E402
    counts_difference,
    paired_counts,
    pool_counts,
    tasks_of,
)


def _row(label: str, counts: tuple[int, int, int, int]) -> str:
    """One table row: the two exact matches (%), the paired difference and the trials."""
    both, only_a, only_b, _ = counts
    d, lo, hi, n = counts_difference(counts)
    a, b = 100.0 * (both + only_a) / n, 100.0 * (both + only_b) / n
    return f"| {label} | {a:.1f} | {b:.1f} | {d:+.1f} [{lo:+.1f}, {hi:+.1f}] | {n} |"


def compare_markdown(result: dict, reference: dict, tasks, depths=None, lengths=None) -> str:
    """The tables for ``tasks``: per length and pooled over the lengths (see the module
    docstring); ValueError from :func:`paired_counts` when the trials do not match."""
    lines = []
    for task in tasks:
        counts = paired_counts(result, reference, task, depths, lengths)
        if not counts:
            raise ValueError(f"--depths {depths}: no trial of {task!r} at those depths")
        lines += [
            f"### {task}" + (f" at depths {', '.join(f'{d:g}' for d in depths)}" if depths else ""),
            "",
            "| length | result (%) | reference (%) | result - reference (points, 95%) | trials |",
            "|---|---|---|---|---|",
        ]
        lines += [_row(f"{n:,}", counts[n]) for n in sorted(counts)]
        lines += [_row("all lengths", pool_counts(counts)), ""]
    return "\n".join(lines)


def decide(result: dict, reference: dict, tasks, depths, lengths=None) -> tuple[bool, str]:
    """The lever rule of the module docstring: (adopt?, markdown with each task's pooled rows
    at ``depths`` and at the other depths, and the verdict); over ``lengths`` only when given."""
    lines = [
        "| task | depths | result (%) | reference (%) "
        "| result - reference (points, 95%) | trials |",
        "|---|---|---|---|---|---|",
    ]
    reasons = []
    for task in tasks:
        aimed = paired_counts(result, reference, task, depths, lengths)
        if not aimed:
            raise ValueError(f"--decide {depths}: no trial of {task!r} at those depths")
        trials = result["tasks"][task]["trials"]
        at = {float(t["depth"]) for t in trials}
        others = sorted(d for d in at if not any(math.isclose(d, x) for x in depths))
        rest = paired_counts(result, reference, task, others, lengths) if others else {}
        named = ", ".join(f"{d:g}" for d in depths)
        pooled = pool_counts(aimed)
        lines.append(_row(f"{task} | {named}", pooled))
        _, lo, _, _ = counts_difference(pooled)
        if lo <= 0:
            reasons.append(f"{task}: at depths {named} the interval does not lie above 0")
        if rest:
            pooled = pool_counts(rest)
            lines.append(_row(f"{task} | the others", pooled))
            _, _, hi, _ = counts_difference(pooled)
            if hi < 0:
                reasons.append(f"{task}: at the other depths the interval lies below 0")
        else:
            lines.append(f"| {task} | the others | (no other depths: not checked) | | | |")
    adopt = not reasons
    verdict = "adopt: yes" if adopt else "adopt: no (" + "; ".join(reasons) + ")"
    return adopt, "\n".join([*lines, "", verdict])


def _numbers(option: str, raw: str) -> list[float]:
    """An option's comma list of numbers (needle depths, lengths); ValueError naming it."""
    try:
        return [float(x) for x in raw.split(",")]
    except ValueError:
        raise ValueError(f"{option} takes numbers separated by commas, got {raw!r}") from None


def _lengths(raw: str) -> list[int]:
    """``--lengths``: whole token counts > 0 separated by commas (as the files' ``length``
    fields, e.g. ``4096,8192``); ValueError naming the option otherwise."""
    bad = ValueError(f"--lengths takes whole token counts > 0 separated by commas (e.g. "
                     f"4096,8192), got {raw!r}")  # fmt: skip
    try:
        values = _numbers("--lengths", raw)
    except ValueError:
        raise bad from None
    if not all(math.isfinite(x) and x.is_integer() and x > 0 for x in values):
        raise bad
    return [int(x) for x in values]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="compare_trials", description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="retrieval.json of the evaluation compared")
    p.add_argument("reference", help="retrieval.json of the reference evaluation")
    p.add_argument("--tasks", help="comma list (default: every task both files hold)")
    p.add_argument("--depths", help="comma list of needle depths, e.g. 0 (default: all)")
    p.add_argument("--lengths", help="comma list of context lengths in tokens (default: all)")
    p.add_argument(
        "--decide",
        metavar="DEPTHS",
        help="comma list of needle depths the lever aims at: print the adoption verdict",
    )
    args = p.parse_args(argv)
    try:
        runs = []
        for path in (args.result, args.reference):
            with open(path) as f:
                runs.append(json.load(f))
        known = tasks_of(runs)
        tasks = [t for t in (args.tasks or "").split(",") if t] or known
        unknown = [t for t in tasks if t not in known]
        if unknown:
            raise ValueError(f"--tasks: {unknown} not in both files; allowed: {', '.join(known)}")
        depths = _numbers("--depths", args.depths) if args.depths else None
        lengths = None if args.lengths is None else _lengths(args.lengths)
        if args.decide is not None:
            if depths is not None:
                raise ValueError("--decide compares every depth: give it without --depths")
            text = decide(runs[0], runs[1], tasks, _numbers("--decide", args.decide), lengths)[1]
        else:
            text = compare_markdown(runs[0], runs[1], tasks, depths, lengths)
    except (OSError, ValueError, KeyError) as exc:
        print(f"compare_trials: error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
