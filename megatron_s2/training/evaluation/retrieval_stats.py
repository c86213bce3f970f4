"""Confidence intervals of retrieval scores: per cell over trials, and per arm over seeds.

* Within one evaluation (one seed of one model) a cell's exact match is ``k`` successes in
  ``n`` trials: its 95% interval is Wilson's score interval (:func:`wilson_interval`), which
  unlike the normal approximation stays inside [0, 1] and is not empty at 0 or n successes, the
  cells that matter most here (a hybrid at 0%, a dense model at 100%).
* Over seeds (:func:`seed_summary`, :func:`difference_to_reference`) the unit is one training
  run: a length's score is the mean over its depths of one seed's cells, and the interval is
  Student's t over seeds (:mod:`..seed_stats`); the trials' own binomial noise is inside each
  seed's value, so it is not counted twice. Differences to the reference arm (``dense``) are
  paired by seed when both ran the same seeds, in points (percentage points of exact match).

Input: the evaluator's ``retrieval.json`` (:func:`~.retrieval.evaluate_retrieval`); files
written before these fields existed are read too (a cell's successes are its accuracy times its
trials).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Optional

from ..seed_stats import CONFIDENCE, Estimate, difference_interval, mean_interval

__all__ = [
    "CONFIDENCE",
    "wilson_interval",
    "cell_counts",
    "cell_interval",
    "paired_difference_interval",
    "paired_counts",
    "paired_trial_difference",
    "counts_difference",
    "pool_counts",
    "length_means",
    "answer_loglik_means",
    "paired_loglik_difference",
    "seed_summary",
    "difference_to_reference",
    "read_arm_results",
    "format_estimate",
    "tasks_of",
    "study_markdown",
    "goal_markdown",
    "study_tokens_per_s",
]


def _z(level: float) -> float:
    from scipy import stats

    return float(stats.norm.ppf(0.5 + level / 2))


def wilson_interval(successes: int, trials: int, level: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson's score interval ``(low, high)`` for a proportion of ``successes`` in ``trials``
    at confidence ``level`` (fractions in [0, 1]): the ``p`` with
    ``(successes / trials - p)^2 <= z^2 p (1 - p) / trials``, ``z`` the normal quantile.
    Raises ValueError for ``trials`` < 1 or ``successes`` outside [0, trials]."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"wilson_interval: need 0 <= successes <= trials, trials >= 1; got "
                         f"{successes} of {trials}")  # fmt: skip
    if not 0.0 < level < 1.0:
        raise ValueError(f"wilson_interval: level must be in (0, 1), got {level}")
    z2 = _z(level) ** 2
    p = successes / trials
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = (
        math.sqrt(z2) / (1 + z2 / trials) * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials**2))
    )
    low, high = max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))
    # At 0 or n successes the bound is exactly 0 or 1 (a root of the equation), not its
    # floating-point neighbour.
    return (0.0 if successes == 0 else low), (1.0 if successes == trials else high)


def cell_counts(cell: Mapping) -> tuple[int, int]:
    """``(successes, trials)`` of a retrieval cell: its ``correct`` count, or (files written
    before it existed) its accuracy times its trials, rounded."""
    n = int(cell["trials"])
    k = cell.get("correct")
    return (int(k) if k is not None else int(round(float(cell["accuracy"]) * n))), n


def cell_interval(cell: Mapping, level: float = CONFIDENCE) -> tuple[float, float]:
    """The cell's ``(ci_low, ci_high)``: stored ones, else Wilson's from its counts."""
    if "ci_low" in cell and "ci_high" in cell:
        return float(cell["ci_low"]), float(cell["ci_high"])
    return wilson_interval(*cell_counts(cell), level=level)


def paired_difference_interval(
    both: int, only_a: int, only_b: int, neither: int, level: float = CONFIDENCE
) -> tuple[float, float, float]:
    """``(difference, low, high)`` of two success rates measured on the same trials: ``a``'s
    rate minus ``b``'s (fractions in [-1, 1]), from the four counts of the trials' outcomes
    (``both`` succeeded, ``only_a``, ``only_b``, ``neither``), with Newcombe's (1998)
    square-and-add interval for paired data at confidence ``level``: each rate's Wilson
    interval, combined with the correlation of the two outcomes over trials (the phi
    coefficient, its positive part reduced by n/2 as Newcombe does), so that two models that
    fail on the same trials get a narrower interval than two independent samples would.
    Raises ValueError for negative counts or no trials."""
    counts = (both, only_a, only_b, neither)
    if min(counts) < 0 or sum(counts) < 1:
        raise ValueError(
            "paired_difference_interval: need counts >= 0 and at least one trial, got "
            f"both={both} only_a={only_a} only_b={only_b} neither={neither}"
        )
    n = sum(counts)
    a_yes, b_yes = both + only_a, both + only_b
    pa, pb = a_yes / n, b_yes / n
    la, ua = wilson_interval(a_yes, n, level)
    lb, ub = wilson_interval(b_yes, n, level)
    margins = a_yes * (n - a_yes) * b_yes * (n - b_yes)
    phi = 0.0
    if margins > 0:
        cross = both * neither - only_a * only_b
        # Newcombe's correction: a positive association counts only beyond n/2.
        if cross > n / 2:
            phi = (cross - n / 2) / math.sqrt(margins)
        elif cross < 0:
            phi = cross / math.sqrt(margins)
    diff = pa - pb
    down = math.sqrt(max(0.0, (pa - la) ** 2 + (ub - pb) ** 2 - 2 * phi * (pa - la) * (ub - pb)))
    up = math.sqrt(max(0.0, (pb - lb) ** 2 + (ua - pa) ** 2 - 2 * phi * (pb - lb) * (ua - pa)))
    return diff, max(-1.0, diff - down), min(1.0, diff + up)


def paired_counts(
    result: Mapping,
    reference: Mapping,
    task: str,
    depths: Optional[Sequence[float]] = None,
    lengths: Optional[Sequence[int]] = None,
) -> dict[int, tuple[int, int, int, int]]:
    """``{length: (both, only_result, only_reference, neither)}``: how many of the length's
    trials (of ``depths`` only when given) each of two evaluations got exactly right, trial by
    trial. Trials are matched by (length, depth, trial index) and must ask the same answers
    (two evaluations with the evaluator's same seed, e.g. two arms of a study, or one run with
    and without ``--prefix-eod``). ``lengths`` (context lengths in tokens) keeps only those
    lengths' trials, e.g. to pair a base evaluated at 4k only with one evaluated at 4k-32k;
    each must be in both files. Raises ValueError when a file has no per-trial records, when a
    length of ``lengths`` is not in both files (naming those that are), or when the trials do
    not match (naming the first that differs, and the lengths both hold when the files were
    evaluated at different lengths)."""

    def trials(r: Mapping, which: str) -> dict[tuple, Mapping]:
        records = r["tasks"][task].get("trials") or []
        if not records:
            raise ValueError(
                f"paired_counts: the {which} file has no per-trial records for {task!r} "
                "(written before they existed?)"
            )
        return {(int(t["length"]), float(t["depth"]), int(t["trial"])): t for t in records}

    mine, ref = trials(result, "first"), trials(reference, "reference")
    common = sorted({k[0] for k in mine} & {k[0] for k in ref})
    if lengths is not None:
        missing = sorted(set(lengths) - set(common))
        if missing:
            raise ValueError(
                f"paired_counts: lengths {missing} are not in both files' {task!r} trials; "
                f"both hold {common}"
            )
        mine = {k: t for k, t in mine.items() if k[0] in lengths}
        ref = {k: t for k, t in ref.items() if k[0] in lengths}
    if set(mine) != set(ref):
        hint = ""
        if {k[0] for k in mine} != {k[0] for k in ref} and common:
            # e.g. a base evaluated at 4k only against a run evaluated at 4k-32k
            hint = (f"; the files were evaluated at different lengths, both at {common}: pair "
                    f"those alone (lengths=, compare_trials.py --lengths)")  # fmt: skip
        raise ValueError(
            f"paired_counts: the two files hold different trials for {task!r} ({len(mine)} "
            f"and {len(ref)}; e.g. {sorted(set(mine) ^ set(ref))[0]} in one only){hint}"
        )
    counts: dict[int, list[int]] = {}
    for key in sorted(mine):
        a, b = mine[key], ref[key]
        if (a.get("answer"), a.get("key")) != (b.get("answer"), b.get("key")):
            raise ValueError(
                f"paired_counts: trial {key} of {task!r} asks {a.get('answer')!r} in one file "
                f"and {b.get('answer')!r} in the other: not the same trials (another "
                "evaluator seed?)"
            )
        if depths is not None and not any(math.isclose(key[1], d) for d in depths):
            continue
        # both, only the first, only the reference, neither
        slot = (0 if b["exact"] else 1) if a["exact"] else (2 if b["exact"] else 3)
        counts.setdefault(key[0], [0, 0, 0, 0])[slot] += 1
    return {n: (c[0], c[1], c[2], c[3]) for n, c in counts.items()}


def paired_trial_difference(
    result: Mapping,
    reference: Mapping,
    task: str,
    level: float = CONFIDENCE,
    depths: Optional[Sequence[float]] = None,
) -> dict[int, tuple[float, float, float, int]]:
    """One evaluation against another on the same trials: ``{length: (difference, low, high,
    trials)}`` of ``result``'s exact match minus ``reference``'s, in points (0-100), with
    :func:`paired_difference_interval` over the length's trials (of ``depths`` only when
    given; matching and errors as :func:`paired_counts`). This is the evaluation's noise alone
    (which trials a model happens to get right), not the training run's: it says whether two
    checkpoints differ on these trials, not whether two recipes differ."""
    counts = paired_counts(result, reference, task, depths)
    return {n: counts_difference(c, level) for n, c in counts.items()}


def counts_difference(
    counts: tuple[int, int, int, int], level: float = CONFIDENCE
) -> tuple[float, float, float, int]:
    """``(difference, low, high, trials)`` in points (0-100) of one ``(both, only_result,
    only_reference, neither)`` tuple of :func:`paired_counts`, by
    :func:`paired_difference_interval`."""
    d, lo, hi = paired_difference_interval(*counts, level=level)
    return 100.0 * d, 100.0 * lo, 100.0 * hi, sum(counts)


def pool_counts(by_length: Mapping[int, tuple[int, int, int, int]]) -> tuple[int, int, int, int]:
    """:func:`paired_counts`'s four counts summed over its lengths (the trials pooled)."""
    both, only_a, only_b, neither = (sum(c[i] for c in by_length.values()) for i in range(4))
    return both, only_a, only_b, neither


def length_means(result: Mapping, task: str) -> dict[int, float]:
    """One evaluation's exact match per length for ``task``: the mean over the length's depths
    of the cells' accuracies (a fraction; every cell has the same trials, so also the fraction
    of the length's trials). Raises KeyError naming the task when the file lacks it."""
    tasks = result["tasks"]
    if task not in tasks:
        raise KeyError(f"task {task!r} not in this retrieval.json (it has {', '.join(tasks)})")
    by_length: dict[int, list[float]] = {}
    for c in tasks[task]["cells"]:
        by_length.setdefault(int(c["length"]), []).append(float(c["accuracy"]))
    return {n: sum(v) / len(v) for n, v in sorted(by_length.items())}


def _trial_logliks(result: Mapping, task: str) -> dict[tuple, tuple[str, float]]:
    """``{(length, depth, trial): (answer, log-likelihood)}`` of one evaluation's ``task``;
    ValueError when it has no per-trial records or a record lacks ``log_likelihood``."""
    records = result["tasks"][task].get("trials") or []
    if not records or any("log_likelihood" not in t for t in records):
        raise ValueError(f"{task!r}: no per-trial answer log-likelihoods in this retrieval.json")
    return {
        (int(t["length"]), float(t["depth"]), int(t["trial"])): (
            t.get("answer"),
            float(t["log_likelihood"]),
        )
        for t in records
    }


def answer_loglik_means(result: Mapping, task: str) -> dict[int, float]:
    """One evaluation's mean log-likelihood of the right answer (nats, summed over the answer's
    tokens, averaged over a length's trials) per length: a graded measure of the same trials
    where exact match sits at 0 (the held-out ``code-value`` task). ValueError as
    :func:`_trial_logliks`."""
    by_length: dict[int, list[float]] = {}
    for key, (_, ll) in _trial_logliks(result, task).items():
        by_length.setdefault(key[0], []).append(ll)
    return {n: sum(v) / len(v) for n, v in sorted(by_length.items())}


def paired_loglik_difference(
    result: Mapping, reference: Mapping, task: str, level: float = CONFIDENCE
) -> dict[int, tuple[float, float, float, int]]:
    """``{length: (difference, low, high, trials)}``: ``result``'s answer log-likelihood minus
    ``reference``'s in nats, the mean over the length's trials with the paired Student-t
    ``level`` interval over those trials (the same trials, matched as :func:`paired_counts`
    does). The evaluation's noise only, like :func:`paired_trial_difference`. ValueError when
    the files hold different trials or lack the log-likelihoods."""
    mine, ref = _trial_logliks(result, task), _trial_logliks(reference, task)
    if set(mine) != set(ref) or any(mine[k][0] != ref[k][0] for k in mine):
        raise ValueError(f"paired_loglik_difference: the two files hold different {task!r} trials")
    diffs: dict[int, list[float]] = {}
    for key in sorted(mine):
        diffs.setdefault(key[0], []).append(mine[key][1] - ref[key][1])
    out = {}
    for n, d in diffs.items():
        est = mean_interval(d, level)
        if est.half_width is None:
            raise ValueError(f"paired_loglik_difference: one trial at {n} tokens, no interval")
        out[n] = (est.mean, est.low, est.high, len(d))
    return out


def _loglik_differences(
    arm: Mapping[int, Mapping], ref: Mapping[int, Mapping], task: str, level: float
) -> dict[int, tuple[float, Optional[float], Optional[float], str]]:
    """As :func:`_differences`, for the answer log-likelihood in nats: ``{length: (mean, low,
    high, how)}``, over seeds (paired or Welch) where two or more can be compared, else over
    the one common seed's trials ("trials"), else the mean alone ("one seed"). Empty when a
    file lacks per-trial log-likelihoods."""
    try:
        mine = {s: answer_loglik_means(r, task) for s, r in arm.items()}
        theirs = {s: answer_loglik_means(r, task) for s, r in ref.items()}
    except ValueError:
        return {}
    trials = _one_seed_trials(arm, ref, lambda a, b: paired_loglik_difference(a, b, task, level))
    return _arm_differences(mine, theirs, trials, level)


def _one_seed_trials(arm: Mapping[int, Mapping], ref: Mapping[int, Mapping], pair) -> dict:
    """Where the two arms share exactly one seed, ``pair(arm's file, ref's file)`` over that
    seed's trials (``{length: (difference, low, high, trials)}``); else, or where the files do
    not hold the same trials (ValueError), empty."""
    common = sorted(set(arm) & set(ref))
    if len(common) != 1:
        return {}
    try:
        return pair(arm[common[0]], ref[common[0]])
    except ValueError:
        return {}


def _arm_differences(
    mine: Mapping[int, Mapping[int, float]],
    theirs: Mapping[int, Mapping[int, float]],
    trials: Mapping[int, tuple],
    level: float,
) -> dict[int, tuple[float, Optional[float], Optional[float], str]]:
    """``{length: (mean, low, high, how)}`` of per-seed values (``{seed: {length: value}}``,
    an arm's and the reference's) at each length both have: the difference with its interval
    over seeds where :func:`difference_interval` gives one ("paired" or "Welch"), else
    ``trials``' interval over the one common seed's trials ("trials"), else the difference of
    the means alone ("one seed")."""
    lengths = {n for v in mine.values() for n in v} & {n for v in theirs.values() for n in v}
    out = {}
    for n in sorted(lengths):
        a = {s: v[n] for s, v in mine.items() if n in v}
        b = {s: v[n] for s, v in theirs.items() if n in v}
        est, how = difference_interval(a, b, level, relative=False)
        if est is not None and est.half_width is not None:
            out[n] = (est.mean, est.low, est.high, how)
        elif n in trials:
            out[n] = (*trials[n][:3], "trials")
        else:
            out[n] = (sum(a.values()) / len(a) - sum(b.values()) / len(b), None, None, "one seed")
    return out


def seed_summary(
    results: Mapping[int, Mapping], task: str, level: float = CONFIDENCE
) -> dict[int, Estimate]:
    """One arm over seeds: ``{length: Estimate}`` of the exact match in points (0-100), the
    mean over seeds of each seed's mean over depths, with the Student-t ``level`` interval
    over seeds (``half_width`` None with one seed). ``results`` maps seed -> retrieval.json
    content. Lengths missing from some seed are summarised over the seeds that have them."""
    per_seed = _per_seed_points(results, task)
    lengths = sorted({n for values in per_seed.values() for n in values})
    return {n: mean_interval([v[n] for v in per_seed.values() if n in v], level) for n in lengths}


def difference_to_reference(
    results: Mapping[int, Mapping],
    reference: Mapping[int, Mapping],
    task: str,
    level: float = CONFIDENCE,
) -> dict[int, tuple[Optional[Estimate], str]]:
    """``{length: (Estimate, how)}``: the arm's exact match minus the reference arm's, in
    points, with its ``level`` interval over seeds: paired by seed when at least two seeds are
    common ("paired"), Welch's otherwise ("Welch"), none with too few seeds (``(None, "")``).
    Lengths present in both arms only."""
    mine, ref = _per_seed_points(results, task), _per_seed_points(reference, task)
    lengths = sorted({n for v in mine.values() for n in v} & {n for v in ref.values() for n in v})
    out = {}
    for n in lengths:
        a = {s: v[n] for s, v in mine.items() if n in v}
        b = {s: v[n] for s, v in ref.items() if n in v}
        out[n] = difference_interval(a, b, level, relative=False)
    return out


def _per_seed_points(results: Mapping[int, Mapping], task: str) -> dict[int, dict[int, float]]:
    if not results:
        raise ValueError("no seeds: give at least one retrieval.json per arm")
    return {
        seed: {n: 100.0 * v for n, v in length_means(r, task).items()}
        for seed, r in results.items()
    }


_SEED_DIR = re.compile(r"^seed(\d+)$")


def read_arm_results(study_dir: str | os.PathLike) -> dict[str, dict[int, dict]]:
    """The raw results of one study: ``{arm: {seed: retrieval.json content}}`` from
    ``study_dir/<arm>/seed<k>/retrieval.json`` (the layout of ``docs/long_context/results/``).
    Raises FileNotFoundError naming the layout when there is none, and ValueError when the
    files were evaluated under different prompt protocols (``prefix_eod``, absent in files
    written before it existed: False), which no table may compare."""
    found: dict[str, dict[int, dict]] = {}
    for arm in sorted(os.listdir(study_dir)):
        arm_dir = os.path.join(study_dir, arm)
        if not os.path.isdir(arm_dir):
            continue
        for name in sorted(os.listdir(arm_dir)):
            m = _SEED_DIR.match(name)
            path = os.path.join(arm_dir, name, "retrieval.json")
            if m and os.path.isfile(path):
                with open(path) as f:
                    found.setdefault(arm, {})[int(m.group(1))] = json.load(f)
    if not found:
        raise FileNotFoundError(
            f"{study_dir}: no <arm>/seed<k>/retrieval.json files (the layout of "
            f"docs/long_context/results/<study>/)"
        )
    protocol = {
        f"{arm}/seed{seed}": bool(r.get("prefix_eod", False))
        for arm, seeds in found.items()
        for seed, r in seeds.items()
    }
    if len(set(protocol.values())) > 1:
        raise ValueError(
            f"{study_dir}: its retrieval.json files mix prompts with and without the EOD prefix "
            f"(prefix_eod: {protocol}); keep each protocol in a study directory of its own"
        )
    return found


def format_estimate(est: Optional[Estimate], signed: bool = False) -> str:
    """``41.0 ± 5.2`` (points, the half-width of the interval), the mean alone for one seed,
    ``–`` for none."""
    if est is None:
        return "–"
    return est.text("{:+.1f}" if signed else "{:.1f}")


def tasks_of(results: Sequence[Mapping]) -> list[str]:
    """The tasks present in every one of ``results`` (retrieval.json contents), in the first's
    order."""
    names = list(results[0]["tasks"]) if results else []
    return [t for t in names if all(t in r["tasks"] for r in results)]


def study_markdown(
    arms: Mapping[str, Mapping[int, Mapping]],
    tasks: Optional[Sequence[str]] = None,
    reference: str = "dense",
    level: float = CONFIDENCE,
) -> str:
    """Markdown tables of a study (``arms``: ``{arm: {seed: retrieval.json content}}``, as
    :func:`read_arm_results` returns): per task, each arm's exact match per length (points, mean
    over depths, then over seeds, ± the half-width of the t-interval over seeds), and each other
    arm's difference to ``reference`` (points, paired by seed where possible, ± its interval).
    ``tasks``: default every task that all arms' files hold. Raises ValueError naming the
    reference when it is not among the arms."""
    if reference not in arms:
        raise ValueError(f"reference arm {reference!r} not among the arms: {', '.join(arms)}")
    if tasks is None:
        tasks = tasks_of([r for seeds in arms.values() for r in seeds.values()])
    order = [reference] + [a for a in arms if a != reference]
    pct = f"{100 * level:g}%"
    lines: list[str] = []
    for task in tasks:
        summaries = {a: seed_summary(arms[a], task, level) for a in order}
        lengths = sorted({n for s in summaries.values() for n in s})
        head = "| " + " | ".join(str(n) for n in lengths) + " |"
        rule = "|---|---|" + "---|" * len(lengths)
        lines += [
            f"### {task}: exact match (points; mean over depths and seeds ± {pct} t-interval "
            "over seeds)",
            "",
            "| arm | seeds " + head,
            rule,
        ]
        for a in order:
            seeds = ",".join(str(s) for s in sorted(arms[a]))
            cells = [format_estimate(summaries[a].get(n)) for n in lengths]
            lines.append(f"| {a} | {seeds} | " + " | ".join(cells) + " |")
        lines.append("")
        if len(order) > 1:
            lines += [
                f"### {task}: difference to {reference} (points ± {pct} interval; paired by "
                "seed where both ran two or more of the same seeds, Welch's otherwise)",
                "",
                "| arm | method " + head,
                rule,
            ]
            for a in order[1:]:
                diffs = difference_to_reference(arms[a], arms[reference], task, level)
                methods = sorted({how for _, how in diffs.values() if how})
                cells = [format_estimate(diffs.get(n, (None, ""))[0], signed=True)
                         for n in lengths]  # fmt: skip
                if not methods:
                    # No interval over seeds: where one seed is common, its two checkpoints on
                    # the same trials, labelled as the evaluation's noise only.
                    by_trial = {
                        n: f"{d:+.1f} [{lo:+.1f}, {hi:+.1f}]"
                        for n, (d, lo, hi, how) in _differences(
                            arms[a], arms[reference], task, level
                        ).items()
                        if how == "trials"
                    }
                    if by_trial:
                        (seed,) = set(arms[a]) & set(arms[reference])
                        methods = [f"trials of seed {seed}"]
                        cells = [by_trial.get(n, "–") for n in lengths]
                lines.append(f"| {a} | {'/'.join(methods or ['one seed'])} | "
                             + " | ".join(cells) + " |")  # fmt: skip
            lines.append("")
    if any("trials of seed" in line for line in lines):
        lines += [
            "Rows marked *trials of seed k*: the two runs of that one seed on the same trials "
            f"(points, Newcombe's paired {pct} interval over trials). That is the evaluation's "
            "noise only, not the training run's: it tells whether these two checkpoints differ "
            "on these trials, not whether the two recipes do; that needs seeds.",
            "",
        ]
    return "\n".join(lines)


def depth_markdown(
    arms: Mapping[str, Mapping[int, Mapping]],
    tasks: Optional[Sequence[str]] = None,
    level: float = CONFIDENCE,
) -> str:
    """Markdown tables of a study by needle depth (``arms`` as :func:`read_arm_results`
    returns): per task and arm, a row per depth and a column per length, each cell the share
    of trials exactly right, pooled over the arm's seeds (correct / trials), with Wilson's
    interval at ``level``. Pooling treats every trial as independent, so with several seeds the
    interval leaves the seeds' own spread out (said in the heading); it is for reading where in
    the context an arm fails (e.g. a ``ZONE_DEPTHS`` evaluation near depth 0), not for
    comparing arms (:func:`study_markdown` does that)."""
    if tasks is None:
        tasks = tasks_of([r for seeds in arms.values() for r in seeds.values()])
    pct = f"{100 * level:g}%"
    lines: list[str] = []
    for task in tasks:
        for arm, seeds in arms.items():
            counts: dict[tuple[float, int], list[int]] = {}
            for result in seeds.values():
                for cell in result["tasks"][task]["cells"]:
                    k, n = cell_counts(cell)
                    c = counts.setdefault((float(cell["depth"]), int(cell["length"])), [0, 0])
                    c[0] += k
                    c[1] += n
            depths = sorted({d for d, _ in counts})
            lengths = sorted({n for _, n in counts})
            lines += [
                f"### {task}, {arm} (seeds {', '.join(str(k) for k in sorted(seeds))}): exact "
                f"match by needle depth (trials pooled over seeds, Wilson {pct} interval)",
                "",
                "| depth | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |",
                "|---|" + "---|" * len(lengths),
            ]
            for d in depths:
                cells = []
                for n in lengths:
                    if (d, n) not in counts:
                        cells.append("not run")
                        continue
                    k, t = counts[(d, n)]
                    lo, hi = wilson_interval(k, t, level)
                    cells.append(f"{k / t:.2f} [{lo:.2f}, {hi:.2f}] ({t})")
                lines.append(f"| {d:g} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _differences(
    arm: Mapping[int, Mapping], ref: Mapping[int, Mapping], task: str, level: float
) -> dict[int, tuple[float, Optional[float], Optional[float], str]]:
    """``{length: (mean, low, high, how)}``: an arm's exact match minus the reference's in
    points at each length both have, with its interval over seeds where two or more can be
    compared (``how`` "paired" or "Welch"), else over the one common seed's trials (``how``
    "trials", when the files hold per-trial records of the same trials), else the mean alone
    (``how`` "one seed", no interval)."""
    trials = _one_seed_trials(arm, ref, lambda a, b: paired_trial_difference(a, b, task, level))
    mine, theirs = _per_seed_points(arm, task), _per_seed_points(ref, task)
    return _arm_differences(mine, theirs, trials, level)


def goal_markdown(
    arms: Mapping[str, Mapping[int, Mapping]],
    tokens_per_s: Mapping[str, Mapping[int, float]],
    reference: str = "dense",
    lengths: Sequence[int] = (16384, 32768),
    tasks: Sequence[str] = ("passkey", "multikey"),
    heldout: str = "code-value",
    points: float = 5.0,
    speedup: float = 1.3,
    min_seeds: int = 3,
    level: float = CONFIDENCE,
) -> str:
    """Issue 50's goal per arm, as a markdown table: its exact-match difference to ``reference``
    (points, mean over depths and seeds, with the 95% interval over seeds, or over the one
    common seed's trials, marked) at each of ``lengths`` for ``tasks``; on the ``heldout`` task
    the mean difference over every length evaluated, of exact match and of the right answer's
    log-likelihood (nats; :func:`answer_loglik_means`, graded where exact match sits at 0);
    its training tokens/s over the
    reference's (``tokens_per_s``: ``{arm: {seed: tokens/s}}``, means over seeds); and a
    verdict: with fewer than ``min_seeds`` seeds of either arm *pending* (naming what the means
    so far miss); else *met* when every mean difference is at least ``-points``, the held-out
    task is no worse (mean difference >= 0, or every length's interval holding 0) and the
    speed-up is at least ``speedup`` (the held-out task's log-likelihood, where the files
    record it, by the same rule as its exact match), *not met* naming what fails otherwise.
    The goal is stated on the means; where they meet it but an interval reaches below
    ``-points``, the verdict says so (*met by the means*, naming those cells), since the seeds
    then do not show the arm within ``points`` of the reference, only fail to show it is not.
    Raises ValueError naming the reference when it is not among the arms."""
    if reference not in arms:
        raise ValueError(f"reference arm {reference!r} not among the arms: {', '.join(arms)}")
    ref = arms[reference]
    header = ["arm", "seeds", *(f"{t} {n:,}" for t in tasks for n in lengths)]
    header += [
        f"{heldout} (mean over lengths)",
        f"{heldout} answer log-likelihood (nats, mean over lengths)",
        f"tokens/s vs {reference}",
        "goal",
    ]
    rows = []
    for name, arm in arms.items():
        if name == reference:
            continue
        cells, misses, loose = [], [], []
        for task in tasks:
            diffs = _differences(arm, ref, task, level)
            for n in lengths:
                mean, lo, hi, how = diffs.get(n, (None, None, None, "not run"))
                if mean is None:
                    cells.append("not run")
                    misses.append(f"{task} at {n:,} not run")
                    continue
                text = f"{mean:+.1f}"
                if lo is not None:
                    text += f" [{lo:+.1f}, {hi:+.1f}]" + (" (trials)" if how == "trials" else "")
                cells.append(text)
                if mean < -points - 1e-9:  # -5.0 is within 5 points, rounding aside
                    misses.append(f"{task} at {n:,} {mean:+.1f} points")
                elif lo is not None and lo < -points - 1e-9:
                    loose.append(f"{task} at {n:,} to {lo:+.1f}")
        has_heldout = any(heldout in r["tasks"] for r in arm.values())
        held = list(_differences(arm, ref, heldout, level).values()) if has_heldout else []
        if held:
            mean_held = sum(h[0] for h in held) / len(held)
            no_worse = mean_held >= 0 or all(lo is not None and lo <= 0 <= hi
                                             for _, lo, hi, _ in held)  # fmt: skip
            cells.append(f"{mean_held:+.1f}" + ("" if no_worse else " (worse)"))
            if not no_worse:
                misses.append(f"{heldout} worse ({mean_held:+.1f} points)")
        else:
            cells.append("not run")
            misses.append(f"{heldout} not run")
        # Exact match on the held-out task can sit at 0 for both arms, where it cannot show
        # "worse"; the right answer's log-likelihood on the same trials still can.
        lls = list(_loglik_differences(arm, ref, heldout, level).values()) if has_heldout else []
        if lls:
            mean_ll = sum(h[0] for h in lls) / len(lls)
            ll_ok = mean_ll >= 0 or all(lo is not None and lo <= 0 <= hi for _, lo, hi, _ in lls)
            how = " (trials)" if all(h[3] == "trials" for h in lls) else ""
            cells.append(f"{mean_ll:+.2f}{how}" + ("" if ll_ok else " (worse)"))
            if not ll_ok:
                misses.append(f"{heldout} answer log-likelihood worse ({mean_ll:+.2f} nats)")
        else:
            cells.append("not recorded" if held else "not run")
        mine = [v for v in tokens_per_s.get(name, {}).values()]
        theirs = [v for v in tokens_per_s.get(reference, {}).values()]
        if mine and theirs:
            ratio = (sum(mine) / len(mine)) / (sum(theirs) / len(theirs))
            cells.append(f"{ratio:.2f}x")
            if ratio < speedup:
                misses.append(f"{ratio:.2f}x tokens/s, below {speedup:g}x")
        else:
            cells.append("not measured")
            misses.append("tokens/s not measured")
        seeds = min(len(arm), len(ref))
        if seeds < min_seeds:
            verdict = f"pending: {seeds} of {min_seeds} seeds"
            if misses:
                verdict += "; so far missed: " + "; ".join(misses)
        elif misses:
            verdict = "not met: " + "; ".join(misses)
        elif loose:
            verdict = f"met by the means; intervals reach below -{points:g}: " + "; ".join(loose)
        else:
            verdict = "met"
        rows.append([name, ",".join(str(k) for k in sorted(arm)), *cells, verdict])
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        f"Differences to {reference} in points (exact match, mean over depths and seeds) with "
        f"their {100 * level:g}% interval over seeds, or over the one common seed's trials where "
        f"marked (the evaluation's noise only). {heldout}: exact match in points and the right "
        f"answer's log-likelihood in nats, each the mean over lengths of the differences; no "
        f"worse when that mean is >= 0 or every length's interval holds 0. Goal: every mean "
        f"at least -{points:g} points, {heldout} no worse on both, >= {speedup:g}x tokens/s, "
        f">= {min_seeds} seeds per arm; *met by the means* where an interval still reaches "
        f"below -{points:g} (the seeds do not show the arm within {points:g} points).",
    ]
    return "\n".join(lines)


def study_tokens_per_s(
    results_csv: str | os.PathLike, arms: Mapping[str, Mapping[int, Mapping]]
) -> dict[str, dict[int, float]]:
    """``{arm: {seed: tokens/s}}`` of the finished runs in a sweep's ``results.csv`` (rows
    ``<arm>,seed=<k>``), for the arms and seeds of ``arms`` (:func:`read_arm_results`).
    Raises FileNotFoundError naming the file when it is missing."""
    if not os.path.isfile(results_csv):
        raise FileNotFoundError(f"no {results_csv} (the sweep's results.csv, for the tokens/s)")
    out: dict[str, dict[int, float]] = {}
    with open(results_csv, newline="") as f:
        for row in csv.DictReader(f):
            arm, _, seed = row["point"].rpartition(",seed=")
            if row["status"] == "finished" and seed.isdigit() and int(seed) in arms.get(arm, {}):
                out.setdefault(arm, {})[int(seed)] = float(row["tokens_per_s"])
    return out
