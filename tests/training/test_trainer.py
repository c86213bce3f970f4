"""End-to-end trainer tests on the CPU (gloo, fp32): the real entry point in subprocesses."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "configs", "demo.yaml")
TWO_PROCESSES = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc-per-node",
    "2",
]

# A smaller model than the demo so that each run takes seconds; still an S2 hybrid with sequences
# several times the local window, and a validation split.
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=128",
    "attention.s2.local_blocks=2",
    "attention.s2.vert_stride=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.eval_interval=0",
    "optimizer.lr_warmup_iters=2",
    "logging.log_interval=1",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_at_end=false",
]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # conftest turns the Triton interpreter on for the kernel tests; the trainer's CPU mode is
    # meant to use the PyTorch reference attention (the interpreter is ~100x slower).
    env.pop("TRITON_INTERPRET", None)
    env.pop("RANK", None)
    return env


def run_trainer(tmp_path, demo_dir, *overrides, name="t", check=True, launcher=None, timeout=300):
    """Run the trainer CLI; return (CompletedProcess, train records of metrics.jsonl)."""
    args = [
        f"name={name}",
        f"logging.run_dir={tmp_path / name}",
        f"data.demo_dir={demo_dir}",
        f"data.cache_dir={tmp_path / 'cache'}",
        *TINY,
        *overrides,
    ]
    cmd = (launcher or [sys.executable]) + ["-m", "megatron_s2.training", "--config", DEMO, *args]
    env = _env()
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout, env=env
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc, read_metrics(tmp_path / name)


def read_metrics(run_dir, kind="train"):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return {r["iteration"]: r for r in recs if r["kind"] == kind}


# The length of the shared uninterrupted run (``plain``): long enough for the resume test to stop
# half-way and for the learning-rate schedule to be past its warm-up.
PLAIN_ITERS = 8


@pytest.fixture(scope="module")
def plain(tmp_path_factory, demo_dir):
    """One uninterrupted single-process run of TINY for PLAIN_ITERS iterations, made once and
    only read: the reference of the resume, recomputation and data-parallel tests, and the run
    without train.deterministic of the deterministic test. Each of those used to train this
    same run itself (every run is a new process: ~8 s of CPU for the imports alone)."""
    tmp = tmp_path_factory.mktemp("plain")
    return run_trainer(tmp, demo_dir, f"train.train_iters={PLAIN_ITERS}", name="plain")


def test_demo_steps_loss_decreases_and_outputs(tmp_path, demo_dir):
    proc, recs = run_trainer(
        tmp_path,
        demo_dir,
        "train.train_iters=12",
        "train.eval_interval=6",
        "train.eval_iters=1",
        "logging.tensorboard=true",
        "logging.plot=true",
        "checkpoint.save_at_end=true",
    )
    assert "CPU mode" in proc.stdout
    assert sorted(recs) == list(range(1, 13))
    losses = [recs[i]["loss"] for i in range(1, 13)]
    assert losses[-1] < losses[0] - 0.5, losses
    for key in (
        "lr",
        "grad_norm",
        "tokens_per_s",
        "tflops_per_gpu",
        "cpu_rss_gib",
        "consumed_samples",
    ):
        assert key in recs[12], key
    assert recs[12]["consumed_samples"] == 12 * 4
    assert recs[12]["tflops_per_gpu"] > 0
    run = tmp_path / "t"
    assert set(read_metrics(run, "valid")) == {6, 12}
    assert (run / "loss.png").is_file()
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iteration"] == 12 and summary["stopped_by"] == "done"
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "12"
    assert "train loss" in proc.stdout and "tokens/s" in proc.stdout


def test_resume_reproduces_uninterrupted_losses(tmp_path, demo_dir, plain):
    n, k = PLAIN_ITERS, 4
    _, full = plain  # uninterrupted, n iterations
    # Interrupted run: the SIGTERM test hook saves at iteration k and stops; a new process resumes.
    proc, first = run_trainer(
        tmp_path, demo_dir, f"train.train_iters={n}", f"debug.sigterm_at_iter={k}", name="resumed"
    )
    assert sorted(first) == list(range(1, k + 1))
    assert "SIGTERM" in proc.stdout
    proc, resumed = run_trainer(tmp_path, demo_dir, f"train.train_iters={n}", name="resumed")
    assert "resumed from" in proc.stdout
    assert sorted(resumed) == list(range(1, n + 1))
    for i in range(1, n + 1):
        assert resumed[i]["loss"] == pytest.approx(full[i]["loss"], abs=1e-5), i
        assert resumed[i]["lr"] == pytest.approx(full[i]["lr"], rel=1e-6), i
        assert resumed[i]["consumed_samples"] == full[i]["consumed_samples"]


def test_nan_loss_stops_with_clear_message_and_keeps_checkpoint(tmp_path, demo_dir):
    proc, recs = run_trainer(
        tmp_path,
        demo_dir,
        "train.train_iters=8",
        "checkpoint.save_interval=2",
        "debug.nan_at_iter=5",
        check=False,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "loss is nan at iteration 5" in proc.stderr
    assert "Last good checkpoint" in proc.stderr and "iter_0000004" in proc.stderr
    ckpt = tmp_path / "t" / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert sorted(recs) == [1, 2, 3, 4]
    # Resuming from the kept checkpoint works (the hook no longer fires after it).
    proc, recs = run_trainer(
        tmp_path, demo_dir, "train.train_iters=6", "checkpoint.save_interval=2"
    )
    assert sorted(recs) == list(range(1, 7))


def test_config_error_exit_code(tmp_path, demo_dir):
    proc, _ = run_trainer(tmp_path, demo_dir, "train.micro_batch_size=0", check=False)
    assert proc.returncode == 2
    assert "train.micro_batch_size must be >= 1, got 0" in proc.stderr
    proc, _ = run_trainer(tmp_path, demo_dir, "train.bogus=1", check=False)
    assert proc.returncode == 2 and "unknown key(s) train.bogus" in proc.stderr
    proc, _ = run_trainer(
        tmp_path, demo_dir, "data.demo=false", f"data.blend=[{tmp_path}/missing]", check=False
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"data.blend: {tmp_path}/missing.bin does not exist" in proc.stderr


def test_activation_recompute_keeps_losses(tmp_path, demo_dir, plain):
    """Full and selective (core attention) recomputation change memory, not the numbers: every
    step's loss as the shared run without recomputation (``plain``)."""
    _, base = plain
    for mode in ("full", "selective"):
        _, recs = run_trainer(
            tmp_path,
            demo_dir,
            f"train.train_iters={PLAIN_ITERS}",
            f"model.recompute={mode}",
            name=mode,
        )
        assert sorted(recs) == sorted(base)
        for i in base:
            assert recs[i]["loss"] == pytest.approx(base[i]["loss"], abs=1e-5), (mode, i)


def test_deterministic_runs_repeat_bit_for_bit(tmp_path, demo_dir, plain):
    """train.deterministic: the run says so, PyTorch's strict deterministic mode accepts every
    operation of a training step on the CPU (strict mode raises on any it has no deterministic
    algorithm for), and a rerun repeats every step's loss and gradient norm exactly. A run
    without it (the shared ``plain`` run) does not say so."""
    runs = [
        run_trainer(tmp_path, demo_dir, "train.train_iters=4", "train.deterministic=true", name=n)
        for n in ("a", "b")
    ]
    for proc, _ in runs:
        assert "deterministic algorithms (train.deterministic)" in proc.stdout
    (_, a), (_, b) = runs
    assert sorted(a) == [1, 2, 3, 4]
    for i in a:
        assert a[i]["loss"] == b[i]["loss"] and a[i]["grad_norm"] == b[i]["grad_norm"], i
    proc, _ = plain
    assert "deterministic algorithms" not in proc.stdout


@pytest.mark.slow
def test_real_sigterm_saves_and_stops(tmp_path, demo_dir):
    """SIGTERM to the whole process group, as Slurm signals a job step: data-loader workers
    included (they must not die and take the trainer down before its checkpoint)."""
    args = [
        "name=s",
        f"logging.run_dir={tmp_path / 's'}",
        f"data.demo_dir={demo_dir}",
        *TINY,
        "train.train_iters=100000",
        "optimizer.lr_warmup_iters=2",
        "train.num_workers=2",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_s2.training", "--config", DEMO, *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    metrics = tmp_path / "s" / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (
        metrics.exists() and metrics.read_text().count("\n") >= 3
    ):
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM" in out
    it = int((tmp_path / "s" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    assert it >= 3
    assert json.loads((tmp_path / "s" / "summary.json").read_text())["stopped_by"] == "sigterm"


@pytest.mark.slow
def test_two_process_data_parallel_matches_single_process(tmp_path, demo_dir, plain):
    """2 DP ranks (torchrun, gloo) see the same global batches as 1 process (the shared
    ``plain`` run): same losses."""
    _, single = plain
    n = PLAIN_ITERS
    proc, dp2 = run_trainer(
        tmp_path,
        demo_dir,
        f"train.train_iters={n}",
        "checkpoint.save_at_end=true",
        name="dp2",
        launcher=TWO_PROCESSES,
    )
    assert "DP 2" in proc.stdout
    assert sorted(dp2) == list(range(1, n + 1))
    for i in range(1, n + 1):
        assert dp2[i]["loss"] == pytest.approx(single[i]["loss"], abs=1e-4), i
    # The 2-rank checkpoint resumes in one process (distributed optimizer resharded over DP).
    proc, more = run_trainer(tmp_path, demo_dir, f"train.train_iters={n + 1}", name="dp2")
    assert "resumed from" in proc.stdout and n + 1 in more


def _trains(recs, n):
    """Iterations 1..n logged, every loss finite, the last below the first."""
    assert sorted(recs) == list(range(1, n + 1))
    losses = [recs[i]["loss"] for i in range(1, n + 1)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_two_process_pipeline_parallel_trains_and_resumes(tmp_path, demo_dir):
    """PP=2 (1F1B schedule, loss broadcast from the last stage; sharded checkpoint resume) runs
    through the trainer. (TP=2's run: test_profile_step_writes_every_ranks_summary_and_max_memory,
    which checks its training progress too.)

    Initialisation differs from one process (per-stage seeds, per-rank TP init), so only
    training progress is checked.
    """
    layout = "parallel.pipeline_model_parallel_size=2"
    proc, recs = run_trainer(
        tmp_path,
        demo_dir,
        layout,
        "train.train_iters=6",
        "debug.sigterm_at_iter=3",
        launcher=TWO_PROCESSES,
    )
    assert sorted(recs) == [1, 2, 3]
    # The PP=2 checkpoint loads in one process (model resharded; optimizer restarts, logged).
    # Iteration 4's loss depends only on the loaded weights and the data position.
    proc, single = run_trainer(
        tmp_path,
        demo_dir,
        "train.train_iters=6",
        f"checkpoint.load_dir={tmp_path / 't' / 'checkpoints'}",
        name="single",
    )
    assert "the optimizer state restarts" in proc.stderr
    proc, recs = run_trainer(
        tmp_path, demo_dir, layout, "train.train_iters=6", launcher=TWO_PROCESSES
    )
    assert "resumed from" in proc.stdout
    _trains(recs, 6)
    assert single[4]["loss"] == pytest.approx(recs[4]["loss"], abs=1e-5)


def test_profile_step_writes_every_ranks_summary_and_max_memory(tmp_path, demo_dir):
    """TP=2 trains through the trainer (6 steps from scratch; initialisation differs from one
    process, so only training progress is checked), and debug.profile_step: both of its ranks
    write their profile summary of that iteration (no GPU kernels in the CPU mode: shares
    None), and every training record carries the largest memory over the ranks beside rank 0's
    own. One run checked both ways: they were two TP=2 runs (a 2-process launch each)."""
    proc, recs = run_trainer(
        tmp_path,
        demo_dir,
        "train.train_iters=6",
        "debug.profile_step=2",
        "parallel.tensor_model_parallel_size=2",
        launcher=TWO_PROCESSES,
    )
    assert "resumed from" not in proc.stdout
    _trains(recs, 6)
    assert "profiling iteration 2" in proc.stdout
    for rank in (0, 1):
        summary = json.loads((tmp_path / "t" / "profile" / f"step2.rank{rank}.json").read_text())
        assert summary["iteration"] == 2 and summary["rank"] == rank
        assert summary["wall_ms"] > 0 and summary["total_kernel_ms"] == 0
        assert summary["share"]["attention"] is None and summary["peak_mem_gib"] is None
    assert not (tmp_path / "t" / "profile" / "step1.rank0.json").exists()
    for rec in recs.values():
        assert rec["cpu_rss_gib_max_rank"] >= rec["cpu_rss_gib"] > 0


def test_profile_step_refused_below_one(tmp_path, demo_dir):
    proc, _ = run_trainer(tmp_path, demo_dir, "debug.profile_step=0", check=False)
    assert proc.returncode != 0
    assert "debug.profile_step must be >= 1" in proc.stdout + proc.stderr
