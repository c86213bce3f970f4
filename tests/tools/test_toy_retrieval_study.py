"""tools/toy_retrieval_study.py --table-only: the table of the study's evaluator files (exact
match with its Wilson interval, answer tokens right, log-likelihood per arm, seed, step and
length), computed here independently from random evaluations; and its argument checks. The
training and evaluation it drives are the trainer's and the evaluator's, tested elsewhere."""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.version_independent

TOOL = Path(__file__).resolve().parents[2] / "tools" / "toy_retrieval_study.py"


def _wilson(k, n, z=1.959963984540054):
    # Wilson's score interval, written out (not the project's function).
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def test_table_from_random_evaluations(tmp_path):
    rng = random.Random(3)
    expected = {}
    for arm in ("single", "multi"):
        for seed in (1, 2):
            for step in (150, 300):
                tasks = {}
                for task in ("passkey", "multikey"):
                    cells, by_length = [], []
                    for length in (512, 1024):
                        recs = [
                            {"length": length, "depth": rng.choice((0.0, 0.5, 1.0)),
                             "exact": rng.random() < 0.4, "token_accuracy": rng.random(),
                             "log_likelihood": -rng.uniform(1, 12)}
                            for _ in range(rng.randrange(5, 30))
                        ]  # fmt: skip
                        expected[(task, length, step, arm, seed)] = recs
                        # What the evaluator writes: per-depth cells with their means, and
                        # per-length counts (the committed copies drop the trial records).
                        for depth in sorted({r["depth"] for r in recs}):
                            cell = [r for r in recs if r["depth"] == depth]
                            cells.append(
                                {
                                    "length": length,
                                    "depth": depth,
                                    "trials": len(cell),
                                    "correct": sum(r["exact"] for r in cell),
                                    "token_accuracy": sum(r["token_accuracy"] for r in cell)
                                    / len(cell),
                                    "log_likelihood": sum(r["log_likelihood"] for r in cell)
                                    / len(cell),
                                }
                            )
                        k = sum(r["exact"] for r in recs)
                        by_length.append({"length": length, "correct": k, "trials": len(recs)})
                    tasks[task] = {"cells": cells, "by_length": by_length}
                d = tmp_path / arm / f"seed{seed}" / f"iter_{step:07d}"
                d.mkdir(parents=True)
                (d / "retrieval.json").write_text(
                    json.dumps({"tasks": tasks, "lengths": [512, 1024]})
                )
    r = subprocess.run(
        [sys.executable, str(TOOL), "--table-only", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rows = [line for line in (tmp_path / "table.md").read_text().splitlines()[2:] if line]
    assert len(rows) == len(expected) == 32
    seen = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        task, length, step, arm, seed = cells[0], int(cells[1]), cells[2], cells[3], int(cells[4])
        step = int(step.split()[0])
        recs = expected[(task, length, step, arm, seed)]
        seen.add((task, length, step, arm, seed))
        k, n = sum(r["exact"] for r in recs), len(recs)
        lo, hi = _wilson(k, n)
        m = re.fullmatch(r"(\d+)/(\d+) = (\d+)% \[(\d+), (\d+)\]", cells[5])
        assert m, cells[5]
        assert (int(m[1]), int(m[2])) == (k, n)
        assert int(m[3]) == round(100 * k / n)
        assert abs(int(m[4]) - 100 * lo) <= 0.5 + 1e-9 and abs(int(m[5]) - 100 * hi) <= 0.5 + 1e-9
        assert float(cells[6]) == pytest.approx(
            sum(r["token_accuracy"] for r in recs) / n, abs=5e-3
        )
        assert float(cells[7]) == pytest.approx(
            sum(r["log_likelihood"] for r in recs) / n, abs=5e-3
        )
    assert len(seen) == 32
    # Rows grouped by task and length, steps in order, the single arm before the multi one.
    keys = [tuple(c.strip() for c in row.strip("|").split("|")[:4]) for row in rows]
    assert keys[0][:2] == ("passkey", "512") and keys[-1][:2] == ("multikey", "1024")
    assert keys[0][3] == "single" and keys[2][3] == "multi"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--weight", "1"], "--weight must be in (0, 1)"),
        (["--seeds", ""], "--seeds is empty"),
        (["--iters", "10", "--save-interval", "20"], "--save-interval <= --iters"),
    ],
)
def test_bad_arguments_stop_before_any_work(tmp_path, argv, message):
    r = subprocess.run(
        [sys.executable, str(TOOL), "--work", str(tmp_path / "w"), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and message in r.stderr
    assert not (tmp_path / "w").exists()
