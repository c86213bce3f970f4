"""Run safety through the real CLI on the CPU (issue 9): resume diffs, apply/keep with the LR
really used, a finished run left alone, damaged checkpoints, --restart, start-up checks, the
lock and Ctrl-C. The pieces themselves are tested without training in test_run_safety.py.

One short run (stopped by the SIGTERM hook at iteration 4, checkpoints at 2 and 4) is made once
and copied into each test.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megatron_s2.training import cli, trainer
from megatron_s2.training.checkpointing import TRACKER, checkpoint_path, find_checkpoint
from megatron_s2.training.errors import RunDirError
from tests.training.test_trainer import DEMO, TINY, _env, read_metrics, run_trainer

# The base run: demo.yaml's optimizer (lr 3e-3, min 3e-4, cosine) with TINY's 2 warm-up steps.
LR, MIN_LR, WARMUP = 3e-3, 3e-4, 2


def megatron_lr(step, max_lr, min_lr, warmup, decay):
    """Megatron's cosine schedule at ``step`` steps done; a record's ``lr`` at iteration i is
    the one that iteration used, the value at step i - 1."""
    if step <= warmup:
        return max_lr * step / warmup
    ratio = min(1.0, (step - warmup) / (decay - warmup))
    return min_lr + (max_lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, demo_dir):
    """runs/base: 6 iterations planned, stopped after 4 (checkpoints iter 2 and 4)."""
    tmp = tmp_path_factory.mktemp("base")
    run_trainer(
        tmp,
        demo_dir,
        "train.train_iters=6",
        "checkpoint.save_interval=2",
        "debug.sigterm_at_iter=4",
        name="base",
    )
    return tmp / "base"


def copy_of(base_run, tmp_path, name="t"):
    shutil.copytree(base_run, tmp_path / name)
    return tmp_path / name


def table_row(text, key):
    """The values of ``key``'s row in a printed settings table."""
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(key + " "))
    return line.split()[1:]


# ------------------------------------------------------------------------------- resume
def test_resume_refuses_changed_model_settings_with_a_diff(tmp_path, demo_dir, base_run):
    run = copy_of(base_run, tmp_path)
    before = {f: (run / f).read_bytes() for f in ("config.yaml", "metrics.jsonl")}
    proc, _ = run_trainer(
        tmp_path,
        demo_dir,
        "train.train_iters=6",
        "model.hidden_size=32",
        "attention.s2.vert_stride=4",
        check=False,
    )
    assert proc.returncode == cli.EXIT_CONFIG_ERROR, proc.stderr[-3000:]
    err = proc.stderr
    assert f"cannot resume run 'base' from {checkpoint_path(str(run / 'checkpoints'), 4)}" in err
    assert table_row(err, "model.hidden_size") == ["64", "32"]
    assert table_row(err, "attention.s2.vert_stride") == ["2", "4"]
    assert "--restart" in err and "Traceback" not in err
    # Refused before anything was written.
    assert {f: (run / f).read_bytes() for f in before} == before


def test_resume_applies_changed_schedule_and_says_so(tmp_path, demo_dir, base_run):
    """The issue's case: more iterations and another LR on resume. The new LR schedule is
    really used (Megatron's scheduler would restore the checkpoint's), and config.yaml says so."""
    run = copy_of(base_run, tmp_path)
    proc, recs = run_trainer(
        tmp_path, demo_dir, "train.train_iters=8", "optimizer.lr=1e-2", "optimizer.min_lr=1e-3"
    )
    out = proc.stdout
    assert "checkpoint.on_resume=apply" in out
    assert table_row(out, "optimizer.lr") == ["0.003", "0.01"]
    assert table_row(out, "train.train_iters") == ["6", "8"]
    assert sorted(recs) == list(range(1, 9))
    for i in range(1, 5):  # before the resume: the old schedule
        assert recs[i]["lr"] == pytest.approx(megatron_lr(i - 1, LR, MIN_LR, WARMUP, 6), rel=1e-6)
    for i in range(5, 9):
        assert recs[i]["lr"] == pytest.approx(megatron_lr(i - 1, 1e-2, 1e-3, WARMUP, 8), rel=1e-6)
    config = (run / "config.yaml").read_text()
    assert "lr: 0.01" in config and "train_iters: 8" in config


def test_resume_keep_uses_the_checkpoints_schedule_and_a_finished_run_is_left_alone(
    tmp_path, demo_dir, base_run
):
    run = copy_of(base_run, tmp_path)
    args = ("checkpoint.on_resume=keep", "optimizer.lr=1e-2", "train.train_iters=8")
    proc, recs = run_trainer(tmp_path, demo_dir, *args)
    assert "checkpoint.on_resume=keep" in proc.stdout
    assert table_row(proc.stdout, "optimizer.lr") == ["0.003", "0.01"]  # kept, ignored
    assert sorted(recs) == list(range(1, 7))  # train.train_iters kept at 6
    for i in (5, 6):
        assert recs[i]["lr"] == pytest.approx(megatron_lr(i - 1, LR, MIN_LR, WARMUP, 6), rel=1e-6)
    config = (run / "config.yaml").read_text()
    assert "lr: 0.003" in config and "train_iters: 6" in config
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "done" and summary["final_loss_iteration"] == 6
    assert summary["first_loss_iteration"] == 1

    # Finished: running it again has nothing to do and changes nothing.
    files = ("summary.json", "metrics.jsonl", "config.yaml")
    before = {f: (run / f).read_bytes() for f in files}
    proc, _ = run_trainer(tmp_path, demo_dir, *args)
    assert "nothing to do" in proc.stdout and "train loss" not in proc.stdout
    assert {f: (run / f).read_bytes() for f in files} == before


# ------------------------------------------------------------------ damaged checkpoints
def _truncate_shard(ckpt):
    shard = sorted(f for f in os.listdir(ckpt) if f.endswith(".distcp"))[0]
    os.truncate(os.path.join(ckpt, shard), 598)


@pytest.mark.parametrize(
    "damage, problem, resumes_at",
    [
        (_truncate_shard, r"shard __0_\d.distcp is truncated \(598 of \d+ bytes\)", 2),
        (lambda c: os.remove(os.path.join(c, ".metadata")), r"\.metadata is missing", 2),
        # A garbled pointer loses nothing: the newest folder itself is intact.
        (
            lambda c: open(os.path.join(os.path.dirname(c), TRACKER), "w").write("x\x00"),
            r"latest_checkpointed_iteration.txt: expected an iteration number",
            4,
        ),
    ],
    ids=["truncated-shard", "missing-metadata", "garbage-pointer"],
)
def test_real_checkpoint_damage_is_found(tmp_path, base_run, damage, problem, resumes_at):
    run = copy_of(base_run, tmp_path)
    root = str(run / "checkpoints")
    assert find_checkpoint(root) == (4, [])
    damage(checkpoint_path(root, 4))
    iteration, problems = find_checkpoint(root)
    assert len(problems) == 1 and re.search(problem, problems[0]), problems
    assert iteration == resumes_at


def test_resume_skips_a_truncated_checkpoint_for_the_previous_one(tmp_path, demo_dir, base_run):
    run = copy_of(base_run, tmp_path)
    _truncate_shard(checkpoint_path(str(run / "checkpoints"), 4))
    proc, recs = run_trainer(tmp_path, demo_dir, "train.train_iters=6")
    assert "skipped damaged checkpoint" in proc.stderr and "is truncated" in proc.stderr
    assert f"resumed from {checkpoint_path(str(run / 'checkpoints'), 2)}" in proc.stdout
    base = read_metrics(base_run)
    # Records after the checkpoint resumed from are replaced; iteration 3 is reproduced.
    assert sorted(recs) == list(range(1, 7))
    assert recs[3]["loss"] == pytest.approx(base[3]["loss"], abs=1e-5)


# ------------------------------------------------------------------------ starting over
def test_starting_over_needs_restart_which_moves_the_old_run_aside(tmp_path, demo_dir, base_run):
    run = copy_of(base_run, tmp_path)
    proc, _ = run_trainer(tmp_path, demo_dir, "checkpoint.resume=false", check=False)
    assert proc.returncode == cli.EXIT_RUN_DIR
    assert "holds a previous run" in proc.stderr and "--restart" in proc.stderr
    assert sorted(read_metrics(run)) == [1, 2, 3, 4]  # untouched

    proc, recs = run_trainer(tmp_path, demo_dir, "train.train_iters=3", "--restart")
    moved = [p for p in os.listdir(tmp_path) if p.startswith("t.old-")]
    assert len(moved) == 1 and f"moved the previous run {run} to" in proc.stdout
    old = tmp_path / moved[0]
    assert sorted(read_metrics(old)) == [1, 2, 3, 4]
    assert (old / "checkpoints" / TRACKER).read_text() == "4"
    assert sorted(recs) == [1, 2, 3] and "resumed from" not in proc.stdout
    assert not os.path.exists(run / "checkpoints" / TRACKER)  # TINY saves no checkpoint


# ---------------------------------------------------------------------- start-up checks
def test_unwritable_checkpoint_dir_fails_before_training(tmp_path, demo_dir):
    (tmp_path / "a_file").write_text("")
    proc, recs = run_trainer(
        tmp_path, demo_dir, f"checkpoint.dir={tmp_path / 'a_file' / 'ckpt'}", check=False
    )
    assert proc.returncode == cli.EXIT_RUN_DIR, proc.stderr[-2000:]
    assert "a_file/ckpt is not writable (Not a directory)" in proc.stderr
    assert not recs and "Traceback" not in proc.stderr


def test_read_only_checkpoint_dir_fails_before_training(tmp_path, demo_dir):
    """A real read-only mount (root ignores permissions, not a read-only file system)."""
    ro = tmp_path / "ro"
    os.makedirs(ro)
    mount = f"mount --bind -o ro {ro} {ro}"
    if (
        shutil.which("unshare") is None
        or subprocess.run(
            ["unshare", "-m", "sh", "-c", f"{mount} && ! touch {ro}/x 2>/dev/null"]
        ).returncode
    ):
        pytest.skip("no private read-only mounts here")
    args = [
        "name=t",
        f"logging.run_dir={tmp_path / 't'}",
        f"data.demo_dir={demo_dir}",
        f"checkpoint.dir={ro}",
        *TINY,
    ]
    cmd = [sys.executable, "-m", "megatron_s2.training", "--config", DEMO, *args]
    script = f'{mount} && exec "$@"'
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", *cmd],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == cli.EXIT_RUN_DIR, proc.stderr[-2000:]
    assert f"{ro} is not writable (Read-only file system)" in proc.stderr
    assert not read_metrics(tmp_path / "t")


FAKE_DISK = """
import shutil, sys
real = shutil.disk_usage
shutil.disk_usage = lambda path: real(path)._replace(free=10**6)
from megatron_s2.training.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_too_little_space_for_a_checkpoint_fails_before_training(tmp_path, demo_dir):
    args = [
        "--config",
        DEMO,
        "name=t",
        f"logging.run_dir={tmp_path / 't'}",
        f"data.demo_dir={demo_dir}",
        *TINY,
    ]
    proc = subprocess.run(
        [sys.executable, "-c", FAKE_DISK, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == cli.EXIT_RUN_DIR, proc.stderr[-2000:]
    assert re.search(r"has 976\.6 KiB free, but one checkpoint .* needs about", proc.stderr)
    assert not read_metrics(tmp_path / "t")


# ------------------------------------------------------------------------- CLI outcomes
@pytest.mark.parametrize(
    "error, code, text",
    [
        (KeyboardInterrupt(), cli.EXIT_INTERRUPTED, "interrupted; no checkpoint was saved now"),
        (RunDirError("runs/x is in use"), cli.EXIT_RUN_DIR, "runs/x is in use"),
    ],
)
def test_cli_exit_codes_without_traceback(monkeypatch, capsys, error, code, text):
    def fail(cfg, restart):
        raise error

    # The command line imports the trainer once the config has loaded, and takes its train.
    monkeypatch.setattr(trainer, "train", fail)
    assert cli.main(["train.train_iters=50"]) == code
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err


def test_cli_restart_may_follow_the_overrides(monkeypatch):
    seen = {}
    monkeypatch.setattr(trainer, "train", lambda cfg, restart: seen.update(restart=restart))
    assert cli.main(["train.train_iters=50", "--restart"]) == cli.EXIT_OK
    assert seen == {"restart": True}


# ----------------------------------------------------------- two processes, Ctrl-C
@pytest.mark.slow
def test_lock_refuses_a_second_run_and_ctrl_c_saves_and_stops(tmp_path, demo_dir):
    """Two runs in one directory at once: the second stops at start-up naming the first. Ctrl-C
    (SIGINT to the process group, as a terminal sends it: data-loader workers included) then
    checkpoints and stops the first like SIGTERM."""
    args = [
        "name=t",
        f"logging.run_dir={tmp_path / 't'}",
        f"data.demo_dir={demo_dir}",
        f"data.cache_dir={tmp_path / 'cache'}",
        *TINY,
        "train.train_iters=100000",
        "train.num_workers=2",  # the loader workers get the Ctrl-C too
    ]
    first = subprocess.Popen(
        [sys.executable, "-m", "megatron_s2.training", "--config", DEMO, *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,
        # SIGINT as a terminal's foreground job has it, even where pytest itself runs as a
        # background job (SIGINT ignored, which the trainer then rightly keeps ignoring).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        metrics = tmp_path / "t" / "metrics.jsonl"
        deadline = time.time() + 180
        while time.time() < deadline and not (
            metrics.exists() and metrics.read_text().count("\n") >= 2
        ):
            assert first.poll() is None, first.communicate()[1][-3000:]
            time.sleep(0.3)
        second, _ = run_trainer(tmp_path, demo_dir, "train.train_iters=100000", check=False)
        assert second.returncode == cli.EXIT_RUN_DIR, second.stderr[-2000:]
        assert f"is in use by a live run (pid {first.pid} on" in second.stderr
        os.killpg(first.pid, signal.SIGINT)
        out, err = first.communicate(timeout=180)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == cli.EXIT_OK, err[-3000:]
    assert err.count("Ctrl-C: finishing this iteration") == 1 and "Traceback" not in err
    it = int((tmp_path / "t" / "checkpoints" / TRACKER).read_text())
    recs = read_metrics(tmp_path / "t")
    assert it >= 2 and max(recs) == it  # metrics.jsonl ends where the run stopped
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["stopped_by"] == "sigint" and summary["iteration"] == it
