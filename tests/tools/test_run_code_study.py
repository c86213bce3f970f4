"""tools/run_code_study.sh's orchestration, with a stand-in interpreter (the real steps are tested
in test_code_corpus.py, test_sweep.py and test_long_context_eval.py): the corpus's overrides reach
the sweep, SWEEP_ARGS reach ``megatron-s2-sweep run``, each finished point is evaluated through
the sweep's ``--after`` in its slot as the sweep finishes it, the points it did not evaluate once
after it (one per GPU at a time with EVAL_DEVICES), and the curves are plotted."""

from __future__ import annotations

import json
import os
import shlex
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

# Logs its arguments and CUDA_VISIBLE_DEVICES; plays the sweep (its --after on the runs that have
# a summary: the finished points), the evaluation (failing once for the run FAKE_EVAL_FAIL_ONCE)
# and the plot; runs everything else (the script's inline Python) with the real interpreter.
FAKE = textwrap.dedent(
    """\
    #!{python}
    import glob, json, os, subprocess, sys, time
    sys.path.insert(0, {repo!r})
    args = sys.argv[1:]
    log = os.environ["FAKE_LOG"]
    with open(log, "a") as f:
        f.write(json.dumps({{"args": args, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
                            "start": time.time()}}) + "\\n")
    if args[:3] == ["-m", "megatron_s2.training.sweep", "run"]:
        from megatron_s2.training.sweep import load_study
        from tests.helpers.study_scripts import run_after
        overrides = [a for a in args[4:args.index("--after")]]
        out = load_study(args[3], extra_overrides=overrides).output_dir
        if "--output-dir" in args:
            out = args[args.index("--output-dir") + 1]
        finished = sorted(glob.glob(os.path.join(out, "runs", "*", "summary.json")))
        code = run_after(args, [os.path.dirname(f) for f in finished])
        with open(log, "a") as f:  # where the sweep ended, for the order of the calls
            f.write(json.dumps({{"args": ["<sweep ended>"]}}) + "\\n")
        sys.exit(code)
    if args[:2] == ["-m", "megatron_s2.training.evaluation.long_context"]:
        run = os.path.dirname(args[args.index("--checkpoint") + 1])
        # long enough for concurrent evaluations to overlap, also on a busy CI machine
        time.sleep(float(os.environ.get("FAKE_EVAL_SLEEP", "1.0")))
        if os.path.basename(run) == os.environ.get("FAKE_EVAL_FAIL_ONCE"):
            if not os.path.exists(os.path.join(run, "failed_once")):
                open(os.path.join(run, "failed_once"), "w").close()
                sys.exit(1)
        os.makedirs(os.path.join(run, "long_context_eval"), exist_ok=True)
        with open(os.path.join(run, "long_context_eval", "loss_by_position.json"), "w") as f:
            json.dump({{"bins": []}}, f)
        sys.exit(0)
    if args and args[0] == "tools/plot_loss_by_position.py":
        sys.exit(0)
    sys.exit(subprocess.call([{python!r}, *args]))
    """
)


def _study(tmp_path):
    """The stand-in interpreter, a corpus and a 3-point study of which two points have finished
    (and one run directory is not a point's); returns (study file, output dir, the env)."""
    fake = tmp_path / "python"
    fake.write_text(FAKE.format(python=sys.executable, repo=str(REPO)))
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
        (out / "runs" / name / "checkpoints" / "iter_0000003").mkdir(parents=True)
    env = dict(
        os.environ,
        CORPUS=str(corpus),
        PYTHON=str(fake),
        FAKE_LOG=str(tmp_path / "calls.jsonl"),
        SWEEP_ARGS="--devices 0,1",
    )
    for var in (
        "TRITON_INTERPRET",
        "EVAL_DEVICES",
        "FAKE_NO_AFTER",
        "FAKE_EVAL_FAIL_ONCE",
        "FAKE_EVAL_SLEEP",
        "OUTPUT_DIR",
        "ADOPT_FROM",
        "ADOPT_RUNS",
    ):
        env.pop(var, None)
    return study, out, env


def _run_script(study, env):
    r = subprocess.run(
        ["bash", "tools/run_code_study.sh", str(study)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    calls = [json.loads(x) for x in Path(env["FAKE_LOG"]).read_text().splitlines()]
    return r, calls


def _sweep_end(calls):
    """The index of the stand-in sweep's end in the log of calls."""
    return next(i for i, c in enumerate(calls) if c["args"] == ["<sweep ended>"])


def _evaluated(calls):
    return [
        Path(c["args"][c["args"].index("--checkpoint") + 1]).parent.name
        for c in calls
        if c["args"][:2] == EVAL_MODULE
    ]


@pytest.mark.parametrize("eval_devices", [None, "0,1"])
def test_study_script_evaluates_every_finished_point(tmp_path, eval_devices):
    """The catch-up after the sweep: here the sweep evaluates nothing (FAKE_NO_AFTER: points
    trained before the script passed --after), so every finished point is evaluated after it."""
    study, out, env = _study(tmp_path)
    names = ["seed=1", "seed=2", "seed=3"]
    log = Path(env["FAKE_LOG"])
    env["FAKE_NO_AFTER"] = "1"
    if eval_devices:
        env["EVAL_DEVICES"] = eval_devices
        env["FAKE_EVAL_SLEEP"] = "3.0"  # the two start well inside each other's 3 s
    r, calls = _run_script(study, env)
    assert r.returncode == 0, r.stdout + r.stderr
    (sweep,) = [c for c in calls if c["args"][:3] == ["-m", "megatron_s2.training.sweep", "run"]]
    assert sweep["args"][2:] == [
        "run",
        str(study),
        "data.demo=false",
        "train.seed=7",
        "--after",
        sweep["args"][7],
        "--devices",
        "0,1",
    ]
    # --after: this script again, on the run the sweep names
    bash, script, *rest = shlex.split(sweep["args"][7])
    assert bash == "bash" and Path(script).resolve() == REPO / "tools" / "run_code_study.sh"
    assert rest == ["--evaluate-run", "{run}"]
    evals = [c for c in calls if c["args"][:2] == EVAL_MODULE]
    assert sorted(_evaluated(calls)) == names[:2]  # finished points only, each once
    (plot,) = [c for c in calls if c["args"][:1] == ["tools/plot_loss_by_position.py"]]
    assert len([a for a in plot["args"] if a.endswith("loss_by_position.json")]) == 2
    if eval_devices:
        assert sorted(c["gpu"] for c in evals) == ["0", "1"]
        assert abs(evals[0]["start"] - evals[1]["start"]) < 2.5  # both at once
        for name in names[:2]:
            assert (out / "runs" / name / "long_context_eval.log").exists()
    else:
        assert all(c["gpu"] is None for c in evals)
        assert evals[1]["start"] - evals[0]["start"] >= 1.0  # one after another

    # Again: everything is evaluated, nothing is rerun.
    log.write_text("")
    r, calls = _run_script(study, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not _evaluated(calls)
    assert [c for c in calls if c["args"][:1] == ["tools/plot_loss_by_position.py"]]


def test_study_script_evaluates_each_point_as_the_sweep_finishes_it(tmp_path):
    """Through the sweep's --after: each finished point evaluated during the sweep, on its slot's
    GPU, into its long_context_eval.log, so that a cut after the sweep loses none; the catch-up
    then has nothing left (not even with EVAL_DEVICES), and a second run evaluates nothing."""
    study, out, env = _study(tmp_path)
    env["EVAL_DEVICES"] = "0,1"
    r, calls = _run_script(study, env)
    assert r.returncode == 0, r.stdout + r.stderr
    after_sweep = _sweep_end(calls)
    evals = [(i, c) for i, c in enumerate(calls) if c["args"][:2] == EVAL_MODULE]
    assert sorted(_evaluated(calls)) == ["seed=1", "seed=2"]  # each finished point once
    assert all(i < after_sweep for i, _ in evals)  # inside the sweep, not after it
    # point i on the i-th GPU of SWEEP_ARGS's --devices, as the sweep gave it
    assert [(_evaluated([c])[0], c["gpu"]) for _, c in evals] == [("seed=1", "0"), ("seed=2", "1")]
    assert all(c["args"][-2:] == ["--position-sequences", "64"] for _, c in evals)
    for name in ("seed=1", "seed=2"):
        assert (out / "runs" / name / "long_context_eval.log").exists()
        assert (out / "runs" / name / "long_context_eval" / "loss_by_position.json").exists()
    (plot,) = [c for c in calls if c["args"][:1] == ["tools/plot_loss_by_position.py"]]
    assert len([a for a in plot["args"] if a.endswith("loss_by_position.json")]) == 2

    Path(env["FAKE_LOG"]).write_text("")
    r, calls = _run_script(study, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not _evaluated(calls)  # the sweep's commands find the curves there


def test_an_evaluation_failed_in_the_sweep_is_redone_after_it(tmp_path):
    """An evaluation that fails inside the sweep (exit code 3: every point trained, a command
    failed) is redone by the catch-up; the script's exit status still says it failed."""
    study, out, env = _study(tmp_path)
    env["FAKE_EVAL_FAIL_ONCE"] = "seed=2"
    r, calls = _run_script(study, env)
    assert r.returncode == 3, r.stdout + r.stderr
    after_sweep = _sweep_end(calls)
    evaluated = [
        (i > after_sweep, _evaluated([c])[0])
        for i, c in enumerate(calls)
        if c["args"][:2] == EVAL_MODULE
    ]
    assert evaluated == [(False, "seed=1"), (False, "seed=2"), (True, "seed=2")]
    assert (out / "runs" / "seed=2" / "long_context_eval" / "loss_by_position.json").exists()


@pytest.mark.parametrize("through_after", [True, False], ids=["sweep-after", "catch-up"])
def test_a_finished_run_without_checkpoints_is_not_evaluated(tmp_path, through_after):
    """A run carried in from an earlier lease (its summary and metrics, no checkpoints, which
    did not outlive that lease): the sweep's --after (run for every finished point whose
    command has not succeeded) and the catch-up both say so and skip it, the others are
    evaluated, and the script's exit status stays 0."""
    study, out, env = _study(tmp_path)
    if not through_after:
        env["FAKE_NO_AFTER"] = "1"
    carried = out / "runs" / "seed=3"
    carried.mkdir()
    (carried / "summary.json").write_text("{}")
    (carried / "metrics.jsonl").write_text("{}\n")
    r, calls = _run_script(study, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(_evaluated(calls)) == ["seed=1", "seed=2"]
    said = (
        f"{carried}: no checkpoint here (trained elsewhere, or saved none), not evaluated"
        if through_after
        else "== not evaluated: seed=3 has no checkpoint here (trained elsewhere, or saved none)"
    )
    assert said in r.stdout, r.stdout


def test_adopt_from_takes_another_studys_matching_runs_before_the_sweep(tmp_path):
    """ADOPT_FROM / ADOPT_RUNS: before the sweep, the real `megatron-s2-sweep adopt` (with the
    corpus's overrides) copies the other study's finished run that trained what seed=3 asks into
    its folder; the sweep then finds it finished and its evaluation runs like any other's."""
    study, out, env = _study(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text(
        yaml.safe_dump(
            {
                "name": "other",
                "base": str(REPO / "configs" / "demo.yaml"),
                "points": [{"train.seed": 3}, {"train.seed": 4}],
                "output_dir": str(tmp_path / "nowhere"),
            }
        )
    )
    from megatron_s2.training.sweep import load_study

    # Overrides a real config accepts (the other tests' corpus has no data.blend: invalid points).
    corpus = {"overrides": "logging.plot=false"}
    (tmp_path / "corpus" / "corpus.json").write_text(json.dumps(corpus))
    runs = tmp_path / "committed"
    source = load_study(other, extra_overrides=["logging.plot=false"])
    assert all(p.valid for p in source.points), [p.error for p in source.points]
    for point in source.points:
        run = runs / point.name
        (run / "checkpoints" / "iter_0000009").mkdir(parents=True)
        iters = point.config.train.train_iters
        (run / "summary.json").write_text(json.dumps({"iteration": iters}))
    env.update(ADOPT_FROM=str(other), ADOPT_RUNS=str(runs))
    r, calls = _run_script(study, env)
    assert r.returncode == 0, r.stdout + r.stderr
    (adopt,) = [c for c in calls if c["args"][:3] == ["-m", "megatron_s2.training.sweep", "adopt"]]
    assert adopt["args"][3:] == [str(study), "logging.plot=false", "--from", str(other),
                                 "--from-runs", str(runs)]  # fmt: skip
    assert "point seed=3: adopted" in r.stdout, r.stdout
    record = json.loads((out / "runs" / "seed=3" / "adopted.json").read_text())
    assert record["from"] == str(runs / "seed=3")
    assert sorted(_evaluated(calls)) == ["seed=1", "seed=2", "seed=3"]


def test_the_study_keeps_its_corpus_and_refuses_another(tmp_path):
    """The first run records the corpus.json its runs train on in the study's folder; a later
    run with the same corpus goes on, one whose corpus has another manifest_sha256 (rebuilt on
    another machine's interpreter) is refused with exit 2, naming both hashes, before adopt or
    the sweep run."""
    study, out, env = _study(tmp_path)
    corpus = Path(env["CORPUS"]) / "corpus.json"
    corpus.write_text(json.dumps({"overrides": "data.demo=false", "manifest_sha256": "aaa"}))
    r, calls = _run_script(study, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "corpus.json").read_text() == corpus.read_text()

    Path(env["FAKE_LOG"]).write_text("")
    r, calls = _run_script(study, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert any(c["args"][:3] == ["-m", "megatron_s2.training.sweep", "run"] for c in calls)

    corpus.write_text(json.dumps({"overrides": "data.demo=false", "manifest_sha256": "bbb"}))
    Path(env["FAKE_LOG"]).write_text("")
    env["ADOPT_FROM"] = str(study)
    r, calls = _run_script(study, env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert (
        f"the corpus in {corpus.parent} (manifest_sha256 bbb) is not the one this study's runs "
        f"trained on ({out / 'corpus.json'}: manifest_sha256 aaa)"
    ) in r.stderr
    assert not [c for c in calls if c["args"][:2] == ["-m", "megatron_s2.training.sweep"]]
    assert json.loads((out / "corpus.json").read_text())["manifest_sha256"] == "aaa"  # kept


def test_output_dir_puts_the_study_elsewhere(tmp_path):
    """OUTPUT_DIR (a rerun of a study's points beside its committed runs): the sweep and adopt
    get --output-dir, the corpus record and the evaluations are in that folder, and the study's
    own output_dir is not touched."""
    study, out, env = _study(tmp_path)
    rerun = tmp_path / "rerun"
    (rerun / "runs" / "seed=2" / "checkpoints" / "iter_0000003").mkdir(parents=True)
    (rerun / "runs" / "seed=2" / "summary.json").write_text("{}")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    # The real adopt takes seed=3 from a committed copy into OUTPUT_DIR (overrides a real
    # config accepts: the other tests' corpus has no data.blend).
    from megatron_s2.training.sweep import load_study

    corpus = {"overrides": "logging.plot=false"}
    (tmp_path / "corpus" / "corpus.json").write_text(json.dumps(corpus))
    point = load_study(study, extra_overrides=["logging.plot=false"]).points[2]
    committed = tmp_path / "committed" / point.name
    (committed / "checkpoints" / "iter_0000009").mkdir(parents=True)
    (committed / "summary.json").write_text(
        json.dumps({"iteration": point.config.train.train_iters})
    )
    env.update(OUTPUT_DIR=str(rerun), ADOPT_FROM=str(study), ADOPT_RUNS=str(committed.parent))
    r, calls = _run_script(study, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"== output: {rerun}" in r.stdout
    for verb in ("adopt", "run"):
        (call,) = [c for c in calls if c["args"][:3] == ["-m", "megatron_s2.training.sweep", verb]]
        i = call["args"].index("--output-dir")
        assert call["args"][i + 1] == str(rerun)
    assert sorted(_evaluated(calls)) == ["seed=2", "seed=3"]
    assert (rerun / "runs" / "seed=3" / "adopted.json").is_file()
    assert (rerun / "runs" / "seed=2" / "long_context_eval" / "loss_by_position.json").is_file()
    assert (rerun / "corpus.json").is_file()
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
