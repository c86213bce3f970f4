"""The retrieval levers through the trainer (CPU, one process): a run with attention sinks (on the
S2 and the dense layers) saves them and resumes from its checkpoint; a dense run's weights start
an S2 hybrid with sinks on every layer and NoPE dense layers (the sinks at their initial values,
noted), and the optimizer state of such a checkpoint is refused with the setting to change."""

import pytest

from tests.training.test_trainer import run_trainer

pytestmark = pytest.mark.slow

SINKS = "attention.s2.sinks=true"
DENSE_SINKS = "attention.dense_layers.sinks=true"


def test_checkpoint_with_sinks_resumes(tmp_path, demo_dir):
    from megatron.core import dist_checkpointing

    _, whole = run_trainer(
        tmp_path, demo_dir, SINKS, DENSE_SINKS, "train.train_iters=4", name="whole"
    )
    _, first = run_trainer(
        tmp_path,
        demo_dir,
        SINKS,
        DENSE_SINKS,
        "train.train_iters=4",
        "debug.sigterm_at_iter=2",  # stops with a checkpoint after iteration 2
        name="split",
    )
    assert sorted(first) == [1, 2]
    ckpt = tmp_path / "split" / "checkpoints" / "iter_0000002"
    saved = dist_checkpointing.load_tensors_metadata(str(ckpt))
    # One checkpoint tensor per layer with sinks (TINY: 2 layers, pattern DS: layer 0 is dense,
    # layer 1 S2; both have sinks here).
    sinks = sorted(k for k in saved if ".sinks." in k)
    assert sinks == [
        f"decoder.layers.self_attention.core_attention.sinks.layer_{i}" for i in (0, 1)
    ], sinks
    # The same run again, to 4 iterations: it resumes (model loaded strictly, optimizer state
    # included) and continues the uninterrupted run.
    proc, more = run_trainer(
        tmp_path, demo_dir, SINKS, DENSE_SINKS, "train.train_iters=4", name="split"
    )
    assert "resumed from" in proc.stdout
    assert sorted(more) == [1, 2, 3, 4]  # metrics.jsonl of both parts of the run
    for i in (3, 4):
        assert more[i]["loss"] == pytest.approx(whole[i]["loss"], abs=1e-5), i


def test_dense_weights_start_a_hybrid_with_sinks_and_nope(tmp_path, demo_dir):
    run_trainer(
        tmp_path,
        demo_dir,
        "attention={dense_layers: {pattern: D}}",
        "train.train_iters=3",
        "checkpoint.save_at_end=true",
        name="dense",
    )
    start = [
        "attention.dense_layers.pattern=DS",
        "attention.dense_layers.position_embedding=nope",
        SINKS,
        DENSE_SINKS,
        f"checkpoint.load_dir={tmp_path / 'dense' / 'checkpoints'}",
        "checkpoint.reset_iteration=true",
        "train.train_iters=3",
    ]
    proc, recs = run_trainer(
        tmp_path, demo_dir, *start, "checkpoint.load_optimizer=false", name="hybrid"
    )
    out = proc.stdout + proc.stderr
    assert "starting at iteration 0 from the weights of" in out
    for key in (
        "attention.dense_layers.position_embedding",
        "attention.s2.sinks",
        "attention.dense_layers.sinks",
    ):
        assert key in out, key
    assert "start at their initial values" in out
    assert sorted(recs) == [1, 2, 3]
    proc, _ = run_trainer(
        tmp_path, demo_dir, *start, "checkpoint.load_optimizer=true", name="with_opt", check=False
    )
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    assert "has no .sinks parameters" in err and "checkpoint.load_optimizer=false" in err, err[
        -2000:
    ]
