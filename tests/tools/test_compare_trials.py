"""tools/compare_trials.py: two evaluations of the same trials, trial by trial."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_s2.training.evaluation import retrieval_stats as S
from tests.helpers.megatron import run_tool_main

pytestmark = pytest.mark.version_independent
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "compare_trials.py")
# The extended hybrid's committed evaluations, EOD first and plain (the docs' depth-0 table).
_RESULTS = os.path.join(REPO, "docs", "long_context", "results")
COMMITTED_EOD_AND_PLAIN = [
    os.path.join(_RESULTS, study, "hybrid-DS", "seed1", "retrieval.json")
    for study in ("retrieval-125m-extend-32k-eod", "retrieval-125m-extend-32k")
]


def _evaluation(exact, answer=lambda k: f" {k[0]}{k[2]}"):
    """A retrieval.json of task passkey with per-trial records ``exact[(length, depth, i)]``."""
    trials = [{"length": n, "depth": d, "trial": i, "answer": answer((n, d, i)), "key": "",
               "exact": bool(e)} for (n, d, i), e in exact.items()]  # fmt: skip
    return {"tasks": {"passkey": {"cells": [], "trials": trials}}}


def _files(tmp_path, a, b):
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    return [str(pa), str(pb)]


def _run(tmp_path, a, b, *args):
    """The tool's ``main`` on the two evaluations, in this process: its exit code, stdout and
    stderr. The command line itself (``python tools/compare_trials.py``, exit code 2 on bad
    input) runs as a process in test_bad_input_is_refused and on the committed evaluations
    (:func:`tests.helpers.megatron.run_tool_main` says why not every call)."""
    return run_tool_main("compare_trials", [*_files(tmp_path, a, b), *args])


def test_rows_per_length_and_pooled_are_the_paired_counts(tmp_path):
    rng = np.random.default_rng(11)
    keys = [(n, d, i) for n in (1024, 2048) for d in (0.0, 0.5, 1.0) for i in range(15)]
    a = {k: bool(rng.random() < 0.7) for k in keys}
    b = {k: bool(rng.random() < 0.5) for k in keys}
    done = _run(tmp_path, _evaluation(a), _evaluation(b), "--depths", "0")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "### passkey at depths 0"

    def counts(sel):
        return (
            sum(a[k] and b[k] for k in sel),
            sum(a[k] and not b[k] for k in sel),
            sum(b[k] and not a[k] for k in sel),
            sum(not (a[k] or b[k]) for k in sel),
        )

    def row(label, sel):
        c = counts(sel)
        d, lo, hi = S.paired_difference_interval(*c)
        pa, pb = 100 * (c[0] + c[1]) / len(sel), 100 * (c[0] + c[2]) / len(sel)
        return (f"| {label} | {pa:.1f} | {pb:.1f} | {100 * d:+.1f} [{100 * lo:+.1f}, "
                f"{100 * hi:+.1f}] | {len(sel)} |")  # fmt: skip

    zero = [k for k in keys if k[1] == 0.0]
    assert row("1,024", [k for k in zero if k[0] == 1024]) in lines
    assert row("2,048", [k for k in zero if k[0] == 2048]) in lines
    assert row("all lengths", zero) in lines
    # Every depth by default: 45 trials a length.
    everything = _run(tmp_path, _evaluation(a), _evaluation(b)).stdout.splitlines()
    assert row("all lengths", keys) in everything


def test_the_committed_eod_comparison_reproduces_the_docs_pooled_numbers(tmp_path):
    """The docs' depth-0 table: EOD-first minus plain for the extended hybrid, pooled over the
    four lengths: passkey +0.0 [-8.7, +8.7], multikey +8.8 [+2.1, +15.3]."""
    args = [*COMMITTED_EOD_AND_PLAIN, "--depths", "0", "--tasks", "passkey,multikey"]
    done = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pooled = [line for line in done.stdout.splitlines() if line.startswith("| all lengths")]
    assert pooled == ["| all lengths | 41.2 | 41.2 | +0.0 [-8.7, +8.7] | 80 |",
                      "| all lengths | 43.8 | 35.0 | +8.8 [+2.1, +15.3] | 80 |"]  # fmt: skip


def test_bad_input_is_refused(tmp_path):
    keys = [(1024, 0.0, i) for i in range(4)]
    a = _evaluation({k: True for k in keys})
    other = _evaluation({k: True for k in keys}, answer=lambda k: " 99999")
    for args, b, message in [
        ((), other, "not the same trials"),
        (("--tasks", "needle"), a, "--tasks: ['needle'] not in both files; allowed: passkey"),
        (("--depths", "x"), a, "--depths takes numbers separated by commas"),
        (("--depths", "0.5"), a, "no trial of 'passkey' at those depths"),
        (("--decide", "0.5"), a, "no trial of 'passkey' at those depths"),
        (("--decide", "0", "--depths", "0"), a, "--decide compares every depth"),
        (("--decide", "first"), a, "--decide takes numbers separated by commas"),
        (("--decide", ""), a, "--decide takes numbers separated by commas"),
        (
            ("--lengths", "2048"),
            a,
            "lengths [2048] are not in both files' 'passkey' trials; both hold [1024]",
        ),
        (("--lengths", "1024.5"), a, "--lengths takes whole token counts > 0"),
        (("--lengths", "0"), a, "--lengths takes whole token counts > 0"),
        (("--lengths", "inf"), a, "--lengths takes whole token counts > 0"),
        (("--lengths", "nan"), a, "--lengths takes whole token counts > 0"),
        (("--lengths", ""), a, "--lengths takes whole token counts > 0"),
    ]:
        done = _run(tmp_path, a, b, *args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
    # The same through the command line: exit code 2 and the message, no traceback.
    done = subprocess.run([sys.executable, TOOL, *_files(tmp_path, a, other)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "not the same trials" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_decide_applies_the_lever_rule(tmp_path):
    """--decide 0: adopted only when, pooled over the lengths, the result's interval at depth 0
    lies above 0 and at the other depths does not lie below 0; each way it fails is named."""
    keys = [(n, d, i) for n in (1024, 2048) for d in (0.0, 0.5, 1.0) for i in range(40)]
    reference = _evaluation({k: k[1] > 0 and k[2] % 10 > 0 for k in keys})  # 90% beyond 0
    # Better at depth 0 (30 of 80 more right), the same elsewhere: adopted.
    better = _evaluation({k: (k[2] < 15) if k[1] == 0 else (k[2] % 10 > 0) for k in keys})
    done = _run(tmp_path, better, reference, "--decide", "0")
    assert done.returncode == 0, done.stderr
    assert "| passkey | 0 | 37.5 | 0.0 | +37.5 [" in done.stdout, done.stdout
    assert "| passkey | the others | 90.0 | 90.0 | +0.0 [" in done.stdout, done.stdout
    assert done.stdout.rstrip().endswith("adopt: yes")
    # As much better at depth 0 but 28 of 160 fewer right elsewhere: not adopted, and why.
    worse = _evaluation({k: (k[2] < 15) if k[1] == 0 else (k[2] % 10 > 0 and k[2] >= 8)
                         for k in keys})  # fmt: skip
    done = _run(tmp_path, worse, reference, "--decide", "0")
    assert done.stdout.rstrip().endswith(
        "adopt: no (passkey: at the other depths the interval lies below 0)"
    ), done.stdout
    # Every depth aimed at: the second condition has nothing to check, and says so.
    done = _run(tmp_path, better, reference, "--decide", "0,0.5,1")
    assert "| passkey | the others | (no other depths: not checked) |" in done.stdout
    # No better at depth 0: not adopted.
    done = _run(tmp_path, reference, reference, "--decide", "0")
    assert "adopt: no (passkey: at depths 0 the interval does not lie above 0)" in done.stdout


def test_decide_on_the_committed_eod_comparison():
    """EOD-first against plain, the extended hybrid: multikey better at depth 0, passkey not:
    not adopted (docs/long_context_eval.md: position 0 is at most a minor cause)."""
    args = [*COMMITTED_EOD_AND_PLAIN, "--tasks", "passkey,multikey", "--decide", "0"]
    done = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "| multikey | 0 | 43.8 | 35.0 | +8.8 [+2.1, +15.3] | 80 |" in done.stdout
    assert done.stdout.rstrip().endswith(
        "adopt: no (passkey: at depths 0 the interval does not lie above 0)"
    ), done.stdout


def test_lengths_pairs_a_file_evaluated_at_fewer_lengths(tmp_path):
    """--lengths 1024: a base evaluated at 1k only against a run evaluated at 1k and 2k pairs
    the 1k trials (without it the files are refused, naming the common lengths and the
    option); with --depths and --decide too; a length in one file only is refused either way."""
    rng = np.random.default_rng(5)
    both = [(n, d, i) for n in (1024, 2048) for d in (0.0, 0.5) for i in range(20)]
    a = {k: bool(rng.random() < 0.6) for k in both if k[0] == 1024}
    b = {k: bool(rng.random() < 0.6) for k in both}
    refused = _run(tmp_path, _evaluation(a), _evaluation(b))
    assert refused.returncode == 2
    assert "evaluated at different lengths, both at [1024]" in refused.stderr
    assert "--lengths" in refused.stderr

    def row(label, sel):
        c = (sum(a[k] and b[k] for k in sel), sum(a[k] and not b[k] for k in sel),
             sum(b[k] and not a[k] for k in sel), sum(not (a[k] or b[k]) for k in sel))  # fmt: skip
        d, lo, hi = S.paired_difference_interval(*c)
        pa, pb = 100 * (c[0] + c[1]) / len(sel), 100 * (c[0] + c[2]) / len(sel)
        return (f"| {label} | {pa:.1f} | {pb:.1f} | {100 * d:+.1f} [{100 * lo:+.1f}, "
                f"{100 * hi:+.1f}] | {len(sel)} |")  # fmt: skip

    short = [k for k in both if k[0] == 1024]
    done = _run(tmp_path, _evaluation(a), _evaluation(b), "--lengths", "1024")
    assert done.returncode == 0, done.stderr
    assert row("all lengths", short) in done.stdout.splitlines(), done.stdout
    assert "| 2,048 |" not in done.stdout
    # A length given twice is the same selection.
    again = _run(tmp_path, _evaluation(a), _evaluation(b), "--lengths", "1024,1024")
    assert again.stdout == done.stdout
    zero = [k for k in short if k[1] == 0.0]
    done = _run(tmp_path, _evaluation(a), _evaluation(b), "--lengths", "1024", "--depths", "0")
    assert row("all lengths", zero) in done.stdout.splitlines(), done.stdout
    done = _run(tmp_path, _evaluation(a), _evaluation(b), "--lengths", "1024", "--decide", "0")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert row("passkey | 0", zero) in lines, done.stdout
    assert row("passkey | the others", [k for k in short if k[1] == 0.5]) in lines, done.stdout
    # A length the reference holds but the result does not is refused, naming the common ones.
    done = _run(tmp_path, _evaluation(a), _evaluation(b), "--lengths", "1024,2048")
    assert done.returncode == 2
    assert "lengths [2048] are not in both files' 'passkey' trials; both hold [1024]" in (
        done.stderr
    )
