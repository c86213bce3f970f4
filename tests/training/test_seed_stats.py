"""Seeds as a first-class sweep axis, and the seeded summary (intervals, paired differences,
the differences-within-noise verdict) that docs/quality.md's tables are recomputed with."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats

from megatron_s2.training import seed_stats, sweep
from megatron_s2.training.sweep import StudyError, load_study
from tests.helpers.megatron import run_tool_main
from tests.training.test_sweep import write_study

# Independent of the megatron-core version: CI runs this module in its first suite only. Study
# files, statistics and tools/quality_tables.py: megatron-core is imported neither here nor in
# any process a test starts (checked with an import hook on the whole module).
pytestmark = pytest.mark.version_independent

REPO = Path(__file__).resolve().parents[2]


# ---- the study file ----------------------------------------------------------------------------
def test_seeds_expand_every_point_with_the_seed_last(tmp_path):
    path = write_study(
        tmp_path,
        overrides={"train.train_iters": 50},
        grid={"attention.s2.vert_stride": [2, 4]},
        points=[{"name": "dense", "attention.dense_layers.pattern": "D"}],
        seeds=[7, 3],
        reference="dense",
    )
    study = load_study(path, output_dir=str(tmp_path / "out"))
    assert [p.name for p in study.points] == [
        "vert_stride=2,seed=7",
        "vert_stride=2,seed=3",
        "vert_stride=4,seed=7",
        "vert_stride=4,seed=3",
        "dense,seed=7",
        "dense,seed=3",
    ]
    assert [p.setting for p in study.points] == [
        "vert_stride=2",
        "vert_stride=2",
        "vert_stride=4",
        "vert_stride=4",
        "dense",
        "dense",
    ]
    assert study.axes[-1] == "train.seed" and study.seeds == [7, 3]
    assert [p.config.train.seed for p in study.points] == [7, 3, 7, 3, 7, 3]
    assert all(p.valid for p in study.points)
    # The seed reaches the trainer's command line like every other point value.
    argv, _ = sweep.point_command(study, study.points[1])
    assert "train.seed=3" in argv


def test_seed_field_in_values_and_seeds_subset(tmp_path, monkeypatch, capsys):
    """{seed} in a value becomes each point's seed (an extension loading the base run of the
    same seed); ``run --seeds`` runs only those seeds' points and collects all of them."""
    path = write_study(
        tmp_path,
        overrides={"train.train_iters": 50, "checkpoint.load_dir": "base/runs/d,seed={seed}/ck"},
        points=[{"name": "dense", "attention.dense_layers.pattern": "D"}],
        seeds=[1, 2, 3],
    )
    study = load_study(path, output_dir=str(tmp_path / "out"))
    assert [p.config.checkpoint.load_dir for p in study.points] == [
        f"base/runs/d,seed={k}/ck" for k in (1, 2, 3)
    ]
    assert [p.name for p in sweep.only_seeds(study, [3, 1])] == ["dense,seed=1", "dense,seed=3"]
    with pytest.raises(StudyError, match="--seeds 4: not among the study's seeds"):
        sweep.only_seeds(study, [4])
    ran, collected = [], []
    monkeypatch.setattr(
        sweep, "run_local", lambda st, dev, after=None: ran.extend(p.name for p in st.points) or 0
    )
    monkeypatch.setattr(
        sweep, "collect_and_write", lambda st: collected.extend(p.name for p in st.points)
    )
    code = sweep.main(["run", str(path), "--output-dir", str(tmp_path / "out"), "--seeds", "2"])
    assert code == 0 and ran == ["dense,seed=2"]
    assert collected == ["dense,seed=1", "dense,seed=2", "dense,seed=3"]
    assert sweep.main(["run", str(path), "--seeds", "x"]) == sweep.EXIT_STUDY_ERROR
    ran.clear()
    code = sweep.main(
        [
            "run",
            str(path),
            "--output-dir",
            str(tmp_path / "out"),
            "--settings",
            "dense",
            "--seeds",
            "1,3",
        ]
    )
    assert code == 0 and ran == ["dense,seed=1", "dense,seed=3"]
    # `list` chooses the same points (what a lease with --seeds would train).
    out = ["--output-dir", str(tmp_path / "out")]
    capsys.readouterr()
    assert sweep.main(["list", str(path), *out, "--seeds", "1,3"]) == sweep.EXIT_OK
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[-1] for line in listed] == ["dense,seed=1", "dense,seed=3"]
    assert sweep.main(["list", str(path), *out, "--settings", "nope"]) == sweep.EXIT_STUDY_ERROR
    with pytest.raises(
        StudyError, match="--settings nope: not a setting of the study; its settings: dense"
    ):
        sweep.only_settings(study, ["nope"])
    no_seeds = write_study(
        tmp_path, name="n", overrides={"checkpoint.load_dir": "b/{seed}"}, points=[{"name": "a"}]
    )
    with pytest.raises(StudyError, match="uses \\{seed\\} but the study has no seeds"):
        load_study(no_seeds, output_dir=str(tmp_path / "n"))


def test_settings_may_name_grid_points_whose_names_hold_commas(tmp_path, monkeypatch):
    """``run --settings`` on a grid study: a grid point's setting is itself a comma list
    (``vert_stride=4,local_blocks=8``), so the list is read by the longest known setting; an
    unknown piece is refused with the study's settings listed."""
    path = write_study(
        tmp_path,
        overrides={"train.train_iters": 50},
        grid={"attention.s2.vert_stride": [4, 8], "attention.s2.local_blocks": [8, 16]},
        points=[{"name": "dense", "attention.dense_layers.pattern": "D"}],
        seeds=[1, 2],
    )
    study = load_study(path, output_dir=str(tmp_path / "out"))
    cells = [f"vert_stride={v},local_blocks={b}" for v in (4, 8) for b in (8, 16)]
    assert set(dict.fromkeys(p.setting for p in study.points)) == {*cells, "dense"}
    raw = f"{cells[0]},dense,{cells[3]}"
    assert sweep.split_settings(study, raw) == [cells[0], "dense", cells[3]]
    assert sweep.split_settings(study, "vert_stride=4,nope") == ["vert_stride=4", "nope"]
    ran = []
    monkeypatch.setattr(
        sweep, "run_local", lambda st, dev, after=None: ran.extend(p.name for p in st.points) or 0
    )
    monkeypatch.setattr(sweep, "collect_and_write", lambda st: None)
    out = ["--output-dir", str(tmp_path / "out")]
    assert sweep.main(["run", str(path), *out, "--settings", raw, "--seeds", "2"]) == 0
    assert sorted(ran) == sorted([f"{cells[0]},seed=2", "dense,seed=2", f"{cells[3]},seed=2"])
    ran.clear()
    code = sweep.main(["run", str(path), *out, "--settings", "vert_stride=4,local_blocks=9"])
    assert code == sweep.EXIT_STUDY_ERROR and not ran


def test_a_study_without_seeds_names_points_as_before(tmp_path):
    study = load_study(write_study(tmp_path, points=[{"name": "a", "train.seed": 5}]))
    assert [(p.name, p.setting) for p in study.points] == [("a", "a")]
    assert study.seeds is None and study.points[0].config.train.seed == 5


@pytest.mark.parametrize(
    "study, message",
    [
        ({"seeds": [], "points": [{}]}, "seeds must be a non-empty list"),
        ({"seeds": [1, "2"], "points": [{}]}, "seeds must be a non-empty list of integers"),
        ({"seeds": [-1], "points": [{}]}, "integers >= 0"),
        ({"seeds": [1, 1], "points": [{}]}, "seeds has a value twice"),
        ({"seeds": [1], "points": [{"train.seed": 2}]}, "train.seed is set in grid/points"),
        ({"seeds": [1], "overrides": {"train.seed": 2}, "points": [{}]}, "set in overrides"),
        ({"seeds": [1], "points": [{"name": "a"}], "reference": "b"}, "reference 'b' is not"),
        ({"points": [{"name": "a"}], "reference": 3}, "reference must be a point's name"),
    ],
)
def test_seed_settings_are_checked_at_load(tmp_path, study, message):
    with pytest.raises(StudyError) as e:
        load_study(write_study(tmp_path, **study))
    assert message in str(e.value)


def _folder(root: Path, name: str) -> Path:
    (root / name).mkdir(exist_ok=True)
    return root / name


def test_train_seed_as_a_grid_axis_is_the_seeds_axis(tmp_path):
    # A user writes the seeds as one more grid axis: the same study as a seeds list (settings
    # grouped over their seeds, the seed named last), not one setting per seed.
    grid = {"train.seed": [1, 2], "attention.dense_layers.pattern": ["D", "DS"]}
    as_grid = load_study(
        write_study(_folder(tmp_path, "g"), grid=grid), output_dir=str(tmp_path / "o")
    )
    listed = load_study(
        write_study(
            _folder(tmp_path, "s"),
            grid={"attention.dense_layers.pattern": ["D", "DS"]},
            seeds=[1, 2],
        ),
        output_dir=str(tmp_path / "o"),
    )
    assert as_grid.seeds == listed.seeds == [1, 2]
    assert as_grid.axes == listed.axes and as_grid.axes[-1] == "train.seed"
    assert [(p.name, p.setting) for p in as_grid.points] == [
        (p.name, p.setting) for p in listed.points
    ]
    assert [p.name for p in as_grid.points][:2] == ["pattern=D,seed=1", "pattern=D,seed=2"]
    assert [p.config.train.seed for p in as_grid.points] == [1, 2, 1, 2]
    # Seeds alone: the base config once per seed.
    alone = load_study(write_study(_folder(tmp_path, "a"), grid={"train.seed": [5, 6]}))
    assert [(p.name, p.setting) for p in alone.points] == [
        ("base,seed=5", "base"),
        ("base,seed=6", "base"),
    ]
    # Both forms at once, or seeds that are not distinct integers >= 0, are refused.
    both = write_study(_folder(tmp_path, "b"), grid={"train.seed": [1]}, seeds=[1, 2], points=[{}])
    with pytest.raises(StudyError, match="set in grid and the study has seeds"):
        load_study(both)
    bad = write_study(_folder(tmp_path, "x"), grid={"train.seed": [1, 1]}, points=[{}])
    with pytest.raises(
        StudyError, match=r"grid.train.seed \(the study's seeds\): seeds has a value twice"
    ):
        load_study(bad)


def test_seed_on_the_command_line_and_in_seeds_is_refused(tmp_path):
    path = write_study(tmp_path, seeds=[1, 2], points=[{"name": "a"}])
    with pytest.raises(StudyError, match="set in command line"):
        load_study(path, extra_overrides=["train.seed=4"])


def test_the_16k_seeded_study_loads_at_equal_tokens(tmp_path):
    corpus = [
        "data.demo=false",
        f"data.blend=[{tmp_path}/train_valid]",
        "data.split=100,3,0",
        f"data.tokenizer={tmp_path}/tokenizer",
    ]
    study = load_study(
        REPO / "configs" / "studies" / "code-125m-16k-seeds.yaml", extra_overrides=corpus
    )
    assert all(p.valid for p in study.points), [p.error for p in study.points]
    assert len(study.points) == 12 and study.reference == "dense"
    assert {p.config.model.seq_length for p in study.points} == {16384}
    per_setting: dict = {}
    for p in study.points:
        per_setting.setdefault(p.setting, []).append(p.config.train.seed)
    assert per_setting == {s: [1, 2, 3] for s in ("dense", "hybrid-DS", "hybrid-SSSD", "all-s2")}
    tokens = {
        p.config.train.train_iters * p.config.train.global_batch_size * p.config.model.seq_length
        for p in study.points
    }
    assert tokens == {366 * 8 * 16384}  # 48.0M tokens per run


# ---- statistics ----------------------------------------------------------------------------------
def test_mean_interval_is_students_t():
    rng = random.Random(0)
    for n in (2, 3, 5):
        xs = [rng.gauss(3.0, 0.1) for _ in range(n)]
        est = seed_stats.mean_interval(xs)
        lo, hi = stats.t.interval(0.95, n - 1, loc=sum(xs) / n, scale=stats.sem(xs))
        assert est.n == n
        assert est.low == pytest.approx(lo, rel=1e-12) and est.high == pytest.approx(hi, rel=1e-12)
    one = seed_stats.mean_interval([2.5])
    assert one.half_width is None and one.text() == "2.5000"
    with pytest.raises(ValueError):
        seed_stats.mean_interval([])


def test_paired_difference_uses_the_same_seeds_and_welch_otherwise():
    ref = {"1": 3.00, "2": 3.10, "3": 2.95}
    # The same seed shifts both: pairing sees a steady +1% where the spread between seeds is 5%.
    arm = {s: v * 1.01 + (0.0001 if s == "2" else 0.0) for s, v in ref.items()}
    diff, how = seed_stats.difference_interval(arm, ref)
    assert how == "paired"
    ref_mean = sum(ref.values()) / 3
    d = [(arm[s] - ref[s]) * 100 / ref_mean for s in ref]
    res = stats.ttest_rel([arm[s] for s in ref], [ref[s] for s in ref])
    ci = res.confidence_interval()
    assert diff.mean == pytest.approx(sum(d) / 3)
    assert diff.low == pytest.approx(ci.low * 100 / ref_mean)
    assert seed_stats.verdict(diff) == "higher (worse)"
    # Different seeds: Welch's interval of the difference of the means.
    other = {"4": 2.99, "5": 3.12, "6": 2.97}
    diff2, how2 = seed_stats.difference_interval(other, ref)
    assert how2 == "Welch"
    ci2 = stats.ttest_ind(list(other.values()), list(ref.values()), equal_var=False)
    ci2 = ci2.confidence_interval()
    assert diff2.low == pytest.approx(ci2.low * 100 / ref_mean)
    assert diff2.high == pytest.approx(ci2.high * 100 / ref_mean)
    assert seed_stats.verdict(diff2) == "no difference"
    assert seed_stats.difference_interval({"1": 3.0}, {"2": 3.1}) == (None, "")


@pytest.mark.parametrize(
    "mean, half, expected",
    [
        (0.5, 1.0, "no difference"),
        (-0.5, 1.0, "no difference"),
        (1.5, 1.0, "higher (worse)"),
        (-1.5, 1.0, "lower (better)"),
        (1.5, None, "one seed: no interval"),
    ],
)
def test_verdict_never_calls_a_difference_inside_the_interval(mean, half, expected):
    assert seed_stats.verdict(seed_stats.Estimate(mean, half, 3)) == expected


# ---- summary from the sweep's table ------------------------------------------------------------
def _rows(losses: dict, speeds: dict):
    """results.csv-like rows (strings) for settings -> [loss per seed]."""
    rows = []
    for setting, per_seed in losses.items():
        for seed, loss in enumerate(per_seed, start=1):
            rows.append(
                {
                    "point": f"{setting},seed={seed}",
                    "status": "finished",
                    "setting": setting,
                    "attention.dense_layers.pattern": {"dense": "D"}.get(setting, "DS"),
                    "train.seed": str(seed),
                    "model.seq_length": "16384",
                    "final_valid_loss": repr(loss),
                    "tokens_per_s": repr(speeds[setting][seed - 1]),
                }
            )
    return rows


def _write_results(path, rows):
    """``rows`` written as a sweep's results.csv at ``path`` (returned)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def test_frontier_figure_names_every_setting_in_its_legend():
    """Each setting with a speed is one point in the frontier plot, named in the legend (with
    the Pareto front) and not by a label on the axes, where labels of close points overlap;
    each point its own marker and colour, so that twelve settings stay told apart."""
    import matplotlib.pyplot as plt

    names = [f"vert_stride={v},local_blocks={w}" for v in (4, 8, 12) for w in (8, 16, 32)]
    names += ["dense", "extra-a", "extra-b"]  # twelve: past tab10's colours
    losses = {n: [3.0 + 0.01 * i, 3.1 + 0.01 * i] for i, n in enumerate(names)}
    speeds = {n: [100.0 + i, 101.0 + i] for i, n in enumerate(names)}
    rows = _rows(losses, speeds)
    summaries = seed_stats.summarize(rows, "dense")
    fig = seed_stats.frontier_figure(summaries, "grid")
    try:
        ax = fig.axes[0]
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert sorted(labels) == sorted([*names, "Pareto front (means)"])
        assert len(ax.texts) == 0  # no labels on the axes
        assert ax.get_title() == "grid"
        styles = {
            (c.lines[0].get_marker(), c.lines[0].get_color())
            for c in ax.containers  # one ErrorbarContainer per setting
        }
        assert len(ax.containers) == len(names) and len(styles) == len(names)
    finally:
        plt.close(fig)


def test_summary_table_and_files(tmp_path):
    rows = _rows(
        {"dense": [3.00, 3.10, 2.95], "hybrid": [3.01, 3.11, 2.96]},
        {"dense": [100.0, 101.0, 99.0], "hybrid": [120.0, 121.0, 119.0]},
    )
    rows.append({**rows[0], "point": "x,seed=1", "setting": "x", "status": "failed"})
    out = seed_stats.summarize(rows, "dense", ["attention.dense_layers.pattern"])
    assert [s.setting for s in out] == ["dense", "hybrid"]  # a failed run is left out
    hyb = out[1]
    assert hyb.speedup == pytest.approx(1.2)
    assert hyb.loss_diff_method == "paired" and hyb.verdict == "higher (worse)"
    text = seed_stats.summary_markdown(out, "dense", ["attention.dense_layers.pattern"])
    assert "| **hybrid** | DS | 1,2,3 |" in text  # faster, so on the Pareto front
    assert "1.20x" in text and "(paired)" in text
    written = seed_stats.write_summary(rows, str(tmp_path), reference="dense", title="t")
    assert [os.path.basename(p) for p in written] == ["summary.csv", "summary.md", "frontier.png"]
    with open(tmp_path / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["setting"] for r in table] == ["dense", "hybrid"]
    assert float(table[1]["speedup"]) == pytest.approx(1.2)
    assert math.isclose(float(table[0]["valid_loss_mean"]), (3.00 + 3.10 + 2.95) / 3)
    with pytest.raises(ValueError, match="reference 'nope'"):
        seed_stats.summarize(rows, "nope")
    # A grid key set only by a point that did not run (its config error) is no summary column.
    rows.append({**rows[0], "point": "bad,seed=1", "setting": "bad", "status": "invalid",
                 "attention.s2.vert_stride": "16"})  # fmt: skip
    seed_stats.write_summary(rows, str(tmp_path), reference="dense", title="t",
                             axes=["attention.s2.vert_stride"])  # fmt: skip
    assert "vert_stride" not in (tmp_path / "summary.md").read_text()
    rows[0]["attention.s2.vert_stride"] = "8"  # a finished run's value: the column stays
    seed_stats.write_summary(rows, str(tmp_path), reference="dense", title="t",
                             axes=["attention.s2.vert_stride"])  # fmt: skip
    assert "| attention.s2.vert_stride |" in (tmp_path / "summary.md").read_text()


def test_quality_tables_tool_recomputes_the_summary(tmp_path):
    rows = _rows(
        {"dense": [3.00, 3.10, 2.95], "hybrid": [2.99, 3.12, 2.95]},
        {"dense": [100.0, 101.0, 99.0], "hybrid": [120.0, 121.0, 119.0]},
    )
    path = _write_results(tmp_path / "results.csv", rows)
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "quality_tables.py"),
            str(path),
            "--reference",
            "dense",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    expected = seed_stats.summary_markdown(
        seed_stats.summarize(
            seed_stats.read_results(path),
            "dense",
            list(c for c in seed_stats.SUMMARY_COLUMNS if rows[0].get(c)),
        ),
        "dense",
        [c for c in seed_stats.SUMMARY_COLUMNS if rows[0].get(c)],
    )
    assert res.stdout == expected
    assert "no difference" in res.stdout
    bad = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "quality_tables.py"),
            str(path),
            "--reference",
            "none",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "reference 'none'" in bad.stderr


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_seed_table_pairs_each_run_with_the_references_same_seed(tmp_path, seed):
    """--per-seed: each run's paired difference is (its loss - the reference's loss of the same
    seed) in % of the reference's mean, the values whose mean and t interval the summary's
    paired difference is; a seed the reference lacks has none; the noise band is the
    reference's spread and standard deviation over its seeds in % of its mean."""
    rng = random.Random(seed)
    losses = {name: [rng.uniform(2.5, 3.5) for _ in range(3)] for name in ("dense", "a", "b")}
    speeds = {name: [rng.uniform(1e5, 3e5) for _ in range(3)] for name in losses}
    rows = _rows(losses, speeds)
    rows.append({**rows[-1], "point": "b,seed=4", "train.seed": "4"})  # no dense seed 4
    rows.append({**rows[-1], "point": "b,seed=5", "train.seed": "5", "status": "failed"})
    path = _write_results(tmp_path / "results.csv", rows)
    res = _checked(_tool(path, "--reference", "dense", "--per-seed"))
    table = res.stdout.split("per seed:\n\n", 1)[1]
    cells = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
    assert [c.strip() for c in cells[0]][:2] == ["setting", "seed"]
    body = {(c[0].strip(), c[1].strip()): [x.strip() for x in c[2:]] for c in cells[1:]}
    assert len(body) == 10 and ("b", "5") not in body  # the failed run is left out
    ref = losses["dense"]
    mean = sum(ref) / 3
    summary = {s.setting: s for s in seed_stats.summarize(rows, "dense")}
    for name in ("a", "b"):
        diffs = []
        for k in range(3):
            loss, speed, diff = body[(name, str(k + 1))]
            assert float(loss) == pytest.approx(losses[name][k], abs=5e-5)
            assert float(speed.replace(",", "")) == pytest.approx(speeds[name][k], abs=0.5)
            expected = (losses[name][k] - ref[k]) * 100 / mean
            assert float(diff.rstrip("%")) == pytest.approx(expected, abs=0.005)
            diffs.append(expected)
        # The same values the summary's paired interval is taken over.
        assert summary[name].loss_diff.mean == pytest.approx(sum(diffs) / 3)
    assert body[("b", "4")][2] == "" and body[("dense", "1")][2] == ""
    sd = stats.tstd(ref)
    band = res.stdout.split("Noise band: ", 1)[1]
    assert f"spread {(max(ref) - min(ref)) * 100 / mean:.2f}%" in band
    assert f"standard deviation {sd * 100 / mean:.2f}%" in band
    # Speed, paired by seed: the mean tokens/s ratio to dense's run of the same seed and its t
    # interval; b's seed 4 has no dense run to pair with and is left out.
    lines = res.stdout.split("paired by seed (tokens/s over dense's run of the same seed):\n")[1]
    quoted = dict(line[2:].split(": ", 1) for line in lines.splitlines() if line.startswith("- "))
    assert sorted(quoted) == ["a", "b"]
    for name in ("a", "b"):
        ratios = [speeds[name][k] / speeds["dense"][k] for k in range(3)]
        m = sum(ratios) / 3
        lo, hi = stats.t.interval(0.95, 2, loc=m, scale=stats.sem(ratios))
        assert quoted[name] == (
            f"{m:.3f}x ± {(hi - lo) / 2:.3f} (95% interval [{lo:.3f}, {hi:.3f}]), seeds 1,2,3"
        )
    bad = _tool(path, "--per-seed")
    assert bad.returncode == 2 and "--per-seed needs --reference" in bad.stderr
    bad = _tool(path, "--per-seed", "--speed-model")
    assert bad.returncode == 2 and "--per-seed" in bad.stderr


@pytest.mark.parametrize("memory", ["cpu rss", "gpu peak"])
def test_summary_and_tool_say_when_runs_trained_in_cpu_mode(tmp_path, memory):
    """Runs trained in CPU mode (the sweep's memory column "cpu rss") measure the CPU reference
    paths: summary.md, the frontier plot's title and tools/quality_tables.py say that their
    speeds are not to be compared; GPU runs get no such note."""
    rows = _rows(
        {"dense": [3.00, 3.10, 2.95], "hybrid": [2.99, 3.12, 2.95]},
        {"dense": [100.0, 101.0, 99.0], "hybrid": [120.0, 121.0, 119.0]},
    )
    for r in rows:
        r["memory"] = memory
    cpu = memory == "cpu rss"
    assert seed_stats.trained_on_cpu(rows) is cpu
    titles = []
    real = seed_stats.write_frontier_plot

    def spy(summaries, path, title):
        titles.append(title)
        return real(summaries, path, title)

    import unittest.mock

    with unittest.mock.patch.object(seed_stats, "write_frontier_plot", spy):
        seed_stats.write_summary(rows, str(tmp_path / "out"), reference="dense", title="t")
    md = (tmp_path / "out" / "summary.md").read_text()
    assert (seed_stats.CPU_NOTE in md) is cpu
    assert titles == ["t (CPU mode: speeds not comparable)" if cpu else "t"]
    path = _write_results(tmp_path / "results.csv", rows)
    res = _checked(_tool(path, "--reference", "dense", "--per-seed"))
    assert (seed_stats.CPU_NOTE in res.stdout) is cpu
    assert res.stdout.count(seed_stats.CPU_NOTE) == int(cpu)


def test_quality_tables_leaves_out_position_tables_without_the_reference_curve(tmp_path):
    """Runs carried in from an earlier lease have no loss_by_position.json: with the reference's
    missing the position tables are left out (naming the settings that have one) and the
    validation-loss table is still printed; with the reference's present they are computed."""
    rows = _rows(
        {"dense": [3.00, 3.10, 2.95], "hybrid": [2.99, 3.12, 2.95]},
        {"dense": [100.0, 101.0, 99.0], "hybrid": [120.0, 121.0, 119.0]},
    )
    path = _write_results(tmp_path / "results.csv", rows)
    runs = tmp_path / "runs"

    def curve(point: str, loss: float) -> None:
        folder = runs / point / "long_context_eval"
        folder.mkdir(parents=True)
        bins = [
            {"start": 0, "end": 1024, "loss": loss + 0.5, "tokens": 100},
            {"start": 1024, "end": 2048, "loss": loss, "tokens": 100},
        ]
        (folder / "loss_by_position.json").write_text(json.dumps({"bins": bins}))

    for seed, loss in enumerate([2.99, 3.12, 2.95], start=1):
        curve(f"hybrid,seed={seed}", loss)
    cmd = [path, "--reference", "dense", "--positions", runs]
    res = _checked(_tool(*cmd))
    assert (
        "position tables are left out" in res.stderr and "(settings with one: hybrid)" in res.stderr
    )
    assert res.stdout.count("| setting") == 1 and "valid loss (95% CI)" in res.stdout
    for seed, loss in enumerate([3.00, 3.10, 2.95], start=1):
        curve(f"dense,seed={seed}", loss)
    res = _checked(_tool(*cmd))
    assert "left out" not in res.stderr
    assert res.stdout.count("| setting") == 3
    assert "loss at positions >= 1024" in res.stdout


def test_quality_tables_joins_reruns_in_front_of_a_studys_runs(tmp_path):
    """Several results files and --positions folders are one set of runs: a point's row from
    the first file where it finished (a rerun in front of the committed run; a point the rerun
    table lists as not run keeps the committed row), its curve and metrics from the first
    folder that has them."""
    committed = _rows(
        {"dense": [3.00, 3.10, 2.95], "hybrid": [2.99, 3.12, 2.95]},
        {"dense": [100.0, 101.0, 99.0], "hybrid": [120.0, 121.0, 119.0]},
    )
    reruns = _rows({"dense": [3.05, 3.02, 3.01]}, {"dense": [98.0, 97.0, 96.0]})
    reruns.append({**committed[3], "status": "not run", "final_valid_loss": ""})  # hybrid seed 1
    first = _write_results(tmp_path / "reruns.csv", reruns)
    second = _write_results(tmp_path / "results.csv", committed)

    def curve(folder, beyond: float) -> None:
        folder.mkdir(parents=True)
        bins = [
            {"start": 0, "end": 1024, "loss": 1.0, "tokens": 10},
            {"start": 1024, "end": 2048, "loss": beyond, "tokens": 10},
        ]
        (folder / "loss_by_position.json").write_text(json.dumps({"bins": bins}))
        (folder / "metrics.jsonl").write_text(
            json.dumps({"kind": "valid", "iteration": 5, "loss": beyond}) + "\n"
        )

    for k in (1, 2, 3):
        curve(tmp_path / "rr" / f"dense,seed={k}", 4.0 + k)  # the reruns' curves
        curve(tmp_path / "cr" / f"dense,seed={k}", 9.0)  # committed: shadowed by the reruns'
        curve(tmp_path / "cr" / f"hybrid,seed={k}", 5.0 + k)
    res = _checked(
        _tool(first, second, "--reference", "dense", "--positions", tmp_path / "rr",
              tmp_path / "cr", "--curve")
    )  # fmt: skip
    joined = [*reruns[:3], *committed[3:]]
    expected = seed_stats.summarize(joined, "dense", ["attention.dense_layers.pattern"])
    final = res.stdout.split("\n\n")[0]
    for summary in expected:
        assert f"| {summary.loss.text()} |" in final, (summary.setting, final)
    beyond = res.stdout.split("loss at positions >= 1024:")[1].split("\n\n")[1]
    assert "| 6.0000 ± " in beyond and "| 7.0000 ± " in beyond  # reruns 5,6,7; hybrid 6,7,8
    assert "9.0000" not in res.stdout
    step5 = res.stdout.split("valid loss at step 5:")[1]
    assert "| 6.0000 ± " in step5 and "| 7.0000 ± " in step5
    one = _tool(first, second, "--speed-model")
    assert one.returncode == 2 and "--speed-model takes one results file" in one.stderr


def test_quality_tables_reads_adopted_points_curves_where_they_were_adopted_from(tmp_path):
    """A point adopted from another study (results.csv's adopted_from) has its curve in that
    study's run folder, under that study's name for it: --adopted-runs reads it from there, under
    the adopting study's point name; a point with a curve of its own keeps it; without the
    option the adopted reference has no curve and the position tables are left out."""
    rows = _rows(
        {"dense": [3.00, 3.10, 2.95], "hybrid": [2.99, 3.12, 2.95]},
        {"dense": [100.0, 101.0, 99.0], "hybrid": [120.0, 121.0, 119.0]},
    )
    for r in rows:
        r["adopted_from"] = (
            f"/elsewhere/other/runs/twin,seed={r['train.seed']}" if r["setting"] == "dense" else ""
        )
    path = _write_results(tmp_path / "results.csv", rows)

    def curve(folder, inside: float, beyond: float) -> None:
        folder.mkdir(parents=True)
        bins = [
            {"start": 0, "end": 1024, "loss": inside, "tokens": 100},
            {"start": 1024, "end": 2048, "loss": beyond, "tokens": 300},
        ]
        (folder / "loss_by_position.json").write_text(json.dumps({"bins": bins}))
        valid = {"kind": "valid", "iteration": 10, "loss": beyond + 1.0}
        (folder / "metrics.jsonl").write_text(json.dumps(valid) + "\n")

    runs, other = tmp_path / "runs", tmp_path / "other"
    beyond = {"dense": [3.0, 3.2, 3.1], "hybrid": [3.1, 3.3, 3.2]}
    for seed in (1, 2, 3):
        curve(runs / f"hybrid,seed={seed}", 4.0, beyond["hybrid"][seed - 1])
        curve(other / f"twin,seed={seed}", 4.5, beyond["dense"][seed - 1])
    # A decoy under the other study's name for a hybrid seed: not read (no adopted_from says so).
    curve(other / "hybrid,seed=1", 9.0, 9.0)
    args = [path, "--reference", "dense", "--positions", runs]
    res = _tool(*args, "--adopted-runs", other)
    assert res.returncode == 0, res.stderr
    table = res.stdout.split("loss at positions >= 1024:")[1]
    pos = seed_stats.position_rows(
        str(runs), 1024, {f"dense,seed={k}": str(other / f"twin,seed={k}") for k in (1, 2, 3)}
    )
    assert sorted(r["point"] for r in pos) == sorted(
        f"{s},seed={k}" for s in beyond for k in (1, 2, 3)
    )
    summary = {
        s.setting: s for s in seed_stats.summarize(pos, "dense", loss_key="loss_beyond_window")
    }
    assert summary["dense"].loss.mean == pytest.approx(3.1)
    assert summary["hybrid"].loss.mean == pytest.approx(3.2)
    for setting in ("hybrid", "dense"):  # the name in bold where on the Pareto front
        line = next(ln for ln in table.splitlines() if ln.strip("| *").startswith(setting))
        assert f" | 1,2,3 | {summary[setting].loss.text()} |" in line, line
    # --curve reads the adopted runs' metrics.jsonl from the same folders.
    curve_res = _tool(*args, "--adopted-runs", other, "--curve")
    assert curve_res.returncode == 0, curve_res.stderr
    step = curve_res.stdout.split("valid loss at step 10:")[1]
    assert "| dense | 1,2,3 | 4.1000 ± " in step.replace("**", "")
    alone = _tool(*args)
    assert alone.returncode == 0 and "position tables are left out" in alone.stderr
    wrong = _tool(path, "--adopted-runs", other)
    assert wrong.returncode == 2 and "--adopted-runs goes with --positions" in wrong.stderr


def test_collect_writes_seed_columns_and_summary(tmp_path):
    """collect on runs that finished (their metrics written here, no training): the table has
    the setting, the seed and the length of every row, and the summary groups the seeds."""
    path = write_study(
        tmp_path,
        overrides={"train.train_iters": 40},
        points=[
            {"name": "dense", "attention.dense_layers.pattern": "D"},
            {"name": "hyb", "attention.dense_layers.pattern": "DS"},
        ],
        seeds=[1, 2, 3],
        reference="dense",
    )
    study = load_study(path, output_dir=str(tmp_path / "out"))
    for p in study.points:
        os.makedirs(p.run_dir)
        base = 3.0 + 0.01 * p.config.train.seed + (0.02 if p.setting == "hyb" else 0.0)
        recs = [
            {
                "kind": "train",
                "iteration": 2,
                "loss": base + 1,
                "tokens_per_s": 10.0,
                "step_time_s": 1.0,
                "consumed_samples": 16,
            },
            {
                "kind": "train",
                "iteration": 4,
                "loss": base + 0.5,
                "tokens_per_s": 10.0,
                "step_time_s": 1.0,
                "consumed_samples": 32,
            },
            {"kind": "valid", "iteration": 40, "loss": base},
        ]
        with open(os.path.join(p.run_dir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
        with open(os.path.join(p.run_dir, "summary.json"), "w") as f:
            json.dump({"iteration": 40}, f)
    sweep.collect_and_write(study)
    with open(tmp_path / "out" / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["setting"], r["train.seed"], r["model.seq_length"]) for r in table][:2] == [
        ("dense", "1", str(study.points[0].config.model.seq_length)),
        ("dense", "2", str(study.points[0].config.model.seq_length)),
    ]
    for key in ("attention.dense_layers.pattern", "final_valid_loss", "tokens_per_s"):
        assert key in table[0]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| hyb | DS" in summary and "higher (worse)" in summary  # +0.02 on every seed
    assert (tmp_path / "out" / "frontier.png").stat().st_size > 0


def _quality_tables(study_name: str, *options: str) -> subprocess.CompletedProcess:
    """tools/quality_tables.py on a committed study under docs/quality/ (dense the reference,
    the study's runs/ for the per-run files)."""
    study = REPO / "docs" / "quality" / study_name
    return _checked(
        _tool(
            study / "results.csv", "--reference", "dense", "--positions", study / "runs", *options
        )
    )


def test_quality_doc_tables_are_the_tools_output_from_the_committed_raw_files():
    """docs/quality.md's 16k section is what tools/quality_tables.py computes from the committed
    results.csv and runs/ (so the doc and its raw output cannot drift apart)."""
    res = _quality_tables("code-125m-16k-seeds", "--window", "1024", "--curve")
    doc = (REPO / "docs" / "quality.md").read_text()
    tables = [b for b in res.stdout.split("\n\n") if b.startswith("| setting")]
    assert len(tables) == 6  # final loss, in / beyond the window, the three validation steps
    tables[1] = tables[1].replace("| setting |", "| setting (positions < 1024) |", 1)
    tables[2] = tables[2].replace("| setting |", "| setting (positions >= 1024) |", 1)
    for table in tables[:5]:  # the last validation step is the final loss's table
        assert table.strip() in doc, table.splitlines()[0]


def test_quality_doc_100m_tables_are_the_tools_output():
    """docs/quality.md's 100M-token section (the final table and the one-table learning curve)
    is what tools/quality_tables.py computes from that study's committed raw files; stopped
    runs count at the validation points they reached."""
    res = _quality_tables("code-125m-16k-seeds-100m", "--curve", "--curve-table", "131072")
    doc = (REPO / "docs" / "quality.md").read_text()
    tables = [
        b for b in res.stdout.split("\n\n") if b.startswith("| setting") or b.startswith("| step")
    ]
    assert len(tables) == 2
    for table in tables:
        assert table.strip() in doc, table.splitlines()[0]
    assert "| 763 | 100.0 |" in tables[1]
    # The goal's speed, paired by seed (--per-seed), as the top of the doc quotes it.
    study = REPO / "docs" / "quality" / "code-125m-16k-seeds-100m"
    res = _checked(_tool(study / "results.csv", "--reference", "dense", "--per-seed"))
    sssd = res.stdout.split("- hybrid-SSSD: ", 1)[1].splitlines()[0]
    low, high = sssd.split("[", 1)[1].split("]", 1)[0].split(", ")
    text = " ".join(doc.split())
    assert f"1.26x dense's tokens/s (paired by seed, 95% interval {low}-{high}x)" in text


def test_quality_doc_100m_rerun_tables_are_the_tools_output():
    """docs/quality.md's tables over the 100M study's reruns are what tools/quality_tables.py
    computes from the committed raw files: the reruns' final loss, and the loss by position
    (inside and beyond the window) of the reruns joined in front of the committed runs; the
    section's count of finished reruns is the folder's."""
    study = REPO / "docs" / "quality" / "code-125m-16k-seeds-100m"
    reruns = study / "reruns"
    doc = (REPO / "docs" / "quality.md").read_text()
    own = _checked(_tool(reruns / "results.csv", "--reference", "dense")).stdout
    assert own.split("\n\n")[0].strip() in doc
    joined = _checked(
        _tool(reruns / "results.csv", study / "results.csv", "--reference", "dense",
              "--positions", reruns / "runs", study / "runs")
    ).stdout  # fmt: skip
    tables = [b.strip() for b in joined.split("\n\n") if b.startswith("| setting")]
    assert len(tables) == 3  # final loss, inside and beyond the window
    tables[1] = tables[1].replace("| setting |", "| setting (positions < 1024) |", 1)
    tables[2] = tables[2].replace("| setting |", "| setting (positions >= 1024) |", 1)
    for table in tables[1:]:
        assert table in doc, table.splitlines()[0]
        rows = {line.split("|")[1].strip(" *"): line for line in table.splitlines()[2:]}
        assert "| 1,2,3 |" in rows["dense"] and "| 1,2,3 |" in rows["all-s2"]
    finished = len(list((reruns / "runs").glob("*/summary.json")))
    heading = (
        "**Reruns of the first lease's runs (8 runs, issue 51).**"
        if finished == 8
        else f"**Reruns of the first lease's runs (in progress: {finished} of 8, issue 51).**"
    )
    assert heading in doc


def _first_table(results_csv, reference: str) -> str:
    """The first table (the final loss's) that tools/quality_tables.py prints for
    ``results_csv`` against ``reference``; the tool must succeed."""
    res = _checked(_tool(results_csv, "--reference", reference))
    return res.stdout.split("\n\n")[0].strip()


def test_quality_doc_4k_reference_table_is_the_tools_output():
    """docs/quality.md's 4k reference table (carried over leases) is what
    tools/quality_tables.py computes from that study's committed results.csv, and the doc's
    count of finished runs is the CSV's."""
    study = REPO / "docs" / "quality" / "code-125m-4k-seeds"
    table = _first_table(study / "results.csv", "dense")
    assert table.startswith("| setting") and "| 4096 |" in table
    doc = (REPO / "docs" / "quality.md").read_text()
    assert table in doc
    rows = seed_stats.read_results(study / "results.csv")
    finished = sum(row["status"] == "finished" for row in rows)
    assert len(rows) == 12
    heading = (
        "## At 4k for reference: 12 runs"
        if finished == 12
        else f"## At 4k for reference, in progress: {finished} of 12 runs"
    )
    assert heading in doc
    # The noise band and the seeds' paired differences the text quotes (--per-seed).
    res = _checked(_tool(study / "results.csv", "--reference", "dense", "--per-seed"))
    per_seed = res.stdout.split("per seed:", 1)[1]
    band = per_seed.split("Noise band: ", 1)[1]
    spread = band.split("spread ", 1)[1].split("%", 1)[0]
    sd = band.split("standard deviation ", 1)[1].split("%", 1)[0]
    text = " ".join(doc.split())
    assert f"a spread of {spread}% of their mean (standard deviation {sd}%)" in text
    cells = {}
    for line in per_seed.splitlines():
        if line.startswith("| hybrid-"):
            setting, seed, _, _, diff = (c.strip() for c in line.strip("|").split("|"))
            cells.setdefault(setting, []).append(diff)
    assert f"same seed {', '.join(cells['hybrid-SSSD'])})" in text
    assert f"({', '.join(cells['hybrid-DS'])};" in text


def test_quality_doc_16k_grid_table_is_the_tools_output():
    """docs/quality.md's table of the 16k stride x window grid (in progress) is what
    tools/quality_tables.py computes from the grid's committed results.csv."""
    study = REPO / "docs" / "quality" / "code-125m-16k-stride-window"
    table = _first_table(study / "results.csv", "dense")
    assert table.startswith("| setting") and "vert_stride=12,local_blocks=8" in table
    doc = (REPO / "docs" / "quality.md").read_text()
    assert table in doc
    # The grid against its default point, and the numbers the text quotes from it.
    default = "vert_stride=8,local_blocks=16"
    table = _first_table(study / "results.csv", default)
    assert f"loss vs {default} (95% CI)" in table and table in doc
    rows = seed_stats.read_results(study / "results.csv")
    summary = {s.setting: s for s in seed_stats.summarize(rows, reference=default)}
    slower = sorted(1 - summary[f"vert_stride=4,local_blocks={w}"].speedup for w in (8, 16, 32))
    text = " ".join(doc.split())
    assert f"measured {slower[0] * 100:.0f}-{slower[-1]:.0%} slower than the default" in text
    window8 = summary["vert_stride=8,local_blocks=8"].loss_diff
    assert f"(+{window8.mean:.2f} ± {window8.half_width:.2f}%)" in text
    # Loss beyond every point's window against the default, the adopted runs' curves included.
    res = _tool(
        study / "results.csv",
        "--reference",
        default,
        "--positions",
        study / "runs",
        "--adopted-runs",
        REPO / "docs" / "quality" / "code-125m-16k-seeds" / "runs",
        "--window",
        2048,
    )
    assert res.returncode == 0, res.stderr
    beyond = res.stdout.split("loss at positions >= 2048:")[1].split("\n\n")[1].strip()
    assert "| dense | 1,2 |" in beyond and beyond in doc
    # The text quotes stride 4's differences at windows 8 and 16 (the table's 6th column).
    diff = {
        w: next(ln for ln in beyond.splitlines() if ln.startswith(f"| vert_stride=4,{w} |"))
        .split(" | ")[5]
        .split("%")[0]
        for w in ("local_blocks=8", "local_blocks=16")
    }
    assert f"by {diff['local_blocks=8']}% and {diff['local_blocks=16']}%: two seeds" in text
    corner = seed_stats.summarize(rows, reference="dense")[2]
    assert corner.setting == "vert_stride=4,local_blocks=32" and corner.verdict.startswith("lower")
    assert f"({corner.loss_diff.text('{:+.2f}')}%) excludes zero only because" in text


# ---- the speed model ---------------------------------------------------------------------------
def _speed_rows(densities: dict, base: float, attention: float, seeds=3, noise=0.0, rng=None):
    """results.csv-like rows whose tokens/s follow ``1 / (base + attention * density)`` (times
    a factor within ``noise`` of 1 per run), plus a setting not run and a failed run."""
    rows = []
    for setting, density in densities.items():
        for seed in range(1, seeds + 1):
            factor = 1.0 + (rng.uniform(-noise, noise) if noise else 0.0)
            rows.append(
                {
                    "point": f"{setting},seed={seed}",
                    "status": "finished",
                    "setting": setting,
                    "train.seed": str(seed),
                    "model.seq_length": "16384",
                    "attention_density": repr(density),
                    "tokens_per_s": repr(factor / (base + attention * density)),
                }
            )
    rows.append({**rows[0], "point": "later,seed=1", "setting": "later", "tokens_per_s": ""})
    rows[-1].update(status="not run", attention_density="0.5")
    rows.append({**rows[1], "status": "failed", "tokens_per_s": "1.0"})  # left out of the fit
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speed_model_recovers_the_line_and_predicts_settings_not_run(seed):
    rng = random.Random(seed)
    base, attention = rng.uniform(2e-6, 5e-6), rng.uniform(0.5e-6, 3e-6)
    densities = {f"s{i}": rng.uniform(0.1, 1.0) for i in range(rng.randint(2, 6))}
    rows = _speed_rows(densities, base, attention)
    model = seed_stats.fit_speed_model(rows)
    assert model.base == pytest.approx(base, rel=1e-9)
    assert model.attention == pytest.approx(attention, rel=1e-9)
    assert model.settings == len(densities) and model.seq_length == 16384
    assert model.attention_share == pytest.approx(attention / (base + attention))
    table = seed_stats.speed_rows(rows, model)
    assert [r.setting for r in table] == [*densities, "later"]
    for r in table[:-1]:
        assert r.measured.n == 3 and abs(r.residual) < 1e-6
    assert table[-1].measured is None and table[-1].residual is None
    assert table[-1].predicted == pytest.approx(1.0 / (base + attention * 0.5))


def test_speed_model_is_least_squares_on_mean_seconds_per_token():
    """With noisy runs the line is numpy's least-squares fit to each setting's mean of
    1 / tokens/s."""
    import numpy as np

    rng = random.Random(7)
    densities = {"d": 1.0, "a": 0.61, "b": 0.42, "c": 0.23}
    rows = _speed_rows(densities, 3.6e-6, 2.0e-6, noise=0.03, rng=rng)
    model = seed_stats.fit_speed_model(rows)
    x = list(densities.values())
    y = [
        np.mean([1 / float(r["tokens_per_s"]) for r in rows[:12] if r["setting"] == s])
        for s in densities
    ]
    slope, intercept = np.polyfit(x, y, 1)
    assert model.attention == pytest.approx(slope, rel=1e-9)
    assert model.base == pytest.approx(intercept, rel=1e-9)


@pytest.mark.parametrize(
    "change,message",
    [
        ("one-density", "at least two settings of different attention density"),
        ("two-lengths", "mix sequence lengths"),
        ("two-densities", "has two attention densities"),
    ],
)
def test_speed_model_refusals(change, message):
    rows = _speed_rows({"d": 1.0, "s": 0.3}, 3e-6, 2e-6)
    if change == "one-density":
        rows = [r for r in rows if r["setting"] != "s"]
    elif change == "two-lengths":
        rows[3]["model.seq_length"] = "4096"
    else:
        rows[4]["attention_density"] = "0.31"
    with pytest.raises(ValueError, match=message):
        seed_stats.fit_speed_model(rows)


def test_speed_model_refuses_rows_at_another_length():
    model = seed_stats.fit_speed_model(_speed_rows({"d": 1.0, "s": 0.3}, 3e-6, 2e-6))
    other = _speed_rows({"d": 1.0}, 3e-6, 2e-6)
    for r in other:
        r["model.seq_length"] = "4096"
    with pytest.raises(ValueError, match="fitted at 16384 tokens, these rows are at 4096"):
        seed_stats.speed_rows(other, model)


def _tool(*args, process: bool = False) -> subprocess.CompletedProcess:
    """tools/quality_tables.py with ``args``: its exit code, stdout and stderr. Its ``main`` in
    this process unless ``process`` (:func:`tests.helpers.megatron.run_tool_main` says why); the
    command line itself runs as a process in
    test_quality_tables_tool_recomputes_the_summary and test_quality_tables_speed_model_cli."""
    argv = [str(a) for a in args]
    if process:
        return subprocess.run(
            [sys.executable, str(REPO / "tools" / "quality_tables.py"), *argv],
            capture_output=True,
            text=True,
        )
    return run_tool_main("quality_tables", argv)


def _checked(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """``res``, which must have succeeded (as ``subprocess.run(..., check=True)``)."""
    assert res.returncode == 0, res.stderr
    return res


def test_quality_tables_speed_model_cli(tmp_path):
    fit = _write_results(tmp_path / "fit.csv", _speed_rows({"d": 1.0, "s": 0.25}, 3e-6, 2e-6))
    grid = _write_results(tmp_path / "grid.csv", _speed_rows({"g1": 0.6, "g2": 0.7}, 3e-6, 2e-6))
    res = _tool(grid, "--speed-model", "--speed-fit", fit, process=True)
    assert res.returncode == 0, res.stderr
    model = seed_stats.fit_speed_model(seed_stats.read_results(fit))
    expected = seed_stats.speed_model_markdown(
        seed_stats.speed_rows(seed_stats.read_results(grid), model), model, str(fit)
    )
    assert res.stdout == expected
    assert "| later | 0.500 | 0 | not run | 250,000 |  |" in res.stdout  # 1 / (3 + 1) us
    assert "attention 40.0% of a dense step at 16384 tokens" in res.stdout
    alone = _tool(grid, "--speed-fit", fit)
    assert alone.returncode == 2 and "--speed-fit goes with --speed-model" in alone.stderr
    short = _write_results(
        tmp_path / "short.csv",
        [{**r, "model.seq_length": "4096"} for r in _speed_rows({"a": 1.0, "b": 0.5}, 1, 1)],
    )
    mixed = _tool(short, "--speed-model", "--speed-fit", fit)
    assert mixed.returncode == 2 and "fitted at 16384 tokens" in mixed.stderr


def test_quality_doc_speed_model_tables_are_the_tools_output():
    """docs/quality.md's speed-model tables (the 48M study's fit, the grid predicted from it)
    are what tools/quality_tables.py --speed-model prints from the committed results.csv files,
    and the line's numbers quoted in the text are the tool's."""
    quality = REPO / "docs" / "quality"
    fit = quality / "code-125m-16k-seeds" / "results.csv"
    doc = (REPO / "docs" / "quality.md").read_text()
    for args in (
        (fit, "--speed-model"),
        (
            quality / "code-125m-16k-stride-window" / "results.csv",
            "--speed-model",
            "--speed-fit",
            fit,
        ),
    ):
        res = _tool(*args)
        assert res.returncode == 0, res.stderr
        line, table = res.stdout.split("\n\n", 1)
        assert table.strip() in doc
        assert "3.5845 us + 2.0486 us x attention density (attention 36.4%" in line
    assert "3.5845 + 2.0486 x density" in doc and "attention is 36.4%" in doc
    # The grid's span, its corners against the default and against their predictions.
    rows = seed_stats.read_results(quality / "code-125m-16k-stride-window" / "results.csv")
    model = seed_stats.fit_speed_model(seed_stats.read_results(fit))
    grid = {r.setting: r for r in seed_stats.speed_rows(rows, model)}
    predicted = [r.predicted for r in grid.values() if r.setting != "dense"]
    text = " ".join(doc.split())
    assert (
        f"spans {min(predicted) / 1e3:,.0f},000-{max(predicted) / 1e3:,.0f},000 predicted" in text
    )
    default = grid["vert_stride=8,local_blocks=16"].predicted
    sparse, dense_corner = (
        grid["vert_stride=12,local_blocks=8"],
        grid["vert_stride=4,local_blocks=32"],
    )
    assert f"{sparse.predicted / default - 1:.0%} above the default" in text
    assert f"about {1 - dense_corner.predicted / default:.0%} below it" in text
    assert (
        f"{-dense_corner.residual:.1f}% and {-sparse.residual:.1f}% below their predictions" in text
    )
    others = sorted(  # the points run on the two-GPU kind besides the corners
        -r.residual
        for r in grid.values()
        if r.residual is not None
        and r.setting not in ("dense", "vert_stride=8,local_blocks=16", sparse.setting)
        and r is not dense_corner
    )
    assert f"every other grid point run there {others[0]:.1f}-{others[-1]:.1f}% below" in text
    fitted = _tool(quality / "code-125m-16k-stride-window" / "results.csv", "--speed-model")
    own = seed_stats.fit_speed_model(rows)
    worst = max(abs(r.residual) for r in seed_stats.speed_rows(rows, own) if r.residual is not None)
    assert f"(attention {own.attention_share:.1%}" in fitted.stdout
    assert f"give attention {own.attention_share:.1%} of a dense step" in text
    assert f"every setting within {worst:.1f}% of that line" in text
    res = _tool(quality / "code-125m-16k-seeds-100m" / "results.csv", "--speed-model")
    assert "3.7141 us + 1.9950 us x attention density (attention 34.9%" in res.stdout
    assert "3.7141 + 1.9950 x density, attention 34.9%" in doc


def test_long_context_speed_budget_is_the_tools_line():
    """docs/long_context_eval.md's speed budget (the 32k extension runs' line and what it
    predicts for k dense layers of 12) is what the speed model gives from the committed
    results.csv."""
    path = REPO / "docs" / "long_context" / "results" / "retrieval-125m-extend-32k" / "results.csv"
    res = _tool(path, "--speed-model")
    assert res.returncode == 0, res.stderr
    assert "3.3884 us + 4.9251 us x attention density (attention 59.2%" in res.stdout
    rows = seed_stats.read_results(path)
    model = seed_stats.fit_speed_model(rows)
    table = {r.setting: r for r in seed_stats.speed_rows(rows, model)}
    assert max(abs(r.residual) for r in table.values() if r.residual is not None) < 0.6
    s2 = 2 * table["hybrid-DS"].density - 1  # DS: six dense layers and six S2
    doc = " ".join((REPO / "docs" / "long_context_eval.md").read_text().split())
    assert "3.3884 + 4.9251 x density microseconds per token, attention 59.2%" in doc
    assert f"attends {s2:.3f} of its causal pairs at 32k" in doc
    seeds = [
        float(r["tokens_per_s"]) for r in rows if r["setting"] == "dense" and r["tokens_per_s"]
    ]
    assert len(seeds) == 2
    assert f"the two dense seeds differ by {abs(seeds[0] / seeds[1] - 1):.1%}" in doc
    dense = table["dense"].measured.mean
    ratio = {k: model.tokens_per_s((k + (12 - k) * s2) / 12) / dense for k in (3, 5, 6, 7)}
    assert (
        f"{ratio[5]:.2f}x the twin's tokens/s at k = 5, {ratio[6]:.2f}x at 6 and "
        f"{ratio[7]:.2f}x at 7" in doc
    )
    assert ratio[6] >= 1.3 > ratio[7]  # "at most six dense layers"
    assert f"predicted at {ratio[3]:.2f}x" in doc


def test_speed_model_refuses_what_is_not_a_speed_model(tmp_path):
    rows = _speed_rows({"d": 1.0, "s": 0.3}, 3e-6, 2e-6)
    zero = [dict(r) for r in rows]
    zero[0]["tokens_per_s"] = "0"
    with pytest.raises(ValueError, match="tokens_per_s 0.0 is not positive"):
        seed_stats.fit_speed_model(zero)
    faster_dense = _speed_rows({"d": 1.0, "s": 0.3}, 3e-6, -1e-6)  # denser runs faster
    with pytest.raises(ValueError, match="not a speed model"):
        seed_stats.fit_speed_model(faster_dense)
    no_density = [{k: v for k, v in r.items() if k != "attention_density"} for r in rows]
    with pytest.raises(ValueError, match="no attention_density in these rows"):
        seed_stats.fit_speed_model(no_density)


def test_speed_rows_say_why_a_setting_has_no_measurement():
    rows = _speed_rows({"d": 1.0, "s": 0.3}, 3e-6, 2e-6)
    # A setting whose run finished without a throughput, and one that stopped part-way.
    rows.append({**rows[0], "setting": "quiet", "point": "quiet,seed=1", "tokens_per_s": ""})
    rows.append({**rows[0], "setting": "cut", "point": "cut,seed=1", "status": "partial"})
    model = seed_stats.fit_speed_model(rows)
    table = {r.setting: r for r in seed_stats.speed_rows(rows, model)}
    assert table["later"].status == "not run"
    assert table["quiet"].status == table["cut"].status == "no tokens/s"
    assert table["d"].status == "measured"
    text = seed_stats.speed_model_markdown(list(table.values()), model, "x.csv")
    assert "| quiet | 1.000 | 0 | no tokens/s |" in text
    assert "| d | 1.000 | 3 | " in text and "| +0.0% |" in text and "-0.0%" not in text


def test_quality_tables_speed_model_refuses_other_options_and_names_the_file(tmp_path):
    path = _write_results(tmp_path / "r.csv", _speed_rows({"d": 1.0, "s": 0.3}, 3e-6, 2e-6))
    res = _tool(path, "--speed-model", "--reference", "d", "--write", tmp_path / "out")
    assert res.returncode == 2 and "leave out --reference, --write" in res.stderr
    assert not (tmp_path / "out").exists()
    missing = _tool(tmp_path / "none.csv", "--speed-model")
    assert missing.returncode == 2 and "none.csv" in missing.stderr
    assert "Traceback" not in missing.stderr
    bare = _write_results(tmp_path / "bare.csv", [{"point": "a", "tokens_per_s": "1"}])
    res = _tool(bare, "--speed-model", "--speed-fit", path)
    assert res.returncode == 2 and "bare.csv: no attention_density" in res.stderr
    assert _tool(tmp_path / "none.csv").returncode == 2  # the summary's own missing file
