"""Context parallelism through the trainer (CPU, gloo, 2 processes): CP=2 trains the same losses
as one process, and its checkpoint resumes in one process (CP=1)."""

import pytest

from tests.training.test_trainer import TWO_PROCESSES, run_trainer

pytestmark = pytest.mark.slow


def test_cp2_matches_single_process_and_resumes_at_cp1(tmp_path, demo_dir):
    _, single = run_trainer(tmp_path, demo_dir, "train.train_iters=5", name="single")
    proc, cp2 = run_trainer(
        tmp_path,
        demo_dir,
        "parallel.context_parallel_size=2",
        "train.train_iters=5",
        "debug.sigterm_at_iter=4",  # stops with a checkpoint after iteration 4
        name="cp2",
        launcher=TWO_PROCESSES,
    )
    assert "CP 2" in proc.stdout and sorted(cp2) == [1, 2, 3, 4]
    # Same weights and data on both layouts: only the reduction order differs.
    for i in range(1, 5):
        assert cp2[i]["loss"] == pytest.approx(single[i]["loss"], abs=1e-4), i
    # The CP=2 checkpoint (model replicated over CP, optimizer sharded over DP x CP) resumes in
    # one process and continues the single-process run.
    proc, more = run_trainer(tmp_path, demo_dir, "train.train_iters=5", name="cp2")
    assert "resumed from" in proc.stdout
    assert more[5]["loss"] == pytest.approx(single[5]["loss"], abs=1e-4)


def test_cp_size_the_sequence_cannot_serve_is_a_config_error(tmp_path, demo_dir):
    proc, _ = run_trainer(
        tmp_path,
        demo_dir,
        "parallel.context_parallel_size=2",
        "model.seq_length=96",
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "parallel.context_parallel_size (2) needs model.seq_length (96)" in proc.stderr
