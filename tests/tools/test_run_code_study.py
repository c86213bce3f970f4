"""tools/run_code_study.sh's orchestration, with a stand-in interpreter (the real steps are tested
in test_code_corpus.py, test_sweep.py and test_long_context_eval.py): the corpus's overrides reach
the sweep, SWEEP_ARGS reach ``megatron-s2-sweep run``, every finished point is evaluated once (one
per GPU at a time with EVAL_DEVICES), and the curves are plotted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

# How the study scripts run the long-context evaluation.
EVAL_MODULE = ["-m", "megatron_s2.training.evaluation.long_context"]

# A shell script's orchestration: CI runs it in its first suite only.
pytestmark = pytest.mark.version_independent

REPO = Path(__file__).resolve().parents[2]

# Logs its arguments and CUDA_VISIBLE_DEVICES; plays the sweep, the evaluation and the plot;
# runs everything else (the script's inline Python) with the real interpreter.
FAKE = textwrap.dedent(
    """\
    #!{python}
    import json, os, subprocess, sys, time
    args = sys.argv[1:]
    log = os.environ["FAKE_LOG"]
    with open(log, "a") as f:
        f.write(json.dumps({{"args": args, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
                            "start": time.time()}}) + "\\n")
    if args[:2] == ["-m", "megatron_s2.training.sweep"]:
        sys.exit(0)
    if args[:2] == ["-m", "megatron_s2.training.evaluation.long_context"]:
        run = os.path.dirname(args[args.index("--checkpoint") + 1])
        time.sleep(1.0)  # long enough for concurrent evaluations to overlap
        os.makedirs(os.path.join(run, "long_context_eval"), exist_ok=True)
        with open(os.path.join(run, "long_context_eval", "loss_by_position.json"), "w") as f:
            json.dump({{"bins": []}}, f)
        sys.exit(0)
    if args and args[0] == "tools/plot_loss_by_position.py":
        sys.exit(0)
    sys.exit(subprocess.call([{python!r}, *args]))
    """
)


@pytest.mark.parametrize("eval_devices", [None, "0,1"])
def test_study_script_evaluates_every_finished_point(tmp_path, eval_devices):
    fake = tmp_path / "python"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(0o755)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "corpus.json").write_text(json.dumps({"overrides": "data.demo=false train.seed=7"}))
    out = tmp_path / "out"
    study = tmp_path / "study.yaml"
    study.write_text(
        yaml.safe_dump(
            {
                "name": "s",
                "base": str(REPO / "configs" / "demo.yaml"),
                "points": [{"train.seed": s} for s in (1, 2, 3)],
                "output_dir": str(out),
            }
        )
    )
    names = ["seed=1", "seed=2", "seed=3"]
    for name in names[:2] + ["unfinished"]:
        (out / "runs" / name).mkdir(parents=True)
    for name in names[:2]:
        (out / "runs" / name / "summary.json").write_text("{}")
    log = tmp_path / "calls.jsonl"
    env = dict(
        os.environ,
        CORPUS=str(corpus),
        PYTHON=str(fake),
        FAKE_LOG=str(log),
        SWEEP_ARGS="--devices 0,1",
    )
    env.pop("TRITON_INTERPRET", None)
    if eval_devices:
        env["EVAL_DEVICES"] = eval_devices
    r = subprocess.run(
        ["bash", "tools/run_code_study.sh", str(study)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    (sweep,) = [c for c in calls if c["args"][:2] == ["-m", "megatron_s2.training.sweep"]]
    assert sweep["args"][2:] == [
        "run",
        str(study),
        "data.demo=false",
        "train.seed=7",
        "--devices",
        "0,1",
    ]
    evals = [c for c in calls if c["args"][:2] == EVAL_MODULE]
    evaluated = sorted(
        Path(c["args"][c["args"].index("--checkpoint") + 1]).parent.name for c in evals
    )
    assert evaluated == names[:2]  # finished points only, each once
    (plot,) = [c for c in calls if c["args"][:1] == ["tools/plot_loss_by_position.py"]]
    assert len([a for a in plot["args"] if a.endswith("loss_by_position.json")]) == 2
    if eval_devices:
        assert sorted(c["gpu"] for c in evals) == ["0", "1"]
        assert abs(evals[0]["start"] - evals[1]["start"]) < 0.9  # both at once
        for name in names[:2]:
            assert (out / "runs" / name / "long_context_eval.log").exists()
    else:
        assert all(c["gpu"] is None for c in evals)
        assert evals[1]["start"] - evals[0]["start"] >= 1.0  # one after another

    # Again: everything is evaluated, nothing is rerun.
    log.write_text("")
    r = subprocess.run(
        ["bash", "tools/run_code_study.sh", str(study)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert not [c for c in calls if c["args"][:2] == EVAL_MODULE]
    assert [c for c in calls if c["args"][:1] == ["tools/plot_loss_by_position.py"]]
