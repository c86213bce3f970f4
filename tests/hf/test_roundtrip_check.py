"""tools/hf_roundtrip_check.py: issue 52's acceptance flow (build a random Llama, import it with
half the layers S2, train, export, compare transformers' logits with ours) end to end on the
CPU with the tiny shape; its verdict logic and its failure reports on made-up inputs."""

from __future__ import annotations

import json
import math
import shlex
import sys

import pytest

from tests.helpers.megatron import import_tool

pytest.importorskip("transformers")

tool = import_tool("hf_roundtrip_check")


def _stats(mean: float, tail: float, top1: float = 1.0, std: float = 1.0) -> dict:
    return {
        "mean_abs_diff": mean,
        "mean_abs_diff_over_std": mean / std,
        "ours_std": std,
        "top1_agreement": top1,
        "tail_mean_abs_diff": tail,
    }


TOL = tool.TOLERANCES["bfloat16"]
NOISE = _stats(0.01, 0.012, top1=0.95)  # the dense pair: rounding noise, near-ties flipped


def test_judge_passes_an_s2_load_within_the_noise_that_dense_attention_would_not_match():
    ok, failures, checks = tool.judge(_stats(0.015, 0.015, 0.95), NOISE, _stats(0.2, 0.3), TOL)
    assert ok and not failures, failures
    assert checks["dense_over_s2_tail_ratio"] == pytest.approx(20)
    assert checks["s2_allowed_mean_abs_diff"] == pytest.approx(0.02)


@pytest.mark.parametrize(
    "s2, pair, dense, words",
    [
        # Within the noise, but dense attention is as close: S2 and dense cannot be told apart.
        (_stats(0.01, 0.01), NOISE, _stats(0.012, 0.012), "cannot tell S2 from dense"),
        # Within the fixed cap, but 3x the implementations' rounding noise.
        (_stats(0.03, 0.03), NOISE, _stats(1.0, 1.0), "the dense pair's"),
        # Beyond the fixed cap, even where the noise floor is as large.
        (_stats(0.06, 0.06), _stats(0.05, 0.05), _stats(1.0, 1.0), "> tolerance"),
        # Close on average, but the top-1 tokens differ more often than rounding explains.
        (_stats(0.01, 0.01, top1=0.9), NOISE, _stats(1.0, 1.0), "top-1 agreement"),
    ],
)
def test_judge_fails(s2, pair, dense, words):
    ok, failures, _ = tool.judge(s2, pair, dense, TOL)
    assert not ok
    assert any(words in f for f in failures), failures


def test_judge_exact_match_reports_no_infinite_ratio():
    exact = _stats(0.0, 0.0)
    fp32 = tool.TOLERANCES["float32"]
    ok, _, checks = tool.judge(exact, exact, _stats(0.1, 0.1), fp32)
    assert ok and checks["dense_over_s2_tail_ratio"] is None
    json.dumps(checks, allow_nan=False)  # strict JSON
    ok, failures, _ = tool.judge(exact, exact, exact, fp32)
    assert not ok and "cannot tell S2 from dense" in failures[0]


def test_a_failing_step_is_reported_with_its_command_and_output(tmp_path):
    settings = {"device": "cpu"}
    out = tmp_path / "report.json"
    check = tool.Check(str(out), str(tmp_path), settings, time_limit=60)
    boom = "import sys; print('some output'); sys.stderr.write('boom: bad thing'); sys.exit(3)"
    record = check.run("import", [sys.executable, "-c", boom])
    assert check.failed and record["ok"] is False
    report = json.loads(out.read_text())
    assert report["verdict"] == "FAIL" and report["failed_step"] == "import"
    assert "exit code 3" in report["reason"]
    step = report["steps"]["import"]
    assert "boom: bad thing" in step["stderr_tail"] and "some output" in step["stdout_tail"]
    # The command as a shell would take it back (copied from the report, it runs as it ran).
    assert shlex.split(step["command"]) == [sys.executable, "-c", boom]
    assert step["wall_s"] >= 0


def test_a_step_past_the_time_limit_fails(tmp_path):
    out = tmp_path / "report.json"
    check = tool.Check(str(out), str(tmp_path), {"device": "cpu"}, time_limit=1)
    check.run("train", [sys.executable, "-c", "import time; time.sleep(30)"])
    report = json.loads(out.read_text())
    assert report["verdict"] == "FAIL" and "timed out" in report["reason"]


@pytest.mark.parametrize(
    "option, words",
    [
        (["--length", "100"], "multiple of the S2 block 16"),
        (["--length", "32"], "local window"),
        (["--length", "256"], "exceeds --seq-length 128"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(tmp_path, capsys, option, words):
    out = tmp_path / "report.json"
    rc = tool.main(["--tiny", "--device", "cpu", "--out", str(out), *option])
    assert rc == 2
    assert words in capsys.readouterr().err
    assert not out.exists()


def test_the_time_limit_counts_from_the_call_not_the_import(tmp_path, monkeypatch):
    # A caller that imported the tool long before (this file, in a long pytest session) must
    # still get its whole --time-limit: counted from the process start, the tiny round trip
    # failed its first step with "no time left" in the full suite.
    import time

    monkeypatch.setattr(tool, "PROCESS_START", time.monotonic() - 10_000)
    seen = {}

    def first_step_only(self, name, cmd):
        seen[name] = self.deadline - time.monotonic()
        return self._failed(name, self.report["steps"].setdefault(name, {}), "stopped by test")

    monkeypatch.setattr(tool.Check, "run", first_step_only)
    out = tmp_path / "report.json"
    rc = tool.main(["--tiny", "--device", "cpu", "--out", str(out), "--time-limit", "100"])
    assert rc == 1 and list(seen) == ["build"]
    assert 90 < seen["build"] <= 100, seen


@pytest.mark.slow
def test_tiny_round_trip_on_the_cpu_passes(tmp_path):
    out, work = tmp_path / "report.json", tmp_path / "work"
    rc = tool.main(
        ["--tiny", "--device", "cpu", "--steps", "3", "--out", str(out), "--work-dir", str(work)]
    )
    report = json.loads(out.read_text())
    assert rc == 0, json.dumps(report, indent=1)[-6000:]
    assert report["verdict"] == "PASS" and report["failed_step"] is None
    assert list(report["steps"]) == list(tool.STEP_NAMES)
    assert all(s["ok"] and s["wall_s"] > 0 for s in report["steps"].values())
    train = report["steps"]["train"]
    assert train["iterations"] == 3 and train["stopped_by"] == "done"
    assert math.isfinite(train["first_loss"]) and math.isfinite(train["last_loss"])
    assert train["tokens_per_s_mean"] > 0
    cmp = report["comparison"]
    assert cmp["layer_kinds"] == "DSDS" and cmp["s2_attn_implementation"] == "s2"
    # fp32 on the CPU: the S2 load equals ours (same reference attention, same weights).
    assert cmp["s2_vs_ours"]["mean_abs_diff_over_std"] <= 1e-4
    assert cmp["s2_vs_ours"]["top1_agreement"] == 1.0
    # Dense attention equals S2 inside the local window and differs past it.
    dense = cmp["dense_vs_ours"]
    assert dense["prefix_mean_abs_diff"] < 1e-5 * dense["ours_std"]
    assert dense["tail_mean_abs_diff"] > 1e-2 * dense["ours_std"]
    pair = cmp["dense_vs_ours_dense"]
    assert pair["mean_abs_diff_over_std"] <= 1e-4  # the two implementations agree in fp32
    assert cmp["ours_dense_vs_ours"]["tail_mean_abs_diff"] > 1e-2 * dense["ours_std"]
    assert all(v for k, v in cmp["checks"].items() if isinstance(v, bool))
    assert report["steps"]["ours"]["logits_shape"] == [1, 128, 384]
