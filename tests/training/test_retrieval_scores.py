"""Retrieval scores and their intervals, CPU, no trained model: Wilson's interval against
published values and its defining equation, the evaluator's retrieval.json fields (a stand-in
for the model's scores), the report's tables and heatmap, the combination of seeds, and
tools/retrieval_tables.py on synthetic raw results."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import types

import numpy as np
import pytest
from scipy import stats

from megatron_s2.training.evaluation import retrieval as R
from megatron_s2.training.evaluation import retrieval_stats as S
from megatron_s2.training.evaluation.report import plot_retrieval, retrieval_table
from megatron_s2.training.tokenizer import load_tokenizer

pytestmark = pytest.mark.version_independent
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Newcombe (1998), "Two-sided confidence intervals for the single proportion", Statistics in
# Medicine 17:857-872, Table I, method 3 (Wilson's score interval without continuity correction).
NEWCOMBE = [
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0000, 0.1611),
    (1, 29, 0.0061, 0.1718),
]


@pytest.mark.parametrize("k, n, low, high", NEWCOMBE)
def test_wilson_matches_published_values(k, n, low, high):
    lo, hi = S.wilson_interval(k, n)
    assert lo == pytest.approx(low, abs=6e-5) and hi == pytest.approx(high, abs=6e-5)


def test_wilson_solves_its_equation_for_random_counts():
    """The bounds are the roots p of (k/n - p)^2 = z^2 p (1 - p) / n, inside [0, 1], around
    k/n; at 0 or n successes one bound is exactly 0 or 1."""
    rng = random.Random(17)
    for _ in range(200):
        n = rng.randint(1, 500)
        k = rng.randint(0, n)
        level = rng.choice([0.8, 0.9, 0.95, 0.99])
        z = stats.norm.ppf(0.5 + level / 2)
        lo, hi = S.wilson_interval(k, n, level)
        p = k / n
        assert 0.0 <= lo <= p <= hi <= 1.0
        for b in (lo, hi):
            if 0 < b < 1:
                assert (p - b) ** 2 == pytest.approx(z * z * b * (1 - b) / n, rel=1e-9, abs=1e-12)
        if k == 0:
            assert lo == 0.0
        if k == n:
            assert hi == 1.0
    # Narrower with more trials at the same proportion.
    assert np.diff(S.wilson_interval(50, 100))[0] < np.diff(S.wilson_interval(5, 10))[0]


@pytest.mark.parametrize("k, n", [(-1, 5), (6, 5), (0, 0)])
def test_wilson_refuses_impossible_counts(k, n):
    with pytest.raises(ValueError, match="successes <= trials"):
        S.wilson_interval(k, n)


def _fake_model(tok, exact_rows):
    """A stand-in for the evaluator's model: ``score_sequences`` says a row's answer tokens
    are all the argmax when ``exact_rows(row)`` holds, one wrong token otherwise."""
    em = types.SimpleNamespace(tokenizer=tok, cfg=None)
    calls = {"rows": 0}

    def score(_em, batch, micro_batch_size=1):
        rows, width = batch.shape
        correct = np.ones((rows, width - 1), dtype=bool)
        for r in range(rows):
            if not exact_rows(calls["rows"] + r):
                correct[r, -1] = False
        calls["rows"] += rows
        return {
            "greedy": batch[:, 1:],
            "nll": np.full((rows, width - 1), 0.5),
            "correct": correct,
        }

    return em, score


def test_retrieval_json_has_counts_and_wilson_intervals(monkeypatch):
    tok = load_tokenizer("byte")
    docs = [np.asarray(tok.encode("x = 1\n" * 400) + [tok.eod])]
    # Rows in evaluation order: per task, per length, per depth, per trial.
    em, score = _fake_model(tok, lambda row: row % 3 != 1)
    monkeypatch.setattr(R, "score_sequences", score)
    out = R.evaluate_retrieval(
        em, ["passkey", "multikey"], [300, 400], [0.0, 1.0], 6, documents=docs, multikey_needles=3
    )
    assert out["interval"] == {"method": "wilson", "level": 0.95}
    assert out["multikey_needles"] == 3
    row = 0
    for task in ("passkey", "multikey"):
        res = out["tasks"][task]
        for cell in res["cells"]:
            k = sum(1 for i in range(6) if (row + i) % 3 != 1)
            row += 6
            assert (cell["correct"], cell["trials"]) == (k, 6)
            assert cell["accuracy"] == pytest.approx(k / 6)
            assert (cell["ci_low"], cell["ci_high"]) == pytest.approx(S.wilson_interval(k, 6))
        for total in res["by_length"]:
            cells = [c for c in res["cells"] if c["length"] == total["length"]]
            k = sum(c["correct"] for c in cells)
            assert (total["correct"], total["trials"]) == (k, 12)
            assert (total["ci_low"], total["ci_high"]) == pytest.approx(S.wilson_interval(k, 12))
        assert {r["needles"] for r in res["trials"]} == {1 if task == "passkey" else 3}
        assert all(0 <= r["distance"] < r["length"] for r in res["trials"])


def _copying_model(tok, batches):
    """:func:`_fake_model` right on every row (greedy = the prompt shifted by one), keeping each
    batch it scores in ``batches``: a record's greedy answer equals its answer only when the
    evaluator reads the answer from the right positions."""
    em, score = _fake_model(tok, lambda row: True)

    def keeping(_em, batch, micro_batch_size=1):
        batches.append(batch.copy())
        return score(_em, batch, micro_batch_size)

    return em, keeping


@pytest.mark.parametrize("task", ["passkey", "multikey"])
def test_prefix_eod_starts_every_prompt_with_eod_at_the_same_length(monkeypatch, task):
    """--prefix-eod: each prompt is the EOD token then the trial built one token shorter, as
    long as without it; the answer is read at the shifted positions (the copying model's
    greedy answer equals the answer, exact everywhere) and the file records the protocol."""
    tok = load_tokenizer("byte")
    docs = [np.asarray(tok.encode("x = 1\n" * 400) + [tok.eod])]
    lengths, depths, trials = [300, 420], [0.0, 0.5, 1.0], 2
    runs = {}
    for prefix in (False, True):
        batches = []
        em, score = _copying_model(tok, batches)
        monkeypatch.setattr(R, "score_sequences", score)
        out = R.evaluate_retrieval(em, [task], lengths, depths, trials, documents=docs,
                                   multikey_needles=3, prefix_eod=prefix)  # fmt: skip
        assert out["prefix_eod"] is prefix
        runs[prefix] = (out, batches)
        for batch, n in zip(batches, lengths):
            assert batch.shape == (len(depths) * trials, n + 1)  # length + 1: the answer's end
            assert (batch[:, 0] == tok.eod).all() == prefix
            assert (batch[:, 1:] != tok.eod).all()  # one EOD at most, only at the start
        for r in out["tasks"][task]["trials"]:
            assert r["exact"] and r["greedy"] == r["answer"], r
    # With the prefix, the trials are those of one token less, behind the EOD.
    from megatron_s2.training.evaluation.tasks import get_task, haystack_stream, make_trial

    t = get_task(task, 3)
    stream = haystack_stream(t, tok, docs, 2 * max(lengths) + 2)
    out, batches = runs[True]
    for batch, n in zip(batches, lengths):
        expected = [make_trial(t, tok, stream, n - 1, d, i, draw_length=n).tokens
                    for d in depths for i in range(trials)]  # fmt: skip
        np.testing.assert_array_equal(batch[:, 1:], np.stack(expected))
    # Each record's answer is its trial's own (read after the prefix, not one token early).
    truth = [
        tok.decode(x.tokens[x.answer_at :].tolist())
        for n in lengths
        for x in (
            make_trial(t, tok, stream, n - 1, d, i, draw_length=n)
            for d in depths
            for i in range(trials)
        )
    ]
    assert [r["answer"] for r in out["tasks"][task]["trials"]] == truth
    # Paired with the plain protocol: every trial asks the same needle for the same value.
    plain = runs[False][0]["tasks"][task]["trials"]
    assert [(r["key"], r["answer"]) for r in out["tasks"][task]["trials"]] == [
        (r["key"], r["answer"]) for r in plain
    ]


def test_a_study_mixing_prompt_protocols_is_refused(tmp_path):
    """Arms evaluated with and without --prefix-eod are not comparable: the tables refuse."""
    plain, eod = _arm(DENSE), _arm(HYBRID)
    for r in eod.values():
        r["prefix_eod"] = True
    _write_study(tmp_path / "mixed", {"dense": plain, "hybrid-DS": eod})
    with pytest.raises(ValueError, match="mix prompts with and without the EOD prefix"):
        S.read_arm_results(tmp_path / "mixed")
    # Old files without the field read as False: a study of them alone is fine.
    for r in plain.values():
        r["prefix_eod"] = False
    _write_study(tmp_path / "same", {"dense": plain, "hybrid-DS": _arm(HYBRID)})
    assert set(S.read_arm_results(tmp_path / "same")) == {"dense", "hybrid-DS"}


def _result(acc, trials=10, tasks=("passkey",), lengths=(1024, 2048), depths=(0.0, 0.5, 1.0)):
    """A synthetic retrieval.json: ``acc(task, length, depth)`` -> successes out of
    ``trials``; written as the evaluator writes it (no per-trial records)."""
    out = {"tasks": {}, "lengths": list(lengths), "depths": list(depths)}
    for task in tasks:
        cells = []
        for n in lengths:
            for d in depths:
                k = acc(task, n, d)
                lo, hi = S.wilson_interval(k, trials)
                cells.append({"length": n, "depth": d, "accuracy": k / trials, "correct": k,
                              "trials": trials, "ci_low": lo, "ci_high": hi,
                              "token_accuracy": k / trials, "log_likelihood": -1.0})  # fmt: skip
        out["tasks"][task] = {"cells": cells, "trials": []}
    return out


def test_tables_and_heatmap_show_intervals(tmp_path):
    res = _result(lambda t, n, d: int(10 * d) if n == 1024 else 3)
    table = retrieval_table(res, "passkey", "interval")
    lo, hi = S.wilson_interval(5, 10)
    assert f"| 0.5 | 0.50 [{lo:.2f}, {hi:.2f}] |" in table
    lo, hi = S.wilson_interval(15, 30)  # all depths of 1024: 0 + 5 + 10 of 30
    assert f"| all | 0.50 [{lo:.2f}, {hi:.2f}] |" in table
    assert "| all | 0.50 | 0.30 |" in retrieval_table(res, "passkey")
    assert "all" not in retrieval_table(res, "passkey", "log_likelihood")
    # A file written before the interval fields: the same table from accuracy x trials.
    old = json.loads(json.dumps(res))
    for c in old["tasks"]["passkey"]["cells"]:
        for key in ("correct", "ci_low", "ci_high"):
            del c[key]
    assert retrieval_table(old, "passkey", "interval") == table
    png = plot_retrieval(res, "passkey", str(tmp_path / "h.png"))
    assert os.path.getsize(png) > 1000


def _arm(values_by_seed):
    """{seed: retrieval.json} where every depth of a length scores ``values[seed][length]``
    successes of 10 (so the mean over depths is that fraction)."""
    return {
        seed: _result(lambda t, n, d, v=v: v[n]) for seed, v in values_by_seed.items()
    }  # fmt: skip


DENSE = {1: {1024: 9, 2048: 8}, 2: {1024: 10, 2048: 6}, 3: {1024: 8, 2048: 7}}
HYBRID = {1: {1024: 9, 2048: 4}, 2: {1024: 9, 2048: 5}, 3: {1024: 6, 2048: 3}}


def test_seed_summary_and_paired_difference():
    dense, hybrid = _arm(DENSE), _arm(HYBRID)
    summary = S.seed_summary(hybrid, "passkey")
    for n in (1024, 2048):
        vals = [10.0 * HYBRID[s][n] for s in (1, 2, 3)]
        mean, sd = np.mean(vals), np.std(vals, ddof=1)
        assert summary[n].mean == pytest.approx(mean)
        assert summary[n].half_width == pytest.approx(stats.t.ppf(0.975, 2) * sd / math.sqrt(3))
        assert summary[n].n == 3
    diff = S.difference_to_reference(hybrid, dense, "passkey")
    for n in (1024, 2048):
        d = [10.0 * (HYBRID[s][n] - DENSE[s][n]) for s in (1, 2, 3)]
        est, how = diff[n]
        assert how == "paired"
        assert est.mean == pytest.approx(np.mean(d))
        assert est.half_width == pytest.approx(
            stats.t.ppf(0.975, 2) * np.std(d, ddof=1) / math.sqrt(3)
        )
    # Different seeds: Welch's interval; one seed: no interval.
    shifted = {s + 10: r for s, r in hybrid.items()}
    assert S.difference_to_reference(shifted, dense, "passkey")[2048][1] == "Welch"
    one = S.seed_summary({1: hybrid[1]}, "passkey")
    assert one[2048].half_width is None and one[2048].mean == pytest.approx(40.0)
    with pytest.raises(KeyError, match="task 'multikey' not in this retrieval.json"):
        S.seed_summary(hybrid, "multikey")


def _write_study(root, arms):
    for arm, seeds in arms.items():
        for seed, res in seeds.items():
            d = root / arm / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "retrieval.json").write_text(json.dumps(res))


def _wilson_by_hand(k, n, level=0.95):
    """Wilson's score interval written out from its formula (the test's own reference)."""
    z = stats.norm.ppf(0.5 + level / 2)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def test_retrieval_tables_by_depth_pools_each_arms_seeds(tmp_path):
    """--by-depth (the zone evaluation's view): per task and arm, a row per depth and a column
    per length, the cell's trials pooled over the arm's seeds with Wilson's interval; no
    reference arm needed (a zone study holds the dense twin alone); refused beside --goal."""
    depths = (0.0, 0.002, 0.01)

    def seed_result(seed):
        return _result(lambda t, n, d: {0.0: 2 + seed, 0.002: 6, 0.01: 9}[d] - (n == 2048),
                       depths=depths)  # fmt: skip

    study = tmp_path / "zone"
    _write_study(study, {"dense": {1: seed_result(1), 2: seed_result(2)}})
    tool = os.path.join(REPO, "tools", "retrieval_tables.py")
    proc = subprocess.run([sys.executable, tool, str(study), "--by-depth"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("### passkey, dense (seeds 1, 2): exact match by needle depth")
    assert "| depth | 1,024 tokens | 2,048 tokens |" in lines
    # depth 0 at 1,024 tokens: 3 + 4 of 20 pooled; at 2,048: 2 + 3 of 20
    for d, (k1, k2) in {0.0: (7, 5), 0.002: (12, 10), 0.01: (18, 16)}.items():
        cells = []
        for k in (k1, k2):
            lo, hi = _wilson_by_hand(k, 20)
            cells.append(f"{k / 20:.2f} [{lo:.2f}, {hi:.2f}] (20)")
        assert f"| {d:g} | {cells[0]} | {cells[1]} |" in lines, d
    both = subprocess.run([sys.executable, tool, str(study), "--by-depth", "--goal"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert both.returncode == 2 and "two views" in both.stderr


def test_retrieval_tables_script_recomputes_the_table(tmp_path):
    study = tmp_path / "study"
    _write_study(study, {"dense": _arm(DENSE), "hybrid-DS": _arm(HYBRID)})
    (study / "notes.md").write_text("not an arm")
    tool = os.path.join(REPO, "tools", "retrieval_tables.py")
    out_md = tmp_path / "t.md"
    proc = subprocess.run([sys.executable, tool, str(study), "--output", str(out_md)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert out_md.read_text().strip() == text.strip()

    # dense first, then the arm; means over seeds with their t half-widths, in points.
    def hw(values):
        return stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(3)

    dense = f"| dense | 1,2,3 | 90.0 ± {hw([90, 100, 80]):.1f} | 70.0 ± {hw([80, 60, 70]):.1f} |"
    assert dense in text.splitlines()
    assert text.index(dense) < text.index("| hybrid-DS |")
    rows = [line for line in text.splitlines() if line.startswith("| hybrid-DS |")]
    assert len(rows) == 2  # its scores, and its difference to dense
    d1024 = [0.0, -10.0, -20.0]
    hw1024 = stats.t.ppf(0.975, 2) * np.std(d1024, ddof=1) / math.sqrt(3)
    d2048 = [-40.0, -10.0, -40.0]
    hw2048 = stats.t.ppf(0.975, 2) * np.std(d2048, ddof=1) / math.sqrt(3)
    assert rows[1] == f"| hybrid-DS | paired | -10.0 ± {hw1024:.1f} | -30.0 ± {hw2048:.1f} |"
    # Bad input: a missing reference arm or task, a directory without results.
    for args, message in [
        (["--reference", "dense2"], "--reference: 'dense2' is not an arm"),
        (["--tasks", "multikey"], "--tasks: ['multikey'] not in every file; allowed: passkey"),
    ]:
        proc = subprocess.run([sys.executable, tool, str(study), *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, tool, str(tmp_path / "t.md").replace("t.md", "")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "no <arm>/seed<k>/retrieval.json" in proc.stderr


def test_retrieval_tables_seeds_selects_the_seeds_that_ran_a_later_task(tmp_path):
    """A task evaluated from seed 2 on (the long base's needle): the default tables hold only
    the tasks every file has, --tasks naming it says which files lack it and points at
    --seeds, and --seeds 2,3 gives its table over those seeds alone (means and t-intervals over
    exactly those seeds, the paired difference too); bad --seeds values are refused by name."""

    def arm(values):
        out = {}
        for seed, v in values.items():
            tasks = ("passkey",) if seed == 1 else ("passkey", "needle")
            out[seed] = _result(lambda t, n, d, v=v: v[n] - (t == "needle"), tasks=tasks)
        return out

    study = tmp_path / "study"
    _write_study(study, {"dense": arm(DENSE), "hybrid-DS": arm(HYBRID)})
    tool = os.path.join(REPO, "tools", "retrieval_tables.py")

    def run(*args):
        return subprocess.run([sys.executable, tool, str(study), *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    plain = run()
    assert plain.returncode == 0 and "### needle" not in plain.stdout, plain.stderr
    asked = run("--tasks", "needle")
    assert asked.returncode == 2
    assert "needle missing in dense/seed1, hybrid-DS/seed1" in asked.stderr, asked.stderr
    assert "--seeds selects the seeds that ran it" in asked.stderr
    kept = run("--seeds", "2,3", "--tasks", "needle")
    assert kept.returncode == 0, kept.stderr
    lines = kept.stdout.splitlines()
    assert lines[0].startswith("### needle") and "### passkey" not in kept.stdout

    def hw(values):
        return stats.t.ppf(0.975, 1) * np.std(values, ddof=1) / math.sqrt(2)

    # needle scores one success fewer than passkey in every cell: (v - 1) / 10 of seeds 2 and 3
    d1024, d2048 = [90.0, 70.0], [50.0, 60.0]
    dense = f"| dense | 2,3 | 80.0 ± {hw(d1024):.1f} | 55.0 ± {hw(d2048):.1f} |"
    assert dense in lines, kept.stdout
    diff = [10.0 * (HYBRID[s][1024] - DENSE[s][1024]) for s in (2, 3)]
    diff2 = [10.0 * (HYBRID[s][2048] - DENSE[s][2048]) for s in (2, 3)]
    row = (f"| hybrid-DS | paired | {np.mean(diff):+.1f} ± {hw(diff):.1f} | "
           f"{np.mean(diff2):+.1f} ± {hw(diff2):.1f} |")  # fmt: skip
    assert row in lines, kept.stdout
    for seeds, message in [
        ("x", "--seeds: a comma list of integers, got 'x'"),
        ("2,9", "--seeds: [9] not run by any arm"),
    ]:
        bad = run("--seeds", seeds)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    # An arm that ran none of the seeds is left out, and says so; the reference may not be.
    _write_study(tmp_path / "study", {"hybrid-SSSD": {3: arm(HYBRID)[3]}})
    fewer = run("--seeds", "1,2")
    assert fewer.returncode == 0, fewer.stderr
    assert "left out hybrid-SSSD (none of those seeds)" in fewer.stderr
    assert "| hybrid-SSSD |" not in fewer.stdout and "| hybrid-DS |" in fewer.stdout
    no_ref = run("--seeds", "3", "--reference", "hybrid-SSSD")
    assert no_ref.returncode == 0, no_ref.stderr
    alone = run("--seeds", "1", "--reference", "hybrid-SSSD")
    assert alone.returncode == 2
    assert "leaves the reference arm hybrid-SSSD without seeds" in alone.stderr
    # --by-depth compares no arms: no reference to keep.
    by_depth = run("--seeds", "1", "--reference", "hybrid-SSSD", "--by-depth")
    assert by_depth.returncode == 0 and "left out hybrid-SSSD" in by_depth.stderr, by_depth.stderr


def test_evaluator_refuses_bad_multikey_needles(capsys):
    """--multikey-needles is checked with the grid, before any model is loaded."""
    from megatron_s2.training.evaluation.long_context import main

    demo = os.path.join(REPO, "configs", "demo.yaml")
    base = ["--config", demo, "--lengths", "128", "--tasks", "passkey,multikey"]
    for bad in ("1", "17"):
        assert main(base + ["--multikey-needles", bad]) == 2
        err = capsys.readouterr().err
        assert "--multikey-needles must be an integer from 2 to 16" in err, err
    assert main(base[:-1] + ["passkey,code-values"]) == 2
    assert "--tasks: unknown ['code-values']" in capsys.readouterr().err


def test_paired_difference_matches_published_value():
    """Fagerland, Lydersen & Laake (2017), Statistical Analysis of Contingency Tables, ch. 8:
    the Cavo et al. (2012) paired table 59 / 6 / 16 / 80, Newcombe's square-and-add interval
    -0.0621 (-0.1186 to -0.0046)."""
    d, lo, hi = S.paired_difference_interval(59, 6, 16, 80)
    assert d == pytest.approx(-0.0621, abs=6e-5)
    assert lo == pytest.approx(-0.1186, abs=6e-5) and hi == pytest.approx(-0.0046, abs=6e-5)
    # Swapping the two models negates the interval.
    d2, lo2, hi2 = S.paired_difference_interval(59, 16, 6, 80)
    assert (d2, lo2, hi2) == pytest.approx((-d, -hi, -lo))


def test_paired_difference_covers_the_true_difference():
    """Over simulated paired outcomes (100 trials, correlated models) the 95% interval holds
    the true difference in 93-97.5% of draws, and it is narrower than the unpaired one when the
    two models fail on the same trials."""
    rng = np.random.default_rng(5)
    for probs in [(0.7, 0.1, 0.05, 0.15), (0.5, 0.2, 0.2, 0.1), (0.85, 0.03, 0.07, 0.05)]:
        true = probs[1] - probs[2]
        hits = 0
        for _ in range(2000):
            lo, hi = S.paired_difference_interval(*rng.multinomial(100, probs))[1:]
            assert -1.0 <= lo <= hi <= 1.0
            hits += lo <= true <= hi
        assert 0.93 <= hits / 2000 <= 0.975, (probs, hits / 2000)
    # Same rates (80% and 75%), outcomes strongly shared vs independent.
    lo, hi = S.paired_difference_interval(75, 5, 0, 20)[1:]
    lo_ind, hi_ind = S.paired_difference_interval(60, 20, 15, 5)[1:]
    assert hi - lo < 0.6 * (hi_ind - lo_ind)
    # Two models right and wrong on exactly the same trials: no difference, still an interval.
    d, lo, hi = S.paired_difference_interval(70, 0, 0, 30)
    assert d == 0.0 and lo < 0.0 < hi
    with pytest.raises(ValueError, match="counts >= 0 and at least one trial"):
        S.paired_difference_interval(0, 0, 0, 0)
    with pytest.raises(ValueError, match="counts >= 0"):
        S.paired_difference_interval(5, -1, 0, 3)


def _with_trials(exact_by_key, answers=None, task="passkey"):
    """A retrieval.json with per-trial records: ``exact_by_key[(length, depth, trial)]``."""
    answers = answers or {}
    trials = [
        {"length": n, "depth": d, "trial": i, "answer": answers.get((n, d, i), f" {n}{i}"),
         "key": "", "exact": bool(e)}
        for (n, d, i), e in exact_by_key.items()
    ]  # fmt: skip
    cells = []
    for n, d in sorted({(n, d) for n, d, _ in exact_by_key}):
        k = sum(e for (m, dd, _), e in exact_by_key.items() if (m, dd) == (n, d))
        t = sum(1 for (m, dd, _) in exact_by_key if (m, dd) == (n, d))
        cells.append({"length": n, "depth": d, "accuracy": k / t, "correct": k, "trials": t})
    return {"tasks": {task: {"cells": cells, "trials": trials}}}


def test_paired_trial_difference_counts_the_same_trials():
    rng = np.random.default_rng(3)
    keys = [(n, d, i) for n in (1024, 2048) for d in (0.0, 1.0) for i in range(25)]
    a = {k: bool(rng.random() < 0.8) for k in keys}
    b = {k: bool(rng.random() < 0.6) for k in keys}
    got = S.paired_trial_difference(_with_trials(a), _with_trials(b), "passkey")
    for n in (1024, 2048):
        mine = [k for k in keys if k[0] == n]
        counts = [
            sum(a[k] and b[k] for k in mine),
            sum(a[k] and not b[k] for k in mine),
            sum(b[k] and not a[k] for k in mine),
            sum(not a[k] and not b[k] for k in mine),
        ]
        want = S.paired_difference_interval(*counts)
        assert got[n] == pytest.approx((*(100 * v for v in want), 50))
    # One depth only.
    only0 = S.paired_trial_difference(_with_trials(a), _with_trials(b), "passkey", depths=[0.0])
    assert only0[1024][3] == 25
    # Not the same trials: refused, naming the trial.
    other = {k: " 99999" for k in keys[:1]}
    with pytest.raises(ValueError, match=r"trial \(1024, 0.0, 0\) of 'passkey' asks"):
        S.paired_trial_difference(_with_trials(a, other), _with_trials(b), "passkey")
    with pytest.raises(ValueError, match="hold different trials"):
        S.paired_trial_difference(
            _with_trials(dict(list(a.items())[:-1])), _with_trials(b), "passkey"
        )
    with pytest.raises(ValueError, match="no per-trial records"):
        S.paired_trial_difference(_result(lambda t, n, d: 5), _with_trials(b), "passkey")


def test_one_seed_study_shows_the_trial_level_difference():
    """With one common seed the difference row is the two checkpoints on the same trials,
    labelled as such; files without per-trial records keep the plain "one seed" row."""
    keys = [(1024, d, i) for d in (0.0, 1.0) for i in range(20)]
    dense = {k: k[2] < 18 for k in keys}  # 36 of 40
    hybrid = {k: k[2] < 12 for k in keys}  # 24 of 40, all inside dense's successes
    text = S.study_markdown(
        {"dense": {1: _with_trials(dense)}, "hybrid-DS": {1: _with_trials(hybrid)}}
    )
    d, lo, hi = S.paired_difference_interval(24, 0, 12, 4)
    row = f"| hybrid-DS | trials of seed 1 | {100 * d:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] |"
    assert row in text.splitlines(), text
    assert "the evaluation's noise only" in text
    plain = S.study_markdown({"dense": {1: _result(lambda t, n, d: 9)},
                              "hybrid-DS": {1: _result(lambda t, n, d: 6)}})  # fmt: skip
    assert "| hybrid-DS | one seed | – | – |" in plain and "noise only" not in plain


GOAL_LENGTHS = (16384, 32768)
GOAL_TASKS = ("passkey", "multikey", "code-value")


def _goal_arm(successes):
    """{seed: retrieval.json}: ``successes[seed][task]`` of 10 at every length and depth (a
    task missing from the dict: 0)."""
    return {
        seed: _result(lambda t, n, d, v=v: v.get(t, 0), tasks=GOAL_TASKS, lengths=GOAL_LENGTHS)
        for seed, v in successes.items()
    }


def test_goal_table_verdicts():
    """Issue 50's goal per arm: met within 5 points on every task and length with 3 seeds and
    the speed-up; met by the means only where an interval reaches below -5 (the cells named);
    not met naming the miss (a mean below -5, a worse held-out task, too slow); pending with
    fewer seeds, naming what the means miss so far."""
    dense = _goal_arm({s: {"passkey": 9, "multikey": 8, "code-value": 2} for s in (1, 2, 3)})
    close = _goal_arm({1: {"passkey": 9, "multikey": 8, "code-value": 2},
                       2: {"passkey": 8, "multikey": 8, "code-value": 2},
                       3: {"passkey": 9, "multikey": 7, "code-value": 3}})  # fmt: skip
    far = _goal_arm({s: {"passkey": 8, "multikey": 7, "code-value": 2} for s in (1, 2, 3)})
    far[3] = _goal_arm({3: {"passkey": 7, "multikey": 8, "code-value": 2}})[3]  # passkey -13.3
    worse = _goal_arm({s: {"passkey": 9, "multikey": 8, "code-value": 0} for s in (1, 2, 3)})
    young = _goal_arm({1: {"passkey": 8, "multikey": 8, "code-value": 2}})
    tight = _goal_arm({1: {"passkey": 9, "multikey": 8, "code-value": 2},
                       2: {"passkey": 9, "multikey": 8, "code-value": 2},
                       3: {"passkey": 9, "multikey": 8, "code-value": 2}})  # fmt: skip
    arms = {"dense": dense, "close": close, "far": far, "worse": worse, "young": young,
            "tight": tight}  # fmt: skip
    speed = {a: {s: 100.0 for s in arms[a]} for a in arms}
    speed["dense"] = {s: 70.0 for s in (1, 2, 3)}
    slow = dict(speed, close={s: 80.0 for s in (1, 2, 3)})
    text = S.goal_markdown(arms, speed)
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    # close's passkey: -0, -10, -0 points by seed -> mean -3.3 with the t-interval over seeds,
    # which reaches below -5: met by the means only, the cells named with their lower ends.
    d = [0.0, -10.0, 0.0]
    hw = stats.t.ppf(0.975, 2) * np.std(d, ddof=1) / math.sqrt(3)
    assert f"| -3.3 [{-10 / 3 - hw:+.1f}, {-10 / 3 + hw:+.1f}] |" in rows["close"]
    assert rows["close"].endswith(
        f"| 1.43x | met by the means; intervals reach below -5: passkey at 16,384 to "
        f"{-10 / 3 - hw:+.1f}; passkey at 32,768 to {-10 / 3 - hw:+.1f}; multikey at 16,384 to "
        f"{-10 / 3 - hw:+.1f}; multikey at 32,768 to {-10 / 3 - hw:+.1f} |"
    ), rows["close"]
    # tight: the reference's own counts at every seed -> every interval [0, 0], above -5: met.
    assert rows["tight"].endswith("| 1.43x | met |"), rows["tight"]
    assert "not met: passkey at 16,384 -13.3 points; passkey at 32,768 -13.3 points" in rows["far"]
    assert "not met: code-value worse (-20.0 points)" in rows["worse"]
    assert rows["young"].endswith("| pending: 1 of 3 seeds; so far missed: passkey at 16,384 "
                                  "-10.0 points; passkey at 32,768 -10.0 points |")  # fmt: skip
    assert "(trials)" not in rows["young"]  # no per-trial records in these files: mean alone
    assert "not met: 1.14x tokens/s, below 1.3x" in S.goal_markdown(arms, slow)
    with pytest.raises(ValueError, match="reference arm 'twin' not among the arms"):
        S.goal_markdown(arms, speed, reference="twin")


def test_goal_table_from_the_committed_study(tmp_path):
    """retrieval_tables.py --goal on the committed recipe study: one seed per arm, the
    trial-level differences, the measured speed-up, pending; without results.csv, refused."""
    tool = os.path.join(REPO, "tools", "retrieval_tables.py")
    study = os.path.join(REPO, "docs", "long_context", "results", "retrieval-125m-extend-32k")
    proc = subprocess.run([sys.executable, tool, study, "--goal"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("| hybrid-DS |")]
    assert "| -5.0 [-12.8, +2.8] (trials) |" in row and "| 1.33x |" in row
    assert row.endswith("| pending: 1 of 3 seeds |")
    import shutil

    bare = tmp_path / "study"
    shutil.copytree(study, bare, ignore=shutil.ignore_patterns("results.csv"))
    proc = subprocess.run([sys.executable, tool, str(bare), "--goal"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "no " in proc.stderr and "results.csv" in proc.stderr


def test_goal_speed_up_against_another_studys_reference(tmp_path):
    """--speed-reference: the reference arm's tokens/s come from another study's results.csv
    (its runs of the reference's seeds), the arm's from this study's, and the table says so;
    a reference seed the other study lacks, or the option without --goal, is refused."""
    import csv
    import shutil

    tool = os.path.join(REPO, "tools", "retrieval_tables.py")
    study = os.path.join(
        REPO, "docs", "long_context", "results", "retrieval-125m-extend-32k-longbase"
    )
    arm = "dense-to-hybrid-DSDSDSDSSSDD"
    with open(os.path.join(study, "results.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    fast = tmp_path / "fast"
    fast.mkdir()
    scale = 1.1 + 0.2 * np.random.default_rng(7).random()  # the other study's twin is faster
    theirs, mine = [], []
    for r in rows:
        name, _, seed = r["point"].rpartition(",seed=")
        if r["status"] != "finished":
            continue
        if name == "dense":
            r["tokens_per_s"] = repr(float(r["tokens_per_s"]) * scale)
            theirs.append(float(r["tokens_per_s"]))
        elif name == arm:
            mine.append(float(r["tokens_per_s"]))
    with open(fast / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)

    def run(*args):
        return subprocess.run([sys.executable, tool, study, *map(str, args)],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    proc = run("--goal", "--speed-reference", fast)
    assert proc.returncode == 0, proc.stderr
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith(f"| {arm} |")]
    ratio = (sum(mine) / len(mine)) / (sum(theirs) / len(theirs))
    assert len(mine) == len(theirs) == 3
    assert f"| {ratio:.2f}x |" in row
    assert f"dense's tokens/s from {fast / 'results.csv'} (seeds 1, 2, 3)" in proc.stdout
    own = run("--goal")
    assert own.returncode == 0 and f"| {ratio * scale:.2f}x |" in own.stdout
    # A reference seed the other study has not run.
    with open(fast / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(r for r in rows if r["point"] != "dense,seed=2")
    proc = run("--goal", "--speed-reference", fast)
    assert proc.returncode == 2 and "no finished run of 'dense' with seed(s) 2" in proc.stderr
    proc = run("--speed-reference", fast)
    assert proc.returncode == 2 and "--speed-reference goes with --goal" in proc.stderr
    shutil.rmtree(fast)
    proc = run("--goal", "--speed-reference", fast)
    assert proc.returncode == 2 and "results.csv" in proc.stderr


def _ll_result(logliks, exact=lambda k: False, answer=lambda k: f" {k[2]:05d}"):
    """A retrieval.json whose task code-value holds per-trial records ``logliks[(length,
    depth, trial)]`` (nats) and an exact-match cell per (length, depth)."""
    trials = [{"length": n, "depth": d, "trial": i, "answer": answer((n, d, i)), "key": "K",
               "log_likelihood": ll, "exact": bool(exact((n, d, i)))}
              for (n, d, i), ll in logliks.items()]  # fmt: skip
    cells = {}
    for t in trials:
        c = cells.setdefault(
            (t["length"], t["depth"]), {"length": t["length"], "depth": t["depth"], "n": 0, "k": 0}
        )
        c["n"] += 1
        c["k"] += t["exact"]
    cells = [{"length": c["length"], "depth": c["depth"], "trials": c["n"], "correct": c["k"],
              "accuracy": c["k"] / c["n"]} for c in cells.values()]  # fmt: skip
    return {"tasks": {"code-value": {"cells": cells, "trials": trials}}}


def test_answer_loglik_difference_is_the_paired_t_interval_over_trials():
    """paired_loglik_difference against scipy's paired t-test interval on fresh random
    log-likelihoods, per length; answer_loglik_means is each length's plain mean."""
    rng = np.random.default_rng(3)
    keys = [(n, d, i) for n in (1024, 4096, 8192) for d in (0.0, 0.5, 1.0) for i in range(17)]
    a = {k: float(rng.normal(-18, 3)) for k in keys}
    b = {k: a[k] + float(rng.normal(-0.7 if k[0] == 4096 else 0.3, 1.5)) for k in keys}
    ra, rb = _ll_result(a), _ll_result(b)
    means = S.answer_loglik_means(ra, "code-value")
    diff = S.paired_loglik_difference(rb, ra, "code-value")
    assert sorted(means) == sorted(diff) == [1024, 4096, 8192]
    for n in (1024, 4096, 8192):
        sel = [k for k in keys if k[0] == n]
        assert means[n] == pytest.approx(np.mean([a[k] for k in sel]))
        ci = stats.ttest_rel([b[k] for k in sel], [a[k] for k in sel]).confidence_interval(0.95)
        d, lo, hi, trials = diff[n]
        assert trials == len(sel) == 51
        assert d == pytest.approx(np.mean([b[k] - a[k] for k in sel]))
        assert (lo, hi) == (pytest.approx(ci.low), pytest.approx(ci.high))
    # Other trials, or files without log-likelihoods, are refused.
    other = _ll_result(a, answer=lambda k: " 99999")
    with pytest.raises(ValueError, match="different 'code-value' trials"):
        S.paired_loglik_difference(other, ra, "code-value")
    bare = json.loads(json.dumps(ra))
    for t in bare["tasks"]["code-value"]["trials"]:
        del t["log_likelihood"]
    with pytest.raises(ValueError, match="no per-trial answer log-likelihoods"):
        S.answer_loglik_means(bare, "code-value")


def test_goal_judges_the_held_out_task_by_its_answer_log_likelihood_too():
    """Exact match at 0 in both arms cannot show "worse"; the right answer's log-likelihood on
    the same trials can: over three seeds, paired by seed; with one common seed, over its trials
    (marked); a file without log-likelihoods says so and is judged on exact match alone."""
    keys = [(n, d, i) for n in GOAL_LENGTHS for d in (0.0, 1.0) for i in range(10)]

    def arm(shift_by_seed):
        out = {}
        for seed, shift in shift_by_seed.items():
            base = {k: -18.0 + 0.1 * seed + 0.01 * k[2] for k in keys}
            out[seed] = _ll_result({k: v + shift for k, v in base.items()})
            # passkey and multikey as dense's, so that only code-value can miss
            for task in ("passkey", "multikey"):
                out[seed]["tasks"][task] = _goal_arm({1: {task: 9}})[1]["tasks"][task]
        return out

    dense = arm({1: 0.0, 2: 0.0, 3: 0.0})
    same = arm({1: 0.1, 2: -0.1, 3: 0.05})
    lower = arm({1: -1.0, 2: -1.2, 3: -0.9})
    one = arm({1: -1.0})
    arms = {"dense": dense, "same": same, "lower": lower, "one": one}
    speed = {a: {s: 140.0 for s in arms[a]} for a in arms}
    speed["dense"] = {s: 100.0 for s in (1, 2, 3)}
    rows = {line.split(" | ")[0][2:]: line for line in S.goal_markdown(arms, speed).splitlines()
            if line.startswith("| ")}  # fmt: skip
    assert rows["same"].endswith("| +0.0 | +0.02 | 1.40x | met |"), rows["same"]
    assert (
        "| +0.0 | -1.03 (worse) | 1.40x | not met: code-value answer log-likelihood worse "
        "(-1.03 nats) |" in rows["lower"]
    ), rows["lower"]
    assert "| -1.00 (trials) (worse) |" in rows["one"], rows["one"]
    # Without per-trial log-likelihoods: "not recorded", exact match alone decides.
    for seeds in (dense, lower):
        for r in seeds.values():
            for t in r["tasks"]["code-value"]["trials"]:
                del t["log_likelihood"]
    rows = {line.split(" | ")[0][2:]: line for line in S.goal_markdown(arms, speed).splitlines()
            if line.startswith("| ")}  # fmt: skip
    assert rows["lower"].endswith("| +0.0 | not recorded | 1.40x | met |"), rows["lower"]
