"""megatron-s2-sweep: study files, point expansion and names, and a tiny CPU study end to end
(an invalid point skipped, an interrupted point resumed, the table's values read back from the
runs' metrics, finished points not rerun)."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from megatron_s2.training import sweep
from megatron_s2.training.sweep import StudyError, load_study
from tests.training.test_trainer import TINY

REPO = Path(__file__).resolve().parents[2]


def write_study(tmp_path, **study):
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


# ---- the study file ----------------------------------------------------------------------------
def test_grid_and_list_expansion_and_names(tmp_path):
    path = write_study(
        tmp_path,
        name="st",
        overrides={"train.train_iters": 50},
        grid={"attention.s2.vert_stride": [2, 4], "attention.s2.local_blocks": [2, 8]},
        points=[
            {"attention.dense_layers.pattern": "D"},
            {"name": "my point/1", "attention.s2.vert_stride": 4, "optimizer.lr": 3.0e-4},
        ],
    )
    study = load_study(path, output_dir=str(tmp_path / "out"))
    names = [p.name for p in study.points]
    assert names == [
        "vert_stride=2,local_blocks=2",
        "vert_stride=2,local_blocks=8",
        "vert_stride=4,local_blocks=2",
        "vert_stride=4,local_blocks=8",
        "pattern=D",
        "my_point_1",  # an explicit name, made safe as a directory and run name
    ]
    assert study.axes == [
        "attention.s2.vert_stride",
        "attention.s2.local_blocks",
        "attention.dense_layers.pattern",
        "optimizer.lr",
    ]
    p = study.points[3]
    assert p.valid, p.error
    assert p.run_dir == str(tmp_path / "out" / "runs" / p.name)
    # The config each point runs: base (the demo) < study overrides < point values.
    assert p.config.attention["s2"]["vert_stride"] == 4
    assert p.config.attention["s2"]["local_blocks"] == 8
    assert p.config.train.train_iters == 50 and p.config.name == p.name
    assert p.config.logging.run_dir == p.run_dir
    assert study.points[5].config.optimizer.lr == 3.0e-4
    assert study.points[4].config.schedule().layer_kinds(4) == ["dense"] * 4
    # The command is the trainer's own, with those overrides.
    argv, _ = sweep.point_command(study, p)
    assert argv[1:5] == ["-m", "megatron_s2.training", "--config", study.base]
    assert "attention.s2.vert_stride=4" in argv and f"logging.run_dir={p.run_dir}" in argv


def test_names_disambiguate_keys_and_are_filesystem_safe(tmp_path):
    path = write_study(
        tmp_path,
        points=[
            {"attention.s2.vert_stride": 2, "attention.overrides.1.vert_stride": 4},
            {"data.blend": ["a/b c", "d"], "data.demo": False},
        ],
    )
    study = load_study(path)
    assert study.name == "study"  # the file's stem
    assert study.points[0].name == "s2.vert_stride=2,1.vert_stride=4"
    name = study.points[1].name
    assert "/" not in name and " " not in name and re.fullmatch(r"[A-Za-z0-9._=,+-]+", name)
    assert name.startswith("blend=")
    assert study.output_dir == os.path.abspath(os.path.join("sweeps", "study"))


@pytest.mark.parametrize(
    "study, message",
    [
        ({"gird": {"train.seed": [1, 2]}}, "unknown key(s) gird"),
        ({"grid": {"train.train_iter": [1, 2]}}, "'train.train_iter'"),
        ({"grid": {"attention.s2.vert_strid": [2]}}, "'attention.s2.vert_strid'"),
        ({"points": [{"attention.dense.pattern": "D"}]}, "'attention.dense.pattern'"),
        ({"points": [{"model.hidden_size.x": 1}]}, "model.hidden_size is a value"),
        ({"overrides": {"trian.seed": 1}, "points": [{}]}, "'trian.seed'"),
        ({"grid": {"train.seed": []}}, "grid.train.seed (the study's seeds): seeds must be"),
        ({"points": [{"train.seed": 1}, {"train.seed": 1}]}, "the same name"),
        ({"points": [{"name": "x"}], "nproc_per_node": 0}, "nproc_per_node"),
        ({"points": [{"logging.run_dir": "x"}]}, "logging.run_dir is set by the sweep"),
        ({"name": "st"}, "no points"),
        ({"base": "missing.yaml", "points": [{}]}, "does not exist"),
    ],
)
def test_study_errors_name_the_key(tmp_path, study, message):
    with pytest.raises(StudyError) as e:
        load_study(write_study(tmp_path, **study))
    assert message in str(e.value)
    # The CLI says so in one line and exits with 2.
    assert sweep.main(["list", str(tmp_path / "study.yaml")]) == 2


def test_invalid_point_is_reported_with_its_config_error(tmp_path, capsys):
    path = write_study(
        tmp_path,
        overrides=TINY,
        points=[
            {"attention.s2.vert_stride": 2},
            {"attention.s2.vert_stride": 8},  # 4 heads cannot cover 8 stripe phases
            {"train.global_batch_size": 3},
        ],
    )
    study = load_study(path, output_dir=str(tmp_path / "out"))
    ok, holes, batch = study.points
    assert ok.valid
    assert not holes.valid and "unseen" in holes.error and "vert_stride=8" in holes.error
    assert "train.global_batch_size (3) must be divisible" in batch.error
    assert [sweep.point_state(p) for p in study.points] == ["new", "invalid", "invalid"]
    sweep.report_invalid(study)
    out = capsys.readouterr().out
    assert f"point {holes.name}: config error, skipped: attention.s2" in out
    # No point valid: a study error, nothing is run.
    bad = write_study(tmp_path, overrides=TINY, points=[{"attention.s2.vert_stride": 8}])
    assert sweep.main(["run", str(bad), "--output-dir", str(tmp_path / "out2")]) == 2
    assert not (tmp_path / "out2" / "runs").exists()


def test_command_line_overrides_sit_between_study_and_point(tmp_path, capsys):
    path = write_study(
        tmp_path,
        overrides=[*TINY, "train.seed=5", "train.train_iters=3"],
        points=[{"train.train_iters": 7}, {"attention.s2.local_blocks": 2}],
    )
    study = load_study(path, extra_overrides=["train.seed=11", "train.train_iters=4"])
    longer, window = study.points
    # The command line wins over the study's overrides, the point's own values over both.
    assert longer.config.train.seed == 11 and longer.config.train.train_iters == 7
    assert window.config.train.seed == 11 and window.config.train.train_iters == 4
    for bad, message in [
        (["train.seeed=1"], "'train.seeed'"),
        (["train.seed"], "not of the form key=value"),
        (["name=x"], "name is set by the sweep"),
    ]:
        with pytest.raises(StudyError, match=message):
            load_study(path, extra_overrides=bad)
    assert sweep.main(["list", str(path), "train.seeed=1"]) == 2
    assert "'train.seeed'" in capsys.readouterr().err


def test_loss_at_tokens_and_pareto_front():
    curve = [(100, 4.0), (200, 3.0), (400, 2.0)]
    assert sweep.loss_at_tokens(curve, 200) == 3.0
    assert sweep.loss_at_tokens(curve, 300) == pytest.approx(2.5)
    assert sweep.loss_at_tokens(curve, 500) is None
    xy = [(0.5, 3.0), (0.3, 3.5), (1.0, 2.9), (0.6, 3.2), (0.3, 3.6)]
    assert sweep.pareto_front(xy) == [1, 0, 2]


# ---- a tiny CPU study, end to end --------------------------------------------------------------
def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def _sweep(*args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # conftest's, for the kernel tests: the trainer runs slower
    return subprocess.run(
        [sys.executable, "-m", "megatron_s2.training.sweep", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )


# The sweep's orchestration does not depend on megatron-core's version (the trainer runs it
# starts are tested under both versions elsewhere): first CI suite only.
@pytest.mark.version_independent
@pytest.mark.timeout(600)
def test_tiny_study_end_to_end(tmp_path, demo_dir):
    iters = 3
    path = write_study(
        tmp_path,
        name="tiny",
        overrides=[
            *TINY,
            f"train.train_iters={iters}",
            "train.eval_interval=3",
            "train.eval_iters=1",
            "checkpoint.save_at_end=true",
            f"data.demo_dir={demo_dir}",
        ],
        grid={"attention.s2.vert_stride": [2, 8], "attention.s2.local_blocks": [2]},
        points=[{"attention.dense_layers.pattern": "D"}, {"attention.s2.vert_stride": 4}],
        output_dir="out",
    )
    # output_dir "out" is relative to the current directory: tmp_path for the sweep run below.
    study = load_study(path, output_dir=str(tmp_path / "out"))
    names = [p.name for p in study.points]
    assert names == [
        "vert_stride=2,local_blocks=2",
        "vert_stride=8,local_blocks=2",
        "pattern=D",
        "vert_stride=4",
    ]
    interrupted, invalid = study.points[0], study.points[1]
    assert not invalid.valid

    # Interrupt point 0 after its first iteration (the trainer checkpoints and stops as on
    # SIGTERM), as a sweep cut short would leave it.
    argv, env = sweep.point_command(study, interrupted)
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run(
        [*argv, "debug.sigterm_at_iter=1"],
        cwd=tmp_path,
        env=dict(env, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert sweep.point_state(interrupted) == "interrupted"

    r = _sweep("run", str(path), cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert f"point {invalid.name}: config error, skipped: attention.s2" in out
    assert not os.path.exists(invalid.run_dir)
    assert f"point {interrupted.name}: interrupted, resuming from its checkpoint" in out
    assert "resumed from" in out
    for name in ("pattern=D", "vert_stride=4"):
        assert f"point {name}: running in" in out
    assert [sweep.point_state(p) for p in study.points] == [
        "finished",
        "invalid",
        "finished",
        "finished",
    ]
    # The resumed point's curve is one run: iterations 1..3, each once.
    recs = _records(interrupted.run_dir)
    assert [x["iteration"] for x in recs if x["kind"] == "train"] == [1, 2, 3]

    out_dir = tmp_path / "out"
    for f in ("results.csv", "results.md", "pareto.png", "loss_curves.png"):
        assert (out_dir / f).stat().st_size > 0, f
    for png in ("pareto.png", "loss_curves.png"):
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out_dir / "results.csv") as f:
        rows = {row["point"]: row for row in csv.DictReader(f)}
    assert list(rows) == names
    assert rows[invalid.name]["status"] == "invalid" and "unseen" in rows[invalid.name]["error"]
    assert rows[invalid.name]["final_train_loss"] == ""
    md = (out_dir / "results.md").read_text()
    assert all(f"| {n} |" in md for n in names)
    assert "Skipped (config errors)" in md
    assert "Trained in CPU mode: tokens/s" in md  # the speeds are not the GPU kernels'
    assert "Adopted" not in md and "adopted_from" not in rows[names[0]]

    # Every value as the runs' metrics say, computed here independently.
    tokens_per_iter = 4 * 128
    for point in (study.points[0], study.points[2], study.points[3]):
        row = rows[point.name]
        recs = _records(point.run_dir)
        train = [x for x in recs if x["kind"] == "train"]
        valid = [x for x in recs if x["kind"] == "valid"]
        assert row["status"] == "finished"
        # A point that leaves an axis alone shows its config's value (never a blank cell).
        assert row["attention.s2.vert_stride"] == str(
            point.values.get(
                "attention.s2.vert_stride", point.config.attention["s2"]["vert_stride"]
            )
        )
        assert float(row["final_train_loss"]) == train[-1]["loss"]
        assert int(row["final_train_iteration"]) == iters
        assert float(row["final_valid_loss"]) == valid[-1]["loss"]
        assert int(row["final_valid_iteration"]) == iters
        assert int(float(row["tokens"])) == iters * tokens_per_iter
        # Equal tokens: every point ran as long, so the loss there is the final one.
        assert int(float(row["equal_tokens"])) == iters * tokens_per_iter
        assert float(row["loss_at_equal_tokens"]) == pytest.approx(train[-1]["loss"], rel=1e-12)
        # Throughput: the logged windows after the first, weighted by their time.
        seconds = sum(x["step_time_s"] for x in train[1:])
        assert float(row["tokens_per_s"]) == pytest.approx(
            (len(train) - 1) * tokens_per_iter / seconds, rel=1e-9
        )
        assert float(row["tflops_per_gpu"]) == pytest.approx(
            sum(x["tflops_per_gpu"] * x["step_time_s"] for x in train[1:]) / seconds, rel=1e-9
        )
        assert float(row["peak_memory_gib"]) == max(x["cpu_rss_gib"] for x in train)
        assert row["memory"] == "cpu rss"
        assert float(row["union_coverage"]) == 1.0
        assert float(row["wall_time_s"]) > 0
        log = (out_dir / "logs" / f"{point.name}.log").read_text()
        printed = re.findall(r"model attention density at 128 tokens: ([0-9.]+)", log)
        assert printed and abs(float(row["attention_density"]) - float(printed[-1])) <= 5e-4
        if point is not interrupted:  # the summary's throughput is its last session's
            summary = json.loads((Path(point.run_dir) / "summary.json").read_text())
            assert float(row["tokens_per_s"]) == pytest.approx(summary["tokens_per_s"], rel=1e-6)
    assert float(rows["pattern=D"]["attention_density"]) == 1.0
    assert float(rows["vert_stride=4"]["attention_density"]) < float(
        rows["vert_stride=2,local_blocks=2"]["attention_density"]
    )

    # Again: nothing is rerun, the runs' files are untouched, the table is written again.
    mtimes = {
        p.name: os.stat(Path(p.run_dir) / "metrics.jsonl").st_mtime_ns
        for p in study.points
        if p.valid
    }
    before = (out_dir / "results.csv").read_text()
    r = _sweep("run", str(path), cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    for name in mtimes:
        assert f"point {name}: finished, not rerun" in out
    assert "[megatron-s2] " not in out  # no trainer started
    assert mtimes == {
        p.name: os.stat(Path(p.run_dir) / "metrics.jsonl").st_mtime_ns
        for p in study.points
        if p.valid
    }
    assert (out_dir / "results.csv").read_text() == before
    r = _sweep("list", str(path), cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.count("finished") == 3 and "invalid" in r.stdout


def test_devices_run_points_at_once_each_on_its_gpus(tmp_path, demo_dir):
    path = write_study(
        tmp_path,
        name="pair",
        overrides=[
            *TINY,
            "train.train_iters=3",
            "train.eval_interval=3",
            "train.eval_iters=1",
            f"data.demo_dir={demo_dir}",
        ],
        grid={"attention.s2.vert_stride": [2, 4]},
        output_dir="out",
    )
    study = load_study(path, output_dir=str(tmp_path / "out"))
    r = _sweep("run", str(path), "--devices", "3,5", cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert [sweep.point_state(p) for p in study.points] == ["finished", "finished"]
    spans = []
    for point, gpu in zip(study.points, ("3", "5")):
        assert f"point {point.name}: on GPU {gpu}," in out
        log = (tmp_path / "out" / "logs" / f"{point.name}.log").read_text()
        assert log.startswith(f"CUDA_VISIBLE_DEVICES={gpu}\n")
        (session,) = [json.loads(x) for x in open(Path(point.run_dir) / sweep.SESSIONS)]
        spans.append((session["start"], session["end"]))
        assert session["how"] == "local" and session["processes"] == 1
    assert "[megatron-s2] " not in r.stdout  # trainers' output goes to their logs only
    # Both trainers ran at the same time.
    assert max(s for s, _ in spans) < min(e for _, e in spans)
    assert (tmp_path / "out" / "results.csv").stat().st_size > 0


@pytest.mark.parametrize("devices", [["0", "0"], [], ["0", "1", "2"]])
def test_devices_must_be_distinct_and_fill_whole_groups(tmp_path, devices):
    path = write_study(
        tmp_path, name="t", overrides=[*TINY], points=[{"train.seed": 1}], nproc_per_node=2
    )
    study = load_study(path, output_dir=str(tmp_path / "out"))
    with pytest.raises(StudyError, match=r"--devices .*nproc_per_node \(2\)"):
        sweep.device_groups(study, devices)
    assert sweep.device_groups(study, ["0", "1", "2", "3"]) == [["0", "1"], ["2", "3"]]
    assert sweep.main(["run", str(path), "--devices", ",".join(devices) or ","]) == 2
    assert sweep.main(["run", str(path), "--devices", "0,1", "--slurm"]) == 2


def test_cpu_demo_study_loads_on_the_demo():
    """docs/sweeps.md's first study (configs/studies/demo-seeds.yaml): no base, so the demo
    model and corpus; dense and the 1:1 hybrid, two seeds each, every point valid."""
    study = load_study(REPO / "configs" / "studies" / "demo-seeds.yaml")
    assert [p.name for p in study.points] == [
        "dense,seed=1", "dense,seed=2", "hybrid-DS,seed=1", "hybrid-DS,seed=2"
    ]  # fmt: skip
    assert all(p.valid for p in study.points), [p.error for p in study.points if not p.valid]
    assert all(p.config.data.demo and p.config.train.train_iters == 40 for p in study.points)
    assert study.reference == "dense" and study.seeds == [1, 2]


def test_example_study_loads():
    study = load_study(REPO / "configs" / "studies" / "s2-stride-window.yaml")
    assert len(study.points) == 11 and all(p.valid for p in study.points), [
        p.error for p in study.points if not p.valid
    ]
    assert study.points[0].name == "vert_stride=4,local_blocks=4"
    assert {p.config.model.seq_length for p in study.points} == {8192}


def _corpus_overrides(tmp_path) -> list:
    """The code corpus's overrides as tools/run_code_study.sh passes them (split 100,3,0; the
    corpus need not exist to validate a study's configs)."""
    return [
        "data.demo=false",
        f"data.blend=[{tmp_path}/train_valid]",
        "data.split=100,3,0",
        f"data.tokenizer={tmp_path}/tokenizer",
    ]


@pytest.mark.parametrize(
    "name, points",
    [
        ("code-125m-attention", 3),
        ("code-125m-stride-window", 7),
        ("code-125m-4k-base", 2),
        ("code-125m-extend-16k", 3),
        ("code-125m-extend-16k-remedies", 5),
        ("code-125m-16k-seeds-100m", 12),
        ("code-125m-16k-stride-window", 20),
        ("code-125m-4k-seeds", 12),
        ("retrieval-125m-4k-probe", 4),
        ("retrieval-125m-4k-base", 24),
        ("retrieval-125m-extend-32k", 40),
        ("retrieval-125m-4k-base-long", 6),
        ("retrieval-125m-extend-32k-longbase", 9),
    ],
)
def test_code_corpus_studies_load_with_the_corpus_overrides(tmp_path, name, points):
    """The studies of docs/quality.md take the corpus from the command line, as
    tools/run_code_study.sh passes it (the corpus need not exist to validate the configs)."""
    corpus = _corpus_overrides(tmp_path)
    study = load_study(REPO / "configs" / "studies" / f"{name}.yaml", extra_overrides=corpus)
    assert len(study.points) == points and all(p.valid for p in study.points), [
        p.error for p in study.points if not p.valid
    ]
    tokens = {
        p.config.train.train_iters * p.config.train.global_batch_size * p.config.model.seq_length
        for p in study.points
    }
    # every point at equal tokens, but for the remedies' longer extension (a remedy of its own)
    assert len(tokens) == (2 if name.endswith("remedies") else 1)
    assert {p.config.data.split for p in study.points} == {"100,3,0"}
    if name == "retrieval-125m-extend-32k":
        # each extension loads the base run of its own arm and seed; the dense-to-* arms the
        # dense one of their seed, extended as the hybrid they name
        for p in study.points:
            seed = p.name.rsplit(",", 1)[1]
            base = "dense" if p.name.startswith("dense-to-") else p.setting
            assert p.config.checkpoint.load_dir == (
                f"sweeps/retrieval-125m-4k-base/runs/{base},{seed}/checkpoints"
            )
            if p.name.startswith("dense-to-hybrid-"):
                pattern = p.setting.split("-")[3]
                assert p.config.attention["dense_layers"]["pattern"] == pattern
        schedules = {p.setting: p.config.schedule() for p in study.points}
        assert schedules["dense-to-hybrid-DS-rope8m"].dense_rotary_base == 8000000
        # the switch that keeps the dense twin's retrieval layers (10, 11) dense: 6 of 12
        late = schedules["dense-to-hybrid-DSDSDSDSSSDD"].dense_layer_indices(12)
        assert sorted(late) == [0, 2, 4, 6, 10, 11]


def test_the_long_base_doubles_the_recipes_base_and_extends_it_the_same_way(tmp_path):
    """The dense bar's lever (docs/long_context_eval.md, "Next leases"): the long base is the
    recipe's 4k base with twice the steps over two data-parallel processes (the same tokens a
    step, batch, LR and 8% warm-up), and its extension study is the recipe's extension, point
    for point, only loading the long base of the same arm and seed."""
    corpus = _corpus_overrides(tmp_path)

    def load(name):
        return load_study(REPO / "configs" / "studies" / f"{name}.yaml", extra_overrides=corpus)

    base, long = load("retrieval-125m-4k-base"), load("retrieval-125m-4k-base-long")
    assert (base.nproc_per_node or 1) == 1 and long.nproc_per_node == 2
    b = {p.name: p.config for p in base.points}
    for p in long.points:
        c, ref = p.config, b[p.name]
        assert c.train.train_iters == 2 * ref.train.train_iters
        assert c.train.global_batch_size == ref.train.global_batch_size
        assert c.train.micro_batch_size * long.nproc_per_node == c.train.global_batch_size
        assert c.optimizer.lr == ref.optimizer.lr
        assert c.optimizer.lr_warmup_iters == 2 * ref.optimizer.lr_warmup_iters
        assert c.model == ref.model and c.attention == ref.attention
    ext, ext_long = load("retrieval-125m-extend-32k"), load("retrieval-125m-extend-32k-longbase")
    e = {p.name: p.config.to_dict() for p in ext.points}
    for p in ext_long.points:
        seed = p.name.rsplit(",", 1)[1]
        arm = "dense" if p.name.startswith("dense-to-") else p.setting
        got = p.config.to_dict()
        assert got["checkpoint"].pop("load_dir") == (
            f"sweeps/retrieval-125m-4k-base-long/runs/{arm},{seed}/checkpoints"
        )
        want = e[p.name]
        want["checkpoint"].pop("load_dir")
        for d in (got, want):
            d.pop("name")
            d["logging"].pop("run_dir")
        assert got == want, p.name


def test_nproc_per_node_on_the_command_line_runs_a_two_process_study_in_one(tmp_path, capsys):
    """`run --nproc-per-node 1`: the long base (two data-parallel processes a point) on a
    one-GPU machine, the same global batch with its micro-batches accumulated: one trainer
    process a point on one GPU id, the configs checked at that size; without it one id is
    refused; a value below 1 is refused naming the option; a size the batch does not divide
    is refused by the configs' own check."""
    corpus = _corpus_overrides(tmp_path)
    path = REPO / "configs" / "studies" / "retrieval-125m-4k-base-long.yaml"
    two = load_study(path, extra_overrides=corpus)
    one = load_study(path, extra_overrides=corpus, nproc_per_node=1)
    assert two.nproc_per_node == 2 and one.nproc_per_node == 1
    assert all(p.valid for p in one.points) and [p.name for p in one.points] == [
        p.name for p in two.points
    ]
    argv, env = sweep.point_command(one, one.points[0], devices=["0"])
    assert argv[:3] == [sys.executable, "-m", "megatron_s2.training"]
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and "NPROC_PER_NODE" not in env
    assert sweep.device_groups(one, ["0"]) == [["0"]]
    with pytest.raises(
        StudyError, match="a multiple of the processes a point, nproc_per_node \\(2"
    ):
        sweep.device_groups(two, ["0"])
    with pytest.raises(StudyError, match="--nproc-per-node must be an integer >= 1, got 0"):
        load_study(path, extra_overrides=corpus, nproc_per_node=0)
    # 3 processes: a global batch of 16 is not a multiple of 3 x the micro-batch of 8.
    three = load_study(path, extra_overrides=corpus, nproc_per_node=3)
    assert not any(p.valid for p in three.points)
    # The command line: list shows the points valid at one process a point.
    code = sweep.main(["list", str(path), "--nproc-per-node", "1", "--output-dir",
                       str(tmp_path / "out"), *corpus])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "dense,seed=1" in out and "error" not in out.lower()


@pytest.mark.parametrize("name", ["retrieval-125m-4k-base", "retrieval-125m-extend-32k"])
def test_a_studys_table_keeps_the_committed_tables_columns(tmp_path, name):
    """A lease's results.csv merges into the committed one (tools/merge_results_csv.py) only
    with the same columns in the same order, and the axes follow the points' order: a point
    added to a study must not reorder them."""
    committed = REPO / "docs" / "long_context" / "results" / name / "results.csv"
    corpus = _corpus_overrides(tmp_path)
    study = load_study(REPO / "configs" / "studies" / f"{name}.yaml", str(tmp_path / "out"),
                       extra_overrides=corpus)  # fmt: skip
    csv_path, _ = sweep.write_tables(study, sweep.collect(study))
    with open(csv_path) as f, open(committed) as g:
        assert next(csv.reader(f)) == next(csv.reader(g))


# ---- --after: a command after each finished point, with a stand-in trainer --------------------
# Plays the trainer (``train RUN_DIR ITERS``: a summary at ITERS, or exit 1 for the points named
# in FAKE_FAIL) and the --after command (``hook RUN_DIR POINT``: exit FAKE_HOOK_EXIT for the
# points named in FAKE_HOOK_FAIL); both append what they saw, with their start and end, to
# FAKE_EVENTS.
FAKE_TRAINER = """\
import json, os, sys, time
what, run_dir = sys.argv[1], sys.argv[2]
start = time.time()
time.sleep(float(os.environ.get("FAKE_SLEEP", "0.3")))
name = os.path.basename(run_dir) if what == "train" else sys.argv[3]
code = 0
if what == "train":
    if name in os.environ.get("FAKE_FAIL", "").split():
        code = 1
    else:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump({"iteration": int(sys.argv[3])}, f)
else:
    print(f"hook of {name} in {run_dir}")
    if name in os.environ.get("FAKE_HOOK_FAIL", "").split():
        code = int(os.environ.get("FAKE_HOOK_EXIT", "7"))
with open(os.environ["FAKE_EVENTS"], "a") as f:
    event = {"what": what, "point": name, "run_dir": run_dir, "code": code, "start": start,
             "end": time.time(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}
    f.write(json.dumps(event) + "\\n")
sys.exit(code)
"""


@pytest.fixture
def fake_sweep(tmp_path, monkeypatch):
    """A 4-point study (seeds 1-4 of the tiny model) in a folder whose name has a space (so that
    ``{run}`` needs its quotes), every point trained by the stand-in above. Returns (the study
    file, the loaded study, the --after command, the events read back)."""
    script = tmp_path / "fake.py"
    script.write_text(FAKE_TRAINER)
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("FAKE_EVENTS", str(events))
    for var in ("FAKE_FAIL", "FAKE_HOOK_FAIL", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    real = sweep.point_command

    def fake_command(study, point, *, restart=False, devices=None):
        _, env = real(study, point, restart=restart, devices=devices)
        iters = str(point.config.train.train_iters)
        return [sys.executable, str(script), "train", point.run_dir, iters], env

    monkeypatch.setattr(sweep, "point_command", fake_command)
    path = write_study(
        tmp_path,
        name="hooks",
        overrides=[*TINY, "train.train_iters=5"],
        points=[{"train.seed": s} for s in (1, 2, 3, 4)],
        output_dir=str(tmp_path / "out dir"),
    )
    study = load_study(path)
    after = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} hook {{run}} {{point}}"

    def read_events():
        if not events.exists():
            return []
        return [json.loads(x) for x in events.read_text().splitlines()]

    return path, study, after, read_events


def _after_record(point):
    return json.loads((Path(point.run_dir) / sweep.AFTER_RECORD).read_text())


def test_after_runs_in_the_points_slot_right_after_it_and_resumes(fake_sweep, monkeypatch, capsys):
    path, study, after, events = fake_sweep
    monkeypatch.setenv("FAKE_FAIL", "seed=3")  # its training fails: no command after it
    code = sweep.main(["run", str(path), "--devices", "3,5", "--after", after])
    out = capsys.readouterr().out
    assert code == sweep.EXIT_FAILED, out
    got = events()
    hooks = {e["point"]: e for e in got if e["what"] == "hook"}
    trains = {e["point"]: e for e in got if e["what"] == "train"}
    assert sorted(trains) == ["seed=1", "seed=2", "seed=3", "seed=4"]
    assert sorted(hooks) == ["seed=1", "seed=2", "seed=4"]  # once each, finished points only
    assert len([e for e in got if e["what"] == "hook"]) == 3
    by_name = {p.name: p for p in study.points}
    for name, hook in hooks.items():
        point = by_name[name]
        assert hook["run_dir"] == point.run_dir  # " " in the path: {run} arrived quoted
        assert hook["gpu"] == trains[name]["gpu"] in ("3", "5")  # the point's own slot
        record = _after_record(point)
        assert record["exit_code"] == 0 and record["iteration"] == 5
        assert record["command"] == sweep.after_command(after, point)
        assert shlex.quote(point.run_dir) in record["command"]
        log = (Path(point.run_dir) / sweep.AFTER_LOG).read_text()
        assert f"hook of {name} in {point.run_dir}" in log
        assert log.splitlines()[1] == f"CUDA_VISIBLE_DEVICES={hook['gpu']}"
    # In each slot one process at a time, and each command before the slot's next training.
    for gpu in ("3", "5"):
        slot = sorted((e for e in got if e["gpu"] == gpu), key=lambda e: e["start"])
        assert slot, got
        for a, b in zip(slot, slot[1:]):
            assert a["end"] <= b["start"], slot
            if a["what"] == "train" and a["code"] == 0:
                assert b == hooks[a["point"]], slot
    assert sweep.point_state(by_name["seed=3"]) != "finished"
    assert not (Path(by_name["seed=3"].run_dir) / sweep.AFTER_RECORD).exists()
    assert "1 point(s) did not finish: seed=3" in out

    # Again, the failure gone: seed=3 trains and gets its command; the others' are not rerun.
    monkeypatch.delenv("FAKE_FAIL")
    before = len(got)
    assert sweep.main(["run", str(path), "--devices", "3,5", "--after", after]) == sweep.EXIT_OK
    out = capsys.readouterr().out
    new = events()[before:]
    assert sorted((e["what"], e["point"]) for e in new) == [("hook", "seed=3"), ("train", "seed=3")]
    for name in ("seed=1", "seed=2", "seed=4"):
        assert f"point {name}: --after succeeded before, not rerun" in out


def test_a_failed_after_command_leaves_the_point_finished_and_is_retried(
    fake_sweep, monkeypatch, capsys
):
    path, study, after, events = fake_sweep
    monkeypatch.setenv("FAKE_HOOK_FAIL", "seed=2 seed=4")
    code = sweep.main(["run", str(path), "--after", after])  # one after another, echoed
    out = capsys.readouterr().out
    assert code == sweep.EXIT_AFTER_FAILED, out
    assert [sweep.point_state(p) for p in study.points] == ["finished"] * 4
    by_name = {p.name: p for p in study.points}
    assert _after_record(by_name["seed=2"])["exit_code"] == 7
    assert "point seed=2: --after failed (exit code 7)" in out
    assert "--after failed for 2 point(s): seed=2, seed=4" in out
    assert "hook of seed=1 in" in out  # without --devices the command's output is shown
    # The table counts the training: every point finished.
    with open(Path(study.output_dir) / "results.csv") as f:
        assert [row["status"] for row in csv.DictReader(f)] == ["finished"] * 4
    # Sequential: each command right after its point, before the next point trains.
    assert [(e["what"], e["point"]) for e in events()] == [
        (w, f"seed={s}") for s in (1, 2, 3, 4) for w in ("train", "hook")
    ]

    # Again: nothing trains, the failed commands are retried (their log appended), the rest not.
    monkeypatch.delenv("FAKE_HOOK_FAIL")
    before = len(events())
    assert sweep.main(["run", str(path), "--after", after]) == sweep.EXIT_OK
    assert [(e["what"], e["point"]) for e in events()[before:]] == [
        ("hook", "seed=2"),
        ("hook", "seed=4"),
    ]
    assert _after_record(by_name["seed=2"])["exit_code"] == 0
    log = (Path(by_name["seed=2"].run_dir) / sweep.AFTER_LOG).read_text()
    assert log.count("# exit code 7") == 1 and log.count("# exit code 0") == 1


def test_after_catches_up_on_points_finished_before(fake_sweep, monkeypatch, capsys):
    path, study, after, events = fake_sweep
    assert sweep.main(["run", str(path), "--devices", "0,1"]) == sweep.EXIT_OK  # no --after
    assert not any((Path(p.run_dir) / sweep.AFTER_RECORD).exists() for p in study.points)
    n = len(events())
    assert sweep.main(["run", str(path), "--devices", "0,1", "--after", after]) == sweep.EXIT_OK
    new = events()[n:]
    assert sorted(e["point"] for e in new) == [p.name for p in study.points]
    assert {e["what"] for e in new} == {"hook"}  # nothing retrained
    assert {e["gpu"] for e in new} <= {"0", "1"}
    # Another command is not the one that succeeded: it runs too.
    n = len(events())
    assert sweep.main(["run", str(path), "--after", after + " --again"]) == sweep.EXIT_OK
    assert len(events()) == n + 4
    # Trained further (train_iters raised): the point resumes and its command runs again.
    n = len(events())
    assert sweep.main(["run", str(path), "train.train_iters=6", "--after", after]) == 0
    new = events()[n:]
    assert [(e["what"], e["point"]) for e in new][:2] == [("train", "seed=1"), ("hook", "seed=1")]
    assert len(new) == 8 and _after_record(study.points[0])["iteration"] == 6
    capsys.readouterr()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--after", ""], "--after: the command is empty"),
        (["--after", "  "], "--after: the command is empty"),
        (["--after", "du {runn} {run} {seed}"], "--after: unknown field(s) {runn}, {seed}"),
        (["--after", "echo 'unclosed {run}"], "is not a valid bash command"),
        (["--after", "echo {run}", "--slurm"], "--after runs its command here"),
    ],
)
def test_bad_after_is_refused_before_any_point(fake_sweep, capsys, extra, message):
    path, study, _, events = fake_sweep
    assert sweep.main(["run", str(path), *extra]) == sweep.EXIT_STUDY_ERROR
    err = capsys.readouterr().err
    assert message in err and err.startswith("megatron-s2-sweep: study error: --after")
    assert not events() and not os.path.exists(study.output_dir)


def test_after_command_fields():
    point = sweep.Point(0, "seed=1", {}, run_dir="/a b/runs/seed=1")
    got = sweep.after_command("x {run}/ck {point} ${HOME} {a,b} {} awk '{{print}}'", point)
    assert got == "x '/a b/runs/seed=1'/ck seed=1 ${HOME} {a,b} {} awk '{print}'"
    sweep.check_after("x {run} ${HOME} {{print}} {a,b}")  # fields known, bash parses it
    with pytest.raises(StudyError, match=r"unknown field\(s\) \{print\}"):
        sweep.check_after("awk '{print}' {run}")


@pytest.mark.parametrize("whole_group", [True, False], ids=["terminal", "sweep-only"])
def test_ctrl_c_during_after_waits_for_it_and_starts_nothing_more(tmp_path, whole_group):
    """Ctrl-C while a command runs: as during training, the sweep lets it end (a terminal's
    Ctrl-C reaches it too, and it stops on its own), records how it ended, starts no other
    point and exits 130; the next run retries a command that was cut short."""
    events = tmp_path / "events.jsonl"
    started = tmp_path / "started"
    (tmp_path / "fake.py").write_text(FAKE_TRAINER)
    # The sweep in a process of its own (the signal goes to it), with the stand-in trainer.
    driver = tmp_path / "driver.py"
    driver.write_text(
        textwrap.dedent(
            """\
            import os, sys
            from megatron_s2.training import sweep
            def command(study, point, *, restart=False, devices=None):
                fake = os.path.join(os.path.dirname(__file__), "fake.py")
                return [sys.executable, fake, "train", point.run_dir, "5"], dict(os.environ)
            sweep.point_command = command
            sys.exit(sweep.main(sys.argv[1:]))
            """
        )
    )
    path = write_study(
        tmp_path,
        name="cut",
        overrides=[*TINY, "train.train_iters=5"],
        points=[{"train.seed": s} for s in (1, 2)],
        output_dir=str(tmp_path / "out"),
    )
    after = f"echo {{point}} >> {events}; touch {started}; sleep 3; echo done {{point}} >> {events}"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(sys.path),
        FAKE_EVENTS=str(tmp_path / "trained.jsonl"),
        FAKE_SLEEP="0",
    )
    proc = subprocess.Popen(
        [sys.executable, str(driver), "run", str(path), "--after", after],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group: the "terminal" Ctrl-C reaches it alone
    )
    deadline = time.time() + 60
    while not started.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert started.exists(), proc.communicate()[0]
    # The command touches the file within milliseconds of its start, possibly before the sweep,
    # on a loaded machine, has returned from starting it and begun to wait: the Ctrl-C this
    # test is about is one during the command, so it comes once the sweep waits (the command
    # sleeps 3 s).
    time.sleep(0.5)
    if whole_group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == sweep.EXIT_INTERRUPTED, out
    assert "interrupted" in out
    study = load_study(path)
    first, second = study.points
    assert sweep.point_state(second) == "new"  # no further point started
    record = _after_record(first)
    lines = events.read_text().split()
    if whole_group:
        assert record["exit_code"] != 0 and lines == ["seed=1"]  # the command stopped
    else:
        assert record["exit_code"] == 0 and lines == ["seed=1", "done", "seed=1"]  # let end
    # Again: the second point trains; a cut command is retried, a whole one not.
    r = subprocess.run(
        [sys.executable, str(driver), "run", str(path), "--after", after.replace("sleep 3", ":")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert sweep.point_state(second) == "finished"
    assert _after_record(first)["exit_code"] == 0 and _after_record(second)["exit_code"] == 0


# Stands in for a process the sweep starts: once the file it is given exists, a SIGINT stops it
# with 130, as the trainer's does; otherwise it runs on (longer than any test waits).
STOPS_ON_CTRL_C = """\
import signal, sys, time
signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
open(sys.argv[1], "w").close()
time.sleep(30)  # then exits 0: a Ctrl-C not passed on fails the test in 30 s, not a hang
"""


def _start_stops_on_ctrl_c(ready, popen=subprocess.Popen, **kwargs):
    """Start :data:`STOPS_ON_CTRL_C` and return it once its SIGINT handler is in place."""
    proc = popen([sys.executable, "-c", STOPS_ON_CTRL_C, str(ready)], **kwargs)
    deadline = time.time() + 60
    while not ready.exists():
        assert proc.poll() is None and time.time() < deadline, "the stand-in did not start"
        time.sleep(0.01)
    return proc


@pytest.mark.parametrize("child", ["train", "after"])
def test_ctrl_c_while_a_process_is_prepared_starts_nothing(fake_sweep, monkeypatch, capsys, child):
    """A Ctrl-C after the sweep last looked but before it started the next process (while it
    prepared a point's command, or looked up its --after record): nothing is started or
    recorded for it (no sessions line, no after.json: a later sweep runs it), exit 130."""
    path, study, after, events = fake_sweep
    monkeypatch.setenv("FAKE_SLEEP", "0")
    real_popen, started = subprocess.Popen, []
    first = study.points[0]

    def popen(argv, **kwargs):
        if argv[:2] != ["bash", "-n"]:  # not the --after command's syntax check at the start
            started.append(argv)
        return real_popen(argv, **kwargs)

    def ctrl_c_inside(real):
        def patched(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)  # handled in os.kill: the main thread runs here
            return real(*args, **kwargs)

        return patched

    monkeypatch.setattr(sweep.subprocess, "Popen", popen)
    if child == "train":
        monkeypatch.setattr(sweep, "point_command", ctrl_c_inside(sweep.point_command))
    else:
        monkeypatch.setattr(sweep, "_after_succeeded", ctrl_c_inside(sweep._after_succeeded))
    code = sweep.main(["run", str(path), "--after", after])
    out, err = capsys.readouterr()
    assert code == sweep.EXIT_INTERRUPTED, out + err
    assert not (Path(first.run_dir) / sweep.AFTER_RECORD).exists()
    if child == "train":
        assert started == [] and events() == []
        assert not (Path(first.run_dir) / sweep.SESSIONS).exists()
    else:  # the first point trained; its --after, and everything after it, did not start
        assert [(e["what"], e["point"]) for e in events()] == [("train", first.name)]
        assert len(started) == 1
    assert [sweep.point_state(p) for p in study.points[1:]] == ["new"] * (len(study.points) - 1)


@pytest.mark.parametrize("child", ["train", "after"])
@pytest.mark.parametrize("devices", [None, "0,1"], ids=["one-at-a-time", "slots"])
def test_ctrl_c_right_after_a_process_started_is_passed_on_waited_for_and_recorded(
    fake_sweep, monkeypatch, capsys, tmp_path, devices, child
):
    """A Ctrl-C that comes right after the sweep started a process (a point's training, or its
    --after command), before the sweep waits for it: the sweep passes it on (the process may
    have started after a terminal's Ctrl-C, and ``kill -INT`` reaches the sweep alone), waits
    for the process, records how it ended (130), starts nothing more, exits 130 and puts its
    SIGINT handler back. The Ctrl-C is sent to this process, where the sweep runs, from inside
    its Popen once the process runs: one at a time, on the way out of Popen; with --devices,
    where the main thread goes on starting the slots' threads once the first slot's process
    runs. (Before, it raised KeyboardInterrupt there, and the sweep exited without waiting.)"""
    path, study, after, events = fake_sweep
    monkeypatch.setenv("FAKE_SLEEP", "0")
    real_popen = subprocess.Popen
    started = []  # the stand-in for the process the Ctrl-C comes after
    running, pressed = threading.Event(), threading.Event()

    def ctrl_c():
        try:
            os.kill(os.getpid(), signal.SIGINT)  # handled in os.kill, in the main thread
        finally:
            pressed.set()

    first_call = threading.Lock()  # two slots' threads may start their processes at once

    def popen(argv, **kwargs):
        ours = argv[2:3] == ["train"] if child == "train" else argv[:2] == ["bash", "-c"]
        with first_call:
            if started or not ours:
                ours = False
            else:
                started.append(_start_stops_on_ctrl_c(tmp_path / "ready", real_popen, **kwargs))
        if not ours:
            return real_popen(argv, **kwargs)
        if devices is None:
            ctrl_c()
        else:  # in the first slot's thread: the main thread sends it
            running.set()
            assert pressed.wait(60)
        return started[0]

    slots = []

    class Slot(threading.Thread):
        """A thread as the sweep starts it: from the main thread, the first slot's start waits
        for the stand-in to run and sends the Ctrl-C (the threads a slot starts go on as ever)."""

        def __init__(self, *args, target=None, **kwargs):
            super().__init__(*args, target=target, **kwargs)
            # threading.Thread is patched for every module while this runs (pytest's and the
            # standard library's threads too): a slot is a thread running the sweep's worker.
            self.is_slot = getattr(target, "__module__", None) == sweep.__name__ and (
                target.__name__ == "worker"
            )

        def start(self):
            if self.is_slot:
                slots.append(self)
            super().start()
            if self.is_slot and len(slots) == 1:
                assert threading.current_thread() is threading.main_thread()
                assert running.wait(60)
                ctrl_c()

    monkeypatch.setattr(sweep.subprocess, "Popen", popen)
    if devices is not None:
        monkeypatch.setattr(sweep.threading, "Thread", Slot)
    handler = signal.getsignal(signal.SIGINT)
    argv = ["run", str(path), "--after", after, *(["--devices", devices] if devices else [])]
    try:
        code = sweep.main(argv)
        (proc,) = started
        # Set by the sweep's wait: it passed the Ctrl-C on and waited for the process.
        returncode = proc.returncode
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for slot in slots:  # (a slot the sweep left behind: let it end here, while faked)
            slot.join(60)
    out, err = capsys.readouterr()
    assert code == sweep.EXIT_INTERRUPTED, out + err
    assert returncode == 130, out + err
    assert err.strip().startswith("megatron-s2-sweep: interrupted;"), err
    assert signal.getsignal(signal.SIGINT) == handler
    first, *others = study.points
    if child == "train":
        with open(Path(first.run_dir) / sweep.SESSIONS) as f:
            assert [json.loads(x)["exit_code"] for x in f] == [130]
        assert events() == []  # no other point trained
    else:
        assert _after_record(first)["exit_code"] == 130
        log = (Path(first.run_dir) / sweep.AFTER_LOG).read_text()
        assert log.endswith("# exit code 130\n"), log
        assert [(e["what"], e["point"]) for e in events()] == [("train", first.name)]
    assert [sweep.point_state(p) for p in others] == ["new"] * len(others)
    # As for any Ctrl-C: one at a time no line on the point (its output was shown), with
    # --devices the slot's line on how it ended.
    what = "failed" if child == "train" else "--after failed"
    said = f"point {first.name}: {what} (exit code 130)"
    assert (said in out) == (devices is not None), out


def test_a_further_ctrl_c_is_passed_on_from_any_thread(tmp_path):
    """The first Ctrl-C reached a running process from the terminal too: the sweep only waits;
    a further one it passes on, also from a slot's thread (--devices), where no signal comes."""
    proc = _start_stops_on_ctrl_c(tmp_path / "ready")
    try:
        ctrl_c = sweep._CtrlC()
        ctrl_c.count = 1
        slot = threading.Thread(target=sweep._wait_through_ctrl_c, args=(proc, ctrl_c))
        slot.start()
        slot.join(5 * sweep._CTRL_C_POLL_S)
        assert slot.is_alive() and proc.returncode is None  # not passed on: still waiting
        ctrl_c.count = 2
        slot.join(60)
        assert not slot.is_alive() and proc.returncode == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_point_finished_with_other_settings_is_refused_not_skipped(fake_sweep, capsys):
    """A finished point whose run folder's config.yaml (the trainer's) records other settings
    than the study asks now, where they decide the result (here the learning rate), would be
    skipped as finished and reported as this study's: `run` refuses before training anything,
    naming the setting and the folder, and `list` shows it as stale. Settings of how the run
    executed (data workers) do not count; a folder without a readable config.yaml (carried from
    another lease without it) is finished as before."""
    path, study, after, events = fake_sweep
    assert sweep.main(["run", str(path)]) == sweep.EXIT_OK
    trained = len(events())
    by_name = {p.name: p for p in study.points}

    def write_config(name, edit=None, text=None):
        cfg = by_name[name].config.to_dict()
        if edit:
            edit(cfg)
        target = Path(by_name[name].run_dir) / "config.yaml"
        target.write_text(text if text is not None else yaml.safe_dump(cfg, sort_keys=False))

    write_config("seed=1")  # as asked
    write_config("seed=3", edit=lambda c: c["train"].update(num_workers=7))  # execution only
    write_config("seed=4", text="{not: [yaml")  # unreadable: not compared
    capsys.readouterr()
    assert sweep.main(["run", str(path)]) == sweep.EXIT_OK
    assert len(events()) == trained  # nothing retrained
    assert sweep.stale_settings(by_name["seed=1"]) == []

    write_config("seed=2", edit=lambda c: c["optimizer"].update(lr=0.5))
    capsys.readouterr()
    assert sweep.main(["run", str(path)]) == sweep.EXIT_STUDY_ERROR
    err = capsys.readouterr().err
    assert "point seed=2 finished with other settings than the study asks now" in err
    assert by_name["seed=2"].run_dir in err and "optimizer.lr" in err and "0.5" in err
    assert "move that run folder aside" in err
    assert len(events()) == trained
    assert sweep.main(["list", str(path)]) == sweep.EXIT_OK
    listed = {line.split()[-1]: line.split()[1] for line in capsys.readouterr().out.splitlines()}
    assert listed == {"seed=1": "finished", "seed=2": "stale", "seed=3": "finished",
                      "seed=4": "finished"}  # fmt: skip
    # Another selection that leaves the stale point out runs as before.
    assert sweep.main(["run", str(path), "--settings", "seed=1,seed=3"]) == sweep.EXIT_OK


# ---- adopt: another study's finished runs as this study's points --------------------------------
def _adopt_studies(tmp_path):
    """A source study (dense and the default hybrid, seeds 1-2) and a target grid over
    vert_stride with the dense reference, seeds 1-2: the grid's vert_stride=2 (the base's) and
    dense points train exactly what the source's points did."""
    common = {"overrides": [*TINY, "train.train_iters=6"], "seeds": [1, 2]}
    src_dir, dst_dir = tmp_path / "src", tmp_path / "dst"
    src_dir.mkdir(), dst_dir.mkdir()
    source = write_study(
        src_dir, name="seeds", output_dir=str(tmp_path / "sweeps" / "seeds"), **common,
        points=[{"name": "dense", "attention.dense_layers.pattern": "D"},
                {"name": "hybrid", "attention.dense_layers.pattern": "DS"}],
    )  # fmt: skip
    target = write_study(
        dst_dir, name="grid", output_dir=str(tmp_path / "sweeps" / "grid"), **common,
        grid={"attention.s2.vert_stride": [2, 4]},
        points=[{"name": "dense", "attention.dense_layers.pattern": "D"}],
    )  # fmt: skip
    return source, target


def _fake_finished(point, run_dir=None, config=None):
    """A finished run folder of ``point``: summary at its last step, metrics, a checkpoint."""
    run = Path(run_dir or point.run_dir)
    (run / "checkpoints" / "iter_0000006").mkdir(parents=True)
    (run / "checkpoints" / "iter_0000006" / "weights.pt").write_bytes(os.urandom(64))
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("6")
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "iteration": 6}) + "\n")
    iters = point.config.train.train_iters
    (run / "summary.json").write_text(json.dumps({"name": point.name, "iteration": iters}))
    if config is not None:
        (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return run


def test_adopt_copies_the_runs_that_trained_what_a_point_asks(tmp_path, capsys):
    """`adopt --from OTHER` gives each not-started point a copy of another study's finished run
    that trained exactly its settings (here the grid's base stride and its dense reference,
    found by settings, not by name), with adopted.json saying where from; checkpoints are
    hard-linked, the rest copied; `list` shows them finished and adopted; --dry-run copies
    nothing; a second adopt finds nothing left to adopt."""
    source_path, target_path = _adopt_studies(tmp_path)
    source, target = load_study(source_path), load_study(target_path)
    for p in source.points:
        _fake_finished(p)
    unfinished = source.points[-1]  # hybrid seed 2: stopped before its last step
    (Path(unfinished.run_dir) / "summary.json").write_text(json.dumps({"iteration": 3}))

    argv = ["adopt", str(target_path), "--from", str(source_path)]
    assert sweep.main([*argv, "--dry-run"]) == sweep.EXIT_OK
    out = capsys.readouterr().out
    assert out.count("would adopt") == 3 and "3 point(s) would be adopted" in out, out
    assert not (tmp_path / "sweeps" / "grid").exists()

    assert sweep.main(argv) == sweep.EXIT_OK
    out = capsys.readouterr().out
    by_name = {p.name: p for p in target.points}
    src = {p.name: p for p in source.points}
    expected = {"vert_stride=2,seed=1": "hybrid,seed=1", "dense,seed=1": "dense,seed=1",
                "dense,seed=2": "dense,seed=2"}  # fmt: skip
    for name, p in by_name.items():
        if name not in expected:
            assert sweep.point_state(p) == "new", name
            continue
        assert sweep.point_state(p) == "finished", name
        origin = src[expected[name]]
        record = json.loads((Path(p.run_dir) / sweep.ADOPTED).read_text())
        assert record["from"] == os.path.abspath(origin.run_dir) and record["point"] == origin.name
        assert record["compared_with"] == "its study point as resolved now"
        weights = "checkpoints/iter_0000006/weights.pt"
        a, b = Path(origin.run_dir), Path(p.run_dir)
        assert (a / weights).read_bytes() == (b / weights).read_bytes()
        assert os.path.samefile(a / weights, b / weights)  # hard link: no second copy
        # Files a resumed target rewrites or appends to are its own copies.
        for own in ("metrics.jsonl", "checkpoints/latest_checkpointed_iteration.txt"):
            assert (a / own).read_text() == (b / own).read_text()
            assert not os.path.samefile(a / own, b / own), own
    assert "3 point(s) adopted from seeds; 3 of grid's 6 valid points left to train" in out, out
    assert sweep.main(["list", str(target_path)]) == sweep.EXIT_OK
    listed = capsys.readouterr().out
    assert listed.count("finished") == 3 and listed.count("(adopted: ") == 3, listed
    assert sweep.main(argv) == sweep.EXIT_OK
    assert "0 point(s) adopted" in capsys.readouterr().out


def test_adopt_takes_no_run_that_trained_otherwise(tmp_path, capsys):
    """A source run whose own config.yaml records other settings than the point asks is not
    adopted, also where they only change the numerics (micro-batch size) or the initialisation
    scale, nor where they are the study's (the seed); only logging and data workers may differ.
    A not-empty target folder is refused, naming it; no finished source run is an error."""
    source_path, target_path = _adopt_studies(tmp_path)
    source, target = load_study(source_path), load_study(target_path)
    argv = ["adopt", str(target_path), "--from", str(source_path)]
    assert sweep.main(argv) == sweep.EXIT_STUDY_ERROR
    assert "no finished run of seeds in" in capsys.readouterr().err

    src = {p.name: p for p in source.points}
    dense_point = {p.name: p for p in target.points}["dense,seed=1"]
    assert sweep.adoption_changes(src["dense,seed=1"].config.to_dict(), dense_point) == []
    assert sweep.adoption_changes(src["dense,seed=2"].config.to_dict(), dense_point)  # seed

    def edited(name, edit):
        cfg = src[name].config.to_dict()
        edit(cfg)
        return cfg

    _fake_finished(src["dense,seed=1"], config=edited("dense,seed=1", lambda c: c["train"].update(
        micro_batch_size=1)))  # fmt: skip
    _fake_finished(src["dense,seed=2"], config=edited("dense,seed=2", lambda c: c["model"].update(
        init_method_std=0.5)))  # fmt: skip
    _fake_finished(src["hybrid,seed=1"], config=edited("hybrid,seed=1", lambda c: (
        c["train"].update(num_workers=9), c["logging"].update(plot=False))))  # fmt: skip
    _fake_finished(src["hybrid,seed=2"], config=edited("hybrid,seed=2", lambda c: c["optimizer"]
        .update(lr=0.5)))  # fmt: skip
    changes = sweep.adoption_changes(
        yaml.safe_load((Path(src["dense,seed=2"].run_dir) / "config.yaml").read_text()),
        {p.name: p for p in target.points}["dense,seed=2"],
    )
    assert [c.key for c in changes] == ["model.init_method_std"]
    blocked = {p.name: p for p in target.points}["vert_stride=2,seed=1"]
    Path(blocked.run_dir).mkdir(parents=True)
    (Path(blocked.run_dir) / "notes.txt").write_text("mine")
    assert sweep.main(argv) == sweep.EXIT_STUDY_ERROR
    out, err = capsys.readouterr()
    assert f"its run folder {blocked.run_dir} holds files of no finished run" in err, err
    assert "0 point(s) adopted" in out, out  # micro-batch, init scale, lr: none matches
    (Path(blocked.run_dir) / "notes.txt").unlink()
    assert sweep.main(argv) == sweep.EXIT_OK
    out = capsys.readouterr().out
    assert "1 point(s) adopted" in out and "compared with its config.yaml" in out, out
    assert sweep.point_state(blocked) == "finished"


def test_overrides_may_follow_the_options(tmp_path, capsys):
    """`run STUDY --devices 0,1 key=value ...` as the study files write it: the overrides after
    the options count as overrides; anything else after them is still refused."""
    path = write_study(tmp_path, name="o", overrides=[*TINY, "train.train_iters=6"],
                       points=[{"train.seed": 1}], output_dir=str(tmp_path / "out"))  # fmt: skip
    assert sweep.main(["list", str(path), "--output-dir", str(tmp_path / "x"),
                       "model.num_layers=0"]) == sweep.EXIT_OK  # fmt: skip
    assert "model.num_layers" in capsys.readouterr().out  # the override reached the point
    with pytest.raises(SystemExit):
        sweep.main(["list", str(path), "--output-dir", str(tmp_path / "x"), "stray"])
    assert "unrecognized arguments: stray" in capsys.readouterr().err


def test_adopt_compares_what_a_resume_does_not(tmp_path, capsys):
    """What decides a new run's result but not a resume's: the weights it started from
    (checkpoint.load_dir, reset_iteration) and the initialisation scale; a key an older
    config.yaml lacks counts as its default (so a point asking otherwise does not match); the
    logging interval counts, when checkpoints were saved does not."""
    source_path, target_path = _adopt_studies(tmp_path)
    source, target = load_study(source_path), load_study(target_path)
    cfg = {p.name: p for p in source.points}["dense,seed=1"].config.to_dict()
    point = {p.name: p for p in target.points}["dense,seed=1"]

    def keys(edit):
        c = json.loads(json.dumps(cfg))
        edit(c)
        return [x.key for x in sweep.adoption_changes(c, point)]

    assert keys(lambda c: None) == []
    assert keys(lambda c: c["checkpoint"].update(load_dir="/base/checkpoints")) == [
        "checkpoint.load_dir"
    ]
    assert keys(lambda c: c["checkpoint"].update(reset_iteration=True)) == [
        "checkpoint.reset_iteration"
    ]
    assert keys(lambda c: c["checkpoint"].update(save_interval=3, keep_last=1)) == []
    assert keys(lambda c: c["logging"].update(log_interval=5)) == ["logging.log_interval"]
    assert keys(lambda c: c["train"].update(precision="fp32")) == ["train.precision"]
    # An older config.yaml without train.eod_mask_loss: its default (False) against True.
    older = json.loads(json.dumps(cfg))
    del older["train"]["eod_mask_loss"]
    assert sweep.adoption_changes(older, point) == []
    point.config.train.eod_mask_loss = True
    assert [c.key for c in sweep.adoption_changes(older, point)] == ["train.eod_mask_loss"]


def test_adopt_takes_only_whole_runs_each_once(tmp_path, capsys, monkeypatch):
    """A source run whose summary stops short of the point's last step is not adopted, even
    where its own study now asks fewer steps; a source run another point adopted in an earlier
    call is not adopted again; studies on other numbers of processes adopt nothing; a copy that
    fails midway leaves the point as it was (not finished) and the others are adopted."""
    source_path, target_path = _adopt_studies(tmp_path)
    target = load_study(target_path)
    short = load_study(source_path, extra_overrides=["train.train_iters=3"])
    # Its study asks 3 steps now, the run reached 3; the grid asks 6.
    for p in short.points:
        _fake_finished(p)
    argv = ["adopt", str(target_path), "--from", str(source_path), "train.train_iters=3"]
    # (the same override for the target: its points ask 3 steps too, and do match)
    assert sweep.main([*argv, "--dry-run"]) == sweep.EXIT_OK
    assert "4 point(s) would be adopted" in capsys.readouterr().out
    full = ["adopt", str(target_path), "--from", str(source_path)]
    assert all(p.config.train.train_iters == 6 for p in target.points)
    monkeypatch.setattr(sweep, "adoption_changes", lambda cfg, point: [])  # settings aside
    assert sweep.adopt_runs(target, short) == sweep.EXIT_OK
    assert "0 point(s) adopted" in capsys.readouterr().out
    monkeypatch.undo()

    # Whole runs of 6 steps: a failing copy for one point, the others adopted.
    for p in load_study(source_path).points:
        (Path(p.run_dir) / "summary.json").write_text(json.dumps({"iteration": 6}))
    real = sweep._copy_run
    failing = {p.name: p for p in target.points}["dense,seed=1"]

    def copy(src, dst):
        if dst.startswith(failing.run_dir):
            real(src, dst)
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(sweep, "_copy_run", copy)
    assert sweep.main(full) == sweep.EXIT_STUDY_ERROR
    out, err = capsys.readouterr()
    assert "point dense,seed=1: copying" in err and "No space left" in err, err
    assert "3 point(s) adopted" in out, out
    assert sweep.point_state(failing) == "new"
    assert not os.path.exists(failing.run_dir + ".adopting")
    monkeypatch.setattr(sweep, "_copy_run", real)
    assert sweep.main(full) == sweep.EXIT_OK  # again: the one left, no run taken twice
    assert "1 point(s) adopted" in capsys.readouterr().out
    froms = [json.loads((Path(p.run_dir) / sweep.ADOPTED).read_text())["from"]
             for p in target.points if (Path(p.run_dir) / sweep.ADOPTED).exists()]  # fmt: skip
    assert len(froms) == len(set(froms)) == 4

    other = write_study(tmp_path, name="wide", output_dir=str(tmp_path / "sweeps" / "wide"),
                        nproc_per_node=2, overrides=[*TINY, "train.train_iters=6"],
                        points=[{"train.seed": 1}])  # fmt: skip
    assert sweep.main(["adopt", str(other), "--from", str(source_path)]) == sweep.EXIT_STUDY_ERROR
    assert "nproc_per_node" in capsys.readouterr().err


def test_adopt_gives_one_run_to_one_point_over_calls(tmp_path, capsys):
    """Two points that differ only in what adopt ignores (data workers) both match one source
    run: the first takes it, the second gets nothing, in this call or a later one."""
    source = write_study(
        tmp_path, name="one", output_dir=str(tmp_path / "one"),
        overrides=[*TINY, "train.train_iters=6"], points=[{"train.seed": 1}],
    )  # fmt: skip
    (tmp_path / "t").mkdir()
    target = write_study(tmp_path / "t", name="two", output_dir=str(tmp_path / "two"),
                         overrides=[*TINY, "train.train_iters=6", "train.seed=1"],
                         points=[{"name": "a", "train.num_workers": 1},
                                 {"name": "b", "train.num_workers": 2}])  # fmt: skip
    _fake_finished(load_study(source).points[0])
    argv = ["adopt", str(target), "--from", str(source)]
    for _ in range(2):
        assert sweep.main(argv) == sweep.EXIT_OK
    out = capsys.readouterr().out
    assert out.count("adopted /") == 1 and "point a: adopted" in out, out
    assert [sweep.point_state(p) for p in load_study(target).points] == ["finished", "new"]


def test_tables_name_adopted_runs_and_the_summary_shows_the_grid(tmp_path, capsys):
    """After `adopt`, `run` says where each adopted point came from; results.csv gets an
    adopted_from column and results.md a list of them (their speed and wall time are the
    source's); the seed summary shows the grid's axis (vert_stride) beside the pattern."""
    source_path, target_path = _adopt_studies(tmp_path)
    source, target = load_study(source_path), load_study(target_path)

    def metrics(point, loss):
        recs = [{"kind": "train", "iteration": i, "loss": loss + 1, "tokens_per_s": 100.0,
                 "step_time_s": 1.0, "consumed_samples": 4 * i} for i in range(1, 7)]  # fmt: skip
        recs.append({"kind": "valid", "iteration": 6, "loss": loss})
        run = Path(point.run_dir)
        run.mkdir(parents=True, exist_ok=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (run / "summary.json").write_text(json.dumps({"iteration": 6}))

    for i, p in enumerate(source.points):
        metrics(p, 3.0 + i / 10)
    assert sweep.main(["adopt", str(target_path), "--from", str(source_path)]) == sweep.EXIT_OK
    for p in target.points:
        if sweep.point_state(p) == "new":
            metrics(p, 2.5)
    capsys.readouterr()
    assert sweep.main(["run", str(target_path)]) == sweep.EXIT_OK  # nothing left to train
    out = capsys.readouterr().out
    src = {p.name: p for p in source.points}
    assert f"point dense,seed=1: adopted from {src['dense,seed=1'].run_dir}, not rerun" in out
    assert "point vert_stride=4,seed=1: finished, not rerun" in out
    out_dir = Path(target.output_dir)
    with open(out_dir / "results.csv") as f:
        rows = {r["point"]: r for r in csv.DictReader(f)}
    assert rows["dense,seed=2"]["adopted_from"] == src["dense,seed=2"].run_dir
    assert rows["vert_stride=2,seed=1"]["adopted_from"] == src["hybrid,seed=1"].run_dir
    assert rows["vert_stride=4,seed=1"]["adopted_from"] == ""
    md = (out_dir / "results.md").read_text()
    assert f"- `dense,seed=1` from `{src['dense,seed=1'].run_dir}`" in md
    assert md.count("` from `") == 4
    summary = (out_dir / "summary.md").read_text()
    header = next(line for line in summary.splitlines() if line.startswith("| setting"))
    assert "attention.s2.vert_stride" in header and "train.seed" not in header, header


def test_the_seed_summary_leaves_out_where_runs_loaded_from(tmp_path):
    """A study's axes include checkpoint.load_dir where its points load other runs (an
    extension study): the summary shows the settings, not that path."""
    from megatron_s2.training.seed_stats import write_summary

    rows = [{"point": f"{s},seed={k}", "setting": s, "status": "finished", "train.seed": str(k),
             "attention.dense_layers.pattern": p, "checkpoint.load_dir": f"base/{s},seed={{seed}}",
             "attention.dense_layers.rotary_base": r, "final_valid_loss": 2.0 + k / 100,
             "tokens_per_s": 100.0}
            for s, p, r in (("dense", "D", ""), ("rope", "DS", "8000000"))
            for k in (1, 2)]  # fmt: skip
    axes = ["attention.dense_layers.pattern", "checkpoint.load_dir",
            "attention.dense_layers.rotary_base", "train.seed"]  # fmt: skip
    write_summary(rows, str(tmp_path), reference="dense", axes=axes)
    with open(tmp_path / "summary.csv") as f:
        header = next(csv.reader(f))
    assert header[:3] == ["setting", "attention.dense_layers.pattern",
                          "attention.dense_layers.rotary_base"], header  # fmt: skip
    assert "checkpoint.load_dir" not in header and "train.seed" not in header


def test_the_eod_first_studies_are_the_long_base_with_eod_first(tmp_path):
    """docs/long_context_eval.md "Next leases" step 4b: the depth-0 studies with EOD at every
    sample's first position differ from the long base's point for point only by
    train.eod_first and by loading the eod-first base of the same seed."""
    corpus = _corpus_overrides(tmp_path)

    def points(name):
        study = load_study(REPO / "configs" / "studies" / f"{name}.yaml", extra_overrides=corpus)
        return study, {p.name: p.config.to_dict() for p in study.points}

    base = "retrieval-125m-4k-base-long"
    for plain_name in (base, "retrieval-125m-extend-32k-longbase"):
        (plain_study, plain), (study, got_points) = (
            points(plain_name),
            points(f"{plain_name}-eodfirst"),
        )
        assert study.nproc_per_node == plain_study.nproc_per_node
        assert sorted(got_points) and set(got_points) <= set(plain)
        for name, got in got_points.items():
            want = plain[name]
            assert got["train"].pop("eod_first") is True and want["train"].pop("eod_first") is False
            load, plain_load = got["checkpoint"].pop("load_dir"), want["checkpoint"].pop("load_dir")
            if plain_load is not None:
                plain_load = plain_load.replace(f"{base}/", f"{base}-eodfirst/")
            assert load == plain_load, name
            for d in (got, want):
                d.pop("name")
                d["logging"].pop("run_dir")
            assert got == want, name


def test_the_sinks_studies_are_the_long_base_with_sinks_on_every_layer(tmp_path):
    """docs/long_context_eval.md "Next leases" step 4: the depth-0 studies differ from the long
    base's point for point only by the sinks (dense layers; the switch's S2 layers too, as its
    base had them on every layer) and by loading the sinks base of the same seed."""
    corpus = _corpus_overrides(tmp_path)

    def points(name):
        study = load_study(REPO / "configs" / "studies" / f"{name}.yaml", extra_overrides=corpus)
        return study, {p.name: p.config.to_dict() for p in study.points}

    for plain_name, sinks_name in (
        ("retrieval-125m-4k-base-long", "retrieval-125m-4k-base-long-sinks"),
        ("retrieval-125m-extend-32k-longbase", "retrieval-125m-extend-32k-longbase-sinks"),
    ):
        (plain_study, plain), (sinks_study, sinks) = points(plain_name), points(sinks_name)
        assert sinks_study.nproc_per_node == plain_study.nproc_per_node
        assert sorted(sinks) and set(sinks) <= set(plain)
        for name, got in sinks.items():
            want = plain[name]
            dense = got["attention"]["dense_layers"]
            assert dense.pop("sinks") is True
            switched = "DSDSDSDSSSDD" in name
            assert got["attention"]["s2"].pop("sinks", False) is switched
            load, plain_load = got["checkpoint"].pop("load_dir"), want["checkpoint"].pop("load_dir")
            if plain_load is not None:
                plain_load = plain_load.replace(
                    "retrieval-125m-4k-base-long/", "retrieval-125m-4k-base-long-sinks/"
                )
            assert load == plain_load, name
            for d in (got, want):
                d.pop("name")
                d["logging"].pop("run_dir")
            assert got == want, name
        # The runs build: every point's schedule passes the model checks.
        for p in sinks_study.points:
            schedule = p.config.schedule()
            assert schedule.dense_sinks
            schedule.validate(12, 12, 12, seq_length=p.config.model.seq_length)
