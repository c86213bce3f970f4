"""tools/compare_retrieval.py: the per-length means, the depth table and the position ranges it
prints, computed here independently from random evaluations."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.version_independent

TOOL = Path(__file__).resolve().parents[2] / "tools" / "compare_retrieval.py"
LENGTHS = (1024, 4096)
DEPTHS = (0.0, 0.5, 1.0)


def _run_dir(root: Path, name: str, rng: random.Random) -> tuple[Path, dict]:
    """A run directory with a random retrieval.json and loss_by_position.json."""
    ev = root / name / "long_context_eval"
    ev.mkdir(parents=True)
    cells = [
        {
            "length": n,
            "depth": d,
            "accuracy": rng.randrange(21) / 20,
            "token_accuracy": rng.random(),
            "log_likelihood": -rng.uniform(1, 12),
            "trials": 20,
        }
        for n in LENGTHS
        for d in DEPTHS
    ]
    (ev / "retrieval.json").write_text(json.dumps({"tasks": {"passkey": {"cells": cells}}}))
    bins = [
        {
            "start": i * 1024,
            "end": (i + 1) * 1024,
            "loss": rng.uniform(3, 5),
            "tokens": rng.randint(1, 9),
        }
        for i in range(4)
    ]
    (ev / "loss_by_position.json").write_text(json.dumps({"bins": bins, "loss": 4.0}))
    return root / name, {"cells": cells, "bins": bins}


def _tool(*args):
    return subprocess.run(
        [sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=60
    )


def test_tables_match_independent_means(tmp_path):
    rng = random.Random(7)
    a, da = _run_dir(tmp_path, "dense", rng)
    b, db = _run_dir(tmp_path, "hybrid", rng)
    r = _tool(f"{a}/", f"S2={b / 'long_context_eval' / 'retrieval.json'}", "--depth-table", 4096,
              "--ranges", "0,1024,4096")  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "20 trials" not in r.stdout and "60 trials a length" in r.stdout
    for label, data in (("dense", da), ("S2", db)):
        row = next(x for x in lines if x.startswith(f"| {label} | ") and "%" in x)
        expect = []
        for n in LENGTHS:
            cs = [c for c in data["cells"] if c["length"] == n]
            acc = sum(c["accuracy"] for c in cs) / len(cs)
            ll = sum(c["log_likelihood"] for c in cs) / len(cs)
            expect.append(f"{acc:.0%} ({ll:.1f})")
        assert row == f"| {label} | " + " | ".join(expect) + " |"
        depth_row = next(x for x in lines if x.startswith(f"| {label} | ") and "%" not in x)
        by_depth = {c["depth"]: c["accuracy"] for c in data["cells"] if c["length"] == 4096}
        assert (
            depth_row == f"| {label} | " + " | ".join(f"{by_depth[d]:.2f}" for d in DEPTHS) + " |"
        )
        pos_row = [x for x in lines if x.startswith(f"| {label} | ")][-1]
        first, rest = data["bins"][0], data["bins"][1:4]  # 1k-2k, 2k-3k, 3k-4k
        tail = sum(x["loss"] * x["tokens"] for x in rest) / sum(x["tokens"] for x in rest)
        assert pos_row == f"| {label} | {first['loss']:.3f} | {tail:.3f} | 4.000 |"
    assert "| run | 1k | 4k |" in r.stdout and "| run | 0-1k | 1k-4k | all |" in r.stdout


def test_bad_input_is_named(tmp_path):
    r = _tool(tmp_path / "nowhere")
    assert r.returncode != 0 and "no retrieval.json" in r.stderr
    run, _ = _run_dir(tmp_path, "x", random.Random(0))
    r = _tool(run, "--ranges", "4096,1024")
    assert r.returncode == 2 and "--ranges" in r.stderr
